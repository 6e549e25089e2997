"""One shaped link: rates and sizes in tc notation, and the tc qdiscs that apply them.

A :class:`LinkSpec` is one worker's access link (``benchmarks/testbed.py`` applies it to both
ends of the worker's veth, so both directions are shaped); :meth:`LinkSpec.tc_commands` gives the
``tc`` argv lists for one device.

Burst: tbf can only send ``burst`` bytes at once after its timer fired, so a burst smaller
than ``rate x (wake-up latency)`` caps throughput below the rate; a burst larger than needed
lets the link run faster than the rate after idle gaps (a real wire has no such credit: a
transfer of ``B`` bytes can beat the rate by up to ``burst/B``). Default:
``burst = max(rate_bytes_per_s x 4 ms, 16 KiB)`` -- the classic ``rate/HZ`` rule with HZ=250,
floored at ~11 full frames. 50 Mbit -> 25 kB, 100 Mbit -> 50 kB, 1 Gbit -> 500 kB. Measured
here with a one-way gloo stream (receiver-timed goodput; TCP ceiling 0.956 x rate):
1 Gbit: 64 KiB -> 592, 128 KiB -> 906, 500 kB -> 947, 2 MiB -> 968 Mbit/s (the last beats the
ceiling by burst credit); 100 Mbit: 8 KiB..64 KiB all 94.8-95.4 Mbit/s. A burst below one GSO
super-packet (64 KiB on veth) makes tbf segment GSO packets in software: harmless at these
rates.

Queue: tbf's ``latency`` (``LinkSpec.queue_ms``, default 50 ms) bounds the queue to
``rate x latency + burst`` bytes; packets beyond are dropped (TCP then backs off).

Delay: ``LinkSpec.delay_ms`` adds a one-way delay on *each direction of each worker's link*
(worker-to-worker one-way = 2 x delay_ms, RTT = 4 x delay_ms), with ``netem`` as the root
qdisc and ``tbf`` as its only child (``handle 1: netem delay D limit P``, ``parent 1:1 tbf``,
the layout the netem documentation gives for rate + delay). netem first holds every packet for
D, then tbf serialises at the rate; netem's ``limit`` (packets) is raised to cover the
bandwidth-delay product, otherwise netem's default of 1000 packets drops at 1 Gbit x 10+ ms.
Kernels without ``CONFIG_NET_SCH_NETEM`` (e.g. the 2-core dev VM, whose kernel has only tbf,
htb, fifo and ingress) reject delay_ms > 0 with a clear error; rate-only links need only
``CONFIG_NET_SCH_TBF``. The delay path is therefore not exercised on the dev VM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["LinkSpec", "parse_rate", "parse_size"]

_MIN_BURST = 16 * 1024


# ---------------------------------------------------------------------------------------------
# units


_RATE_UNITS = {
    "": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9,
}
_SIZE_UNITS = {
    "": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2,
    "mib": 1024**2, "g": 1024**3, "gb": 1024**3, "gib": 1024**3,
    "kbit": 1000 / 8, "mbit": 10**6 / 8,
}


def parse_rate(rate: str | int | float) -> int:
    """Rate in bits/s from tc notation: '100mbit', '1gbit', '500kbit', '12.5mbps' (bytes/s)."""
    if isinstance(rate, (int, float)):
        bits = float(rate)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", rate)
        if not m or m.group(2).lower() not in _RATE_UNITS:
            raise ValueError(f"cannot parse rate {rate!r}; use tc units, e.g. '100mbit', '1gbit'")
        bits = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is below 8 kbit/s")
    return int(bits)


def parse_size(size: str | int) -> int:
    """Size in bytes from tc notation: '128kb' (KiB), '2mb' (MiB), '1500' (bytes), '1mbit'."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", size)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse size {size!r}; use e.g. '128kb', '1mb', '64000'")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


# ---------------------------------------------------------------------------------------------
# link description


@dataclass
class LinkSpec:
    """One worker's access link, applied in both directions.

    rate: tc rate ('100mbit', '1gbit', or bits/s as a number).
    delay_ms: one-way delay added on each direction of each worker link (needs netem).
    burst: tbf bucket ('256kb', bytes as int); None -> max(rate x 4 ms, 16 KiB).
    queue_ms: tbf 'latency': the queue holds rate * queue_ms + burst bytes before dropping.
    mtu: MTU of the veths (1500 like Ethernet).
    """

    rate: str | int = "100mbit"
    delay_ms: float = 0.0
    burst: str | int | None = None
    queue_ms: float = 50.0
    mtu: int = 1500

    @property
    def rate_bps(self) -> int:
        return parse_rate(self.rate)

    @property
    def burst_bytes(self) -> int:
        if self.burst is not None:
            b = parse_size(self.burst)
            if b < self.mtu + 14:
                raise ValueError(f"burst {self.burst!r} is below one frame ({self.mtu + 14} bytes)")
            return b
        return max(int(self.rate_bps / 8 * 0.004), _MIN_BURST)

    def netem_limit(self) -> int:
        """netem queue in packets: 2 x bandwidth-delay product in MTU frames, at least 1000."""
        bdp_pkts = self.rate_bps / 8 * (self.delay_ms / 1000) / (self.mtu + 14)
        return max(1000, int(2 * bdp_pkts) + 100)

    def tc_commands(self, dev: str) -> list[list[str]]:
        """tc argv lists (without 'tc -n NS') that shape egress of ``dev``."""
        if self.delay_ms < 0 or self.queue_ms <= 0:
            raise ValueError("delay_ms must be >= 0 and queue_ms > 0")
        tbf = ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(self.burst_bytes),
               "latency", f"{self.queue_ms:g}ms"]
        if self.delay_ms == 0:
            return [["qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf]]
        return [
            ["qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
             "delay", f"{self.delay_ms:g}ms", "limit", str(self.netem_limit())],
            ["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf],
        ]
