"""The model's parameter counts and its compute per sample.

From a transformers config (a folder, a hub id where a network is up, or a config object): the
parameters are counted exactly by building the model on the ``meta`` device (no memory, no
weights). From a stated shape: a dense decoder's ``12 L h^2 + V h`` (attention 4 h^2, MLP 8 h^2
per layer, tied embeddings), or the stated count itself."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    params: int  # all parameters
    layers: int
    hidden: int
    vocab: int
    seq_len: int = 2048
    trainable_fraction: float = 1.0

    def __post_init__(self):
        if self.params <= 0 or self.layers <= 0 or self.hidden <= 0 or self.seq_len <= 0:
            raise ValueError(f"a model needs positive params, layers, hidden and seq_len, got {self}")
        if not 0 < self.trainable_fraction <= 1:
            raise ValueError(f"trainable_fraction must be in (0, 1], got {self.trainable_fraction}")

    @property
    def trainable(self) -> int:
        return max(1, round(self.params * self.trainable_fraction))

    def flops_per_sample(self, recompute: bool = False) -> float:
        """Forward + backward FLOPs of one sequence: 2 P per token forward, 2 P backward for the
        activations' gradients, 2 P_trainable for the weights' (Kaplan et al. 2020's 6 P with
        frozen weights left out), plus attention's 12 L h T per token (forward + backward: 4 + 8).
        ``recompute``: activation checkpointing runs the forward once more in the backward."""
        t = self.seq_len
        dense = (4 * self.params + 2 * self.trainable) * t
        attention = 12 * self.layers * self.hidden * t * t
        forward = (2 * self.params + 4 * self.layers * self.hidden * t) * t if recompute else 0
        return float(dense + attention + forward)


def from_shape(layers: int, hidden: int, vocab: int, params: int | None = None, seq_len: int = 2048,
               trainable_fraction: float = 1.0) -> ModelShape:
    count = params if params is not None else 12 * layers * hidden * hidden + vocab * hidden
    return ModelShape(int(count), layers, hidden, vocab, seq_len, trainable_fraction)


def from_transformers(source, seq_len: int | None = None, trainable_fraction: float = 1.0) -> ModelShape:
    """``source``: a folder with config.json, a hub id, or a ``PretrainedConfig``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = source if not isinstance(source, str) else AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd")
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer")
    seq = seq_len or min(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 2048), 4096)
    return ModelShape(params, layers, hidden, cfg.vocab_size, seq, trainable_fraction)


# the projections' dense models (Llama-style shapes; counts as published)
PRESETS = {
    "1b": from_shape(16, 2048, 128256, params=1_240_000_000, seq_len=4096),  # Llama-3.2-1B
    "8b": from_shape(32, 4096, 128256, params=8_030_000_000, seq_len=4096),  # Llama-3.1-8B
    "70b": from_shape(80, 8192, 128256, params=70_600_000_000, seq_len=4096),  # Llama-3.1-70B
}
