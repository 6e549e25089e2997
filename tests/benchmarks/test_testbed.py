"""benchmarks.testbed: real shaped links between namespaces, gloo traffic over them, clean teardown.

Root tests are skipped with a reason when not root or iproute2 is missing (CI runs as root).
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks import testbed as tbm
from benchmarks.testbed import LinkSpec, Testbed, TestbedError, cleanup_stale, requires_root_reason

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("testbed_worker.py")
_reason = requires_root_reason()
skip_unless_root = pytest.mark.skipif(_reason is not None, reason=f"testbed unavailable: {_reason}")


def _leftovers(prefix: str) -> list[str]:
    """Anything named after the testbed prefix: namespaces, root-ns links, /etc/netns dirs."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    etc = os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []
    return ([line for line in ns.splitlines() if line.startswith(prefix + "-")]
            + [line for line in links.splitlines() if f": {prefix}" in line]
            + [d for d in etc if d.startswith(prefix + "-")])


# --------------------------------------------------------------------------- no root needed


def test_units_and_tc_commands():
    assert tbm.parse_rate("50mbit") == 50_000_000
    assert tbm.parse_rate("1gbit") == 10**9
    assert tbm.parse_rate("12.5mbps") == 100_000_000  # tc: mbps = megabytes/s
    assert tbm.parse_size("128kb") == 131072
    with pytest.raises(ValueError):
        tbm.parse_rate("fast")
    # burst = max(rate x 4 ms, 16 KiB)
    assert LinkSpec("100mbit").burst_bytes == 50_000
    assert LinkSpec("10mbit").burst_bytes == 16384
    assert LinkSpec("1gbit").burst_bytes == 500_000
    assert LinkSpec("1gbit", burst="1mb").burst_bytes == 1 << 20
    (cmd,) = LinkSpec("50mbit").tc_commands("eth9")
    assert cmd[cmd.index("tbf"):] == ["tbf", "rate", "50000000bit", "burst", "25000",
                                      "latency", "50ms"]
    netem, tbf = LinkSpec("1gbit", delay_ms=20).tc_commands("eth9")
    assert netem[4:7] == ["root", "handle", "1:"] and "netem" in netem and "20ms" in netem
    assert int(netem[netem.index("limit") + 1]) > 2 * 10**9 / 8 * 0.02 / 1514  # >= 2 BDP
    assert tbf[4:8] == ["parent", "1:1", "handle", "10:"] and "tbf" in tbf
    with pytest.raises(ValueError):
        Testbed(workers=2, prefix="this-prefix-is-bad")


def test_clear_errors(monkeypatch):
    monkeypatch.setattr(tbm.os, "geteuid", lambda: 1000)
    reason = requires_root_reason()
    assert reason and "needs root" in reason and "sudo" in reason
    with pytest.raises(TestbedError, match="needs root"):
        Testbed(workers=2).__enter__()
    monkeypatch.setattr(tbm.os, "geteuid", lambda: 0)
    monkeypatch.setattr(tbm.shutil, "which", lambda tool: None if tool == "tc" else "/bin/" + tool)
    reason = requires_root_reason()
    assert reason and "`tc`" in reason and "iproute2" in reason


# --------------------------------------------------------------------------- root


@pytest.mark.root
@skip_unless_root
@pytest.mark.parametrize("rate_mbit", [50])
def test_gloo_over_shaped_link(rate_mbit):
    prefix = "acltest"
    iters, mbytes = 8, 4.0  # each rank sends 8 x 2 MB = 16 MB to its peer: ~2.8 s at 50 Mbit/s
    with Testbed(workers=2, link=LinkSpec(f"{rate_mbit}mbit"), prefix=prefix) as tb:
        assert len(_leftovers(prefix)) >= 3
        before = [tb.counters(r) for r in range(2)]
        wire_before = [tb.qdisc_stats(r)["up"]["bytes"] for r in range(2)]
        procs = [
            tb.popen(r, [sys.executable, str(WORKER), "--port", "29511", "--iters", str(iters),
                         "--mbytes", str(mbytes), "--chunks", "8"],
                     cpu=str(r % os.cpu_count()), stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
            for r in range(2)
        ]
        outs = [p.communicate(timeout=90) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err[-2000:]
        after = [tb.counters(r) for r in range(2)]
        wire = [tb.qdisc_stats(r)["up"]["bytes"] - wire_before[r] for r in range(2)]
        for r, (out, _) in enumerate(outs):
            res = json.loads(out.strip().splitlines()[-1])
            assert res["ok"], res
            # (a) goodput at the shaped rate: the ceiling is rate x 1448/1514 = 0.956 x rate
            # (TCP/IP/Ethernet headers per 1500-byte frame count against the tbf rate)
            assert 0.6 * rate_mbit <= res["mbit_s"] <= 1.1 * rate_mbit, res
            # (b) tx_bytes of the worker's veth: payload plus headers. veth counts GSO
            # super-packets (one header set per <= 64 KB), so ~+0.3%; even fully segmented the
            # headers are 66/1448 = 4.6%, pure ACKs <= 2.3%, rendezvous and barriers a few KB:
            # under +10% in every case, and never below the payload.
            sent = after[r]["tx_bytes"] - before[r]["tx_bytes"]
            assert res["payload_bytes"] <= sent <= 1.10 * res["payload_bytes"], (sent, res)
            # the tbf counts per-segment frames: what the rate is applied to
            assert res["payload_bytes"] <= wire[r] <= 1.10 * res["payload_bytes"], (wire, res)
            assert after[1 - r]["rx_bytes"] - before[1 - r]["rx_bytes"] >= res["payload_bytes"]
        namespaces = list(tb.namespaces)
    # (c) nothing left with the prefix: namespaces, links in the root ns, /etc/netns files
    assert _leftovers(prefix) == []
    assert not any(os.path.exists(f"/run/netns/{ns}") for ns in namespaces)


@pytest.mark.root
@skip_unless_root
def test_teardown_when_body_raises():
    prefix = "acltrb"
    handler_before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="boom"):
        with Testbed(workers=2, link=LinkSpec("10mbit"), prefix=prefix) as tb:
            sleeper = tb.popen(1, ["sleep", "60"])
            assert tb.run(0, ["cat", "/sys/class/net/acltrbw0/address"]).returncode == 0
            raise RuntimeError("boom")
    # (d) processes killed, everything deleted, the SIGTERM handler restored
    assert sleeper.poll() is not None
    assert _leftovers(prefix) == []
    assert signal.getsignal(signal.SIGTERM) is handler_before


_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from benchmarks.testbed import Testbed, LinkSpec
    with Testbed(workers=2, link=LinkSpec("10mbit"), prefix={prefix!r}) as tb:
        tb.popen(0, ["sleep", "60"])
        print("ready", flush=True)
        time.sleep(60)
""")


def _start_child(prefix: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _CHILD.format(root=str(ROOT), prefix=prefix)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.root
@skip_unless_root
def test_teardown_on_sigterm():
    prefix = "acltsig"
    p = _start_child(prefix)
    assert _leftovers(prefix)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == 143  # TestbedTerminated: exit status of a SIGTERM'd process
    assert _leftovers(prefix) == []


@pytest.mark.root
@skip_unless_root
def test_cleanup_stale_after_crash():
    prefix = "acltst"
    p = _start_child(prefix)
    live = cleanup_stale(prefix)  # its creator still runs: nothing removed
    assert live == [] and _leftovers(prefix)
    p.kill()  # SIGKILL: no teardown; the orphaned `sleep` keeps running inside worker 0's ns
    p.wait(timeout=10)
    time.sleep(0.2)
    left = _leftovers(prefix)
    assert any(x.endswith("-w0") for x in left)
    removed = cleanup_stale(prefix)
    assert len(removed) == 3, removed
    assert _leftovers(prefix) == []


@pytest.mark.root
@skip_unless_root
def test_two_testbeds_coexist():
    prefix = "acltwo"
    with Testbed(workers=2, link=LinkSpec("10mbit"), prefix=prefix) as a, \
            Testbed(workers=3, link=LinkSpec("20mbit"), prefix=prefix) as b:
        assert not set(a.namespaces + [a.hub_ns]) & set(b.namespaces + [b.hub_ns])
        assert a.addresses[:2] == b.addresses[:2]  # same subnet, isolated namespaces
        out = b.run(2, ["cat", "/sys/class/net/acltwow2/address", "/etc/hosts"]).stdout
        assert "acltwow2" in out
        assert a.qdisc_stats(1)["down"] and b.counters(2)["tx_bytes"] >= 0
    assert _leftovers(prefix) == []
