"""bf16 against fp32 accumulation of the gradient across micro-batches (engine/flat.py keeps a
parameter's ``.grad`` in its dtype, so a bf16 model sums its micro-batches in bf16): the same
tiny GPT-2 (2 layers, width 64) on README.md's bytes, the same micro-batches, bf16 parameters
with an fp32 master and AdamW; held-out loss every 10 steps.

    python benchmarks/bf16_accumulation.py bf16 16 40     # mode, micro-batches per step, steps
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lm.data import (ByteTokenizer, TokenBatches, eval_batches, eval_loss, hf_lm_loss,  # noqa: E402
                     load_text_documents, split_heldout, tokenize_documents)
from lm.models import tiny_gpt2  # noqa: E402

SEQ, MB = 64, 4


def run(mode: str, k: int, steps: int, seed: int = 0) -> list[tuple[int, float]]:
    tok = ByteTokenizer()
    train_docs, held = split_heldout(load_text_documents(str(ROOT / "README.md")), heldout_fraction=0.1)
    train_t, held_t = tokenize_documents(train_docs, tok), tokenize_documents(held, tok)
    model = tiny_gpt2(vocab_size=len(tok), n_layer=2, n_embd=64, n_head=4, n_positions=128, seed=seed)
    master = [p.detach().float().clone() for p in model.parameters()]
    for p in model.parameters():
        p.data = p.data.bfloat16()
    opt = torch.optim.AdamW(master, lr=3e-3, weight_decay=0.0)
    stream = TokenBatches(train_t, SEQ, MB, seed=seed)
    j, out = 0, []
    for step in range(steps):
        acc = [torch.zeros_like(m) for m in master]
        for p in model.parameters():
            p.grad = None
        for _ in range(k):
            hf_lm_loss(model, stream.batch(j)).backward()
            j += 1
            if mode == "fp32":  # each micro-batch's bf16 gradient added into an fp32 sum
                for a, p in zip(acc, model.parameters()):
                    a.add_(p.grad.float())
                    p.grad = None
        for a, m, p in zip(acc, master, model.parameters()):
            m.grad = (a if mode == "fp32" else p.grad.float()) / k
        opt.step()
        for m, p in zip(master, model.parameters()):
            p.data.copy_(m)
        if (step + 1) % 10 == 0:
            loss = eval_loss(model, eval_batches(held_t, SEQ, MB, max_batches=8), hf_lm_loss).loss
            out.append((step + 1, round(loss, 4)))
            print(mode, step + 1, round(loss, 4), flush=True)
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, k, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps({"mode": mode, "micro_batches": k, "held_out": run(mode, k, steps)}))
