"""The optimizer state of one flat fp32 shard: the master and the moments."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SCRATCH_SLOTS = 3  # a gatherer sends piece k - 2 at most while piece k is stepped (engine/parallel/collectives.py)


@dataclass
class ShardState:
    """``step`` counts applied updates (skipped non-finite steps do not count), which is what
    Adam's bias correction needs. An optimizer that keeps one moment leaves ``exp_avg_sq`` None.
    ``start``: the shard index its tensors begin at (0 for the whole shard; a piece's start for
    the piece-sized scratch of :meth:`scratch`), so ``part(a, b)`` reads values [a, b) of the
    shard from either."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor | None = None
    step: int = 0
    # (start, rows, cols) of each matrix an optimizer steps whole (Muon), sorted by start
    matrices: tuple[tuple[int, int, int], ...] = ()
    start: int = 0
    # host memory, page-locked: the spare and scratch are allocated pinned too (an offloaded
    # state, engine/runtime/offload.py, copies from them asynchronously)
    pinned: bool = False
    _spare: "ShardState | None" = field(default=None, repr=False, compare=False)
    # the piece-sized scratch: (up to SCRATCH_SLOTS master slots taken in turn, the moments' slot)
    _scratch: "tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None] | None" = field(
        default=None, repr=False, compare=False)

    def part(self, a: int, b: int) -> "ShardState":
        """Values [a, b) of the shard (shard indices), views of this state's tensors, ``start`` a."""
        lo, hi = a - self.start, b - self.start
        if lo < 0 or hi > self.master.numel() or lo > hi:
            raise ValueError(f"values [{a}, {b}) of the shard are not in this state's "
                             f"[{self.start}, {self.start + self.master.numel()})")
        return ShardState(self.master[lo:hi], self.exp_avg[lo:hi],
                          None if self.exp_avg_sq is None else self.exp_avg_sq[lo:hi], self.step, start=a)

    def spare(self) -> "ShardState":
        """Tensors shaped like this state's, to propose the next step into (``step + 1``),
        allocated once and reused: after :meth:`install` with ``recycle`` they are the old state's."""
        sp = self._spare
        if sp is None or sp.master.shape != self.master.shape or (sp.exp_avg_sq is None) != (self.exp_avg_sq is None):
            sp = self._spare = ShardState(self._empty_like(self.master), self._empty_like(self.exp_avg),
                                          None if self.exp_avg_sq is None else self._empty_like(self.exp_avg_sq))
        sp.step = self.step + 1
        return sp

    def scratch(self, k: int, a: int, b: int, width: int) -> "ShardState":
        """A piece-sized state to propose values [a, b) of the next step into (``step + 1``,
        ``start`` a), for piece k of a round whose longest piece is ``width`` values long: its
        master is one of SCRATCH_SLOTS kept slots taken in turn (a parameter gatherer may still be
        sending pieces k - 1 and k - 2 from theirs while piece k is stepped), its moments one kept
        slot every piece shares (nothing reads a proposal's moments once its piece is stepped:
        the step is recomputed in place at install). Allocated once and reused; the tensors of
        the state itself are never touched."""
        kept, dev = self._scratch, self.master.device
        if (kept is None or kept[1].numel() != width or kept[1].device != dev
                or (kept[2] is None) != (self.exp_avg_sq is None)):
            def empty() -> torch.Tensor:
                return torch.empty(width, dtype=torch.float32, device=dev, pin_memory=self.pinned)

            kept = self._scratch = ([], empty(), None if self.exp_avg_sq is None else empty())
        masters, exp_avg, exp_avg_sq = kept
        while len(masters) <= k % SCRATCH_SLOTS:  # as many as the pieces, at most SCRATCH_SLOTS
            masters.append(self._empty_like(exp_avg))
        n = b - a
        if n > width:
            raise ValueError(f"piece [{a}, {b}) is longer than the scratch's {width} values")
        return ShardState(masters[k % SCRATCH_SLOTS][:n], exp_avg[:n], None if exp_avg_sq is None else exp_avg_sq[:n],
                          self.step + 1, start=a)

    def _empty_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=t.device, pin_memory=self.pinned)

    def install(self, proposal: "ShardState", recycle: bool = False) -> None:
        """Take a proposed step's tensors as this state (no copy). ``recycle``: the proposal came
        from :meth:`spare`, and the old state's tensors become the next spare (nothing else may
        hold them)."""
        old = ShardState(self.master, self.exp_avg, self.exp_avg_sq)
        self.master, self.exp_avg, self.exp_avg_sq, self.step = (
            proposal.master, proposal.exp_avg, proposal.exp_avg_sq, proposal.step)
        self._spare = old if recycle else (None if proposal is self._spare else self._spare)

    def rebind(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor | None,
               step: int) -> None:
        """Become views of tensors someone else lays out (1-bit Adam's whole moments after its
        freeze): no copy, and the spare is dropped (no step is proposed into it any more)."""
        self.master, self.exp_avg, self.exp_avg_sq, self.step = master, exp_avg, exp_avg_sq, step
        self._spare = self._scratch = None

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(the tensors, by name, as they are: the caller copies them; {"step": ...})."""
        return self.tensors(), {"step": self.step}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Copy saved values into this state's own tensors (their memory and layout stay)."""
        for name, t in self.tensors().items():
            t.copy_(tensors[name])
        self.step = meta["step"]

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"master": self.master, "exp_avg": self.exp_avg}
        if self.exp_avg_sq is not None:
            out["exp_avg_sq"] = self.exp_avg_sq
        return out
