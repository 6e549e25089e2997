"""Heartbeats through the rendezvous store, so that a lost or stalled peer gets a name.

Each worker bumps a counter and publishes the round it last submitted, every ``interval``
seconds, from a daemon thread. When a round fails or times out, ``diagnose`` reads every peer
twice, a few intervals apart: a peer whose counter did not move is lost (dead process or
unreachable host); a peer whose counter moves but whose round lags is stalled.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

# why a rank closed its engine, published with its last heartbeat
EXIT_DONE = "done"
EXIT_ERROR = "error"  # an error of its own: the peers name it
EXIT_PEER = "peer"  # it failed because a peer was lost: the peers look further


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

    def _publish(self, exit_reason: str = "") -> None:
        self._beat += 1
        self.store.set(self._key(self.rank), f"{self._beat} {self.round} {exit_reason}".rstrip())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._publish()
            except Exception:
                return  # the store is gone; diagnose() will say so

    def _read(self) -> dict[int, tuple[int, int, str] | None]:
        """rank -> (heartbeat count, last submitted round, why it closed its engine or "")."""
        seen: dict[int, tuple[int, int, str] | None] = {}
        for r in range(self.world_size):
            key = self._key(r)
            if not self.store.check([key]):
                seen[r] = None
                continue
            beat, rnd, *rest = self.store.get(key).decode().split()
            seen[r] = (int(beat), int(rnd), rest[0] if rest else "")
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
        # a peer that closed its engine (done, after an error of its own, or after naming a lost
        # peer itself) stopped beating on purpose: it is not the one that was lost
        lost = [r for r in range(self.world_size) if r != self.rank
                and (second[r] is None or first[r] is None or (second[r][0] == first[r][0] and not second[r][2]))]
        if lost:
            return WorkerLostError(
                f"{waiting_for} failed: lost rank(s) {lost}: no heartbeat for "
                f"{2.5 * self.interval_s:.1f} s (the process died or its host is unreachable)", lost)
        rounds = {r: v[1] for r, v in second.items() if v is not None and not v[2]}
        behind = [r for r, rnd in rounds.items() if rnd < self.round]
        if behind:
            return WorkerLostError(
                f"{waiting_for} failed: stalled rank(s) {behind} (last submitted round "
                f"{[rounds[r] for r in behind]} while rank {self.rank} waits in round {self.round})", behind)
        left = [r for r, v in second.items() if r != self.rank and v is not None and v[2] == EXIT_ERROR]
        if left:
            return WorkerLostError(
                f"{waiting_for} failed: rank(s) {left} closed their engine (after an error of their own: "
                "see their output)", left)
        return WorkerLostError(f"{waiting_for} failed while every peer is alive and in step", [])

    def close(self, reason: str = EXIT_DONE) -> None:
        """Stop beating and tell the peers why this rank left (EXIT_*)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)
            self._thread = None
            try:
                self._publish(reason)
            except Exception:
                pass  # the store is gone with rank 0: nobody is left to tell


def may_be_peer_failure(exc: BaseException) -> bool:
    """Collective and time-out failures may come from a lost peer; a TypeError in a codec cannot."""
    peer_errors = (TimeoutError, ConnectionError, getattr(dist, "DistError", RuntimeError))
    return isinstance(exc, peer_errors) or type(exc) is RuntimeError
