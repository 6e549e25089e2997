"""Engine: the lifecycle of a training run (process group, device, comm thread, watchdog,
checkpoints) and the compute side's micro-batches; the strategy's loop decides what a round
boundary does (engine/loops/).

    engine = Engine(model, EngineConfig(strategy="acco", lr=3e-4, micro_batches=2))
    history = engine.fit(batches)      # this worker's micro-batches
    # or the user's own loop: result = engine.feed(batch) per micro-batch, engine.finish() at the end
    engine.save("ckpt")                # Engine.load("ckpt", model) resumes the same trajectory
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from .auto import choose_strategy
from .batch.accumulation import Accumulation
from .batch.dealing import deal
from .checkpoint import load as checkpoint_load
from .checkpoint.periodic import PeriodicSaver
from .checkpoint.rank_state import gather_state, restore_state
from .checkpoint.reshard import recut
from .checkpoint.writer import CheckpointWriter
from .config import EngineConfig
from .core.context import build_context, pretrained_engine, start_rank
from .core.counters import EngineState
from .core.loss import LossFn, batch_size, checked_loss, default_loss
from .core.run import RunState
from .core.step_result import StepResult
from .loops.parts import LoopParts
from .parallel.agreement import check_agreement
from .parallel.comm import default_store
from .parallel.dims import ParallelDims
from .runtime.clock import make_clock
from .runtime.placement import Placement
from .runtime.progress import progress_bar
from .runtime.streams import CommWorker
from .runtime.watchdog import EXIT_ERROR, EXIT_PEER, Watchdog, WorkerLostError
from .strategies import make_strategy

_END = object()


class Engine:
    def __init__(self, model: torch.nn.Module, cfg: EngineConfig | None = None,
                 loss_fn: LossFn | None = None, *, weights=None, device=None):  # both: engine/core/loading.py
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        cfg = cfg if cfg is not None else EngineConfig()
        if not isinstance(cfg, EngineConfig):
            raise TypeError(f"cfg must be an EngineConfig, got {type(cfg).__name__}")
        cfg.validate()
        device, rank, world, named, self.weights = start_rank(model, cfg, weights, device)  # weights: the source
        dims = ParallelDims.start(rank, world, device, cfg.ranks_per_node, cfg.topology, cfg.timeout_s)
        check_agreement(model, cfg, dims.comm("control"), device)  # before any collective that depends on sizes
        cfg, self.auto_choice = choose_strategy(cfg, model, dims)  # strategy="auto": the planner chooses (engine/auto.py)
        self.cfg, self.model, self.loss_fn = cfg, model, loss_fn or default_loss
        self.strategy = make_strategy(cfg)
        self.plan, self.spec = self.strategy.plan, cfg.optimizer_spec()
        self.dims = dims.decide(cfg, self.strategy)  # flat, two-level or node-sharded
        self.comm = self.dims.comm("world")  # the comm thread's: the rounds
        self.device = device
        self.placement = Placement(device)  # every micro-batch goes to the model's device
        self.clock = make_clock(device)  # micro-batch times: CUDA events on a GPU

        self.ctx = build_context(model, named, cfg, self.dims, self.strategy, self.spec, self.weights)
        self.flat = self.ctx.flat
        self.strategy.setup(self.ctx)
        self.worker = CommWorker(device, cfg.timeout_s)
        self.watchdog = Watchdog(default_store() if world > 1 else None, rank, world, cfg.heartbeat_s)
        torch.manual_seed(cfg.seed)

        self.state = EngineState()  # counters and the pending accumulator: saved by save()
        self.state.start_accumulator(device)
        # history, round counts, timeline, comm CPU, the loop's end: not saved (engine/core/run.py)
        self.run = RunState(rank, self.dims.counter, cfg.record_timeline, cfg.max_steps)
        # grow on CPU with overlap: the comm side's CPU per round sets a floor on the
        # micro-batches per round (zero1 has nothing to overlap: grow is fixed there)
        self.accumulation = Accumulation(cfg, self.plan, rank, world, paced=device.type == "cpu" and self.plan.overlap,
                                         lockstep=self.dims.layout.ranks_per_node if cfg.model_sharding == "node" else 1)
        writer = CheckpointWriter(self.dims.comm("control"), device, self.watchdog, model, cfg, self.loss_fn,
                                  self.state_dict, self.state)
        self.saver = PeriodicSaver(writer, cfg)  # save(), and checkpoint_every(_s) (engine/checkpoint/periodic.py)
        self.parts = LoopParts(cfg=cfg, ctx=self.ctx, strategy=self.strategy, worker=self.worker,
                               accumulation=self.accumulation, state=self.state, run=self.run,
                               saver=self.saver, watchdog=self.watchdog, device=device)
        self.loop = self.strategy.make_loop(self.parts)  # what a round boundary does (engine/loops/)
        self._looping = False  # inside a loop of feed() calls: fit's, or the user's since the first feed
        self._closed = False

    # ------------------------------------------------------------------ public API
    from_pretrained = classmethod(pretrained_engine)  # a transformers folder, each rank reading its own values
    step = property(lambda self: self.state.step, doc="committed steps (local steps: this worker's inner steps)")
    round_index = property(lambda self: self.state.round_index, doc="rounds submitted")
    consumed = property(lambda self: self.state.consumed, doc="micro-batches taken from this worker's data")
    shard_state = property(lambda self: self.ctx.shard_state, doc="this worker's fp32 master shard and moments")
    grads = property(lambda self: self.ctx.grads, doc="the gradient reducer (.feedback: a compressed one's error state)")
    layout = property(lambda self: self.dims.layout, doc="M nodes x G ranks, and this rank's place in them")
    topology = property(lambda self: self.dims.kind, doc="the exchange: 'flat', 'two_level' or 'node_sharded'")
    rank = property(lambda self: self.comm.rank)
    world_size = property(lambda self: self.comm.world_size)
    history = property(lambda self: self.run.history, doc="one dict per committed step (StepResult's fields)")
    round_counts = property(lambda self: self.run.round_counts, doc="this worker's micro-batches per submitted round")
    timeline = property(lambda self: self.run.timeline, doc="(phase, rank, t0, t1, round) with record_timeline")
    comm_cpu_s = property(lambda self: self.run.comm_cpu_s, doc="the comm side's CPU seconds per finished round")
    stop_at = property(lambda self: self.run.stop_at, doc="the step at which the current loop ends")

    def fit(self, batches: Iterable[Any], steps: int | None = None) -> list[dict]:
        """Train until ``cfg.max_steps`` committed steps or until some worker's data runs out.

        ``batches`` are this worker's micro-batches (after a resume, from index ``engine.consumed``
        on), or one ``GlobalBatches`` stream that every rank passes alike under a global batch: the
        engine deals each worker its share (engine/batch/dealing.py), and a resumed run passes the same
        stream again. ``steps`` stops this call after that many more committed steps (every rank
        passes the same); the lr schedule keeps ``cfg.max_steps`` as its horizon, so fitting in
        pieces follows the trajectory of one call. Returns one dict per committed step of this call.

        It is the user's loop of :meth:`feed` calls over ``batches`` and :meth:`finish` when they
        run out, with a progress bar: a user who keeps their own loop gets the same trajectory."""
        self.begin(steps)
        first, it, bar = len(self.history), self.deal(batches), progress_bar(self.cfg, self.rank, self.step)
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
    @property
    def done(self) -> bool:
        """True when :meth:`feed` takes no more batches: ``max_steps`` (or ``fit``'s ``steps``)
        committed steps, or some worker's data ran out (every rank stops at the same step)."""
        return self.run.done(self.step)

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
            raise RuntimeError(self.run.why_done(self.step))
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
                # the round ends with what this worker has: short of its share, the data ran out
                if self.loop.boundary(not self.loop.round_may_end()):
                    self.run.stop()
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
        self.run.begin(self.step, steps)  # restarts the clock of time_s
        self._looping = True
        with self._aborting_on_error():
            self._settle()  # a round this worker has no micro-batches in goes out before its first

    def _settle(self) -> None:
        """End every round that may end now: the one the last micro-batch completed, then any
        that follow with no micro-batches of this worker's (a share of 0)."""
        while not self.done and self.loop.round_may_end():
            if self.loop.boundary(False):
                self.run.stop()
        if self.done:
            self._looping = False  # the next feed() starts a new loop (and says why it cannot)

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
        return deal(batches, self.cfg, self.strategy, self.state, self.accumulation, self.rank)

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str) -> str:
        """Write a checkpoint (all ranks call this); returns the directory."""
        self._require_quiescent("save")
        return self.saver.save_to(directory)

    @classmethod
    def load(cls, directory: str, model: torch.nn.Module, cfg: EngineConfig | None = None,
             loss_fn: LossFn | None = None, *, max_steps: int | None = None) -> "Engine":
        """Build an engine from a checkpoint written by ``save`` (at this or another world size:
        engine/checkpoint/reshard.py re-cuts the state). ``max_steps`` sets a new horizon for the resumed run
        (it must lie beyond the saved step)."""
        opened = checkpoint_load.open_checkpoint(directory, model, cfg, loss_fn, max_steps)
        try:
            engine = cls(model, opened.cfg, loss_fn, weights=opened.weights)  # a meta model: read from the checkpoint
            error: Exception | None = None
            try:
                engine.load_state_dict(*opened.rank_state(engine.rank, engine.world_size,
                                                      partial(recut, engine.ctx, engine.strategy, engine.topology)))
            except Exception as exc:  # any rank's failure stops every rank here, not in its first round
                error = exc
            checkpoint_load.agree_loaded(engine.dims.comm("control"), engine.device, engine.watchdog, opened.path, error,
                                         engine.close)
            return engine
        finally:
            opened.close()

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """This rank's whole training state as (tensors, JSON-able metadata): counters, the
        owned shard and its optimizer moments, the gradient accumulated but not yet sent, the
        RNG, the gradient reducer's error state and what the strategy keeps between rounds."""
        self._require_quiescent("take the state")
        return gather_state(self.ctx, self.strategy, self.state, self.accumulation, self.device, self.topology)

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict, where: str = "the state") -> None:
        """Restore what ``state_dict`` returned (same model, config and world size)."""
        restore_state(self.ctx, self.strategy, self.state, self.accumulation, self.worker, self.device,
                      tensors, meta, where)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.loop.inflight is not None:
            self.loop.drain()
        self.saver.finish_pending()  # a periodic save still being written: finished and renamed
        self.watchdog.close()
        self.worker.close()
        self.clock.flush()

    # ------------------------------------------------------------------ compute side
    def _micro_batch(self, batch: Any) -> None:
        span = self.clock.start()
        batch = self.placement(batch)
        loss = checked_loss(self.loss_fn(self.model, batch))
        loss.backward()
        self.state.add_micro_batch(batch_size(batch), loss)
        self.clock.stop(span, partial(self._micro_batch_timed, self.round_index))

    def _micro_batch_timed(self, round_index: int, t0: float, t1: float) -> None:
        """A micro-batch's time, once known (at once on CPU; on a GPU when its end event is
        reached, so a time may count towards the round after its own: engine/runtime/clock.py)."""
        self.accumulation.pacer.on_micro_batch(t1 - t0)
        self.loop.on_micro_batch(t1 - t0)
        self.run.computed(t0, t1, round_index)

    # ------------------------------------------------------------------ errors
    def _require_quiescent(self, what: str) -> None:
        if self.loop.inflight is not None:
            raise RuntimeError(f"cannot {what} while a round is in flight")

    def _abort(self, reason: str) -> None:
        """After an error: stop heartbeats, telling peers why, never hang here."""
        self.loop.abandon()
        self.saver.abandon()  # a background save is left unfinished (.tmp)
        if reason == EXIT_PEER:
            self.worker.abort()  # NCCL: ends a lost peer's collective, which wakes the comm thread
        self.watchdog.close(reason)
