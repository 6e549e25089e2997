"""onebit_adam: 1-bit Adam on the ZeRO-1 engine (Tang et al., ICML 2021; the math is
acco_loco/onebit.py, the exact form and the choices are docs/onebit_adam.md).

Warmup: the engine's ZeRO-1 AdamW round as it is (ShardedStrategy), one round per step, until
``onebit_warmup_steps`` AdamW steps, or, when that is None, until the L1 norm of the
bias-corrected second moment moved by at most ``onebit_tolerance`` over ``onebit_window`` steps
(never before ``onebit_min_warmup``, at the latest after ``onebit_max_warmup_fraction`` of
``max_steps``).

The freeze, in the round of the last warmup step: the momentum and the second moment shards are
all-gathered once (and the fp32 master, unless the parameters every replica holds already are
it), so every worker holds them whole: each worker applies the averaged momentum itself, which is
what lets both directions travel at 1 bit a value (a sharded variance would need the parameters
all-gathered every step instead). The second moment is frozen, so it is kept as the denominator
it gives (formed once, in its place), and the warmup's reducer and gatherer buffers are freed:
no round runs those collectives again.

Compressed stage, one synchronous round per step:

    small all-reduce     counts, loss, squared norms, every rank's flags (sharded.agree)
    all-to-all           each worker's compressed momentum, row j to the owner of shard j
    owner                average, add the server error, compress again
    all-gather           the owners' compressed shards; every worker decodes and steps alone

Every replica decodes the same bytes and runs the same update, so replicas stay bit-identical.
A step whose new parameters are not finite installs nothing (the new momentum, errors and
master are kept apart until then, in kept buffers the state swaps with). The encodes and decodes
take a piece of whole groups at a time (acco_loco/onebit.py ``PIECE``): the round's temporaries
are the 1-bit rows and a piece's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from acco_loco import onebit
from acco_loco.acco import RoundKind, RoundPlan
from acco_loco.optim import clip_coefficient
from acco_loco.registry import WIRE_CODECS
from acco_loco.schedule import lr_at

from ..core.rounds import NonFiniteGradientError, RoundContext, RoundRequest, RoundResult
from ..parallel.two_level import TwoLevelGrads, gather_slices, slice_of
from ..runtime.host import nonfinite_flag, to_host
from .base import Recut
from .sharded import ShardedStrategy, agree
from .spec import ALIGN, MemorySpec, StrategySpec, small_bytes
from .spec import padded as padded_to


def _nodes_of(ctx: RoundContext) -> TwoLevelGrads | None:
    """The two-level reducer (its node and rail groups and the layout), or None when flat."""
    return ctx.grads if isinstance(ctx.grads, TwoLevelGrads) else None


def _rail_of(ctx: RoundContext):
    """model_sharding='node': the comm thread's rail group, whose M ranks are 1-bit Adam's workers,
    each with its FSDP2 local shards (already the node's gradient sum) as the whole buffer; None
    otherwise."""
    dims = getattr(ctx, "dims", None)
    return dims.comm("rail") if dims is not None and dims.kind == "node_sharded" else None


@dataclass
class CompressedState:
    """What the compressed stage keeps per worker (full size unless said)."""

    momentum: torch.Tensor  # m, the same on every replica after every step
    denominator: torch.Tensor  # d = sqrt(v_T) / sqrt(1 - beta2^T) + eps, formed once at the freeze
    mask: torch.Tensor  # bool: v == 0 at the freeze (never had a gradient; padding)
    worker_error: torch.Tensor  # e_w
    server_error: torch.Tensor  # e_s, this worker's shard only
    master: torch.Tensor | None  # fp32 master; None: the parameters (gather_buf) are it
    frozen_step: int  # T, the AdamW steps behind v

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"momentum": self.momentum, "denominator": self.denominator, "mask": self.mask,
               "worker_error": self.worker_error, "server_error": self.server_error}
        if self.master is not None:
            out["master"] = self.master
        return out


class OnebitAdam(ShardedStrategy):
    # two-level: a node is one 1-bit Adam worker; each rank keeps its slice of the state and its
    # rail carries the 1-bit rows (docs/nodes.md, "1-bit Adam over the rails")
    two_level = True
    # model_sharding='node': a node is one worker too, its ranks' local shards its buffer, the rail
    # carries the 1-bit rows (docs/onebit_adam.md)
    node_sharding_refused = None
    gathered_is_state = True  # the compressed stage's parameters (often its master) live in ctx.gather_buf
    whole_matrices_refused = "its compressed stage is 1-bit Adam's own update, not the shard optimizer's"
    offload_refused = "its compressed stage keeps whole-buffer state on the device and steps it itself"
    # the server error is each owner's; momentum, the frozen denominator and mask every replica's
    # alike (onebit.variance: v_T, as checkpoints written before the denominator was kept hold it)
    recut_rules = {**ShardedStrategy.recut_rules, "onebit.server_error": Recut("shard"),
                   "onebit.momentum": Recut("shared"), "onebit.denominator": Recut("shared"),
                   "onebit.variance": Recut("shared"),
                   "onebit.mask": Recut("shared", fill=True), "onebit.master": Recut("shared"),
                   "onebit.worker_error": Recut("summed")}
    sections = ("onebit",)  # its settings: engine/strategies/onebit_config.py
    plan = RoundPlan("onebit_adam", overlap=False, kinds=(RoundKind.COMMIT,))
    piece = onebit.PIECE  # values the round's encodes and decodes take at a time (a test may shorten it)

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.codec = WIRE_CODECS["sign1"](cfg.group_size, cfg.scale_dtype)
        self.norms: list[float] = []  # the variance rule's L1 norms, newest last
        self.state: CompressedState | None = None  # None while in warmup
        # the round's kept buffers (fp32): u_w, then h_w, then the decoded m (full); the proposed
        # master, worker error (full) and server error (a shard), which the state swaps with
        self._buf: torch.Tensor | None = None
        self._new_master = self._new_error = self._new_server_error = None

    @classmethod
    def from_config(cls, cfg) -> "OnebitAdam":
        return cls(cfg)

    @classmethod
    def spec(cls) -> StrategySpec:  # after the warmup; the warmup runs zero1's rounds
        return StrategySpec(rounds=1, overlap=False, memory=MemorySpec("whole", piece=cls.piece),
                            round_parts=_spec_parts,
                            work=lambda numel, slice_, shard, mode: {"onebit_s_per_param": numel,
                                                                     "codec_s_per_param": 2 * slice_},
                            warmup_as="zero1")

    @classmethod
    def codec_groups(cls, cfg) -> list[int]:
        return [cfg.group_size]  # its momentum goes out in sign1 groups after the warmup (docs/onebit_adam.md)

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.optimizer != "adamw":
            raise ValueError(f"strategy 'onebit_adam' is 1-bit Adam, it freezes AdamW's second moment: set "
                             f"optimizer='adamw' (got {cfg.optimizer!r})")
        if cfg.codec != "none":
            # the frozen variance is built from the warmup's gradients: a value whose quantized
            # gradients were all 0 would be masked as unused for the rest of the run
            raise ValueError(f"strategy 'onebit_adam' compresses its momentum itself and its warmup needs exact "
                             f"gradients for the variance it freezes: set codec='none' (got {cfg.codec!r})")

    # ------------------------------------------------------------------ warmup
    def run_round(self, ctx: RoundContext, req: RoundRequest) -> RoundResult:
        if self.state is not None:
            return self._compressed_round(ctx, req)
        applied = ctx.shard_state.step
        result = super().run_round(ctx, req)
        if ctx.shard_state.step != applied:  # an AdamW update was installed
            before = ctx.comm.bytes_sent
            if self._freeze_due(ctx):
                self._freeze(ctx)
            result.bytes_sent += ctx.comm.bytes_sent - before
        return result

    def _freeze_due(self, ctx: RoundContext) -> bool:
        cfg, state = self.cfg, ctx.shard_state
        if cfg.onebit_warmup_steps is not None:
            return state.step >= cfg.onebit_warmup_steps
        # one float64 all-reduce per warmup step; the same value, so the same verdict, everywhere
        local = onebit.corrected_l1(state.exp_avg_sq, state.step, cfg.betas[1]).reshape(1)
        self.norms = (self.norms + [float(to_host(ctx.comm.all_reduce_sum(local))[0])])[-cfg.onebit_window - 1:]
        cap = max(1, math.ceil(cfg.onebit_max_warmup_fraction * cfg.max_steps))
        return state.step >= cap or onebit.variance_settled(state.step, self.norms, cfg.onebit_window,
                                                            cfg.onebit_tolerance, cfg.onebit_min_warmup)

    def _freeze(self, ctx: RoundContext) -> None:
        """Gather m, v (and the master when the parameters are not it) once; start the errors at 0."""
        comm, shard, rail = ctx.comm, ctx.shard_state, _rail_of(ctx)
        padded, dev = ctx.flat.padded, ctx.gather_buf.device
        if rail is not None:  # the shards are the rail's chunks of this rank's local buffer
            comm = rail

        def whole(part: torch.Tensor) -> torch.Tensor:
            return comm.all_gather(part, torch.empty(padded, dtype=torch.float32, device=dev))

        nodes = _nodes_of(ctx)  # two-level: this rank keeps its slice of every whole tensor
        keep = (lambda t: t) if nodes is None else (lambda t: slice_of(t, nodes.layout))
        momentum, variance = keep(whole(shard.exp_avg)), keep(whole(shard.exp_avg_sq))
        master = None if self._params_are_master(ctx) else keep(whole(shard.master))
        mask = onebit.unused_mask(variance)
        # v_T is only ever read through d: d in its place, once (the same ops every step would repeat)
        denominator = onebit.frozen_denominator(variance, shard.step, ctx.spec, out=variance)
        self.state = CompressedState(momentum, denominator, mask, torch.zeros_like(momentum),
                                     torch.zeros_like(shard.exp_avg), master, shard.step)
        self.norms = []
        self._bind_shard(ctx, shard.step)
        _drop_warmup_buffers(ctx)

    def _params_are_master(self, ctx: RoundContext) -> bool:
        """fp32 compute with an fp32 parameter gather: what every replica holds is the master."""
        return ctx.gather_buf.dtype == torch.float32 and ctx.cfg.param_codec in ("auto", "float32")

    def _bind_shard(self, ctx: RoundContext, step: int) -> None:
        """The shard state (the same object) becomes views of the whole tensors (no second copy;
        its spare is dropped), so the checkpoint's opt.* and engine.shard_state stay meaningful
        (its exp_avg_sq: the frozen denominator's shard)."""
        st, size, nodes, rail = self.state, ctx.flat.shard_size, _nodes_of(ctx), _rail_of(ctx)
        lo = (ctx.comm if rail is None else rail).rank * size  # in a whole tensor (a local buffer);
        # in a slice, the shard is the node's chunk
        at = lo if nodes is None else nodes.layout.node * size
        master = st.master[at:at + size] if st.master is not None else ctx.gather_buf[lo:lo + size]
        ctx.shard_state.rebind(master, st.momentum[at:at + size], st.denominator[at:at + size], step)

    # ------------------------------------------------------------------ compressed stage
    def _compressed_round(self, ctx: RoundContext, req: RoundRequest) -> RoundResult:
        comm, cfg, nodes = ctx.comm, ctx.cfg, _nodes_of(ctx)
        full = ctx.flat.grads[req.grad_index]
        before, phases, t = comm.bytes_sent, {}, time.perf_counter()
        # the workers of 1-bit Adam: the ranks (flat), or the nodes, each rank its slice (two-level)
        # or its local shards (model_sharding='node')
        rail = _rail_of(ctx)
        n = comm.world_size if nodes is None else nodes.layout.nodes
        n = n if rail is None else rail.world_size
        numel = full.numel() if nodes is None else full.numel() // nodes.layout.ranks_per_node
        if self._buf is None or self._buf.numel() != numel:
            self._buf = torch.empty(numel, dtype=torch.float32, device=full.device)
            self._new_master, self._new_error = torch.empty_like(self._buf), torch.empty_like(self._buf)
            self._new_server_error = torch.empty(numel // n, dtype=torch.float32, device=full.device)
        if nodes is not None:
            grad = self._buf.copy_(nodes.node_sum(full))  # the node's sum of this rank's slice
        else:
            grad = full if full.dtype == torch.float32 else self._buf.copy_(full)
        # two-level: the squared norms of the slices add up to the nodes' sum_w |x_w|^2
        totals = agree(ctx, req, grad, nonfinite_flag(full), None)
        lr = lr_at(req.step_index, cfg.lr, cfg.lr_schedule, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
        # sum_w |x_w| <= sqrt(N sum_w |x_w|^2) bounds |sum_w x_w|: the clipping norm (section 9)
        bound = math.sqrt(n * totals.sq_norm) / totals.count if totals.count and not totals.nonfinite else math.nan
        phases["small_all_reduce"] = (t, time.perf_counter())
        if totals.count and not totals.nonfinite:
            coef = clip_coefficient(bound, cfg.max_grad_norm)
            torch.mul(grad, n * coef / totals.count, out=self._buf)  # u_w
            if not self._step(ctx, lr, phases):
                totals.nonfinite, bound = True, math.nan
                totals.reason = "non-finite parameters after the update; every replica computed it:"
        if cfg.poison_freed_buffers:
            full.fill_(float("nan"))
        return RoundResult(
            index=req.index, kind=req.kind, step_index=req.step_index, local_count=req.count,
            count=totals.count, samples=totals.samples,
            loss=totals.loss_sum / totals.count if totals.count else math.nan, lr=lr, grad_norm=bound,
            skipped=totals.nonfinite, empty=totals.count == 0, bad_ranks=totals.bad_ranks,
            exhausted_ranks=totals.exhausted_ranks, bytes_sent=comm.bytes_sent - before, phases=phases,
            skip_reason=totals.reason, micro_batch_s=totals.micro_batch_s)

    def _step(self, ctx: RoundContext, lr: float, phases: dict) -> bool:
        """Exchange the compressed momentum (u_w in self._buf) and step; False when the new
        parameters are not finite (then nothing was installed)."""
        st, codec, spec, nodes, rail = self.state, self.codec, ctx.spec, _nodes_of(ctx), _rail_of(ctx)
        comm = ctx.comm if nodes is None else nodes.rail  # two-level: the 1-bit rows go over the rail
        comm = comm if rail is None else rail  # and under model sharding
        n, size = comm.world_size, ctx.flat.shard_size
        lo, hi = comm.rank * size, (comm.rank + 1) * size  # this rank's shard in what it keeps
        t = time.perf_counter()
        h = onebit.worker_message(st.momentum, self._buf, st.worker_error, spec.betas[0])
        rows = torch.empty((n, codec.wire_bytes(size)), dtype=torch.uint8, device=h.device)
        onebit.encode_rows(h, codec, st.mask, rows, self._new_error, self.piece)  # the new e_w, kept apart
        received = comm.all_to_all_rows(rows)
        own = torch.empty(rows.shape[1], dtype=torch.uint8, device=h.device)
        onebit.server_round(received, codec, st.server_error, st.mask[lo:hi], own, self._new_server_error, self.piece)
        del received
        phases["reduce_scatter"] = (t, time.perf_counter())

        t = time.perf_counter()
        gathered = comm.all_gather(own, rows.view(-1))  # the sent rows are free: every owner's row into them
        momentum = onebit.decode_rows(gathered.view(n, -1), codec, size, st.mask, out=self._buf, piece=self.piece)
        phases["all_gather"] = (t, time.perf_counter())

        t = time.perf_counter()
        step = ctx.shard_state.step + 1
        if st.master is not None:
            master = st.master
        else:
            master = ctx.gather_buf if nodes is None else slice_of(ctx.gather_buf, nodes.layout)
        new = onebit.apply_update(master, momentum, st.denominator, st.mask, lr, step, spec, out=self._new_master)
        bad = nonfinite_flag(new)
        if nodes is not None:  # the node's ranks decide alike on the whole update
            bad = nodes.node.all_reduce_sum(bad.reshape(1))[0]
        elif rail is not None:
            bad = ctx.dims.comm("node").all_reduce_sum(bad.reshape(1))[0]
        finite = not bool(to_host(bad))  # the same bytes on every replica: the same verdict
        if finite:
            st.momentum, self._buf = momentum, st.momentum  # the old momentum is the next round's buffer
            st.worker_error, self._new_error = self._new_error, st.worker_error
            st.server_error, self._new_server_error = self._new_server_error, st.server_error
            if st.master is not None:
                st.master, self._new_master = new, st.master
            if nodes is None:
                ctx.gather_buf.copy_(new)  # the compute dtype: the parameters every replica holds
            else:  # every slice of the node, in the compute dtype, into the parameters every replica holds
                gather_slices(nodes.node, new, ctx.gather_buf, nodes.layout)
            self._bind_shard(ctx, step)
        elif ctx.cfg.nan_policy == "stop":
            raise NonFiniteGradientError(
                f"non-finite parameters after the 1-bit Adam update of step {step} (every replica computed "
                "it): nothing was installed; lower the learning rate or clip gradients (max_grad_norm), or "
                "set nan_policy='skip'")
        phases["optimizer"] = (t, time.perf_counter())
        return finite

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self, ctx: RoundContext) -> tuple[dict[str, torch.Tensor], dict]:
        meta = {"onebit": {"phase": "warmup" if self.state is None else "compressed", "norms": list(self.norms)}}
        if self.state is None:
            return {}, meta
        meta["onebit"]["frozen_step"] = self.state.frozen_step
        # copies: the engine's opt.* are views of these, and a checkpoint file holds no shared memory
        return {f"onebit.{k}": v.detach().cpu().clone() for k, v in self.state.tensors().items()}, meta

    def load_state_dict(self, ctx: RoundContext, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        saved = meta.get("onebit")
        if saved is None:
            raise ValueError("the checkpoint holds no 1-bit Adam state (phase, errors, frozen variance): it was "
                             "not written by strategy 'onebit_adam'")
        self.norms = list(saved["norms"])
        self.state = None
        if saved["phase"] == "warmup":
            return
        dev = ctx.gather_buf.device
        got = {k[len("onebit."):]: v.to(dev).clone() for k, v in tensors.items() if k.startswith("onebit.")}
        if "variance" in got:  # written before the denominator was kept: form it as the freeze does
            got["denominator"] = onebit.frozen_denominator(got.pop("variance"), saved["frozen_step"], ctx.spec)
        if ("master" in got) == self._params_are_master(ctx):
            raise ValueError("the checkpoint's 1-bit Adam state does not match this run's compute dtype and "
                             "param_codec (a separate fp32 master is kept unless both are fp32): resume with "
                             "the checkpoint's settings")
        self.state = CompressedState(got["momentum"], got["denominator"], got["mask"], got["worker_error"],
                                     got["server_error"], got.get("master"), saved["frozen_step"])
        self._bind_shard(ctx, meta["opt_step"])


def _drop_warmup_buffers(ctx: RoundContext) -> None:
    """Free the warmup's reducer output and the send, receive and cast buffers its collectives keep
    (the engine's Comms of the comm thread): the compressed rounds never run those collectives
    again; a buffer one of its own collectives takes (a two-level node sum) is made again on first use."""
    grads = getattr(ctx.grads, "inner", ctx.grads)  # the flat reducer, which two-level and node sharding wrap
    grads.drop_buffers()
    comms = [ctx.comm, getattr(ctx.grads, "node", None), getattr(ctx.grads, "rail", None)]
    for comm in {id(c): c for c in comms if c is not None}.values():
        comm.drop_buffers()


def compressed_step_parts(padded: int, world: int, group_size: int = 128, scale_dtype: str = "float32") -> dict:
    """What one worker sends in one step of the compressed stage (Comm's count), by collective:
    the all-to-all and the all-gather of sign1 rows (S/8 payload bytes + S/g scales each, S =
    padded / world), and the small all-reduce of 4 + 3N float64 values."""
    row = WIRE_CODECS["sign1"](group_size, scale_dtype).wire_bytes(padded // world)
    return {"all_to_all": (world - 1) * row, "all_gather": (world - 1) * row, "small": small_bytes(world, 4 + 3 * world)}


def compressed_step_bytes(padded: int, world: int, group_size: int = 128, scale_dtype: str = "float32") -> int:
    return sum(compressed_step_parts(padded, world, group_size, scale_dtype).values())


def _spec_parts(numel: int, world: int, mode, ws) -> dict:
    return compressed_step_parts(padded_to(numel, world, math.lcm(ALIGN, ws.group_size)), world, ws.group_size,
                                 ws.scale_dtype)
