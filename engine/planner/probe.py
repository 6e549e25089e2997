"""``--measure`` and ``strategy="auto"``: probe the cluster this process runs on instead of taking
rates on trust (docs/planning.md, "--measure").

Over the current process group (gloo or NCCL; initialised from the launcher's env if needed):

- **between nodes**: a timed ``all_to_all_single`` over each rail (the ranks with the same local
  rank, one per node) with ``payload`` bytes per rank, all rails at once: a node's link carries
  G (M-1)/M payload, so its rate is that over the time (median of ``repeats``, slowest rank).
  The payload goes as the engine sends it: on gloo in the pieces its ``comm_chunks="auto"``
  issues at once (one gloo collective fills about half a shaped link, at 20 Mbit/s measured
  10 Mbit/s per direction against 14-17 for the pieces), on NCCL as one collective;
- **inside the node** (G > 1): a timed ``all_gather_into_tensor`` over the node's group, (G-1)/G
  payload per rank over the time;
- **compute**: a few forward + backward passes of the model (or a caller's closure), after one
  untimed warm-up, medians, as samples/s per worker.

The layout comes from the launcher (LOCAL_WORLD_SIZE, as torchrun sets it) and the groups from
engine/parallel/dims.py (the compute thread's); with one rank per node (G = 1, the CPU testbed)
the world is the one rail. Every rank gets the same
figures (the slowest rank's times, all-reduced with MAX)."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Measured:
    nodes: int
    per_node: int
    inter_Bps: float  # one node link, bytes/s
    intra_Bps: float  # per rank inside a node, bytes/s (0 when G = 1)
    samples_per_s: float  # per worker (0 when not measured)
    rank: int

    def describe(self) -> str:
        intra = f", inside the node {self.intra_Bps * 8 / 1e9:.3g} Gbit/s per rank" if self.per_node > 1 else ""
        comp = f", compute {self.samples_per_s:.3g} samples/s per worker" if self.samples_per_s else ""
        return (f"{self.nodes} nodes x {self.per_node} ranks; node link {self.inter_Bps * 8 / 1e6:.4g} Mbit/s"
                + intra + comp)


def _ensure_group() -> None:
    if dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        raise RuntimeError("--measure probes a cluster: start it under torchrun (or `accelerate launch`) "
                           "with at least 2 processes")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # one GPU per rank, as torchrun numbers them
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, init_method="env://")


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, device, world_group) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world_group)
    return float(t.item())


def probe_groups(dims):
    """(world, rail, node) groups of the probe: the engine's compute-thread groups
    (engine/parallel/dims.py); with one rank per node the world is the one rail."""
    world = dims.comm("control").group
    if dims.layout.ranks_per_node == 1:
        return world, world, None
    return world, dims.comm("rail.compute").group, dims.comm("node.compute").group


def _timed(run: Callable[[], None], group, world_group, device, repeats: int) -> float:
    """Median seconds of ``run`` (a collective of ``group``) over ``repeats``, after one that
    warms the connections up; the slowest rank's figure."""
    times = []
    for i in range(repeats + 1):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return _slowest(statistics.median(times), device, world_group)


def _pieces(device) -> int:
    """How many async pieces the engine splits a large collective into here (engine.comm)."""
    from ..parallel.comm import AUTO_CHUNKS

    return 1 if device.type == "cuda" else AUTO_CHUNKS


def _in_pieces(issue: Callable[[int, bool], object], pieces: int) -> Callable[[], None]:
    """Run ``issue(piece, async_op)`` for every piece, all in flight at once, then wait."""
    def run():
        works = [issue(i, True) for i in range(pieces)]
        for w in works:
            w.wait()
    return run


def time_all_to_all(payload: int, group, size: int, device, world_group, repeats: int = 3) -> tuple[float, int]:
    """(seconds, bytes per rank) of ~``payload`` bytes per rank all-to-all, in the engine's pieces."""
    pieces = _pieces(device)
    per = max(1, payload // (size * pieces)) * size
    send = torch.zeros(pieces, per, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    return _timed(_in_pieces(lambda i, a: dist.all_to_all_single(recv[i], send[i], group=group, async_op=a),
                             pieces), group, world_group, device, repeats), send.numel()


def time_all_gather(payload: int, group, size: int, device, world_group, repeats: int = 3) -> tuple[float, int]:
    """(seconds, bytes gathered per rank) of an all-gather of ~``payload`` bytes, in the engine's pieces."""
    pieces = _pieces(device)
    per = max(1, payload // (size * pieces))
    piece = torch.zeros(pieces, per, dtype=torch.uint8, device=device)
    out = torch.empty(pieces, per * size, dtype=torch.uint8, device=device)
    return _timed(_in_pieces(lambda i, a: dist.all_gather_into_tensor(out[i], piece[i], group=group, async_op=a),
                             pieces), group, world_group, device, repeats), out.numel()


def time_compute(step: Callable[[], None], samples: int, device, world_group=None, repeats: int = 3) -> float:
    """samples/s of ``step`` (one forward + backward of ``samples`` samples), median of repeats."""
    step()  # warm-up: allocations, lazy init
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return samples / _slowest(statistics.median(times), device, world_group)


def model_step(model: torch.nn.Module, samples: int, seq_len: int | None = None) -> Callable[[], None]:
    """One forward + backward of ``model`` on a synthetic micro-batch: ``samples`` sequences of
    ``seq_len`` random token ids for a transformers-style model (it has ``config.vocab_size``),
    else ``samples`` random rows for its first Linear layer; a sum of squares as the loss."""
    device = next(model.parameters()).device
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "vocab_size"):
        ctx = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 512)
        t = min(seq_len or 512, ctx)
        ids = torch.randint(0, cfg.vocab_size, (samples, t), device=device)

        def run():
            out = model(input_ids=ids)
            logits = out.logits if hasattr(out, "logits") else out[0]
            logits.float().pow(2).mean().backward()
    else:
        first = next((m for m in model.modules() if isinstance(m, torch.nn.Linear)), None)
        if first is None:
            raise ValueError("the compute probe needs a transformers-style model or one whose first layer "
                             "is a torch.nn.Linear: give --samples-per-s instead")
        dtype = first.weight.dtype
        x = torch.randn(samples, first.in_features, device=device, dtype=dtype)

        def run():
            model(x).float().pow(2).mean().backward()

    def step():
        run()
        model.zero_grad(set_to_none=True)

    return step


def probe_cluster(shape=None, micro_batch: int = 1, model: torch.nn.Module | None = None,
                  payload: int = 8 * 2**20, repeats: int = 3, dims=None) -> Measured:
    """Measure the node links, the intra-node links and (with ``model``, or a transformers model
    built from ``shape`` when it is small enough to build here) the compute rate, over ``dims``'
    groups (an engine's ParallelDims; None: made here from the launcher's environment)."""
    if dims is None:
        from ..parallel.dims import ParallelDims

        _ensure_group()
        dims = ParallelDims.start(dist.get_rank(), dist.get_world_size(), _device())
    nodes, per_node, device = dims.layout.nodes, dims.layout.ranks_per_node, dims.device
    world_group, rail, node = probe_groups(dims)
    inter = intra = 0.0
    if nodes > 1:
        t, sent = time_all_to_all(payload, rail, nodes, device, world_group, repeats)
        inter = per_node * (nodes - 1) / nodes * sent / t
    if per_node > 1:
        t, gathered = time_all_gather(payload, node, per_node, device, world_group, repeats)
        intra = (per_node - 1) / per_node * gathered / t
    rate = 0.0
    if model is not None:
        rate = time_compute(model_step(model, micro_batch, getattr(shape, "seq_len", None)), micro_batch,
                            device, world_group, repeats)
    return Measured(nodes, per_node, inter, intra, rate, dims.rank)
