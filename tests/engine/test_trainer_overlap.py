"""A Trainer's own collectives beside an engine round in flight: transformers' Trainer gathers
its metrics on the default process group at every logging step (``store_flos`` ->
``distributed_broadcast_scalars``), while under acco or dpu the comm thread has a round on the
wire. The engine's rounds run on groups of its own (engine/parallel/dims.py), so neither waits on
the other. EngineTrainer and TRL's SFTTrainer at 2 gloo ranks launched as torchrun launches them
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE set), each run to its end with the ranks
bit-identical and one logged loss per step, the engine's."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig
from engine.parallel.local_group import spawn
from tests.tiny import flat_params

STEPS = 3
TORCHRUN_ENV = {"LOCAL_WORLD_SIZE": "2"}  # spawn sets RANK, WORLD_SIZE, LOCAL_RANK (one node of 2)


def _texts():
    from datasets import Dataset

    return Dataset.from_dict({"text": ["to be or not to be, " * 2, "that is the question. " * 2] * 16})


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1, **{chr(i): i for i in range(32, 127)}}  # one token a character
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>")


def _train(rank, world, kind, strategy, codec, out):
    from lm.models import tiny_gpt2

    model = tiny_gpt2(vocab_size=128, n_layer=2, n_embd=32, n_head=2, n_positions=64, seed=3)
    engine_config = EngineConfig(strategy=strategy, codec=codec, align=8, timeout_s=60)
    common = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
                  learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                  disable_tqdm=True, seed=5)
    if kind == "sft":
        from trl import SFTConfig

        from engine.hf import EngineSFTTrainer

        trainer = EngineSFTTrainer(model=model, args=SFTConfig(max_length=32, **common), train_dataset=_texts(),
                                   processing_class=_tokenizer(), engine_config=engine_config)
    else:
        from transformers import TrainingArguments

        from engine.hf import EngineTrainer

        g = torch.Generator().manual_seed(1)
        data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, 128, (64, 12), generator=g)]
        trainer = EngineTrainer(model=model, args=TrainingArguments(**common), train_dataset=data,
                                engine_config=engine_config)
    trainer.train()
    return {"logged": [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h],
            "engine": [(e["step"], e["loss"]) for e in trainer.engine.history], "params": flat_params(trainer.model)}


@pytest.mark.parametrize("kind,strategy,codec", [("trainer", "acco", "loco4"), ("trainer", "dpu", "none"),
                                                 ("sft", "acco", "none")])
def test_a_trainer_with_a_round_in_flight_finishes_with_ranks_identical(kind, strategy, codec, tmp_path):
    pytest.importorskip("trl" if kind == "sft" else "transformers")
    r0, r1 = spawn(_train, 2, kind, strategy, codec, str(tmp_path), timeout=300, env=TORCHRUN_ENV)
    assert torch.equal(r0["params"], r1["params"])  # replicas bit-identical
    assert r0["logged"] == r1["logged"] == r0["engine"]  # one logged loss per step, the engine's
    assert [s for s, _ in r0["logged"]] == list(range(1, STEPS + 1))
