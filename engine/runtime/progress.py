"""fit's progress bar (rank 0, ``progress=True``): tqdm, imported only when asked for."""

from __future__ import annotations


def progress_bar(cfg, rank: int, step: int):
    """rank 0's bar over ``cfg.max_steps`` from ``step``, or None."""
    if not cfg.progress or rank != 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError as exc:
        raise ImportError("progress=True draws its bar with tqdm: pip install tqdm (or the [hf] extra), "
                          "or leave progress off") from exc
    return tqdm(total=cfg.max_steps, initial=step, desc=f"{cfg.strategy}", unit="step")
