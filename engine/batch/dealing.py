"""One micro-batch stream for all workers, dealt out by the engine under a global batch.

With per-worker streams (``engine.fit(my_batches)``), speed shares change the data: a fast
worker reads further into its own stream than a slow one, so which samples make a step depends
on who is fast, and over epochs the fast worker's part of the data is seen more often. A
``GlobalBatches`` stream removes that: global micro-batch ``i`` is the same on every rank, and
the engine hands each worker the indices of its share,

    round k: G_0 + ... + G_{k-1} earlier micro-batches, then rank w takes the next s_w
    starting after the shares s_0 .. s_{w-1} of the lower ranks,

so step ``t`` trains on global micro-batches ``[t G, (t + 1) G)`` whatever the shares
(acco_loco/batch.py gives G_k and s_w). Equal and speed shares then train on the same samples
in the same steps; only who computes them, and the float summation order, differ.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from acco_loco.batch import round_targets


class GlobalBatches:
    """A stream every rank sees alike: ``source(i)`` (a callable) or ``source[i]`` (a sequence,
    a map-style dataset of micro-batches) is global micro-batch ``i``. IndexError ends the data.

        engine.fit(GlobalBatches(stream.batch))  # e.g. lm.data.TokenBatches(..., world_size=1)
    """

    def __init__(self, source: Callable[[int], Any] | Any):
        if callable(source):
            self._fetch = source
        elif hasattr(source, "__getitem__"):
            self._fetch = source.__getitem__
        else:
            raise TypeError(f"GlobalBatches needs a callable index -> micro-batch or an indexable "
                            f"sequence, got {type(source).__name__}")

    def fetch(self, index: int) -> Any:
        return self._fetch(index)


def round_offset(round_index: int, global_micro_batches: int, rounds_per_step: int) -> int:
    """Global micro-batches dealt in all rounds before ``round_index``."""
    targets = round_targets(global_micro_batches, rounds_per_step)
    steps, within = divmod(round_index, rounds_per_step)
    return steps * global_micro_batches + sum(targets[:within])


def dealt_index(round_index: int, position: int, rank: int, shares: list[int],
                global_micro_batches: int, rounds_per_step: int) -> int:
    """The global index of this rank's ``position``-th micro-batch in round ``round_index``."""
    return round_offset(round_index, global_micro_batches, rounds_per_step) + sum(shares[:rank]) + position


def dealt_stream(source: GlobalBatches, where: Callable[[], tuple[int, int, list[int]]], rank: int,
                 global_micro_batches: int, rounds_per_step: int) -> Iterator[Any]:
    """This rank's micro-batches, in order: ``where()`` gives (round index, micro-batches this
    rank already ran in that round, the round's shares) when the next one is asked for."""
    while True:
        round_index, position, shares = where()
        try:
            batch = source.fetch(dealt_index(round_index, position, rank, shares,
                                             global_micro_batches, rounds_per_step))
        except IndexError:
            return
        yield batch


def deal(batches, cfg, strategy, counters, accumulation, rank: int) -> Iterator[Any]:
    """This worker's micro-batches of ``batches``: a GlobalBatches stream dealt out by this
    worker's share of each round (pull each just before feeding it: the dealing reads the round
    from ``counters`` and the shares from ``accumulation``), anything else as it is."""
    if not isinstance(batches, GlobalBatches):
        return iter(batches)
    if cfg.global_micro_batches is None:
        raise ValueError("GlobalBatches is dealt out by the global batch: set global_micro_batches "
                         "(accumulation 'fixed'), or pass this worker's own micro-batches")
    strategy.check_global_batches(cfg)

    def where():
        r = counters.round_index
        return r, counters.pending_count, accumulation.shares(r)
    return dealt_stream(batches, where, rank, cfg.global_micro_batches, strategy.plan.rounds_per_step)
