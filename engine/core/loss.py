"""What the engine needs from a micro-batch: its loss (a user's ``loss_fn`` or the Hugging Face
default) and its size in samples."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """``model(**batch).loss`` for dict batches (Hugging Face causal LMs with labels)."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"batches of type {type(batch).__name__} need a loss_fn(model, batch) -> "
                        "scalar loss; the default only handles dict batches as model(**batch).loss")
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None:
        raise TypeError("model(**batch) returned no loss: put labels in the batch or pass loss_fn")
    return loss


def batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            if isinstance(item, torch.Tensor) and item.dim():
                return item.shape[0]
    return 1


def checked_loss(loss) -> torch.Tensor:
    """``loss_fn``'s result, refused unless it is a scalar tensor that requires grad."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                        f"{'' if not isinstance(loss, torch.Tensor) else ' of shape ' + str(tuple(loss.shape))}")
    if not loss.requires_grad:
        raise RuntimeError("the loss does not require grad: is the model in torch.no_grad(), "
                           "or are the trainable parameters not used by the loss?")
    return loss
