"""Calibration statistics for a low-bit export: the input Gram matrix ``X X^T`` of every linear
layer of the transformer blocks, over windows of the training text.

One forward pass of the transformer body (no LM head) with forward pre-hooks; no activation is
kept beyond the current batch. Layers that read the same input tensor (q/k/v, gate/up) share one
Gram matrix, accumulated once. ``acco_loco.eora`` turns the matrices into residuals.

Errors are builtin exceptions, as in ``lm.data`` and ``lm.models``: ``TypeError`` for a model
without supported linear layers, ``ValueError`` for too little text or a linear the forward pass
never calls.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from acco_loco.eora import GramAccumulator
from lm.models import transformer_blocks

__all__ = ["block_linears", "block_of", "calibration_windows", "collect_grams", "shared_input_groups"]


def calibration_windows(tokens: torch.Tensor, n: int, seq_len: int, seed: int) -> torch.Tensor:
    """``(n, seq_len)`` windows at seeded random offsets of the training stream."""
    if tokens.numel() < seq_len:
        raise ValueError(f"the training text has {tokens.numel()} tokens, fewer than one "
                         f"calibration window ({seq_len} tokens)")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - seq_len + 1, (n,), generator=g)
    return tokens[starts[:, None] + torch.arange(seq_len)]


def block_linears(model) -> dict[str, torch.nn.Linear]:
    """Every ``nn.Linear`` inside the transformer blocks, by module name, in model order."""
    blocks = set(map(id, transformer_blocks(model)))  # TypeError for an unknown architecture
    found: dict[str, torch.nn.Linear] = {}
    for name, module in model.named_modules():
        if id(module) in blocks:
            for sub, child in module.named_modules():
                if isinstance(child, torch.nn.Linear):
                    found[f"{name}.{sub}"] = child
    if not found:
        raise TypeError(f"{type(model).__name__}: no torch.nn.Linear in the transformer blocks "
                        "(GPT-2's Conv1D layers are not supported); pass a Llama-style model")
    return found


def block_of(name: str) -> str:
    """``model.layers.3.mlp.up_proj`` -> ``model.layers.3``."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def _input_of(args: tuple, kwargs: dict) -> torch.Tensor:
    # with_kwargs=True hooks see the input positionally or as `input=`
    return args[0] if args else kwargs["input"]


def shared_input_groups(model, linears: dict[str, torch.nn.Linear], sample: torch.Tensor) -> list[list[str]]:
    """Linears grouped by the input tensor they read in one short forward (q/k/v share one,
    gate/up another), so that each Gram matrix is accumulated once."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(
        lambda mod, args, kwargs, name=name: seen.__setitem__(name, _input_of(args, kwargs)),
        with_kwargs=True) for name, m in linears.items()]
    try:
        with torch.inference_mode():
            model.base_model(input_ids=sample, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    missing = [n for n in linears if n not in seen]
    if missing:
        raise ValueError(f"linear layers never called in a forward pass: {missing[:4]}")
    groups: dict[int, list[str]] = {}
    for name in linears:  # `seen` holds every input alive, so ids are distinct
        groups.setdefault(id(seen[name]), []).append(name)
    return list(groups.values())


def collect_grams(model, linears: dict[str, torch.nn.Linear], groups: list[list[str]],
                  windows: torch.Tensor, batch_size: int, progress: bool) -> dict[str, GramAccumulator]:
    """One forward pass of the transformer body (no LM head) over the calibration windows;
    returns a Gram accumulator per group, keyed by the group's first linear."""
    grams = {g[0]: GramAccumulator(linears[g[0]].in_features) for g in groups}
    hooks = [linears[key].register_forward_pre_hook(
        lambda mod, args, kwargs, acc=acc: acc.add(_input_of(args, kwargs)), with_kwargs=True)
        for key, acc in grams.items()]
    try:
        with torch.inference_mode():
            for batch in tqdm(windows.split(batch_size), desc="calibration", unit="batch",
                              disable=not progress):
                model.base_model(input_ids=batch, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return grams
