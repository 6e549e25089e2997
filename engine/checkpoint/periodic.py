"""Periodic checkpoints: when one is due, and the one still being written in the background.

``PeriodicSaver`` owns the cadence (every ``checkpoint_every`` steps, or ``checkpoint_every_s``
seconds as a step every rank agrees on: ``Cadence``) and, with ``checkpoint_async``, the save
whose files a thread is writing; that save is finished (renamed, ``latest`` moved) at the next
save or at close. A loop asks ``due(step)`` after each committed step and calls ``save()`` at a
point with no round in flight."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from .peers import LATEST
from .writer import CheckpointWriter, PendingSave


class Cadence:
    """When the next time-based checkpoint (``checkpoint_every_s``) is due, as a step every rank
    agrees on: the first after the first committed step; at each save the ranks take rank 0's
    seconds per step since the last save (one small all-reduce at the save, where no round is in
    flight) and the next is due that many seconds later, in steps. No collective between saves."""

    def __init__(self, step: int, every_s: float, comm, device: torch.device, watchdog) -> None:
        self.every_s, self.comm, self.device, self.watchdog = every_s, comm, device, watchdog
        self.next_step = step + 1
        self.mark = (time.perf_counter(), step)  # rank 0's (clock, step) at the last save

    def after_save(self, step: int) -> None:
        now, (then, step0) = time.perf_counter(), self.mark
        per_step = (now - then) / max(1, step - step0) if self.comm.rank == 0 else 0.0
        agreed = torch.tensor([per_step], dtype=torch.float64, device=self.device)
        if self.comm.world_size > 1:
            try:
                self.comm.all_reduce_sum(agreed)
            except Exception as exc:
                raise self.watchdog.diagnose("agreeing on the checkpoint cadence") from exc
        per_step = float(agreed[0])
        interval = max(1, int(self.every_s / per_step)) if per_step > 0 else 1
        self.next_step = step + interval
        self.mark = (time.perf_counter(), step)  # the save's own time is not a step's


class PeriodicSaver:
    """Saves ``cfg.checkpoint_dir/step-NNNNNNNN`` when due and points ``latest`` at it; also the
    user's own saves (``save_to``), which finish a background save first."""

    def __init__(self, writer: CheckpointWriter, cfg):
        self._writer = writer
        self._root, self._every, self._background = cfg.checkpoint_dir, cfg.checkpoint_every, cfg.checkpoint_async
        self._cadence = (Cadence(writer.step, cfg.checkpoint_every_s, writer.comm, writer.device, writer.watchdog)
                         if cfg.checkpoint_every_s is not None else None)
        self._pending: PendingSave | None = None

    @property
    def pending(self) -> PendingSave | None:
        """The periodic save still being written in the background (checkpoint_async), if any."""
        return self._pending

    def due(self, step: int) -> bool:
        """Whether the step just committed is due a periodic checkpoint: every ``checkpoint_every``
        steps, or once the agreed step of the time-based cadence is reached."""
        by_steps = bool(self._every) and step % self._every == 0
        return by_steps or (self._cadence is not None and step >= self._cadence.next_step)

    def save(self, root: str | os.PathLike | None = None) -> str:
        """Checkpoint ``root/step-NNNNNNNN`` (default root: ``checkpoint_dir``) at the current step
        and point ``root/latest`` at it (every rank; no round in flight). In the background
        (``checkpoint_async``) it is finished at the next save or at close."""
        root = Path(root if root is not None else self._root)
        step = self._writer.step
        name = f"step-{step:08d}"
        self.finish_pending()

        def point_latest() -> None:
            pointer = root / (LATEST + ".tmp")
            pointer.write_text(name + "\n")
            os.replace(pointer, root / LATEST)

        if self._background:
            self._pending = self._writer.start(root / name, then=point_latest)
        else:
            self._writer.save(root / name, then=point_latest)
        if self._cadence is not None:
            self._cadence.after_save(step)
        return str(root / name)

    def save_to(self, directory: str | os.PathLike) -> str:
        """The user's checkpoint in ``directory``, written now (a background save finishes first)."""
        self.finish_pending()
        return self._writer.save(directory)

    def finish_pending(self) -> None:
        """Finish the periodic save still being written in the background, if any (every rank)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish()

    def abandon(self) -> None:
        """After an error: a background save is left unfinished (its ``.tmp`` is never loaded)."""
        self._pending = None
