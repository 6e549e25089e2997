"""Activation memory of one micro-batch per GPU, with and without activation checkpointing.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv
2205.05198, section 4.1): a transformer layer stores s b h (34 + 5 a s / h) bytes of 16-bit
activations for a micro-batch of b sequences of s tokens (hidden h, a heads, no tensor or sequence
parallelism). With FlashAttention (Dao et al., arXiv 2205.14135) the 5 a s^2 b bytes of attention
scores, softmax and its dropout mask are not stored (the kernel keeps s b a softmax statistics),
which leaves 34 s b h, scaled here by e / 2 for an e-byte compute dtype. Their block is GPT's (a
4h MLP); a Llama block's SwiGLU MLP (three 3.5h matrices) stores about as much: not modelled apart.

    no checkpointing    L x 17 e s b h                      every layer's activations
    checkpointing       L x e s b h + 17 e s b h            each block's input, one block recomputed
    both, plus logits   s b V (e + 4 + 4)                   the logits, their fp32 copy for the loss
                                                            (transformers upcasts) and its gradient

Checkpointing recomputes each block's forward in the backward: the planner charges it as one more
forward pass (engine/planner/shape.py ``flops_per_sample(recompute=True)``)."""

from __future__ import annotations

from .shape import ModelShape


def activation_bytes(shape: ModelShape, micro_batch: int, compute_bytes: int, checkpointing: bool) -> float:
    """Peak bytes of one micro-batch's activations on one GPU."""
    tokens = shape.seq_len * micro_batch
    layer = 17 * compute_bytes * tokens * shape.hidden  # 34 s b h at 16 bits
    logits = tokens * shape.vocab * (compute_bytes + 8)
    if checkpointing:
        return shape.layers * compute_bytes * tokens * shape.hidden + layer + logits
    return shape.layers * layer + logits
