"""When no mode fits the GPU's memory: what would, each computed with the same formulas as the
plan's rows (engine/planner/memory.py, activations.py), never a canned list. Tried one change at
a time, for the modes the decision rule could take (``keeps``: in make_plan, those with measured
rows that meet the goal, engine/planner/decide.py): activation checkpointing, model sharding over
the node (FSDP2), a smaller micro-batch, more nodes of the same size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .fit import Limits, fitting
from .modes import Mode, candidates
from .shape import ModelShape
from .timeline import Batch
from .wire import Layout, WireSettings

MORE_NODES = 64  # look up to this many times the nodes


def adamw_class(m: Mode) -> bool:
    return m.is_ddp or m.spec.adamw_class


def _smallest(modes, shape, layout, batch, ws, limit, checkpointing, keeps) -> tuple[Mode, float, bool] | None:
    """(mode, bytes per GPU, checkpointed) of the fitting mode of ``keeps`` that needs the least, or None."""
    best = None
    for m in modes:
        if not keeps(m):
            continue
        state, act, ckpt, fits = fitting(m, shape, layout, batch, ws, limit, checkpointing)
        if fits and (best is None or state.total + act < best[1]):
            best = (m, state.total + act, ckpt)
    return best


def _say(found: tuple[Mode, float, bool]) -> str:
    m, total, ckpt = found
    return f"{m.name} at {total / 2**30:.3g} GiB" + (" checkpointed" if ckpt else "")


def _single_changes(shape, layout, batch, ws, limit, modes, checkpointing, keeps) -> list[str]:
    """Each change that alone makes a mode fit."""
    g, out = layout.ranks_per_node, []
    if checkpointing == "off":
        found = _smallest(modes, shape, layout, batch, ws, limit, "on", keeps)
        if found:
            out.append(f"activation checkpointing (--activation-checkpointing on): {_say(found)}")
    if g > 1 and not any(m.sharding == "node" for m in modes):
        found = _smallest(candidates(two_level=True), shape, layout, batch, ws, limit, checkpointing, keeps)
        if found and found[0].sharding == "node":
            out.append(f"model sharding over the node (model_sharding='node'): {_say(found)}")
    mb = batch.micro_batch // 2
    while mb >= 1:
        found = _smallest(modes, shape, layout, replace(batch, micro_batch=mb), ws, limit, checkpointing, keeps)
        if found:
            out.append(f"micro-batch {mb} (--micro-batch {mb}): {_say(found)}")
            break
        mb //= 2
    nodes = _more_nodes(shape, layout, batch, ws, limit, candidates(two_level=g > 1), checkpointing, keeps)
    if nodes:
        out.append(nodes[1])
    return out


def _more_nodes(shape, layout, batch, ws, limit, modes, checkpointing, keeps) -> tuple[Layout, str] | None:
    g = layout.ranks_per_node
    for factor in (2 ** k for k in range(1, MORE_NODES.bit_length())):
        bigger = Layout(layout.nodes * factor, g)
        if batch.global_samples < bigger.world:
            return None
        found = _smallest(modes, shape, bigger, batch, ws, limit, checkpointing, keeps)
        if found:
            return bigger, f"{bigger.nodes} nodes of {g} (--nodes {bigger.nodes}): {_say(found)}"
    return None


def what_would_fit(shape: ModelShape, layout: Layout, batch: Batch, ws: WireSettings, limit: float,
                   modes: list[Mode], checkpointing: str, keeps: Callable[[Mode], bool] = adamw_class) -> str:
    single = _single_changes(shape, layout, batch, ws, limit, modes, checkpointing, keeps)
    if single:
        return "What would fit, one change at a time: " + "; ".join(single) + "."
    # no single change is enough: take them together, the cheapest first, until a mode fits
    changes, g = [], layout.ranks_per_node
    if checkpointing == "off":
        checkpointing = "auto"
        changes.append("activation checkpointing (--activation-checkpointing on)")
    if g > 1 and not any(m.sharding == "node" for m in modes):
        modes = candidates(two_level=True)
        changes.append("model sharding over the node (model_sharding='node')")
    found = _smallest(modes, shape, layout, batch, ws, limit, checkpointing, keeps)
    if not found and batch.micro_batch > 1:
        batch = replace(batch, micro_batch=1)
        changes.append("micro-batch 1 (--micro-batch 1)")
        found = _smallest(modes, shape, layout, batch, ws, limit, checkpointing, keeps)
    if not found:
        nodes = _more_nodes(shape, layout, batch, ws, limit, modes, checkpointing, keeps)
        if nodes:
            changes.append(nodes[1].split(":")[0])
            found = _smallest(modes, shape, nodes[0], batch, ws, limit, checkpointing, keeps)
    if found:
        return "What would fit, no one change being enough: " + ", ".join(changes) + f" together: {_say(found)}."
    device = limit.device if isinstance(limit, Limits) else limit
    return (f"Nothing tried fits {device / 2**30:.3g} GiB (checkpointing, node sharding, micro-batch 1, up to "
            f"{MORE_NODES}x the nodes within the global batch, alone and together): train fewer parameters "
            "(--trainable-fraction) or use GPUs with more memory (--gpu-mem-gib), or nodes with more host "
            "memory where the rows that fit the GPU are out on it (--host-mem-gib).")
