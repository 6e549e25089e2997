"""The optimizer state of one flat fp32 shard: the master and the moments."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ShardState:
    """``step`` counts applied updates (skipped non-finite steps do not count), which is what
    Adam's bias correction needs. An optimizer that keeps one moment leaves ``exp_avg_sq`` None."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor | None = None
    step: int = 0

    def install(self, proposal: "ShardState") -> None:
        """Take a proposed step's tensors as this state (no copy)."""
        self.master, self.exp_avg, self.exp_avg_sq, self.step = (
            proposal.master, proposal.exp_avg, proposal.exp_avg_sq, proposal.step)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"master": self.master, "exp_avg": self.exp_avg}
        if self.exp_avg_sq is not None:
            out["exp_avg_sq"] = self.exp_avg_sq
        return out
