"""bf16 against fp32 accumulation of the gradient across micro-batches, the engine's two
``grad_dtype`` settings (engine/core/dtypes.py): ``compute`` sums a bf16 model's micro-batches in
bf16 (each parameter's ``.grad``), ``float32`` (auto's choice for bf16) adds each micro-batch's
bf16 gradient into an fp32 buffer. The same tiny GPT-2 (2 layers, width 64) on README.md's bytes,
the same micro-batches, bf16 parameters, zero1 at world size 1 (fp32 master, AdamW); held-out
loss every 10 steps.

    python benchmarks/bf16_accumulation.py compute 16 40     # grad_dtype, micro-batches per step, steps
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import Engine, EngineConfig  # noqa: E402
from lm.data import (  # noqa: E402
    ByteTokenizer,
    TokenBatches,
    eval_batches,
    eval_loss,
    hf_lm_loss,
    load_text_documents,
    split_heldout,
    tokenize_documents,
)
from lm.models import tiny_gpt2  # noqa: E402

SEQ, MB = 64, 4


def run(grad_dtype: str, k: int, steps: int, seed: int = 0) -> list[tuple[int, float]]:
    tok = ByteTokenizer()
    train_docs, held = split_heldout(load_text_documents(str(ROOT / "README.md")), heldout_fraction=0.1)
    train_t, held_t = tokenize_documents(train_docs, tok), tokenize_documents(held, tok)
    model = tiny_gpt2(vocab_size=len(tok), n_layer=2, n_embd=64, n_head=4, n_positions=128, seed=seed)
    cfg = EngineConfig(strategy="zero1", lr=3e-3, weight_decay=0.0, micro_batches=k, accumulation="fixed",
                       max_steps=steps, compute_dtype="bfloat16", grad_dtype=grad_dtype)
    engine = Engine(model, cfg, hf_lm_loss)
    stream = TokenBatches(train_t, SEQ, MB, seed=seed)
    batches = (stream.batch(j) for j in itertools.count())
    out = []
    while engine.step < steps:
        engine.fit(batches, steps=min(10, steps - engine.step))
        loss = eval_loss(model, eval_batches(held_t, SEQ, MB, max_batches=8), hf_lm_loss).loss
        out.append((engine.step, round(loss, 4)))
        print(grad_dtype, engine.step, round(loss, 4), flush=True)
    engine.close()
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    grad_dtype, k, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if grad_dtype not in ("compute", "float32"):
        raise SystemExit("grad_dtype: compute (bf16 accumulation) or float32")
    print(json.dumps({"grad_dtype": grad_dtype, "micro_batches": k, "held_out": run(grad_dtype, k, steps)}))
