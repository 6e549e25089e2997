"""Whether a mode fits one GPU: its training state (memory.py) and one micro-batch's activations
(activations.py) against the GPU's memory, with activation checkpointing where it is needed."""

from __future__ import annotations

from dataclasses import dataclass

from .activations import activation_bytes
from .memory import Memory, memory_per_gpu
from .modes import Mode
from .shape import ModelShape
from .timeline import Batch
from .wire import Layout, WireSettings

CHECKPOINTING = ("auto", "on", "off")  # auto: only where the activations would not fit otherwise


@dataclass(frozen=True)
class Limits:
    """What a mode must fit: one GPU's memory, and the host memory each GPU's share of a node has
    (the node's over its GPUs: an offloaded optimizer's or outer state's host bytes); 0: not checked."""

    device: float
    host: float = 0.0


def fitting(mode: Mode, shape: ModelShape, layout: Layout, batch: Batch, ws: WireSettings, limit: float | Limits,
            checkpointing: str = "auto") -> tuple[Memory, float, bool, bool]:
    """(state, activation bytes, checkpointed, fits) of ``mode``: checkpointing 'auto' takes it only
    where it makes the mode fit (a mode that fits neither way keeps its plain figures, the
    reference's speed-ups included); ``limit`` (bytes per GPU, or ``Limits``) 0 checks nothing."""
    limits = limit if isinstance(limit, Limits) else Limits(limit)
    limit = limits.device
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing {checkpointing!r}: choose one of {CHECKPOINTING}")
    state = memory_per_gpu(mode, shape, layout, ws)
    plain = activation_bytes(shape, batch.micro_batch, ws.compute_bytes, False)
    stored = activation_bytes(shape, batch.micro_batch, ws.compute_bytes, True)
    fits_plain, fits_stored = state.total + plain <= limit, state.total + stored <= limit
    ckpt = checkpointing == "on" or (checkpointing == "auto" and bool(limit) and not fits_plain and fits_stored)
    on_host = not limits.host or state.host <= limits.host
    return state, stored if ckpt else plain, ckpt, on_host and (not limit or (fits_stored if ckpt else fits_plain))
