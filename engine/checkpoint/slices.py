"""Reading a transformers model folder's safetensors by name, whole or by rows of dim 0, counting
the bytes each read takes from the files (docs/nodes.md, "Loading a model that does not fit one
rank").

A folder is what ``save_pretrained`` writes: config.json and either one model.safetensors or
several shards named by model.safetensors.index.json's ``weight_map``. A rank reads a row range
with ``safe_open(...).get_slice(name)[start:stop]``: safetensors stores a tensor row-major, so
rows [start, stop) are one contiguous run of (stop - start) x row bytes in the file, and only
those are read. ``bytes_read`` adds up the bytes of every tensor or row range handed out.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# other checkpoint formats a model folder may hold instead: named in the refusal
OTHER_FORMATS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")


def tensor_files(folder: str | os.PathLike) -> dict[str, Path]:
    """Every tensor name of the folder's safetensors checkpoint and the file that holds it."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"weights folder {root} does not exist: pass a folder written by save_pretrained "
                                "(config.json and *.safetensors)")
    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a safetensors index (no 'weight_map': {exc}): write the folder again "
                             "with save_pretrained") from exc
        files = {name: root / file for name, file in weight_map.items()}
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise FileNotFoundError(f"{index} names {missing[0]}, which is not there ({len(missing)} file(s) "
                                    "missing): copy the whole folder")
        return files
    single = root / SINGLE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    other = [name for name in OTHER_FORMATS if (root / name).is_file()]
    if other:
        raise ValueError(f"{root} holds {other[0]}, not safetensors: reading a rank's slices needs safetensors. "
                         "Convert it once: AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder) "
                         "(safetensors is save_pretrained's default)")
    raise FileNotFoundError(f"{root} has no {SINGLE} and no {INDEX}: pass a folder written by save_pretrained")


class SliceReader:
    """The folder's tensors by name: their shapes and dtypes, and the rows a rank asks for."""

    def __init__(self, folder: str | os.PathLike):
        from safetensors import safe_open

        self.folder = Path(folder).expanduser()
        self.files = tensor_files(self.folder)
        self.bytes_read = 0
        self.largest_read = 0  # the most bytes one read handed out at once
        self._stack = ExitStack()
        self._open = {file: self._stack.enter_context(safe_open(str(file), framework="pt"))
                      for file in sorted(set(self.files.values()))}

    def __enter__(self) -> SliceReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return list(self.files)

    def _slice(self, name: str):
        return self._open[self.files[name]].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0 (a 0-dim tensor: the whole value), in the file's dtype."""
        piece = self._slice(name)
        if not piece.get_shape():  # a 0-dim tensor has no rows: read it whole
            out = self._open[self.files[name]].get_tensor(name)
        else:
            out = piece[start:stop]
        self.bytes_read += out.numel() * out.element_size()
        self.largest_read = max(self.largest_read, out.numel() * out.element_size())
        return out

    def whole(self, name: str) -> torch.Tensor:
        shape = self.shape(name)
        return self.rows(name, 0, shape[0] if shape else 0)
