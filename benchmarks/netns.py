"""The testbed's plumbing: Linux network namespaces, and the bridges, veth pairs and tc qdiscs
inside them, built and read with iproute2 (``ip``, ``tc``).

Nothing here is ever created in the root namespace: a veth pair is created directly inside its
two namespaces, so the host's routes and interfaces are never touched. Deleting a namespace
destroys the veths, the bridge and the qdiscs in it; processes still running inside would keep
it alive, so anything ``ip netns pids`` reports is killed first. ``/etc/netns/<ns>/`` holds
files that ``ip netns exec`` bind-mounts over ``/etc`` (the testbed's ``hosts``); they go with
the namespace. :func:`cleanup_stale` removes what a killed testbed process left behind.

Needs root (CAP_NET_ADMIN/CAP_SYS_ADMIN) and iproute2; :func:`requires_root_reason` says why
the testbed cannot run here (it builds a throwaway namespace to find out).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Iterable, Sequence

from benchmarks.shaping import LinkSpec

__all__ = [
    "TestbedError",
    "add_bridge",
    "add_namespace",
    "add_veth",
    "check_privileges",
    "cleanup_stale",
    "delete_namespace",
    "list_namespaces",
    "missing_tool_message",
    "namespace_tag",
    "prepare_namespace",
    "probe",
    "read_counters",
    "requires_root_reason",
    "run",
    "shape",
    "tbf_stats",
    "write_etc_netns",
]

_SEQ = itertools.count()
_ETC_NETNS = "/etc/netns"
_TOOL_PACKAGES = {"ip": "iproute2", "tc": "iproute2", "taskset": "util-linux"}


class TestbedError(RuntimeError):
    """Building, using or tearing down the testbed failed."""

    __test__ = False  # not a pytest test class


# ---------------------------------------------------------------------------------------------
# running ip and tc


def run(argv: Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    try:
        cp = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise TestbedError(missing_tool_message(argv[0])) from e
    if check and cp.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed (exit {cp.returncode}): {cp.stderr.strip()}")
    return cp


def missing_tool_message(tool: str) -> str:
    pkg = _TOOL_PACKAGES.get(tool)
    hint = f" (Debian package {pkg}: `apt-get update && apt-get install -y {pkg}`)" if pkg else ""
    return f"the testbed needs the `{tool}` command, which is not on PATH{hint}"


def _root_message() -> str:
    return ("the testbed needs root (it creates network namespaces, veth pairs and tc qdiscs); "
            "run as root, e.g. `sudo -E env PATH=$PATH python -m pytest tests/benchmarks/test_testbed.py`")


def check_privileges(tools: Iterable[str] = ("ip", "tc")) -> None:
    if os.geteuid() != 0:
        raise TestbedError(_root_message())
    for tool in tools:
        if shutil.which(tool) is None:
            raise TestbedError(missing_tool_message(tool))


# ---------------------------------------------------------------------------------------------
# building


def namespace_tag(prefix: str) -> str:
    """``<prefix>-<pid>-<seq>``: unique per testbed, and names the process that created it."""
    return f"{prefix}-{os.getpid()}-{next(_SEQ)}"


def add_namespace(ns: str) -> None:
    run(["ip", "netns", "add", ns])


def prepare_namespace(ns: str) -> None:
    """Loopback up, IPv6 off."""
    run(["ip", "-n", ns, "link", "set", "lo", "up"])
    # no IPv6 on the test links: keeps DAD/MLD/router solicitations out of the counters
    run(["ip", "netns", "exec", ns, "sh", "-c",
         "for f in /proc/sys/net/ipv6/conf/all/disable_ipv6 "
         "/proc/sys/net/ipv6/conf/default/disable_ipv6; do "
         "[ -w $f ] && echo 1 > $f; done; true"])


def add_bridge(ns: str, bridge: str) -> None:
    run(["ip", "-n", ns, "link", "add", bridge, "type", "bridge", "stp_state", "0",
         "forward_delay", "0"])
    run(["ip", "-n", ns, "link", "set", bridge, "up"])


def add_veth(ns: str, dev: str, address: str, hub_ns: str, hub_dev: str, bridge: str, mtu: int) -> None:
    """veth pair ``dev`` (in ``ns``, with ``address`` as 'a.b.c.d/len') -- ``hub_dev`` (in
    ``hub_ns``, on ``bridge``), both up."""
    # created directly inside the two namespaces: nothing ever appears in the root ns
    run(["ip", "link", "add", dev, "netns", ns, "mtu", str(mtu), "type", "veth",
         "peer", "name", hub_dev, "netns", hub_ns, "mtu", str(mtu)])
    run(["ip", "-n", hub_ns, "link", "set", hub_dev, "master", bridge])
    run(["ip", "-n", hub_ns, "link", "set", hub_dev, "up"])
    run(["ip", "-n", ns, "addr", "add", address, "dev", dev])
    run(["ip", "-n", ns, "link", "set", dev, "up"])


def shape(ns: str, dev: str, link: LinkSpec) -> None:
    """Shape what ``dev`` sends with ``link``'s qdiscs."""
    for args in link.tc_commands(dev):
        run(["tc", "-n", ns, *args])


def write_etc_netns(ns: str, name: str, text: str) -> None:
    """/etc/netns/<ns>/<name>: `ip netns exec` bind-mounts it over /etc/<name>."""
    for attempt in range(3):  # a concurrent teardown may rmdir an empty /etc/netns meanwhile
        try:
            os.makedirs(os.path.join(_ETC_NETNS, ns), exist_ok=True)
            with open(os.path.join(_ETC_NETNS, ns, name), "w") as f:
                f.write(text)
            return
        except FileNotFoundError:
            if attempt == 2:
                raise


# ---------------------------------------------------------------------------------------------
# reading


def read_counters(ns: str, dev: str, names: Sequence[str]) -> dict[str, int]:
    """``/sys/class/net/<dev>/statistics/<name>`` of a device in ``ns``."""
    paths = [f"/sys/class/net/{dev}/statistics/{n}" for n in names]
    # `ip netns exec` remounts /sys for the namespace: read the counters from inside
    cp = run(["ip", "netns", "exec", ns, "cat", *paths])
    return dict(zip(names, (int(x) for x in cp.stdout.split())))


def tbf_stats(ns: str, dev: str) -> dict[str, int]:
    """bytes, packets, drops, overlimits, requeues, backlog of the tbf on ``dev`` ({} if none)."""
    cp = run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev])
    stats: dict[str, int] = {}
    for q in json.loads(cp.stdout or "[]"):
        if q.get("kind") == "tbf":
            stats = {k: int(q.get(k, 0)) for k in
                     ("bytes", "packets", "drops", "overlimits", "requeues", "backlog")}
    return stats


# ---------------------------------------------------------------------------------------------
# deleting


def list_namespaces() -> list[str]:
    cp = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in cp.stdout.splitlines() if line.strip()]


def _namespace_pids(ns: str) -> list[int]:
    cp = run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in cp.stdout.split() if x.isdigit()]


def _kill_ns_processes(ns: str) -> None:
    for _ in range(3):
        pids = [p for p in _namespace_pids(ns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _remove_etc_netns(ns: str) -> None:
    shutil.rmtree(os.path.join(_ETC_NETNS, ns), ignore_errors=True)
    try:
        os.rmdir(_ETC_NETNS)  # only if empty: it may hold other namespaces' files
    except OSError:
        pass


def delete_namespace(ns: str) -> str | None:
    """Kill what still runs in ``ns`` and delete it; returns an error string or None."""
    _kill_ns_processes(ns)
    cp = run(["ip", "netns", "del", ns], check=False)
    _remove_etc_netns(ns)
    if cp.returncode != 0 and ns in list_namespaces():
        return f"ip netns del {ns}: {cp.stderr.strip()}"
    return None


# ---------------------------------------------------------------------------------------------
# capability probes


@functools.lru_cache(maxsize=None)
def probe(qdisc: str = "tbf") -> str | None:
    """Build a throwaway namespace with a bridge, a veth and ``qdisc``; None if that works."""
    ns = f"tbprobe-{os.getpid()}-{next(_SEQ)}"
    try:
        run(["ip", "netns", "add", ns])
        run(["ip", "-n", ns, "link", "add", "pbr", "type", "bridge"])
        run(["ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
        spec = {"tbf": ["tbf", "rate", "1mbit", "burst", "32kb", "latency", "50ms"],
                "netem": ["netem", "delay", "1ms"]}[qdisc]
        cp = run(["tc", "-n", ns, "qdisc", "add", "dev", "pa", "root", *spec], check=False)
        if cp.returncode != 0:
            return (f"the kernel lacks the {qdisc} qdisc (CONFIG_NET_SCH_{qdisc.upper()}): "
                    f"{cp.stderr.strip()}")
        return None
    except TestbedError as e:
        return f"cannot create network namespaces/veth/bridge here: {e}"
    finally:
        run(["ip", "netns", "del", ns], check=False)


def requires_root_reason(delay: bool = False) -> str | None:
    """Why the testbed cannot run on this machine (a pytest skip reason), or None.

    delay=True also requires the netem qdisc (LinkSpec.delay_ms > 0).
    """
    try:
        check_privileges()
    except TestbedError as e:
        return str(e)
    reason = probe("tbf")
    if reason is None and delay:
        reason = probe("netem")
    return reason


def exit_unless_testbed(delay: bool = False) -> None:
    """A benchmark's first line: stop with the reason when the testbed cannot run here."""
    reason = requires_root_reason(delay)
    if reason:
        raise SystemExit(f"error: the testbed needs root and iproute2: {reason}")


# ---------------------------------------------------------------------------------------------
# stale leftovers


def _proc_start_time(pid: int) -> float | None:
    """Start time of ``pid`` as a Unix timestamp, None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 (starttime); fields[0] is field 3
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return None


def _creator_runs(ns: str, pid: int) -> bool:
    """``pid`` exists and started before ``ns`` was created (a recycled pid started later)."""
    started = _proc_start_time(pid)
    try:
        created = os.stat(f"/run/netns/{ns}").st_mtime
    except OSError:
        created = None
    return started is not None and (created is None or started <= created + 1.0)


def cleanup_stale(prefix: str = "acl", include_live: bool = False) -> list[str]:
    """Delete namespaces of earlier testbeds with ``prefix`` whose creating process is gone.

    A namespace counts as live when the pid in its name exists and started before the
    namespace was created (so a recycled pid does not protect a leftover). include_live=True
    removes live ones too. Processes still inside a removed namespace are killed. Returns the
    names removed.
    """
    check_privileges(("ip",))
    # also throwaway namespaces of requires_root_reason() probes that crashed mid-probe
    pat = re.compile(rf"^(?:{re.escape(prefix)}-(\d+)-\d+-(?:br|w\d+)|tbprobe-(\d+)-\d+)$")
    removed, errors = [], []
    for ns in list_namespaces():
        m = pat.match(ns)
        if not m:
            continue
        if not include_live and _creator_runs(ns, int(m.group(1) or m.group(2))):
            continue  # its creator still runs
        err = delete_namespace(ns)
        (errors if err else removed).append(err or ns)
    if errors:
        raise TestbedError("cleanup_stale could not remove: " + "; ".join(errors))
    return removed
