"""Loading a model that does not fit one rank (engine/core/loading.py, engine/checkpoint/slices.py):
a transformers model built on the meta device, its values read by each rank from a save_pretrained
folder (safetensors, sharded into several files), against the same model loaded eagerly by
from_pretrained.

Node-sharded (2 nodes x 2 ranks) each rank reads only its FSDP2 local shards' rows: the local
shards equal the eager model's rows bit for bit, the bytes read are the rows' (about 1/G of the
model), and zero1 and acco train the same losses bit for bit as the eagerly loaded run (the same
values, the same arithmetic). Unsharded (world 1, world 2 flat) every rank reads the whole folder
itself, no broadcast. Refused: a .bin folder, a folder whose tensors do not match the model (the
first missing and unexpected name), a meta model without weights, auto with node sharding."""

from __future__ import annotations

import json

import pytest
import torch

from engine import Engine, EngineConfig
from engine.checkpoint.slices import SliceReader
from engine.core.loading import causal_lm_on_meta
from engine.parallel.local_group import spawn

STEPS = 3
SEQ, BATCH, VOCAB = 16, 2, 257


def save_folder(path, kind: str = "llama"):
    """A tiny transformers model saved by save_pretrained, cut into several safetensors files."""
    from lm.models import tiny_gpt2, tiny_llama

    model = tiny_llama(seed=3) if kind == "llama" else tiny_gpt2(n_layer=2, n_embd=64, n_head=4, seed=3)
    model.save_pretrained(path, max_shard_size="40KB")
    files = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(files) >= 2, files
    return path


def eager_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def lm_stream(rank: int, n: int):
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def file_bytes(folder) -> tuple[int, int]:
    """(every tensor's bytes in the folder, the largest row of any tensor)."""
    with SliceReader(folder) as reader:
        total = row = 0
        for name in reader.names():
            t = reader._slice(name)
            shape, size = t.get_shape(), torch.finfo(torch.float32).bits // 8  # tiny models save fp32
            numel = 1
            for d in shape:
                numel *= d
            total += numel * size
            row = max(row, numel // shape[0] * size if shape else numel * size)
    return total, row


def config(strategy: str, sharding: str, **kw) -> EngineConfig:
    kw = {"max_steps": STEPS, **kw}
    return EngineConfig(strategy=strategy, lr=1e-3, micro_batches=1, accumulation="fixed", model_sharding=sharding,
                        **kw)


def _train(engine: Engine, rank: int) -> list[float]:
    engine.fit(iter(lm_stream(rank, 3 * (STEPS + 1))))
    losses = [h["loss"] for h in engine.history]
    engine.close()
    return losses


# ---------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_meta_model_loads_whole_equal_to_the_eager_one(tmp_path, kind):
    folder = save_folder(tmp_path / kind, kind)
    eager = eager_model(folder)
    engine = Engine.from_pretrained(folder, config("zero1", "none"))
    model = engine.model
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    for (name, p), (_, q) in zip(model.state_dict().items(), eager.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    total, _ = file_bytes(folder)
    assert engine.weights.bytes_read == total  # every tensor once (the tied head is not in the file)
    losses = _train(engine, 0)
    assert losses == _train(Engine(eager, config("zero1", "none")), 0)


def test_one_rank_node_sharded_in_bf16_trains_as_the_eager_load(tmp_path):
    """The node-sharded path at world 1 (FSDP2 over one rank): the fp32 master is taken from the
    values as built (fp32) and the parameters cast to bf16 after, as in the eager load."""
    folder = save_folder(tmp_path / "llama")
    engine = Engine.from_pretrained(folder, config("zero1", "node", compute_dtype="bfloat16"))
    params = list(engine.model.parameters())
    assert {type(p).__name__ for p in params} == {"DTensor"} and {p.dtype for p in params} == {torch.bfloat16}
    total, _ = file_bytes(folder)
    assert engine.weights.bytes_read == total and engine.weights.held_bytes == total // 2  # bf16 storage
    eager = Engine(eager_model(folder), config("zero1", "node", compute_dtype="bfloat16"))
    assert _train(engine, 0) == _train(eager, 0)


def test_the_reader_hands_out_rows_and_counts_their_bytes(tmp_path):
    from safetensors.torch import save_file

    save_file({"scalar": torch.tensor(3.5), "matrix": torch.arange(12.0).view(4, 3)}, tmp_path / "model.safetensors")
    with SliceReader(tmp_path) as reader:
        assert reader.shape("matrix") == (4, 3) and reader.shape("scalar") == ()
        assert torch.equal(reader.rows("matrix", 1, 3), torch.arange(3.0, 9.0).view(2, 3))
        assert reader.bytes_read == reader.largest_read == 2 * 3 * 4  # the two rows, nothing else
        assert reader.whole("scalar").item() == 3.5 and reader.bytes_read == 24 + 4


def test_refusals_name_the_problem(tmp_path):
    folder = save_folder(tmp_path / "llama")
    with pytest.raises(ValueError, match="meta device.*weights="):
        Engine(causal_lm_on_meta(folder), config("zero1", "none"))
    # another configuration: the first missing and the first unexpected name
    other = save_folder(tmp_path / "gpt2", "gpt2")
    with pytest.raises(ValueError, match=r"does not match the model: missing 'model.embed_tokens.weight'.*"
                                         r"unexpected 'transformer"):
        Engine(causal_lm_on_meta(folder), config("zero1", "none"), weights=other)
    # same names, another shape
    from transformers import AutoConfig, AutoModelForCausalLM

    wider = AutoConfig.from_pretrained(folder)
    wider.intermediate_size = 192
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(wider)
    with pytest.raises(ValueError, match=r"has shape \(160, 64\).*\(192, 64\)"):
        Engine(model, config("zero1", "none"), weights=folder)
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    torch.save({}, bin_folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin, not safetensors.*save_pretrained"):
        Engine(causal_lm_on_meta(folder), config("zero1", "none"), weights=bin_folder)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine(causal_lm_on_meta(folder), config("zero1", "none"), weights=tmp_path / "nowhere")
    with pytest.raises(ValueError, match="strategy='auto'.*name the strategy"):
        Engine(causal_lm_on_meta(folder), config("auto", "node"), weights=folder)
    with pytest.raises(ValueError, match="device= places a model built on the meta device"):
        Engine(eager_model(folder), config("zero1", "none"), device="cpu")


# ---------------------------------------------------------------------------------- process groups
def _node_sharded(rank: int, world: int, folder: str, g: int):
    from torch.distributed.tensor import DTensor

    from engine.core.loading import row_range

    local = rank % g
    eager = dict(eager_model(folder).named_parameters())
    out = {"mismatch": [], "read": None, "losses": {}}
    for strategy in ("zero1", "acco"):
        engine = Engine.from_pretrained(folder, config(strategy, "node", topology="two_level"))
        for name, p in engine.model.named_parameters():
            assert isinstance(p, DTensor), name
            start, stop = row_range(p.shape[0], g, local)
            if not torch.equal(p.to_local(), eager[name][start:stop]):
                out["mismatch"].append(name)
        buffers = dict(eager_model(folder).named_buffers())
        for name, b in engine.model.named_buffers():
            if not torch.equal(b, buffers[name]):
                out["mismatch"].append(name)
        out["read"], out["held"] = engine.weights.bytes_read, engine.weights.held_bytes
        out["largest_read"] = engine.weights.largest_read
        ranges = {name: row_range(p.shape[0], g, local) for name, p in eager.items()}
        out["expected_read"] = sum((stop - start) * (eager[name].numel() // eager[name].shape[0]) * 4
                                   for name, (start, stop) in ranges.items())
        sliced = _train(engine, rank)
        out["losses"][strategy] = (sliced, _train(Engine(eager_model(folder), config(strategy, "node",
                                                                                      topology="two_level")), rank))
    return out


@pytest.mark.slow
def test_node_sharded_ranks_read_only_their_rows(tmp_path):
    folder = save_folder(tmp_path / "llama")
    g = 2
    runs = spawn(_node_sharded, 4, str(folder), g, env={"LOCAL_WORLD_SIZE": str(g)})
    total, row = file_bytes(folder)
    with SliceReader(folder) as reader:
        n_tensors = len(reader.names())
        largest = max(reader.whole(name).nbytes for name in reader.names())
    for rank, run in enumerate(runs):
        assert run["mismatch"] == [], (rank, run["mismatch"])
        assert run["read"] == run["expected_read"], rank
        assert run["read"] <= total / g + n_tensors * row, (rank, run["read"], total)  # ceil's extra row each
        # the parameters' storage it allocated (FSDP2's local shards, padded to ceil(rows / G)) and
        # the most it read at once: no rank held the whole model while loading
        assert run["held"] <= total / g + n_tensors * row, (rank, run["held"], total)
        assert run["largest_read"] <= largest / g + row, (rank, run["largest_read"], largest)
        for strategy, (sliced, eager) in run["losses"].items():
            assert len(sliced) == STEPS and sliced == eager, (rank, strategy, sliced, eager)
    assert runs[0]["losses"]["zero1"][0] == runs[2]["losses"]["zero1"][0]  # every rank reports the step's loss


def _resume(rank: int, world: int, folder: str, ckpt: str, g: int):
    """acco at 2 x 2 node-sharded from the folder: 4 steps at once, and 2 steps, a checkpoint, and
    Engine.load into a model built on the meta device (each rank reads its rows of the
    checkpoint's model.safetensors) for 2 more."""
    cfg = config("acco", "node", topology="two_level", max_steps=4)
    stream = lm_stream(rank, 40)
    whole = Engine.from_pretrained(folder, cfg)
    whole.fit(iter(stream))
    out = {"whole": [h["loss"] for h in whole.history],
           "whole_local": [p.to_local().clone() for p in whole.model.parameters()]}
    whole.close()
    first = Engine.from_pretrained(folder, cfg)
    first.fit(iter(stream), steps=2)
    first.save(ckpt)
    out["resumed"] = [h["loss"] for h in first.history]
    first.close()
    again = Engine.load(ckpt, causal_lm_on_meta(folder))
    again.fit(iter(stream[again.consumed:]))
    out["resumed"] += [h["loss"] for h in again.history]
    out["resumed_local"] = [p.to_local().clone() for p in again.model.parameters()]
    out["read"], out["checkpoint_file"] = again.weights.bytes_read, str(again.weights.folder)
    again.close()
    return out


@pytest.mark.slow
def test_node_sharded_resume_reads_each_ranks_rows_of_the_checkpoint(tmp_path):
    folder = save_folder(tmp_path / "llama")
    runs = spawn(_resume, 4, str(folder), str(tmp_path / "ckpt"), 2, env={"LOCAL_WORLD_SIZE": "2"})
    total, row = file_bytes(folder)
    with SliceReader(folder) as reader:
        n_tensors = len(reader.names())
    for rank, run in enumerate(runs):
        assert len(run["whole"]) == 4 and run["resumed"] == run["whole"], rank
        assert all(torch.equal(a, b) for a, b in zip(run["resumed_local"], run["whole_local"], strict=True)), rank
        assert run["read"] <= total / 2 + n_tensors * row, (rank, run["read"])  # its rows of model.safetensors
        assert "ckpt" in run["checkpoint_file"]


def _flat(rank: int, world: int, folder: str):
    eager = eager_model(folder)
    out = {"losses": {}}
    for strategy in ("zero1", "acco"):
        engine = Engine.from_pretrained(folder, config(strategy, "none", topology="flat"))
        out["equal"] = all(torch.equal(p, q) for p, q in zip(engine.model.state_dict().values(),
                                                               eager.state_dict().values(), strict=True))
        out["read"], out["held"] = engine.weights.bytes_read, engine.weights.held_bytes
        out["losses"][strategy] = (_train(engine, rank),
                                   _train(Engine(eager_model(folder), config(strategy, "none", topology="flat")), rank))
    return out


@pytest.mark.slow
def test_flat_ranks_each_read_the_whole_folder(tmp_path):
    folder = save_folder(tmp_path / "llama")
    runs = spawn(_flat, 2, str(folder))
    total, _ = file_bytes(folder)
    for rank, run in enumerate(runs):
        assert run["equal"] and run["read"] == run["held"] == total, rank  # whole, each tensor once
        for strategy, (sliced, eager) in run["losses"].items():
            assert len(sliced) == STEPS and sliced == eager, (rank, strategy, sliced, eager)


# ---------------------------------------------------------------------------------- the recipe
def byte_tokenizer_folder(folder) -> None:
    """A transformers tokenizer of the 256 bytes and an end token (257 ids: the tiny models' vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(folder)


def _recipe(args: list[str]) -> str:
    import os
    import subprocess
    import sys

    from tests.recipes.test_recipe_smoke import CPU_2PROC, RECIPE, REPO, _free_port

    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_2PROC),
                          "--main_process_port", str(_free_port()), str(RECIPE), *args],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return run.stdout + run.stderr


@pytest.mark.slow
def test_the_recipe_reads_each_ranks_slices_and_trains_as_the_eager_load(tmp_path):
    """recipes/finetune.py --model-sharding node --model FOLDER at 1 node x 2 ranks, 2 steps and a
    --resume to 3 (the model built on the meta device both times, the resume reading each rank's
    rows of the checkpoint's model): each rank read half the folder, and the train and held-out
    losses are those of the same run loaded whole without sharding (within float32 summation
    order: FSDP2 sums the node's gradients per micro-batch)."""
    from tests.texts import text_folder

    folder = save_folder(tmp_path / "model")
    byte_tokenizer_folder(folder)
    data = text_folder(tmp_path / "text")
    common = ["--model", str(folder), "--dataset", str(data), "--seq-len", "16", "--micro-batch-size", "2",
              "--train-layers", "1", "--eval-batches", "2", "--checkpoint-every", "0",
              "--strategy", "acco", "--codec", "none", "--param-codec", "float32", "--compute-dtype", "float32",
              "--timeout-s", "60"]
    sliced = ["--model-sharding", "node", "--output-dir", str(tmp_path / "sliced")]
    assert "each rank read its own slices" in _recipe(common + sliced + ["--max-steps", "2"])
    total, row = file_bytes(folder)
    with SliceReader(folder) as reader:
        n_tensors = len(reader.names())
    for rank in json.loads((tmp_path / "sliced" / "memory.json").read_text())["ranks"]:
        assert rank["weights_bytes_read"] <= total / 2 + n_tensors * row, rank
        assert rank["weights_held_bytes"] <= total / 2 + n_tensors * row, rank
    assert "resumed at step 2" in _recipe(common + sliced + ["--max-steps", "3", "--resume"])
    for rank in json.loads((tmp_path / "sliced" / "memory.json").read_text())["ranks"]:
        assert rank["weights_bytes_read"] <= total / 2 + n_tensors * row, rank  # the checkpoint's rows
    _recipe(common + ["--max-steps", "3", "--output-dir", str(tmp_path / "whole")])
    assert json.loads((tmp_path / "whole" / "memory.json").read_text())["ranks"][0]["weights_bytes_read"] is None

    def losses(run):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        return ({r["step"]: r["loss"] for r in rows if r["kind"] == "train"},
                {r["step"]: r["eval_loss"] for r in rows if r["kind"] == "eval"})

    (train_s, eval_s), (train_w, eval_w) = losses("sliced"), losses("whole")
    # the sliced run also evaluates at step 2 (after its first part, and before the resumed one)
    assert sorted(train_s) == sorted(train_w) == [1, 2, 3] and sorted(eval_s) == [0, 2, 3] and sorted(eval_w) == [0, 3]
    for step in train_w:
        assert train_s[step] == pytest.approx(train_w[step], rel=1e-6), step
    for step in eval_w:
        assert eval_s[step] == pytest.approx(eval_w[step], rel=1e-6), step
