"""Issue 41's must-show for runs with offloaded state: at 2 nodes x 2 ranks, diloco and sparseloco
with model_sharding='node', the inner AdamW state in host memory (optimizer_offload='cpu',
engine/runtime/offload.py) and the outer state there too (outer_state_device='cpu'), hold at most
0.7x the bytes of the same run without node sharding (the two-level run, a node as one replica, with
the same offload and outer state), and end within 1e-3 of its loss.

On this CPU-only machine host and device memory are one, so the bytes are counted both ways, by
what each buffer is (as tests/engine/test_memory_accounting_local.py draws the split):
  device  the engine's accounting (``held_bytes``: it already leaves out what the offload keeps in
          host memory) less the outer state (theta_sync, the snapshot, the momentum or the error),
          which ``held_bytes`` files under the strategy;
  host    the offload's host storages (``host_held_bytes``: master, moments, the gradient's host
          slot, the piece scratch), the outer state, and the outer round's temporaries (formed from
          the host state; on a GPU the wire rows are device temporaries a piece of 4M values long,
          which this model's one piece cannot tell apart: also checked counted on the device);
  held    everything: device + host."""

from __future__ import annotations

import pytest

from engine.parallel.local_group import spawn

RUNS = [(s, sharding) for s in ("diloco", "sparseloco") for sharding in ("none", "node")]


def _storage_bytes(tensors) -> int:
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in seen.items() if ptr)


def _memory(rank: int, world: int) -> dict:
    from acco_loco import kernels
    from engine import Engine, EngineConfig
    from engine.runtime.memory_accounting import held_bytes, host_held_bytes, track_round_temporaries
    from tests.engine.test_local_steps_sharded import H
    from tests.engine.test_memory_accounting_sharded import Blocks, _loss, _stream

    kernels.use(False)  # the torch path, as test_memory_accounting_local measures it
    out = {}
    for strategy, sharding in RUNS:
        cfg = EngineConfig(strategy=strategy, lr=1e-3, micro_batches=1, accumulation="fixed", max_steps=2 * H,
                           inner_steps=H, model_sharding=sharding, topology="two_level", optimizer_offload="cpu",
                           outer_state_device="cpu")
        engine = Engine(Blocks(), cfg, _loss)
        peaks = track_round_temporaries(engine.strategy)
        history = engine.fit(_stream(rank, 50))
        engine.close()
        st = engine.strategy
        outer = [st.theta_sync, st.submitted, *st.outer_tensors().values()]
        out[strategy, sharding] = {
            "held": held_bytes(engine.model, engine.ctx, st), "inner_host": host_held_bytes(st),
            "staging": _storage_bytes(st.offload.device_tensors()), "outer": _storage_bytes(outer),
            "outer_on": sorted({t.device.type for t in outer}), "temps": max(peaks), "rounds": len(peaks),
            "inner_values": engine.shard_state.master.numel(), "loss": history[-1]["loss"]}
    return out


def split(got: dict) -> dict:
    """The run's device, host and total bytes (the module's docstring)."""
    device = sum(got["held"].values()) - got["outer"]
    host = got["inner_host"] + got["outer"] + got["temps"]
    return {"device": device, "host": host, "held": device + host, "device_with_temps": device + got["temps"]}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_offloaded_sharded_local_steps_hold_at_most_0_7_of_the_unsharded_bytes():
    """2 nodes x 2 ranks, 4 blocks of 128 x 128 (fp32), H = 3, two outer rounds; rank 0's figures
    printed (every rank holds the same), the round temporaries the ranks' smallest (below)."""
    runs = spawn(_memory, 4, env={"LOCAL_WORLD_SIZE": "2"}, timeout=600)
    for key in runs[0]:
        # Every rank makes the same temporaries, but gloo's worker thread lets go of a finished
        # collective's tensors only after it has woken the caller: now and then one rank's peak still
        # holds the last wire piece's sum (seen: diloco's 66048 B on one rank of four). The ranks'
        # smallest peak is the round's own.
        runs[0][key]["temps"] = min(run[key]["temps"] for run in runs)
    rows = []
    for strategy in ("diloco", "sparseloco"):
        plain, got = runs[0][strategy, "none"], runs[0][strategy, "node"]
        want, have = split(plain), split(got)
        ratio = {k: have[k] / want[k] for k in have}
        rows.append(f"{strategy}: node-sharded / two-level unsharded, optimizer and outer state on cpu: "
                    + ", ".join(f"{k} {got['held'][k]}/{plain['held'][k]}" for k in got["held"])
                    + f"; outer state {got['outer']}/{plain['outer']}, inner state on host "
                    f"{got['inner_host']}/{plain['inner_host']}, round temporaries {got['temps']}/{plain['temps']} "
                    f"(largest of {got['rounds']} rounds); "
                    + ", ".join(f"{k} {have[k]}/{want[k]} ({ratio[k]:.3f})" for k in have)
                    + f"; final loss {got['loss']:.6f}/{plain['loss']:.6f}")
        for run in (got, plain):
            # the offload is on: no inner state on the device but its staging, all of it in host memory;
            # the outer state in host memory, filed by the accounting under the strategy
            assert run["held"]["optimizer"] == run["staging"], rows[-1]
            assert run["inner_host"] >= 12 * run["inner_values"] > 0, rows[-1]
            assert run["outer_on"] == ["cpu"] and 0 < run["outer"] <= run["held"]["strategy"], rows[-1]
            assert run["rounds"] == 2, rows[-1]
        assert ratio["device"] <= 0.7, rows[-1]  # (a)
        assert ratio["device_with_temps"] <= 0.7, rows[-1]  # (a) with the round's temporaries on the device
        assert ratio["held"] <= 0.7, rows[-1]  # (b)
        assert have["host"] <= want["host"], rows[-1]
        assert abs(got["loss"] - plain["loss"]) <= 1e-3 * abs(plain["loss"]), rows[-1]
    print("\n".join(rows))
    for other in runs[1:]:  # every rank holds the same
        for key, got in other.items():
            assert got["held"] == runs[0][key]["held"] and got["inner_host"] == runs[0][key]["inner_host"], key
