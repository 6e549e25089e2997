"""LoCo quality on a real language model: acco with 4-bit compensated gradients and int8
parameter deltas trains (almost) as well as fp32 ZeRO-1, with a fraction of the wire bytes.

Uses benchmarks/loco_quality.py (GPT-2-shaped, byte vocabulary, Shakespeare with Hamlet held out,
world 2 in gloo process groups). The test is a short run of a small model; the full 300-step
comparison of the benchmark's default model is a benchmark run by hand (its command and figures:
docs/results.md), not a test: three 300-step runs of two processes take over 10 minutes here.
"""

from __future__ import annotations


from benchmarks.loco_quality import QualityConfig, compare, markdown_table

# CI: a small model, a short run (each mode is one spawn of 2 processes)
CI = QualityConfig(steps=40, n_layer=1, n_embd=64, n_head=2, seq_len=32, micro_batch_size=4,
                   micro_batches=2, lr=3e-3, warmup_steps=5, eval_batches=4)
CI_TOLERANCE = 0.05  # relative, on the mean loss of the last 10% of steps; see the figures below


def test_loco4_int8_close_to_zero1_short():
    res = compare(["zero1", "acco+loco4+int8"], CI, log=lambda s: None)
    print("\n" + markdown_table(res))
    z, l = res["zero1"], res["acco+loco4+int8"]
    assert z["steps"] == l["steps"] == CI.steps
    # it learned something: well below the uniform-byte loss ln(257) = 5.55
    assert z["final_train_loss"] < 4.0 and l["final_train_loss"] < 4.0
    assert l["final_train_loss"] <= z["final_train_loss"] * (1 + CI_TOLERANCE), (
        z["final_train_loss"], l["final_train_loss"])
    # 4-bit gradients + int8 params: well under half of zero1's fp32 bytes per step
    assert l["wire_bytes_per_step"] < 0.5 * z["wire_bytes_per_step"]
