"""What a step costs on a given machine, besides the bytes: compute rate, link rates, and the
comm side's own work (optimizer on the shard, codecs, the transport's CPU).

Two kinds of profile:

- ``gpu(...)``: compute on the accelerator at a stated FLOP rate x MFU (or a measured samples/s);
  the comm side's kernels (codec passes, the shard's AdamW) are memory-bound and priced at a
  fraction of HBM bandwidth; they run on the comm stream beside compute (``shares_core=False``).
- ``cpu_testbed(...)``: the project's benchmark machine (docs/testbed.md, "The testbed: real links on one machine"): one core per
  worker, gloo over a shaped veth. The comm thread and gloo's threads share the worker's one core
  with compute (``shares_core=True``), so their CPU adds to the step. The constants below are
  measured from docs/results (``thread_cpu_s_per_rank`` over steps, medians over the matched-batch
  rows), stated once, not tuned per row: see ``TESTBED_CONSTANTS``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    name: str
    inter_Bps: float  # bytes/s of one node's network link (one direction)
    intra_Bps: float = 0.0  # bytes/s per GPU inside a node (NVLink / PCIe); 0 = no intra-node peers
    flops: float = 0.0  # peak FLOP/s per worker (GPU) at the compute dtype
    mfu: float = 0.4  # model FLOPs utilisation of compute
    samples_per_s: float = 0.0  # measured per worker; overrides flops x mfu when set
    shares_core: bool = False  # comm-side CPU is taken from compute (CPU testbed)
    link_efficiency: float = 1.0  # achieved fraction of the link rate by a large collective
    framing: float = 1.0  # bytes on the wire per payload byte (TCP/IP headers, ACKs)
    # comm-side work, seconds
    round_s_per_param: float = 0.0  # a sharded round's work per value of the whole buffer (copies, install)
    shard_opt_s_per_param: float = 0.0  # the owner's optimizer step per value of its shard
    codec_s_per_param: float = 0.0  # one codec pass (quantize + error feedback, or decode) per value
    onebit_s_per_param: float = 0.0  # a 1-bit Adam step's full-size work per value
    outer_sgd_s_per_param: float = 0.0  # local steps: an outer round with outer momentum SGD, per value
    outer_topk_s_per_param: float = 0.0  # local steps: an outer round with error feedback + top-k, per value
    optimizer_s_per_param: float = 0.0  # a full-size AdamW step on the compute side (DDP, inner steps)
    transport_s_per_byte: float = 0.0  # CPU of the transport (gloo threads) per byte sent
    ddp_bucket_bytes: float = 25 * 2**20  # torch DDP's bucket_cap_mb: overlap starts after the first bucket
    compute_inflation: float = 0.0  # compute runs this much slower while a comm side shares its core
    memory_bytes: float = 0.0  # one GPU's memory (0: not checked, the CPU testbed)
    host_memory_bytes: float = 0.0  # host memory per GPU: a node's over its GPUs (0: not checked)

    def work_s(self, work: dict) -> float:
        """Seconds of comm-side work given as {cost attribute: values} (a strategy spec's ``work``)."""
        return sum(getattr(self, cost) * values for cost, values in work.items())

    def compute_s(self, samples: float, flops_per_sample: float) -> float:
        """Seconds of forward + backward for ``samples`` sequences on one worker."""
        if self.samples_per_s > 0:
            return samples / self.samples_per_s
        if self.flops <= 0:
            raise ValueError("the hardware needs a compute rate: flops (and mfu) or samples_per_s")
        return samples * flops_per_sample / (self.flops * self.mfu)

    def wire_s(self, node_link_bytes: float) -> float:
        return node_link_bytes * self.framing / (self.inter_Bps * self.link_efficiency) if node_link_bytes else 0.0

    def intra_s(self, rank_bytes: float) -> float:
        if not rank_bytes:
            return 0.0
        if self.intra_Bps <= 0:
            raise ValueError("two-level exchange with G > 1 needs an intra-node rate (intra_Bps)")
        return rank_bytes / self.intra_Bps


def gbit(x: float) -> float:
    """Gbit/s -> bytes/s."""
    return x * 1e9 / 8


# H100 SXM: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 4 at 450 GB/s per direction per GPU
H100_BF16_FLOPS = 989e12
H100_HBM_Bps = 3.35e12
H100_MEM_GIB = 79.6  # an H100 80GB as nvidia-smi reports it: 81559 MiB
NODE_HOST_GIB = 2048  # a DGX H100's 2 TB of host memory, the 8-GPU node the presets assume


def gpu(inter_gbit: float, intra_GBps: float = 450.0, flops: float = H100_BF16_FLOPS, mfu: float = 0.4,
        samples_per_s: float = 0.0, hbm_Bps: float = H100_HBM_Bps, name: str = "H100",
        mem_gib: float = H100_MEM_GIB) -> Hardware:
    """A GPU node. The comm side's kernels are memory-bound at 70% of HBM bandwidth: a codec pass
    touches about 12 bytes per value (read the fp32/bf16 value and the int8 error, write the
    error and the packed code: the torchao fp8 quantizer reaches 79-87% of H100 peak, see
    /work/shared/FIELD.md); the shard's AdamW about 32 bytes per value (read g, m, v, master;
    write m, v, master, the new parameter); 1-bit Adam's full-size step about 40; an outer round
    with momentum SGD about 24, with error feedback and top-k about 48. ``mem_gib``: one GPU's
    memory, GiB."""
    bw = 0.7 * hbm_Bps
    return Hardware(name=name, inter_Bps=gbit(inter_gbit), intra_Bps=intra_GBps * 1e9, flops=flops, mfu=mfu,
                    samples_per_s=samples_per_s, shares_core=False, link_efficiency=0.9, framing=1.0,
                    round_s_per_param=2 * 2 / bw, shard_opt_s_per_param=32 / bw, codec_s_per_param=12 / bw,
                    onebit_s_per_param=40 / bw, outer_sgd_s_per_param=24 / bw, outer_topk_s_per_param=48 / bw,
                    optimizer_s_per_param=32 / bw, transport_s_per_byte=0.0, memory_bytes=mem_gib * 2**30)


# Measured on the CPU testbed (docs/results, matched-batch JSONs; medians over rows; seconds):
# see benchmarks/plan_validate.py `measure_constants`, which recomputes every one of them.
TESTBED_CONSTANTS = {
    "round_s_per_param": 3.55e-9,  # comm thread CPU of a sharded round per padded value
    "onebit_s_per_param": 14.5e-9,  # comm thread CPU of a 1-bit Adam step per value
    "outer_sgd_s_per_param": 12e-9,  # comm thread CPU per outer round: momentum SGD
    "outer_topk_s_per_param": 26e-9,  # error feedback + top-k
    "optimizer_s_per_param": 4.5e-9,  # torch AdamW / the fused inner AdamW on the compute thread
    "transport_s_per_byte": {"slow": 10.6e-9, "fast": 1.28e-9},  # gloo threads, <= 100 Mbit/s | 1 Gbit/s
    "framing": {"slow": 1.052, "fast": 1.003},  # tx counter bytes / Comm's bytes
    # achieved fraction of the shaped line by gloo, from torch DDP's runs (wire-bound, one large
    # all-reduce; one value per seed): (bytes x framing / rate) / (step - compute - optimizer), by
    # link rate (bit/s)
    "link_efficiency": {20e6: 0.883, 100e6: 0.945, 1e9: 0.954},
    "compute_inflation": 0.0,
}


def cpu_testbed(rate_bps: float, samples_per_s: float, constants: dict | None = None) -> Hardware:
    """One worker per core behind a shaped link of ``rate_bps`` bits/s, computing at the
    measured compute-only ``samples_per_s`` per worker."""
    c = {**TESTBED_CONSTANTS, **(constants or {})}
    cls = "fast" if rate_bps >= 5e8 else "slow"
    eff = _interpolate_log(c["link_efficiency"], rate_bps)
    return Hardware(name="cpu-testbed", inter_Bps=rate_bps / 8, samples_per_s=samples_per_s, shares_core=True,
                    link_efficiency=eff, framing=c["framing"][cls], round_s_per_param=c["round_s_per_param"],
                    codec_s_per_param=0.0,
                    onebit_s_per_param=c["onebit_s_per_param"], outer_sgd_s_per_param=c["outer_sgd_s_per_param"],
                    outer_topk_s_per_param=c["outer_topk_s_per_param"],
                    optimizer_s_per_param=c["optimizer_s_per_param"],
                    transport_s_per_byte=c["transport_s_per_byte"][cls], compute_inflation=c["compute_inflation"])


def _interpolate_log(table: dict, x: float) -> float:
    """Piecewise linear in log(x) between the measured rates, constant beyond them."""
    import math

    pts = sorted(table.items())
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return pts[-1][1]
