"""``grad_dtype`` (EngineConfig): the dtype the gradient is accumulated in across micro-batches,
and in which an uncompressed gradient travels.

A bf16 model's ``.grad`` is bf16: summed over k micro-batches in bf16, each add rounds the sum
to 8 bits of mantissa. Megatron-LM keeps an fp32 ``main_grad`` buffer for bf16 runs instead, into
which each backward's gradient is added and which is reduced in fp32
(``accumulate_allreduce_grads_in_fp32``, its default for bf16). ``float32`` does the same on the
flat path (engine/core/flat.py: the gradient buffers are fp32 and a post-accumulate-grad hook adds
each parameter's bf16 ``.grad`` into its slice), and an uncompressed gradient then travels in
fp32: twice the bytes of torch DDP's bf16 all-reduce. ``auto`` takes fp32 where that costs no
bytes: where a gradient codec encodes the buffer (LoCo's encode reads fp32 whatever the buffer
holds) or where gradients do not travel at all (the local-step strategies send pseudo-gradients);
an uncompressed gradient of zero1, dpu, acco or 1-bit Adam stays in the compute dtype, as DDP's
and FSDP2's reduce it. Under model_sharding='node' FSDP2 hands each sharded parameter its reduced
gradient in the sharded parameter's dtype (the compute dtype here): there ``auto`` is the
compute dtype and ``float32`` is refused unless the parameters are fp32. With fp32 parameters
every setting is fp32, exactly as before the setting existed.
"""

from __future__ import annotations

import torch

GRAD_DTYPE_NODE_REFUSED = (
    "grad_dtype='float32' with model_sharding='node' and bfloat16 parameters: FSDP2 hands each sharded "
    "parameter its reduced gradient in the parameter's dtype, so the engine cannot accumulate it in fp32; "
    "use grad_dtype='auto' or 'compute' (accumulation in the compute dtype), or fp32 parameters "
    "(compute_dtype='float32')")


COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # compute_dtype's named settings


def resolve_compute_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """The parameters' dtype in training for ``compute_dtype`` ('auto': the model's own);
    refused unless floating point."""
    dtype = model_dtype if setting == "auto" else COMPUTE_DTYPES[setting]
    if not dtype.is_floating_point:
        raise TypeError(f"trainable parameters must be floating point, got {dtype}")
    return dtype


def grad_buffers_fp32(setting: str, compute_fp32: bool, node_sharded: bool, uncompressed: bool) -> bool:
    """The rule, on dtypes' names only (the planner's WireSettings asks it too): whether the
    gradient buffers are fp32. Raises for 'float32' under node sharding with non-fp32 params."""
    if setting == "compute" or compute_fp32:
        return compute_fp32
    if node_sharded:
        if setting == "float32":
            raise ValueError(GRAD_DTYPE_NODE_REFUSED)
        return False
    return not (setting == "auto" and uncompressed)


def resolve_grad_dtype(setting: str, compute: torch.dtype, node_sharded: bool,
                       uncompressed: bool = False) -> torch.dtype:
    """The gradient buffers' dtype for ``setting`` ('auto', 'float32', 'compute') and the
    parameters' (compute) dtype; ``uncompressed``: the gradient itself travels, with no codec
    (``gradient_travels_uncompressed``)."""
    fp32 = grad_buffers_fp32(setting, compute == torch.float32, node_sharded, uncompressed)
    return torch.float32 if fp32 else compute


def gradient_travels_uncompressed(codec: str, local_steps: bool) -> bool:
    """Whether the accumulated gradient goes on the wire as it is: no gradient codec, and a
    strategy that exchanges gradients (not a local-step one, which sends pseudo-gradients)."""
    return codec == "none" and not local_steps
