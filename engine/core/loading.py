"""A model's start values read from a safetensors model folder on every rank, instead of rank 0's
values broadcast (docs/nodes.md, "Loading a model that does not fit one rank").

The user builds the model on the meta device (``with torch.device("meta"):
AutoModelForCausalLM.from_config(config)``, or ``Engine.from_pretrained(folder, cfg)`` does it);
no rank ever holds a value it does not need:

- ``model_sharding="none"``: each rank reads every tensor of the folder itself (``load_whole``);
- ``model_sharding="node"``: FSDP2 shards the meta model, then each rank reads only the rows of
  dim 0 of each parameter that its local shard holds (``load_local_shards``): about 1/G of the
  model's bytes, plus the small tensors whole (a 0-dim one, persistent buffers).

A parameter under several names (a tied LM head) is read once, from whichever of its names the
folder holds. Buffers: a persistent one is read whole from the folder; a non-persistent one the
folder lacks keeps its value if it was built on a real device, and is recomputed when it is on
the meta device (a transformers model's ``_init_weights`` writes RoPE's ``inv_freq`` from the
config), else refused with the buffer named. The checkpoint must match the model: the first
missing and the first unexpected name, or a shape that differs, are refused before any process
group starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.slices import SliceReader


def on_meta(model: torch.nn.Module) -> bool:
    """True when any parameter or buffer of the model has no storage (built on the meta device)."""
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def causal_lm_on_meta(folder: str | os.PathLike) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config`` of the folder's config.json, built on the meta device
    in float32 (no values: ``Engine(..., weights=folder)`` reads them; ``compute_dtype`` casts
    them after the fp32 master is taken)."""
    import transformers
    from packaging.version import Version
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    # from_config otherwise takes config.json's dtype; the keyword is torch_dtype before 4.56
    dtype_kw = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **{dtype_kw: torch.float32})


def default_device() -> torch.device:
    """Where a loaded model goes when the caller does not say: this rank's GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


@dataclass
class CheckpointMatch:
    """Which folder tensor starts which part of the model, by the model's names."""

    params: dict[str, str]  # the parameter's first name in the model -> its name in the folder
    buffers: dict[str, str]  # buffer name -> its name in the folder
    recompute: list[str]  # non-persistent buffers on the meta device that the folder lacks


def _buffers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, bool]]:
    """(full name, owner, local name, persistent) of every buffer."""
    out = []
    for prefix, module in model.named_modules():
        for local, buf in module._buffers.items():
            if buf is not None:
                out.append((f"{prefix}.{local}" if prefix else local, module, local,
                            local not in module._non_persistent_buffers_set))
    return out


def match_checkpoint(model: torch.nn.Module, reader: SliceReader) -> CheckpointMatch:
    """Every parameter and persistent buffer found in the folder with the model's shape, and no
    tensor in the folder that the model lacks; otherwise a ValueError naming the first of each."""
    in_file = set(reader.names())
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    params, missing, known = {}, [], set()
    for names in aliases.values():
        known.update(names)
        found = next((n for n in names if n in in_file), None)
        if found is None:
            missing.append(names[0])
        else:
            params[names[0]] = found
    buffers, recompute = {}, []
    for name, module, local, persistent in _buffers(model):
        known.add(name)
        if name in in_file:
            buffers[name] = name
        elif persistent:
            missing.append(name)
        elif module._buffers[local].is_meta:
            recompute.append(name)
    unexpected = [n for n in reader.names() if n not in known]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing[0]!r} ({len(missing)} parameter(s) or persistent buffer(s) of the "
                         "model are not in it)")
        if unexpected:
            parts.append(f"unexpected {unexpected[0]!r} ({len(unexpected)} tensor(s) in it that the model does "
                         "not have)")
        raise ValueError(f"{reader.folder} does not match the model: {'; '.join(parts)}. Build the model from the "
                         "folder's own config.json (AutoConfig.from_pretrained(folder)), or pass the folder this "
                         "model was saved to")
    state = dict(model.named_parameters(remove_duplicate=False))
    for name, found in {**params, **buffers}.items():
        want = tuple(state[name].shape) if name in state else tuple(model.get_buffer(name).shape)
        if reader.shape(found) != want:
            raise ValueError(f"{reader.folder}: {found!r} has shape {reader.shape(found)}, the model's {name!r} "
                             f"{want}: the folder was saved from another configuration")
    return CheckpointMatch(params, buffers, recompute)


@dataclass
class WeightsLoad:
    """Where a run's start values come from (``Engine(..., weights=folder)``), checked against the
    model at engine start; ``bytes_read`` counts what this rank took from the files."""

    folder: Path
    device: torch.device
    match: CheckpointMatch
    dtypes: dict[str, torch.dtype]  # each parameter's dtype as built, before a compute_dtype cast
    bytes_read: int = 0
    largest_read: int = 0  # the largest tensor or row range read at once
    held_bytes: int = 0  # the parameters' storage this rank allocated for the values (measured)
    loaded: bool = False  # the values are in the model (read whole, or the local shards)


def plan_weights(model: torch.nn.Module, weights, device) -> WeightsLoad | None:
    """None when the model brings its own values (no ``weights``); else the checked plan. A model
    on the meta device needs ``weights``; ``device`` is where a meta model's values go (default:
    this rank's GPU, else the CPU), and a model with values stays where it is."""
    meta = on_meta(model)
    if weights is None:
        if meta:
            raise ValueError("the model is on the meta device (no values): pass weights=<a save_pretrained "
                             "folder> so that every rank reads its own values, e.g. Engine.from_pretrained(folder, "
                             "cfg), or build the model on a real device")
        if device is not None:
            raise ValueError("device= places a model built on the meta device; move a model with values "
                             "yourself (model.to(device)) and leave device out")
        return None
    if meta:
        device = torch.device(device) if device is not None else default_device()
    else:
        held = next(model.parameters()).device
        if device is not None and torch.device(device) != held:
            raise ValueError(f"device={device} but the model's values are on {held}: move the model "
                             "(model.to(device)) or build it on the meta device")
        device = held
    with SliceReader(weights) as reader:
        match = match_checkpoint(model, reader)
    return WeightsLoad(Path(weights).expanduser(), device, match,
                       {n: p.dtype for n, p in model.named_parameters()})


def start_weights(model: torch.nn.Module, cfg, weights, device) -> WeightsLoad | None:
    """Engine start: the folder checked against the model (or None: the model's own values, rank
    0's broadcast), and under model_sharding="none" read whole by this rank now; under "node" the
    local shards are read once FSDP2 has cut the model (engine/parallel/sharding.py)."""
    plan = plan_weights(model, weights, device)
    if plan is None:
        return None
    if cfg.model_sharding == "node":
        if cfg.strategy == "auto":
            raise ValueError("strategy='auto' times the model's forward on one rank, and a model loaded by its "
                             "node-sharded slices is never whole on one rank: name the strategy (python -m "
                             "engine.plan --model <config folder> says which)")
    else:
        load_whole(model, plan)
    return plan


def pretrained_engine(cls, folder: str | os.PathLike, cfg=None, loss_fn=None, *, model=None, device=None):
    """``Engine.from_pretrained(folder, cfg, loss_fn, model=None, device=None)``: an engine whose
    model starts from a transformers model folder (config.json and safetensors), read by each rank
    itself: whole under model_sharding="none", its FSDP2 local shards only under "node".
    ``model``: the model built on the meta device (to freeze layers first, or a class of your
    own); default ``causal_lm_on_meta(folder)``. ``device``: where its values go (default: this
    rank's GPU, else the CPU). ``engine.weights.bytes_read``: what this rank read."""
    return cls(model if model is not None else causal_lm_on_meta(folder), cfg, loss_fn, weights=folder,
               device=device)


def _kept_buffers(model: torch.nn.Module, plan: WeightsLoad) -> dict[str, torch.Tensor]:
    """The buffers that keep their values (built on a real device, not in the folder)."""
    return {name: module._buffers[local].detach().clone() for name, module, local, _ in _buffers(model)
            if name not in plan.match.buffers and not module._buffers[local].is_meta}


def _fill_buffers(model: torch.nn.Module, plan: WeightsLoad, reader: SliceReader,
                  kept: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, found in plan.match.buffers.items():
            model.get_buffer(name).copy_(reader.whole(found))
        for name, value in kept.items():
            model.get_buffer(name).copy_(value)
    recompute_buffers(model, plan.match.recompute, plan.folder)


def recompute_buffers(model: torch.nn.Module, names: list[str], folder: Path) -> None:
    """Write the non-persistent buffers that were on the meta device: a transformers model's
    ``_init_weights`` on each owner that has no parameters of its own (RoPE's inv_freq from the
    config); every buffer it leaves unwritten is refused by name."""
    if not names:
        return
    owners = {}
    for name in names:
        owner, _, _ = name.rpartition(".")
        owners.setdefault(owner, []).append(name)
    init = getattr(model, "_init_weights", None)
    for owner, owned in owners.items():
        module = model.get_submodule(owner)
        before = {n: model.get_buffer(n)._version for n in owned}
        if callable(init) and not any(True for _ in module.parameters(recurse=False)):
            with torch.no_grad():
                init(module)
        unwritten = [n for n in owned if model.get_buffer(n)._version == before[n]]
        if unwritten:
            raise ValueError(f"buffer {unwritten[0]!r} was built on the meta device and is not in {folder}, and "
                             "nothing here can compute it (only a transformers model's _init_weights, e.g. RoPE's "
                             "inv_freq): create it on a real device (register_buffer with a CPU tensor) or save it "
                             "with the checkpoint (persistent=True)")


def parameter_storage_bytes(model: torch.nn.Module) -> int:
    """The bytes of the distinct storages behind this rank's parameters (an FSDP2 parameter's: its
    local shard's, padding included)."""
    from torch.distributed.tensor import DTensor

    seen = {}
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _allocate_in_place(model: torch.nn.Module, device: torch.device) -> None:
    """Storage on ``device`` for every parameter and buffer, each Parameter object kept
    (``torch.utils.swap_tensors``): a tied head stays tied and parameters already listed stay
    the model's (``to_empty`` from the meta device makes new ones)."""
    with torch.no_grad():
        for p in {id(p): p for p in model.parameters()}.values():
            torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty_like(p, device=device),
                                                           requires_grad=p.requires_grad))
        for module in model.modules():
            for local, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[local] = torch.empty_like(buf, device=device)


def _tied_names(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter that has several (a tied LM head and its embedding)."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    return [names for names in aliases.values() if len(names) > 1]


def load_whole(model: torch.nn.Module, plan: WeightsLoad) -> None:
    """model_sharding='none': every tensor of the folder read by this rank into the model, placed
    on ``plan.device`` in the dtype it was built with."""
    kept = _kept_buffers(model, plan)
    _allocate_in_place(model, plan.device)
    plan.held_bytes = parameter_storage_bytes(model)
    with SliceReader(plan.folder) as reader, torch.no_grad():
        for name, found in plan.match.params.items():
            model.get_parameter(name).copy_(reader.whole(found))
        _fill_buffers(model, plan, reader, kept)
        plan.bytes_read, plan.largest_read = reader.bytes_read, reader.largest_read
    plan.loaded = True


def row_range(rows: int, g: int, local: int) -> tuple[int, int]:
    """Local rank ``local``'s rows of dim 0 under FSDP2's Shard(0) cut over g ranks (torch.chunk's:
    ceil(rows / g) each, the last ones shorter or empty)."""
    per = -(-rows // g)
    start = min(local * per, rows)
    return start, min(start + per, rows)


def load_local_shards(model: torch.nn.Module, plan: WeightsLoad, g: int, local: int) -> dict[str, torch.Tensor]:
    """model_sharding='node', after ``fully_shard`` on the meta model: the storage of every local
    shard allocated on ``plan.device`` and filled with its rows read from the folder, trainable
    and frozen parameters alike, and the buffers. Returns the trainable parameters' local values
    in fp32 (the dtype the model was built in, then fp32, as an eager load's start values), by name."""
    from torch.distributed.tensor import DTensor, Shard

    kept, tied = _kept_buffers(model, plan), _tied_names(model)
    model.to_empty(device=plan.device)
    if _tied_names(model) != tied:  # FSDP2 moves its sharded parameters in place: ties hold
        raise RuntimeError(f"moving the sharded model off the meta device untied {tied}")
    plan.held_bytes = parameter_storage_bytes(model)
    out = {}
    with SliceReader(plan.folder) as reader, torch.no_grad():
        for name, p in model.named_parameters():
            if isinstance(p, DTensor):
                if tuple(p.placements) != (Shard(0),):
                    raise RuntimeError(f"{name}: FSDP2 placed it as {p.placements}, the loader reads Shard(0) rows "
                                       "over one mesh dimension")
                start, stop = row_range(p.shape[0], g, local) if p.dim() else (0, 0)
                target = p.to_local()
            else:
                start, stop, target = 0, (p.shape[0] if p.dim() else 0), p
            rows = reader.rows(plan.match.params[name], start, stop).to(plan.dtypes[name])
            if rows.shape != target.shape:
                raise RuntimeError(f"{name}: FSDP2's local shard is {tuple(target.shape)}, rows [{start}, {stop}) "
                                   f"of the file are {tuple(rows.shape)} (torch.chunk's cut of dim 0 over {g})")
            target.copy_(rows)
            if p.requires_grad:
                out[name] = rows.to(torch.float32).reshape(-1)
        _fill_buffers(model, plan, reader, kept)
        plan.bytes_read, plan.largest_read = reader.bytes_read, reader.largest_read
    plan.loaded = True
    return out
