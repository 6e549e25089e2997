"""Engine: the compute side's loop. Accumulates micro-batches and hands rounds to the comm side.

    engine = Engine(model, EngineConfig(strategy="acco", lr=3e-4, micro_batches=2))
    history = engine.fit(batches)      # this worker's micro-batches
    # or the user's own loop: result = engine.feed(batch) per micro-batch, engine.finish() at the end
    engine.save("ckpt")                # Engine.load("ckpt", model) resumes the same trajectory

At a round boundary (after this worker's share of the round's micro-batches, engine/batching.py),
the compute side waits for the round in flight (in the batch-growing mode it keeps accumulating
until that round is done), installs the parameters it gathered, submits the gradients it just
accumulated as the next round and goes on accumulating into the other buffer.

Local-step strategies (``plan.local_steps`` > 0: diloco, sparseloco; docs/DESIGN.md section 8)
take an inner optimizer step at every boundary instead, on this worker alone, and submit an
outer round only when the strategy says one is due (engine/local_loop.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from acco_loco.acco import RoundKind
from acco_loco.optim import init_state

from . import checkpoint as ckpt
from .comm import Comm, default_store, init_process_group
from .layout import choose_topology, make_two_level_collectives
from .collectives import codec_groups, make_collectives
from .config import EngineConfig
from .cpu_memory import keep_freed_memory
from .dealing import GlobalBatches, dealt_stream
from .flat import FlatParams
from .clock import make_clock
from .local_loop import LocalStepsLoop
from .loop import StepResult
from .loss import LossFn, batch_size, default_loss
from .agreement import check_agreement
from .auto import resolve as resolve_auto
from .placement import Placement
from .batching import Accumulation
from .rounds import RoundContext, RoundRequest, RoundResult
from .state import EngineState
from .strategies import make_strategy
from .streams import CommWorker, RoundHandle
from .watchdog import EXIT_ERROR, EXIT_PEER, Watchdog, WorkerLostError, may_be_peer_failure

log = logging.getLogger("acco_loco")

_END = object()


class Engine(LocalStepsLoop):
    def __init__(self, model: torch.nn.Module, cfg: EngineConfig | None = None,
                 loss_fn: LossFn | None = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        cfg = cfg if cfg is not None else EngineConfig()
        if not isinstance(cfg, EngineConfig):
            raise TypeError(f"cfg must be an EngineConfig, got {type(cfg).__name__}")
        cfg.validate()
        cfg = resolve_auto(cfg, model)  # strategy="auto": the planner and a probe choose (engine/auto.py)
        self.cfg = cfg
        self.model = model
        self.loss_fn = loss_fn or default_loss
        self.strategy = make_strategy(cfg)
        self.plan = self.strategy.plan
        self.spec = cfg.optimizer_spec()

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters (every requires_grad is False): "
                             "unfreeze at least one parameter")
        device = named[0][1].device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif cfg.keep_cpu_memory:
            keep_freed_memory()  # before the process group and the comm thread start
        rank, world = init_process_group(device, cfg.timeout_s)
        self.layout, self.topology = choose_topology(cfg, self.strategy, rank, world, device)
        check_agreement(model, cfg, rank, world, device)  # before any collective that depends on sizes
        self.comm = Comm(rank, world, cfg.comm_chunks,
                         peer_nodes=[self.layout.node_of(r) for r in range(world)])
        self.device = device
        self.placement = Placement(device)  # every micro-batch goes to the model's device
        self.clock = make_clock(device)  # micro-batch times: CUDA events on a GPU

        self.ctx = self._place_parameters(named, rank, world)
        self.flat = self.ctx.flat
        self.strategy.setup(self.ctx)
        self.worker = CommWorker(device, cfg.timeout_s)
        self.watchdog = Watchdog(default_store() if world > 1 else None, rank, world, cfg.heartbeat_s)
        torch.manual_seed(cfg.seed)

        self._link_mark = (self.comm.counter.intra, self.comm.counter.inter)  # after the start-up broadcast
        self.state = EngineState()  # counters and the pending accumulator: saved by save()
        self.state.start_accumulator(device)
        self._inflight: RoundHandle | None = None
        self._submitted_at = 0.0
        self._step_rounds = 0
        self._step_local = 0
        self._step_bytes = 0
        self._outer_done: list[dict] = []  # local steps: outer rounds finished since the last entry
        self._clock = time.perf_counter()
        self.history: list[dict] = []
        self.round_counts: list[int] = []  # this worker's micro-batches in each submitted round
        self.timeline: list[tuple] = []
        # grow on CPU with overlap: the comm side's CPU per round sets a floor on the
        # micro-batches per round (zero1 has nothing to overlap: grow is fixed there)
        self.accumulation = Accumulation(cfg, self.plan, rank, world,
                                         paced=device.type == "cpu" and self.plan.overlap)
        self._round_compute_s = 0.0  # this worker's compute seconds in the round it accumulates
        self.comm_cpu_s: list[float] = []  # CPU seconds of every thread but the compute loop, per round
        self._cpu_mark = (time.process_time(), time.thread_time())
        self._stop_at = cfg.max_steps  # fit(steps=...) stops its call earlier
        self._closed = False

    def _place_parameters(self, named: list, rank: int, world: int) -> RoundContext:
        """Flatten the trainable parameters into one padded buffer, start every replica from
        rank 0's fp32 values, and build what the rounds work with around it."""
        cfg, device = self.cfg, self.device
        # fp32 values of rank 0 define every replica's start and every master shard
        flat32 = torch.cat([p.detach().reshape(-1).to(torch.float32) for _, p in named])
        dtype = {"auto": named[0][1].dtype, "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.compute_dtype]
        if not dtype.is_floating_point:
            raise TypeError(f"trainable parameters must be floating point, got {dtype}")
        if cfg.compute_dtype != "auto":
            self.model.to(dtype)
        flat = FlatParams([p for _, p in named], [n for n, _ in named], world,
                          math.lcm(cfg.align, *codec_groups(cfg)), dtype)
        padded32 = torch.zeros(flat.padded, dtype=torch.float32, device=device)
        padded32[:flat32.numel()] = flat32
        self.comm.broadcast_(padded32, src=0)
        flat.data.copy_(padded32)
        if self.topology == "two_level":
            grads, params = make_two_level_collectives(cfg, self.comm, self.layout, flat.padded, device, dtype)
        else:
            grads, params = make_collectives(cfg, flat.padded, world, device, rank, dtype)
        owned = self.strategy.initial_values(flat, padded32, rank, self.layout)
        return RoundContext(cfg=cfg, comm=self.comm, flat=flat, spec=self.spec,
                            shard_state=init_state(owned, self.spec), grads=grads,
                            params=params, gather_buf=flat.data.clone())  # what every replica holds

    # ------------------------------------------------------------------ public API
    @property
    def step(self) -> int:
        return self.state.step

    @property
    def round_index(self) -> int:
        return self.state.round_index

    @property
    def consumed(self) -> int:
        return self.state.consumed

    @property
    def shard_state(self):
        return self.ctx.shard_state

    @property
    def grads(self):
        """The gradient reducer (``.feedback`` holds the error state of a compressed one)."""
        return self.ctx.grads

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def fit(self, batches: Iterable[Any], steps: int | None = None) -> list[dict]:
        """Train until ``cfg.max_steps`` committed steps or until some worker's data runs out.

        ``batches`` are this worker's micro-batches. After a resume, pass the stream from index
        ``engine.consumed`` on. Or, under a global batch (``global_micro_batches``), one
        ``GlobalBatches`` stream that every rank passes alike: the engine deals each worker the
        micro-batches of its share (engine/dealing.py), so the samples of a step do not depend on
        the shares, and a resumed run passes the same stream again. ``steps`` stops this call after that many more committed steps
        (every rank must pass the same value); the learning-rate schedule keeps ``cfg.max_steps``
        as its horizon, so fitting in pieces follows the same trajectory as one call. Returns one
        dict per committed step of this call.

        It is the user's loop of :meth:`feed` calls over ``batches`` and :meth:`finish` when they
        run out, with a progress bar: a user who keeps their own loop gets the same trajectory.
        """
        self.begin(steps)
        first = len(self.history)
        it = self.deal(batches)
        bar = self._progress_bar()
        try:
            while not self.done:
                with self._aborting_on_error():  # a failing data loader: the peers are told too
                    batch = next(it, _END)  # pulled only while a micro-batch is due (dealing reads the round)
                if batch is _END:
                    self.finish()
                    break
                self.feed(batch)
                if bar is not None and bar.n != self.step:
                    bar.update(self.step - bar.n)
                    h = self.history[-1]
                    bar.set_postfix(loss=f"{h['loss']:.4f}", samples_s=f"{h['samples'] / max(h['time_s'], 1e-9):.1f}")
        finally:
            if bar is not None:
                bar.close()
        return self.history[first:]

    # ------------------------------------------------------------------ the user's loop
    _stopped = False  # the last boundary said stop (the data of some rank ran out, or the horizon)
    _looping = False  # inside a loop of feed() calls: fit's, or the user's since the first feed

    @property
    def done(self) -> bool:
        """True when :meth:`feed` takes no more batches: ``max_steps`` (or ``fit``'s ``steps``)
        committed steps, or some worker's data ran out (every rank stops at the same step)."""
        return self._stopped or self.step >= self._stop_at

    def feed(self, batch: Any) -> StepResult | None:
        """Run one micro-batch of this worker's; when it completes a round, hand the round to the
        comm side. Returns the step this call committed (None while the step is still being
        accumulated or on the wire: with ACCO's overlap a step commits during a later call). Every
        rank calls it with its own micro-batches; at the end of the data call :meth:`finish`.
        Should one call commit two steps (a round with no micro-batches of this worker's, under
        speed shares), it returns the later; ``engine.history`` holds every one."""
        if not self._looping:
            self.begin(None)
        if self.done:
            raise RuntimeError(self._done_message())
        first = len(self.history)
        with self._aborting_on_error():
            self._micro_batch(batch)
            self._settle()
        return StepResult.from_entry(self.history[-1]) if len(self.history) > first else None

    def finish(self) -> list[StepResult]:
        """This worker's data ran out: send what it accumulated and finish the rounds in flight,
        until every rank has stopped (all ranks call it; the others' data may last longer, they
        stop at the same step). Returns the steps committed meanwhile. Micro-batches a round did
        not take stay pending for a later ``fit``/``feed``. After :attr:`done` it does nothing."""
        if not self._looping:
            if self.done:
                return []
            self.begin(None)
        first = len(self.history)
        with self._aborting_on_error():
            while not self.done:
                self._stopped = self._boundary(self._accumulate(iter(())))
        self._looping = False
        return [StepResult.from_entry(e) for e in self.history[first:]]

    def begin(self, steps: int | None = None) -> None:
        """Start a loop of :meth:`feed` calls that ends (:attr:`done`) after ``steps`` more
        committed steps (every rank passes the same; default: at ``cfg.max_steps``), or when some
        worker's data runs out; the first feed() starts one itself. Like ``fit(steps=...)``: a
        run in pieces (an evaluation between them) follows the trajectory of one loop; each piece
        restarts the clock of ``time_s``."""
        if self._closed:
            raise RuntimeError("this engine was closed: build a new one")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps must be a positive integer or None, got {steps!r}")
        if self.step >= self.cfg.max_steps:
            raise RuntimeError(
                f"the engine is at step {self.step}, its max_steps is {self.cfg.max_steps}: nothing to "
                f"train. To continue a saved run, load it with a new horizon: "
                f"Engine.load(directory, model, loss_fn=..., max_steps={self.step + self.cfg.max_steps})")
        self._stop_at = self.cfg.max_steps if steps is None else min(self.cfg.max_steps, self.step + steps)
        self._stopped, self._looping = False, True
        self._clock = time.perf_counter()
        with self._aborting_on_error():
            self._settle()  # a round this worker has no micro-batches in goes out before its first

    def _settle(self) -> None:
        """End every round that may end now: the one the last micro-batch completed, then any
        that follow with no micro-batches of this worker's (a share of 0)."""
        while not self.done and self._round_may_end():
            self._stopped = self._boundary(False)
        if self.done:
            self._looping = False  # the next feed() starts a new loop (and says why it cannot)

    def _done_message(self) -> str:
        if self.step >= self.cfg.max_steps:
            return (f"the engine is at step {self.step}, its max_steps: nothing more to train (load it with "
                    f"a new horizon to continue: Engine.load(directory, model, max_steps=...))")
        if self.step >= self._stop_at:
            return f"this loop's steps are done at step {self.step}: begin(steps) starts another piece"
        return (f"training stopped at step {self.step}: the data of some worker ran out; begin() and "
                f"feed() again on every rank to continue with more data")

    @contextmanager
    def _aborting_on_error(self):
        """Any error in the loop: stop heartbeats and tell the peers why, then raise it."""
        try:
            yield
        except BaseException as exc:
            self._looping = False
            self._abort(EXIT_PEER if isinstance(exc, WorkerLostError) else EXIT_ERROR)
            raise

    def deal(self, batches: Iterable[Any]):
        """This worker's micro-batches of ``batches`` for a loop of :meth:`feed` calls: a
        ``GlobalBatches`` stream dealt out by this worker's share of each round (as ``fit`` does;
        pull each batch just before feeding it, the dealing reads the round), else ``batches``."""
        return self._dealt(batches) if isinstance(batches, GlobalBatches) else iter(batches)

    def _dealt(self, batches: GlobalBatches):
        """This worker's micro-batches of the shared stream: its share of each round, by index."""
        cfg = self.cfg
        if cfg.global_micro_batches is None:
            raise ValueError("GlobalBatches is dealt out by the global batch: set global_micro_batches "
                             "(accumulation 'fixed'), or pass this worker's own micro-batches")
        if self.plan.local_steps:
            raise ValueError(f"strategy {cfg.strategy!r} takes local steps (each worker its own inner "
                             f"steps): pass each worker its own micro-batches, not GlobalBatches")

        def where():
            r = self.state.round_index
            return r, self.state.pending_count, self.accumulation.shares(r)
        return dealt_stream(batches, where, self.rank, cfg.global_micro_batches, self.plan.rounds_per_step)

    def save(self, directory: str) -> str:
        """Write a checkpoint (all ranks call this); returns the directory."""
        self._require_quiescent("save")
        return ckpt.save(self, directory)

    @classmethod
    def load(cls, directory: str, model: torch.nn.Module, cfg: EngineConfig | None = None,
             loss_fn: LossFn | None = None, *, max_steps: int | None = None) -> "Engine":
        """Build an engine from a checkpoint written by ``save`` (at this or another world size:
        engine/reshard.py re-cuts the state).

        ``max_steps`` sets a new horizon for the resumed run (it must lie beyond the saved step).
        """
        return ckpt.load(cls, directory, model, cfg, loss_fn, max_steps=max_steps)

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """This rank's whole training state as (tensors, JSON-able metadata): counters, the
        owned shard and its optimizer moments, the gradient accumulated but not yet sent, the
        RNG, the gradient reducer's error state and what the strategy keeps between rounds."""
        self._require_quiescent("take the state")
        state = self.ctx.shard_state
        tensors = {f"opt.{k}": v.detach().cpu().contiguous() for k, v in state.tensors().items()}
        tensors["pending_grad"] = self.flat.grads[self.flat.active].detach().cpu().contiguous()
        tensors["rng_cpu"] = torch.get_rng_state()
        if self.device.type == "cuda":
            tensors["rng_cuda"] = torch.cuda.get_rng_state(self.device)
        mid_step = self.state.round_index % self.plan.rounds_per_step != 0
        tensors.update({k: v.detach().cpu().contiguous() for k, v in self.ctx.grads.state_dict(mid_step).items()})
        strategy_tensors, strategy_meta = self.strategy.state_dict(self.ctx)
        tensors.update(strategy_tensors)
        meta = {"rank": self.rank, "world_size": self.world_size, "topology": self.topology,
                **self.state.state_dict(),
                "opt_step": state.step, "shard_size": self.flat.shard_size, "numel": self.flat.numel,
                "accumulation": self.accumulation.state_dict(), **strategy_meta}
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict, where: str = "the state") -> None:
        """Restore what ``state_dict`` returned (same model, config and world size)."""
        flat, dev = self.flat, self.device
        tensors = {k: v.to(dev) for k, v in tensors.items()}  # once, for every part below
        # the comm side keeps some of these (a resumed ACCO kept half) and frees them there
        self.worker.adopt(tensors.values())
        if meta["shard_size"] != flat.shard_size or meta["numel"] != flat.numel:
            raise ValueError(f"{where} holds a shard of {meta['shard_size']} values for a model of "
                             f"{meta['numel']} trainable values; this engine has {flat.shard_size} and "
                             f"{flat.numel}: same model, same trainable parameters and align are needed")
        state = self.ctx.shard_state
        state.master.copy_(tensors["opt.master"])
        state.exp_avg.copy_(tensors["opt.exp_avg"])
        if state.exp_avg_sq is not None:
            state.exp_avg_sq.copy_(tensors["opt.exp_avg_sq"])
        state.step = meta["opt_step"]
        with torch.no_grad():
            flat.grads[flat.active].copy_(tensors["pending_grad"])
            self.ctx.gather_buf.copy_(flat.data)
        self.ctx.grads.load_state_dict(tensors, where)
        torch.set_rng_state(tensors["rng_cpu"].cpu())
        if "rng_cuda" in tensors and dev.type == "cuda":
            torch.cuda.set_rng_state(tensors["rng_cuda"].cpu(), dev)
        self.state.load_state_dict(meta, dev)
        self.accumulation.load_state_dict(meta.get("accumulation", {}))
        self.strategy.load_state_dict(self.ctx, tensors, meta)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._inflight is not None:
            (self._finish_outer if self.plan.local_steps else self._finish)(self._inflight)
            self._inflight = None
        self.watchdog.close()
        self.worker.close()
        self.clock.flush()

    # ------------------------------------------------------------------ compute side
    def _accumulate(self, it) -> bool:
        """Run micro-batches until this round may end; True if the data ran out."""
        while not self._round_may_end():
            batch = next(it, _END)
            if batch is _END:
                return True
            self._micro_batch(batch)
        return False

    def _round_may_end(self) -> bool:
        """Whether this worker's micro-batches complete the round: its share of them (grow: at
        least that many, and more while the round in flight is still on the wire)."""
        cfg = self.cfg
        grow, least = self.accumulation.grow, self.accumulation.minimum(self.round_index)
        if self.state.pending_count < least:
            return False
        if not grow or self._inflight is None:
            return True
        if cfg.max_micro_batches is not None and self.state.pending_count >= cfg.max_micro_batches:
            return True
        if self._inflight.done():
            return True
        return time.perf_counter() - self._submitted_at > cfg.timeout_s  # _finish names the peer that holds it up

    def _micro_batch(self, batch: Any) -> None:
        span = self.clock.start()
        batch = self.placement(batch)
        loss = self.loss_fn(self.model, batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                            f"{'' if not isinstance(loss, torch.Tensor) else ' of shape ' + str(tuple(loss.shape))}")
        if not loss.requires_grad:
            raise RuntimeError("the loss does not require grad: is the model in torch.no_grad(), "
                               "or are the trainable parameters not used by the loss?")
        loss.backward()
        self.state.pending_count += 1
        self.state.pending_samples += batch_size(batch)
        self.state.pending_loss += loss.detach().float()
        self.state.consumed += 1
        self.clock.stop(span, partial(self._micro_batch_timed, self.round_index))

    def _micro_batch_timed(self, round_index: int, t0: float, t1: float) -> None:
        """A micro-batch's time, once known (at once on CPU; on a GPU when its end event is
        reached, so a time may count towards the round after its own: engine/clock.py)."""
        self.accumulation.pacer.on_micro_batch(t1 - t0)
        self._round_compute_s += t1 - t0
        if self.cfg.record_timeline:
            self.timeline.append(("compute", self.rank, t0, t1, round_index))

    def _boundary(self, exhausted: bool) -> bool:
        """Finish the round in flight, submit the next; True when training must stop."""
        if self.plan.local_steps:
            return self._local_boundary(exhausted)
        if self._inflight is not None:
            handle, self._inflight = self._inflight, None
            if self._finish(handle):
                return True
        if exhausted and self.state.pending_count == 0 and self.world_size == 1:
            self._warn_stopped_early([0])
            return True
        self.flat.check_grads_attached()
        handle = self._submit(exhausted)
        if not self.plan.overlap or exhausted:
            return self._finish(handle)
        self._inflight = handle
        return False

    def _submit(self, exhausted: bool) -> RoundHandle:
        req = RoundRequest(
            index=self.round_index, kind=self.plan.kind(self.round_index), step_index=self.step,
            grad_index=self.flat.active, count=self.state.pending_count, samples=self.state.pending_samples,
            loss_sum=self.state.pending_loss.clone(), exhausted=exhausted,
            first_of_step=self.round_index % self.plan.rounds_per_step == 0,
            micro_batch_s=self._round_compute_s / self.state.pending_count if self.state.pending_count else 0.0)
        self._round_compute_s = 0.0
        if self.worker.stream is not None:
            # the comm stream reads this compute-stream tensor: keep its memory until it has
            req.loss_sum.record_stream(self.worker.stream)
        handle = self.worker.submit(req.index, partial(self.strategy.run_round, self.ctx, req))
        self._submitted_at = time.perf_counter()
        self.state.round_index += 1
        self.round_counts.append(req.count)
        self.watchdog.round = req.index
        # the compute side moves to the other buffer; the round owns this one until it is done
        nxt = 1 - self.flat.active
        self.flat.point_grads(nxt)
        self.flat.grads[nxt].zero_()
        self.state.start_accumulator(self.device)
        return handle

    def _finish(self, handle: RoundHandle) -> bool:
        """Wait for a round, install its parameters, record a committed step; True to stop."""
        result = self._wait(handle)
        with torch.no_grad():
            self.flat.data.copy_(self.ctx.gather_buf)
        self._measure(result)
        self._step_local += result.local_count
        if result.kind is RoundKind.COMMIT and not result.empty:
            self._record_step(result)
        if result.exhausted_ranks:
            self._warn_stopped_early(result.exhausted_ranks)
            return True
        return self.step >= self._stop_at

    def _wait(self, handle: RoundHandle) -> RoundResult:
        """The round's result, or the error a user should see (a lost peer is named)."""
        try:
            return handle.wait(self.cfg.timeout_s)
        except Exception as exc:
            err = self._explain(exc, f"round {handle.index} on rank {self.rank}")
            if err is exc:
                raise
            raise err from exc

    def _measure(self, result: RoundResult) -> None:
        """A finished round's CPU, rounds, bytes and phases, for the next history entry."""
        # what the other threads (comm, gloo) used since the last round ended: on CPU it is
        # taken from the compute side's cores
        proc, main = time.process_time(), time.thread_time()
        comm_cpu = max(0.0, (proc - self._cpu_mark[0]) - (main - self._cpu_mark[1]))
        self._cpu_mark = (proc, main)
        self.comm_cpu_s.append(comm_cpu)
        self.accumulation.on_round(result.micro_batch_s, comm_cpu)
        self._step_rounds += 1
        self._step_bytes += result.bytes_sent
        if self.cfg.record_timeline:
            for phase, (a, b) in result.phases.items():
                self.timeline.append((phase, self.rank, a, b, result.index))

    def _record_step(self, result: RoundResult) -> None:
        self.state.step += 1
        now = time.perf_counter()
        entry = {
            "step": self.step, "loss": result.loss, "lr": result.lr, "samples": result.samples,
            "micro_batches": self._step_local, "global_micro_batches": result.count,
            "wire_bytes": self._step_bytes, "time_s": now - self._clock, "grad_norm": result.grad_norm,
            "skipped": result.skipped, "bad_ranks": result.bad_ranks, "rounds": self._step_rounds,
            "min_micro_batches": self.accumulation.pacer.current, **self._link_bytes(),
        }
        if result.skipped:
            log.warning("step %d skipped: %s rank(s) %s; the master, the optimizer state and the "
                        "error feedback are as before the step", self.step, result.skip_reason or
                        "non-finite gradient from", result.bad_ranks or "unknown (the reduced sum overflowed)")
        self.history.append(entry)
        self._clock = now
        self._step_rounds = self._step_local = self._step_bytes = 0
        cfg = self.cfg
        if ckpt.periodic_due(self):
            ckpt.save_periodic(self, cfg.checkpoint_dir)

    # ------------------------------------------------------------------ helpers
    def _link_bytes(self) -> dict:
        """Bytes this rank sent since the last history entry, to its own node and to others."""
        c = self.comm.counter
        intra, inter = c.intra - self._link_mark[0], c.inter - self._link_mark[1]
        self._link_mark = (c.intra, c.inter)
        return {"wire_bytes_intra": intra, "wire_bytes_inter": inter}

    def _warn_stopped_early(self, ranks: list[int]) -> None:
        log.warning("training stopped at step %d: the data of rank(s) %s ran out; %d micro-batches "
                    "accumulated on this rank stay pending and are used if fit() continues",
                    self.step, ranks, self.state.pending_count)

    def _explain(self, exc: Exception, where: str) -> Exception:
        """The error a user should see for a failed round: the round's own exception (with
        where it happened), or WorkerLostError when the failure is a peer that died or stalled."""
        if self.world_size > 1 and may_be_peer_failure(exc):
            lost = self.watchdog.diagnose(where)
            if lost.ranks or isinstance(exc, TimeoutError):
                return lost
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(f"(raised on the communication side: {where})")
        return exc

    def _require_quiescent(self, what: str) -> None:
        if self._inflight is not None:
            raise RuntimeError(f"cannot {what} while a round is in flight")

    def _abort(self, reason: str) -> None:
        """After an error: stop heartbeats, telling peers why, never hang here."""
        self._inflight = None
        if reason == EXIT_PEER:
            self.worker.abort()  # NCCL: ends a lost peer's collective, which wakes the comm thread
        self.watchdog.close(reason)

    def _progress_bar(self):
        if not self.cfg.progress or self.rank != 0:
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError as exc:
            raise ImportError("progress=True draws its bar with tqdm: pip install tqdm (or the [hf] extra), "
                              "or leave progress off") from exc

        return tqdm(total=self.cfg.max_steps, initial=self.step, desc=f"{self.cfg.strategy}", unit="step")
