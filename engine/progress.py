"""fit's progress bar (rank 0, ``progress=True``): tqdm, imported only when asked for."""

from __future__ import annotations


def progress_bar(engine):
    if not engine.cfg.progress or engine.rank != 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError as exc:
        raise ImportError("progress=True draws its bar with tqdm: pip install tqdm (or the [hf] extra), "
                          "or leave progress off") from exc
    return tqdm(total=engine.cfg.max_steps, initial=engine.step, desc=f"{engine.cfg.strategy}", unit="step")
