"""The compute side's counters, as one object with a state dict (checkpoints use it by name)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class EngineState:
    step: int = 0  # committed optimizer steps
    round_index: int = 0  # rounds submitted
    consumed: int = 0  # micro-batches this worker has taken from its data
    pending_count: int = 0  # micro-batches in the accumulator not yet submitted
    pending_samples: int = 0
    pending_loss: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float32))

    def start_accumulator(self, device: torch.device) -> None:
        """A fresh accumulator: nothing pending."""
        self.pending_count, self.pending_samples = 0, 0
        self.pending_loss = torch.zeros((), dtype=torch.float32, device=device)

    def add_micro_batch(self, samples: int, loss: torch.Tensor) -> None:
        """One more micro-batch taken from this worker's data and accumulated."""
        self.pending_count += 1
        self.pending_samples += samples
        self.pending_loss += loss.detach().float()
        self.consumed += 1

    def state_dict(self) -> dict:
        return {"step": self.step, "round_index": self.round_index, "consumed": self.consumed,
                "pending_count": self.pending_count, "pending_samples": self.pending_samples,
                "pending_loss": float(self.pending_loss)}

    def load_state_dict(self, meta: dict, device: torch.device) -> None:
        self.step, self.round_index, self.consumed = meta["step"], meta["round_index"], meta["consumed"]
        self.pending_count, self.pending_samples = meta["pending_count"], meta["pending_samples"]
        self.pending_loss = torch.tensor(meta["pending_loss"], dtype=torch.float32, device=device)
