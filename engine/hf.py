"""A transformers ``Trainer`` that trains through the engine.

    from engine import EngineConfig
    from engine.hf import EngineTrainer

    trainer = EngineTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                            engine_config=EngineConfig(strategy="acco", codec="loco4"))
    trainer.train()                       # or trainer.train(resume_from_checkpoint=True)

What the Trainer's arguments name, they decide: the per-device batch, gradient accumulation and
the world size give the engine's global batch (``global_micro_batches`` = accumulation x world,
one micro-batch = one per-device batch), and learning rate, its schedule and warmup, AdamW's
betas/eps/weight decay, gradient clipping, max_steps and the seed become the EngineConfig's.
``engine_config`` brings the rest (strategy, codecs, layout, timeouts); setting one of the
Trainer's settings there to another value is refused. The Trainer's data loading, ``compute_loss``
(the engine's loss function), logging (one ``log_history`` entry per logged step, the same on
every rank), callbacks, evaluation, ``save_model`` and checkpoint rotation are the Trainer's own.
Each ``checkpoint-N`` also holds the engine's checkpoint (``checkpoint-N/engine``: the optimizer
shard, error feedback, counters), which ``resume_from_checkpoint`` loads.

The training loop replaces ``Trainer._inner_training_loop`` (transformers 5.x); no optimizer,
scheduler or DDP wrapper is created: the engine owns every update and all communication.
``EngineSFTTrainer`` is TRL's ``SFTTrainer`` on the same mixin (when trl is installed).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from .config import EngineConfig
from .engine import Engine

log = logging.getLogger("acco_loco")

ENGINE_DIR = "engine"  # the engine's checkpoint inside each checkpoint-N folder
# Trainer lr_scheduler_type -> the engine's schedule (both decay to 0 at max_steps after warmup)
SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}


def _name(value: Any) -> str:
    return str(getattr(value, "value", value))  # the Trainer's enums (SchedulerType, OptimizerNames)


def settings_from_args(args, max_steps: int) -> dict[str, Any]:
    """The EngineConfig settings a ``TrainingArguments`` decides, for ``max_steps`` optimizer steps."""
    schedule = _name(args.lr_scheduler_type)
    if schedule not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type={schedule!r}: the engine's schedules are {sorted(SCHEDULES)}")
    optim = _name(args.optim)
    if not (optim.startswith("adamw_torch") or optim == "sgd"):
        raise ValueError(f"optim={optim!r}: the engine's optimizers are AdamW (adamw_torch) and sgd")
    if args.fp16:
        raise ValueError("fp16=True: the engine computes in float32 or bfloat16 (bf16=True) and has no loss scaling")
    if args.auto_find_batch_size:
        raise ValueError("auto_find_batch_size=True: the engine's batch is fixed; set per_device_train_batch_size")
    clip = args.max_grad_norm
    return {
        "optimizer": "adamw" if optim != "sgd" else "sgd",
        "lr": args.learning_rate, "weight_decay": args.weight_decay, "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon, "max_grad_norm": clip if clip and clip > 0 else None,
        "max_steps": max_steps, "lr_schedule": SCHEDULES[schedule], "min_lr_ratio": 0.0,
        "warmup_steps": 0 if schedule == "constant" else args.get_warmup_steps(max_steps),
        "seed": args.seed % 2**32, "global_micro_batches": args.gradient_accumulation_steps * args.world_size,
        **({"compute_dtype": "bfloat16"} if args.bf16 else {}),
    }


def merged_config(engine_config: EngineConfig, args, max_steps: int) -> EngineConfig:
    """engine_config with the Trainer's settings; a different value set in both is refused."""
    from_args = settings_from_args(args, max_steps)
    defaults = EngineConfig()
    clash = [f"{k}={getattr(engine_config, k)!r} (TrainingArguments give {v!r})" for k, v in from_args.items()
             if getattr(engine_config, k) != getattr(defaults, k) and getattr(engine_config, k) != v]
    if engine_config.micro_batches != 1:
        clash.append(f"micro_batches={engine_config.micro_batches} (the batch is per_device_train_batch_size "
                     "x gradient_accumulation_steps x world)")
    if clash:
        raise ValueError(f"engine_config sets {', '.join(clash)}: the Trainer's arguments decide these; set them "
                         "in TrainingArguments and leave them at their defaults in engine_config")
    return EngineConfig.from_dict({**engine_config.to_dict(), **from_args})


class EngineTrainerMixin:
    """The engine's training loop for a transformers Trainer (or a subclass such as SFTTrainer)."""

    def __init__(self, *args, engine_config: EngineConfig | None = None, **kwargs):
        if engine_config is not None and not isinstance(engine_config, EngineConfig):
            raise TypeError(f"engine_config must be an EngineConfig, got {type(engine_config).__name__}")
        self.engine_config = engine_config if engine_config is not None else EngineConfig(strategy="zero1")
        self.engine: Engine | None = None
        super().__init__(*args, **kwargs)
        if self.optimizer is not None or self.lr_scheduler is not None:
            raise ValueError("EngineTrainer takes no optimizers=(...): the engine's optimizer and lr schedule "
                             "come from TrainingArguments and engine_config")

    # ------------------------------------------------------------------ the loop
    def _inner_training_loop(self, batch_size=None, args=None, resume_from_checkpoint=None, trial=None,
                             ignore_keys_for_eval=None):
        args = args if args is not None else self.args
        loader = self.get_train_dataloader()
        (epochs, per_epoch, _, num_train_samples, _, steps_in_epoch,
         max_steps) = self.set_initial_training_values(args, loader)
        self._init_training_state(max_steps, per_epoch, epochs, resume_from_checkpoint, trial)
        cfg = merged_config(self.engine_config, args, max_steps)
        if resume_from_checkpoint is not None:
            where = os.path.join(resume_from_checkpoint, ENGINE_DIR)
            if not os.path.isdir(where):
                raise FileNotFoundError(f"{resume_from_checkpoint} has no engine checkpoint ({ENGINE_DIR}/): it was "
                                        "not written by EngineTrainer (or with save_only_model=True)")
            self.engine = Engine.load(where, self.model, cfg, self._engine_loss, max_steps=max_steps)
        else:
            self.engine = Engine(self.model, cfg, self._engine_loss)
        self.model_wrapped = self.model
        if self.model not in self.accelerator._models:
            # as Trainer's own prepare() would: evaluation then takes the model as it is (preparing it
            # again would replace the .grad views into the engine's gradient buffer)
            self.accelerator._models.append(self.model)
        handler = self.callback_handler
        handler.model, handler.optimizer, handler.lr_scheduler, handler.train_dataloader = self.model, None, None, loader
        self._steps_in_epoch = max(steps_in_epoch, 1)
        start_time = time.time()
        self._initial_global_step = self.state.global_step
        self._losses_since_log: list[float] = []
        self._total_loss_scalar, self._tr_loss = 0.0, torch.tensor(0.0)
        self._globalstep_last_logged = self.state.global_step
        self._pending = set()  # "evaluate" / "save" asked while a round was in flight
        self.control = handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start:
            self.evaluate(ignore_keys=ignore_keys_for_eval)
        try:
            self._train_pieces(loader, max_steps, trial, ignore_keys_for_eval)
        finally:
            self.engine.close()
        return self._finalize_training(trial, num_train_samples, start_time)

    def _train_pieces(self, loader, max_steps: int, trial, ignore_keys) -> None:
        """Feed micro-batches in pieces that end where the arguments schedule an evaluation or a save
        (the engine is quiescent there); the pieces follow the trajectory of one loop."""
        engine, batches = self.engine, self._micro_batches(loader)
        seen, step_open = len(engine.history), False
        while engine.step < max_steps and not self.control.should_training_stop:
            engine.begin(self._next_pause(engine.step, max_steps) - engine.step)
            while not engine.done and not self.control.should_training_stop:
                batch = next(batches, None)
                if batch is None:
                    engine.finish()
                    self.control.should_training_stop = True
                    break
                if not step_open:
                    self.control = self.callback_handler.on_step_begin(self.args, self.state, self.control)
                    step_open = True
                if engine.feed(batch) is None:
                    self.control = self.callback_handler.on_substep_end(self.args, self.state, self.control)
                for entry in engine.history[seen:]:
                    step_open = False
                    self._on_step(entry)
                seen = len(engine.history)
                if self._pending and engine.loop.inflight is None:
                    self._run_pending(trial, ignore_keys)
            for entry in engine.history[seen:]:  # committed by finish()
                self._on_step(entry)
            seen = len(engine.history)
            self._run_pending(trial, ignore_keys)

    def _next_pause(self, step: int, max_steps: int) -> int:
        stops = [max_steps]
        for strategy, every in ((self.args.eval_strategy, self.state.eval_steps),
                                (self.args.save_strategy, self.state.save_steps)):
            if _name(strategy) == "steps" and every:
                every = int(every)
                stops.append((step // every + 1) * every)
        return min(stops)

    def _micro_batches(self, loader):
        """This worker's micro-batches, epoch after epoch, from where the engine left off."""
        epoch, skip = divmod(self.engine.consumed, self._steps_in_epoch)
        while True:
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            self.control = self.callback_handler.on_epoch_begin(self.args, self.state, self.control)
            got = False
            for i, batch in enumerate(loader):
                got = True
                if i >= skip:
                    yield batch
            skip = 0
            self.control = self.callback_handler.on_epoch_end(self.args, self.state, self.control)
            self._pending |= {n for n, f in (("evaluate", self.control.should_evaluate),
                                             ("save", self.control.should_save)) if f}
            epoch += 1
            if not got or self.control.should_training_stop:
                return

    def _engine_loss(self, model, batch) -> torch.Tensor:
        model.train()  # as Trainer.training_step: an evaluation leaves the model in eval mode
        return self.compute_loss(model, batch)

    # ------------------------------------------------------------------ per committed step
    def _on_step(self, entry: dict) -> None:
        args, state = self.args, self.state
        state.global_step = entry["step"]
        state.epoch = self.engine.consumed / self._steps_in_epoch
        self._losses_since_log.append(entry["loss"])
        self.control = self.callback_handler.on_step_end(args, state, self.control)
        if self.control.should_log and state.global_step > self._globalstep_last_logged:
            losses, self._losses_since_log = self._losses_since_log, []
            logs = {"loss": sum(losses) / len(losses), "learning_rate": entry["lr"]}
            if entry.get("grad_norm") is not None:
                logs["grad_norm"] = entry["grad_norm"]
            self._total_loss_scalar += sum(losses)
            self._globalstep_last_logged = state.global_step
            self.store_flos()
            self.log(logs)
        self._pending |= {n for n, f in (("evaluate", self.control.should_evaluate),
                                         ("save", self.control.should_save)) if f}

    def _run_pending(self, trial, ignore_keys) -> None:
        """The evaluation and the save asked for, now that no round is in flight."""
        if "evaluate" in self._pending:
            metrics = self.evaluate(ignore_keys=ignore_keys)
            if self._determine_best_metric(metrics=metrics, trial=trial) and _name(self.args.save_strategy) == "best":
                self._pending.add("save")
        if "save" in self._pending:
            self._save_checkpoint(self.model, trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        self._pending = set()

    def _finalize_training(self, trial, num_train_samples, start_time):
        self._total_loss_scalar += sum(self._losses_since_log)  # the steps after the last log
        self._losses_since_log = []
        return super()._finalize_training(trial, num_train_samples, start_time)

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint stands for the optimizer and the schedule (every rank writes its part)."""
        self.engine.save(os.path.join(output_dir, ENGINE_DIR))

    def _save_scaler(self, output_dir: str) -> None:
        pass  # no loss scaling: fp16 is refused

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        pass  # Engine.load restores them in _inner_training_loop


def _subclass(base: type, name: str) -> type:
    cls = type(name, (EngineTrainerMixin, base), {"__doc__": f"{base.__name__} trained through the engine "
                                                  "(engine/hf.py EngineTrainerMixin)."})
    cls.__module__ = __name__
    return cls


def __getattr__(name: str):
    """EngineTrainer and EngineSFTTrainer, built on first use (transformers and trl load only then)."""
    if name == "EngineTrainer":
        from transformers import Trainer

        base = Trainer
    elif name == "EngineSFTTrainer":
        try:
            from trl import SFTTrainer
        except ImportError as exc:
            raise ImportError("EngineSFTTrainer needs TRL: pip install trl") from exc
        base = SFTTrainer
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = _subclass(base, name)
    globals()[name] = cls
    return cls


__all__ = ["EngineTrainer", "EngineSFTTrainer", "EngineTrainerMixin", "merged_config", "settings_from_args"]
