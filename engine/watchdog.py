"""Heartbeats through the rendezvous store, so that a lost or stalled peer gets a name.

Each worker bumps a counter and publishes the round it last submitted, every ``interval``
seconds, from a daemon thread. When a round fails or times out, ``diagnose`` reads every peer
twice, a few intervals apart: a peer whose counter did not move is lost (dead process or
unreachable host); a peer whose counter moves but whose round lags is stalled.
"""

from __future__ import annotations

import threading
import time


class WorkerLostError(RuntimeError):
    """A peer died or stalled; ``ranks`` names it (empty when it could not be told)."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


class Watchdog:
    def __init__(self, store, rank: int, world_size: int, interval_s: float, prefix: str = "acco_loco"):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self.prefix = prefix
        self.round = -1
        self._beat = 0
        self._stop = threading.Event()
        self._thread = None
        if store is not None and world_size > 1:
            self._publish()
            self._thread = threading.Thread(target=self._loop, name="acco-loco-heartbeat", daemon=True)
            self._thread.start()

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/hb/{rank}"

    def _publish(self) -> None:
        self._beat += 1
        self.store.set(self._key(self.rank), f"{self._beat} {self.round}")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._publish()
            except Exception:
                return  # the store is gone; diagnose() will say so

    def _read(self) -> dict[int, tuple[int, int] | None]:
        seen: dict[int, tuple[int, int] | None] = {}
        for r in range(self.world_size):
            key = self._key(r)
            if not self.store.check([key]):
                seen[r] = None
                continue
            beat, rnd = self.store.get(key).decode().split()
            seen[r] = (int(beat), int(rnd))
        return seen

    def diagnose(self, waiting_for: str) -> WorkerLostError:
        """Build the error that names the lost or stalled peers (call after a failure)."""
        if self.store is None or self.world_size == 1:
            return WorkerLostError(f"{waiting_for} failed; no store to tell which peer was lost", [])
        try:
            first = self._read()
            time.sleep(2.5 * self.interval_s)
            second = self._read()
        except Exception as exc:
            return WorkerLostError(
                f"{waiting_for} failed and the rendezvous store is unreachable ({exc}): rank 0 "
                "(which hosts the store unless a launcher agent does) is lost", [0])
        lost = [r for r in range(self.world_size) if r != self.rank
                and (second[r] is None or first[r] is None or second[r][0] == first[r][0])]
        if lost:
            return WorkerLostError(
                f"{waiting_for} failed: lost rank(s) {lost}: no heartbeat for "
                f"{2.5 * self.interval_s:.1f} s (the process died or its host is unreachable)", lost)
        rounds = {r: v[1] for r, v in second.items() if v is not None}
        behind = [r for r, rnd in rounds.items() if rnd < self.round]
        if behind:
            return WorkerLostError(
                f"{waiting_for} failed: stalled rank(s) {behind} (last submitted round "
                f"{[rounds[r] for r in behind]} while rank {self.rank} waits in round {self.round})", behind)
        return WorkerLostError(f"{waiting_for} failed while every peer is alive and in step", [])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)
