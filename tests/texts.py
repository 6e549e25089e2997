"""A small made-up corpus for recipe tests: three ~8 KB documents, the last one held out."""

from __future__ import annotations

import random
from pathlib import Path


def text_folder(folder: Path) -> Path:
    rng = random.Random(0)
    words = ("to be or not that is the question whether tis nobler in the mind to suffer "
             "the slings and arrows of outrageous fortune").split()
    folder.mkdir()
    for i in range(3):
        (folder / f"doc{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(1500)))
    return folder
