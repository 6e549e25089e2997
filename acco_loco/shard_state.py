"""The optimizer state of one flat fp32 shard: the master and the moments."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ShardState:
    """``step`` counts applied updates (skipped non-finite steps do not count), which is what
    Adam's bias correction needs. An optimizer that keeps one moment leaves ``exp_avg_sq`` None."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor | None = None
    step: int = 0
    # (start, rows, cols) of each matrix an optimizer steps whole (Muon), sorted by start
    matrices: tuple[tuple[int, int, int], ...] = ()
    _spare: "ShardState | None" = field(default=None, repr=False, compare=False)

    def spare(self) -> "ShardState":
        """Tensors shaped like this state's, to propose the next step into (``step + 1``),
        allocated once and reused: after :meth:`install` with ``recycle`` they are the old state's."""
        sp = self._spare
        if sp is None or sp.master.shape != self.master.shape or (sp.exp_avg_sq is None) != (self.exp_avg_sq is None):
            sp = self._spare = ShardState(torch.empty_like(self.master), torch.empty_like(self.exp_avg),
                                          None if self.exp_avg_sq is None else torch.empty_like(self.exp_avg_sq))
        sp.step = self.step + 1
        return sp

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
        self._spare = None

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
