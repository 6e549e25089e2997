"""engine.hf.EngineTrainer: a transformers Trainer that trains through the engine, in 2 gloo
processes: per-step losses in log_history, ranks bit-identical, the same parameters as the same
run through Engine.feed, evaluation, checkpoints with the engine's state beside them, and a
resume that lands on the uninterrupted run's parameters."""

from __future__ import annotations

import os

import pytest
import torch

from engine import Engine, EngineConfig
from engine.parallel.local_group import spawn
from tests.tiny import flat_params

STEPS, PER_DEVICE, ACCUM, LR = 4, 2, 2, 1e-3


def _data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 257, (12,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _model():
    from lm.models import tiny_gpt2

    return tiny_gpt2(n_layer=2, n_embd=32, n_head=2, n_positions=16, seed=3)


def _args(out: str, **more):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out, per_device_train_batch_size=PER_DEVICE, per_device_eval_batch_size=4,
                             gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=LR,
                             lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.01, max_grad_norm=1.0,
                             logging_steps=1, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                             save_steps=2, report_to="none", use_cpu=True, seed=5, disable_tqdm=True, **more)


def _recording_trainer():
    from engine.hf import EngineTrainer

    class Recording(EngineTrainer):
        """Keeps every micro-batch the engine trained on (to replay them through Engine.feed)."""

        def compute_loss(self, model, inputs, *a, **k):
            if model.training:
                self.seen.append({key: v.detach().clone() for key, v in inputs.items()})
            return super().compute_loss(model, inputs, *a, **k)

    return Recording


def _train(rank, world, out):
    from transformers import GPT2LMHeadModel

    from engine.hf import EngineTrainer

    Recording = _recording_trainer()
    engine_cfg = EngineConfig(strategy="zero1", align=8)
    trainer = Recording(model=_model(), args=_args(out), train_dataset=_data(64, 1), eval_dataset=_data(8, 2),
                        engine_config=engine_cfg)
    trainer.seen = []
    trainer.train()
    history = [{k: v for k, v in h.items() if "runtime" not in k and "per_second" not in k}
               for h in trainer.state.log_history]
    params = flat_params(trainer.model)
    trainer.save_model(os.path.join(out, "final"))

    # the same run through Engine.feed: the engine settings the Trainer's arguments stand for
    cfg = EngineConfig(strategy="zero1", align=8, lr=LR, lr_schedule="linear", warmup_steps=1, weight_decay=0.01,
                       max_grad_norm=1.0, max_steps=STEPS, global_micro_batches=ACCUM * world, seed=5)
    engine = Engine(_model(), cfg)
    losses = [r.loss for r in (engine.feed(b) for b in trainer.seen) if r is not None]
    engine.close()
    same_as_feed = torch.equal(flat_params(engine.model), params)

    # resume from step 2's checkpoint: the same parameters as the run that went through
    resumed = EngineTrainer(model=_model(), args=_args(out), train_dataset=_data(64, 1), eval_dataset=_data(8, 2),
                            engine_config=engine_cfg)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    reloaded = GPT2LMHeadModel.from_pretrained(os.path.join(out, "final"))
    return {"history": history, "params": params, "feed_losses": losses, "same_as_feed": same_as_feed,
            "resumed_equal": torch.equal(flat_params(resumed.model), params),
            "resumed_losses": [(h["step"], h["loss"]) for h in resumed.state.log_history if "loss" in h],
            "saved_equal": torch.equal(flat_params(reloaded), params), "micro_batches": len(trainer.seen)}


@pytest.mark.slow  # 2 processes, three training runs with transformers: minutes under load
def test_engine_trainer_two_ranks_matches_engine_feed_and_resumes(tmp_path):
    pytest.importorskip("transformers")
    out = str(tmp_path / "run")
    r0, r1 = spawn(_train, 2, out, timeout=600)
    # ranks bit-identical: the same log_history and parameters
    assert r0["history"] == r1["history"] and torch.equal(r0["params"], r1["params"])
    train_logs = [h for h in r0["history"] if "loss" in h]
    assert [h["step"] for h in train_logs] == [1, 2, 3, 4]  # one entry per step (logging_steps=1)
    assert r0["micro_batches"] == STEPS * ACCUM
    # the Trainer logs the engine's losses (the mean over both ranks' micro-batches) and its schedule
    assert [h["loss"] for h in train_logs] == r0["feed_losses"]
    assert [h["learning_rate"] for h in train_logs] == pytest.approx([LR / 2, LR, LR * 2 / 3, LR / 3])
    assert all(h["grad_norm"] > 0 for h in train_logs)
    assert r0["same_as_feed"] and r1["same_as_feed"]
    assert [h["step"] for h in r0["history"] if "eval_loss" in h] == [2, 4]
    assert r0["saved_equal"]  # save_model writes the trained parameters
    for step in (2, 4):  # Trainer's checkpoint with the engine's beside it
        folder = tmp_path / "run" / f"checkpoint-{step}"
        assert (folder / "trainer_state.json").is_file() and (folder / "engine").is_dir()
    # the resumed run keeps steps 1-2's log (trainer_state.json) and logs steps 3-4 as the first run did
    assert r0["resumed_losses"] == [(h["step"], h["loss"]) for h in train_logs]
    assert r0["resumed_equal"] and r1["resumed_equal"]


def test_trainer_settings_decide_and_a_clash_is_refused(tmp_path):
    pytest.importorskip("transformers")
    from engine.hf import merged_config

    args = _args(str(tmp_path))
    cfg = merged_config(EngineConfig(strategy="acco", codec="loco4"), args, max_steps=10)
    assert (cfg.strategy, cfg.codec, cfg.lr, cfg.global_micro_batches, cfg.max_steps, cfg.warmup_steps) == \
        ("acco", "loco4", LR, ACCUM * args.world_size, 10, 1)
    assert cfg.betas == (args.adam_beta1, args.adam_beta2) and cfg.max_grad_norm == 1.0
    with pytest.raises(ValueError, match=r"lr=0.5 \(TrainingArguments give 0.001\)"):
        merged_config(EngineConfig(lr=0.5), args, max_steps=10)
    with pytest.raises(ValueError, match="lr_scheduler_type='polynomial'"):
        merged_config(EngineConfig(), _args(str(tmp_path), ).__class__(
            output_dir=str(tmp_path), lr_scheduler_type="polynomial", use_cpu=True), max_steps=10)


def test_trl_sft_trainer_through_the_same_mixin(tmp_path):
    """TRL's SFTTrainer (its tokenization, collator and extra metrics) on the engine, one process."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig

    from engine.hf import EngineSFTTrainer
    from lm.models import tiny_gpt2

    vocab = {"<eos>": 0, "<unk>": 1, **{chr(i): i for i in range(32, 127)}}  # one token a character
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>")
    texts = Dataset.from_dict({"text": ["to be or not to be, " * 2, "that is the question. " * 2] * 16})
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     max_steps=3, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
                     use_cpu=True, max_length=32, disable_tqdm=True)
    model = tiny_gpt2(vocab_size=128, n_layer=2, n_embd=32, n_head=2, n_positions=64)
    trainer = EngineSFTTrainer(model=model, args=args, train_dataset=texts, processing_class=tokenizer,
                               engine_config=EngineConfig(strategy="zero1", align=8))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["loss"] for h in logged] == [e["loss"] for e in trainer.engine.history]  # the engine's steps
    assert "mean_token_accuracy" in logged[0]  # SFTTrainer's own metrics still logged
    assert logged[-1]["loss"] < logged[0]["loss"]
