"""Worker processes behind real, rate-limited links on one machine.

A :class:`Testbed` builds, for ``workers`` processes, a small switched network out of Linux
network namespaces, veth pairs and one bridge, and shapes every worker's link with ``tc``::

    with Testbed(workers=2, link=LinkSpec("100mbit")) as tb:
        procs = [tb.popen(r, [sys.executable, "train.py"], cpu=str(r)) for r in range(2)]
        before = tb.tx_bytes(0)
        for p in procs:
            p.wait()
        print("worker 0 sent", tb.tx_bytes(0) - before, "bytes")

Topology (everything lives in namespaces that the testbed creates; nothing is added to the
root namespace, so the host's routes and interfaces are never touched and no test traffic
can leave the machine)::

    ns <prefix>-<pid>-<seq>-w0          ns <prefix>-<pid>-<seq>-br           ns ...-w1
    lo, <prefix>w0 10.213.0.1/24 ==veth== <prefix>h0 -+- <prefix>br -+- <prefix>h1 ==veth== <prefix>w1 10.213.0.2/24
        tbf (worker upload)              tbf (worker download)

* Worker ``i`` lives in namespace ``namespaces[i]`` with address ``addresses[i]`` on interface
  ``ifnames[i]``; the hub namespace holds the bridge and the peer ends of all veths.
* Shaping: ``tbf`` as root qdisc on the worker-side veth (what worker i sends) and on the
  hub-side veth (what worker i receives). Each worker thus has its own full-duplex access
  link of ``rate`` in each direction, like a host on a switch port.
* Teardown deletes the namespaces; deleting a namespace destroys the veths, the bridge and
  the qdiscs in it. Processes still running inside a namespace would keep it alive, so they
  are killed first (those started with :meth:`Testbed.popen` by process group, then anything
  ``ip netns pids`` still reports).

Shaping details (rates and sizes in tc notation, burst, queue, delay with netem) are in
``benchmarks/shaping.py``, with :class:`LinkSpec`; its names are importable from here.

Counters: :meth:`Testbed.tx_bytes`/``rx_bytes`` read ``/sys/class/net/<veth>/statistics``
inside the worker's namespace (``ip netns exec`` remounts /sys there; from the root namespace
those devices are invisible). veth counts each skb it transmits: a GSO super-packet (up to
64 KiB, one header set) counts once, so tx_bytes ~ payload x 1.003 when the burst is >= 64
KiB (1 Gbit), but tbf segments GSO packets when burst < 64 KiB (<= 100 Mbit with the default
burst) and then every 1514-byte frame counts its own headers: ~ payload x 1.04-1.06 with ACKs.
For the bytes the rate is applied to (every frame, headers included) use
``qdisc_stats(rank)['up']['bytes']``.

Name lookups: each worker namespace gets ``/etc/netns/<ns>/hosts`` (``ip netns exec``
bind-mounts it over /etc/hosts) mapping ``<prefix>w<i>`` to the testbed addresses, also as
``::ffff:a.b.c.d`` because c10d's TCPStore listens dual-stack and reverse-resolves its peers
(without it every connection logs "The hostname of the client socket cannot be retrieved"),
and this machine's host name to the worker's own address, so gloo's hostname-based interface
choice works even without GLOO_SOCKET_IFNAME (without the file it picked 127.0.0.1 and
connectFullMesh failed). Removed at teardown.

Environment of processes started with :meth:`Testbed.popen` (on top of ``os.environ``; the
``env`` argument wins): ``GLOO_SOCKET_IFNAME`` and ``TP_SOCKET_IFNAME`` = the worker's veth
(gloo otherwise picks its interface by resolving the host name, which inside a namespace
names an address that does not exist there), ``MASTER_ADDR`` = worker 0's address,
``TESTBED_RANK``, ``TESTBED_WORLD_SIZE``, ``TESTBED_ADDR``, ``TESTBED_IFNAME``,
``TESTBED_ADDRESSES`` (comma-separated). Every namespace is fresh, so any port is free in it
(e.g. 29500 for ``MASTER_PORT``).

Teardown (``__exit__``, also after an exception, KeyboardInterrupt or SIGTERM): while the
context is open a SIGTERM handler raises :class:`TestbedTerminated` (a SystemExit with code
143) in the main thread, so the with-block unwinds; the previous handler is restored at exit.
Processes from ``popen`` get SIGTERM, then SIGKILL after ``kill_grace_s``, by process group
(they run in their own session); SIGTERM/SIGINT arriving during teardown are held and
re-delivered afterwards. An ``atexit`` hook covers a testbed left open. After a SIGKILL of
the creating process nothing runs: :func:`cleanup_stale` removes those leftovers.

Needs root (CAP_NET_ADMIN/CAP_SYS_ADMIN) and iproute2 (``ip``, ``tc``); ``cpu=`` needs
``taskset`` (util-linux). :func:`requires_root_reason` says why the testbed cannot run here.
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from typing import Iterable, Mapping, Sequence

from benchmarks.shaping import LinkSpec, parse_rate, parse_size

__all__ = [
    "LinkSpec",
    "Testbed",
    "TestbedError",
    "TestbedTerminated",
    "cleanup_stale",
    "parse_rate",
    "parse_size",
    "requires_root_reason",
]

DEFAULT_SUBNET = "10.213.0.0/24"
_IFNAMSIZ = 15  # Linux interface names: at most 15 characters
_PREFIX_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,9}$")
_SEQ = itertools.count()


class TestbedError(RuntimeError):
    """Building, using or tearing down the testbed failed."""

    __test__ = False  # not a pytest test class


class TestbedTerminated(SystemExit):
    """Raised in the with-block when the process gets SIGTERM (exit status 143 if uncaught)."""

    __test__ = False

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


# ---------------------------------------------------------------------------------------------
# helpers


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    try:
        cp = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise TestbedError(_missing_tool_message(argv[0])) from e
    if check and cp.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed (exit {cp.returncode}): {cp.stderr.strip()}")
    return cp


_TOOL_PACKAGES = {"ip": "iproute2", "tc": "iproute2", "taskset": "util-linux"}


def _missing_tool_message(tool: str) -> str:
    pkg = _TOOL_PACKAGES.get(tool)
    hint = f" (Debian package {pkg}: `apt-get update && apt-get install -y {pkg}`)" if pkg else ""
    return f"the testbed needs the `{tool}` command, which is not on PATH{hint}"


def _root_message() -> str:
    return ("the testbed needs root (it creates network namespaces, veth pairs and tc qdiscs); "
            "run as root, e.g. `sudo -E env PATH=$PATH python -m pytest tests/benchmarks/test_testbed.py`")


def _check_privileges(tools: Iterable[str] = ("ip", "tc")) -> None:
    if os.geteuid() != 0:
        raise TestbedError(_root_message())
    for tool in tools:
        if shutil.which(tool) is None:
            raise TestbedError(_missing_tool_message(tool))


def _netns_list() -> list[str]:
    cp = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in cp.stdout.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    cp = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in cp.stdout.split() if x.isdigit()]


def _kill_ns_processes(ns: str) -> None:
    for _ in range(3):
        pids = [p for p in _netns_pids(ns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


_ETC_NETNS = "/etc/netns"


def _write_etc_netns(ns: str, name: str, text: str) -> None:
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


def _remove_etc_netns(ns: str) -> None:
    shutil.rmtree(os.path.join(_ETC_NETNS, ns), ignore_errors=True)
    try:
        os.rmdir(_ETC_NETNS)  # only if empty: it may hold other namespaces' files
    except OSError:
        pass


def _delete_ns(ns: str) -> str | None:
    """Kill what still runs in ``ns`` and delete it; returns an error string or None."""
    _kill_ns_processes(ns)
    cp = _run(["ip", "netns", "del", ns], check=False)
    _remove_etc_netns(ns)
    if cp.returncode != 0 and ns in _netns_list():
        return f"ip netns del {ns}: {cp.stderr.strip()}"
    return None


def _ns_tag(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_SEQ)}"


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


# ---------------------------------------------------------------------------------------------
# capability probes


@functools.lru_cache(maxsize=None)
def _probe(qdisc: str = "tbf") -> str | None:
    """Build a throwaway namespace with a bridge, a veth and ``qdisc``; None if that works."""
    ns = f"tbprobe-{os.getpid()}-{next(_SEQ)}"
    try:
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "add", "pbr", "type", "bridge"])
        _run(["ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
        spec = {"tbf": ["tbf", "rate", "1mbit", "burst", "32kb", "latency", "50ms"],
                "netem": ["netem", "delay", "1ms"]}[qdisc]
        cp = _run(["tc", "-n", ns, "qdisc", "add", "dev", "pa", "root", *spec], check=False)
        if cp.returncode != 0:
            return (f"the kernel lacks the {qdisc} qdisc (CONFIG_NET_SCH_{qdisc.upper()}): "
                    f"{cp.stderr.strip()}")
        return None
    except TestbedError as e:
        return f"cannot create network namespaces/veth/bridge here: {e}"
    finally:
        _run(["ip", "netns", "del", ns], check=False)


def requires_root_reason(delay: bool = False) -> str | None:
    """Why the testbed cannot run on this machine (a pytest skip reason), or None.

    delay=True also requires the netem qdisc (LinkSpec.delay_ms > 0).
    """
    try:
        _check_privileges()
    except TestbedError as e:
        return str(e)
    reason = _probe("tbf")
    if reason is None and delay:
        reason = _probe("netem")
    return reason


# ---------------------------------------------------------------------------------------------
# stale leftovers


def cleanup_stale(prefix: str = "acl", include_live: bool = False) -> list[str]:
    """Delete namespaces of earlier testbeds with ``prefix`` whose creating process is gone.

    A namespace counts as live when the pid in its name exists and started before the
    namespace was created (so a recycled pid does not protect a leftover). include_live=True
    removes live ones too. Processes still inside a removed namespace are killed. Returns the
    names removed.
    """
    _check_privileges(("ip",))
    # also throwaway namespaces of requires_root_reason() probes that crashed mid-probe
    pat = re.compile(rf"^(?:{re.escape(prefix)}-(\d+)-\d+-(?:br|w\d+)|tbprobe-(\d+)-\d+)$")
    removed, errors = [], []
    for ns in _netns_list():
        m = pat.match(ns)
        if not m:
            continue
        pid = int(m.group(1) or m.group(2))
        if not include_live:
            started = _proc_start_time(pid)
            try:
                created = os.stat(f"/run/netns/{ns}").st_mtime
            except OSError:
                created = None
            if started is not None and (created is None or started <= created + 1.0):
                continue  # its creator still runs
        err = _delete_ns(ns)
        (errors if err else removed).append(err or ns)
    if errors:
        raise TestbedError("cleanup_stale could not remove: " + "; ".join(errors))
    return removed


# ---------------------------------------------------------------------------------------------
# the testbed


class Testbed:
    """``workers`` namespaces on one bridge, each behind a shaped veth link. See module doc."""

    __test__ = False

    def __init__(
        self,
        workers: int = 2,
        link: LinkSpec | Sequence[LinkSpec] | None = None,
        prefix: str = "acl",
        subnet: str = DEFAULT_SUBNET,
        kill_grace_s: float = 3.0,
    ) -> None:
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix {prefix!r}: 1-10 characters, a letter then [A-Za-z0-9_]")
        if workers < 1:
            raise ValueError("workers must be >= 1")
        net = ipaddress.ip_network(subnet)
        if workers > net.num_addresses - 2:
            raise ValueError(f"subnet {subnet} has room for {net.num_addresses - 2} workers")
        if len(f"{prefix}w{workers - 1}") > _IFNAMSIZ:
            raise ValueError(f"prefix {prefix!r} too long for {workers} workers (IFNAMSIZ)")
        links = link if isinstance(link, (list, tuple)) else [link or LinkSpec()] * workers
        if len(links) != workers:
            raise ValueError(f"{len(links)} LinkSpecs for {workers} workers")
        for spec in links:  # validate early: parse rate/burst, reject bad values
            spec.tc_commands("x")
        self.workers = workers
        self.links: list[LinkSpec] = list(links)
        self.link = self.links[0]
        self.prefix = prefix
        self.subnet = net
        self.kill_grace_s = kill_grace_s
        self.tag = ""
        self.hub_ns = ""
        self.bridge = f"{prefix}br"
        self.namespaces: list[str] = []
        self.addresses: list[str] = []
        self.ifnames: list[str] = [f"{prefix}w{i}" for i in range(workers)]
        self.hub_ifnames: list[str] = [f"{prefix}h{i}" for i in range(workers)]
        self._created_ns: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._old_sigterm = None
        self._sigterm_installed = False
        self._active = False

    # -- context --------------------------------------------------------------------------

    def __enter__(self) -> "Testbed":
        _check_privileges()
        if any(s.delay_ms > 0 for s in self.links):
            reason = _probe("netem")
            if reason:
                raise TestbedError(f"LinkSpec.delay_ms > 0 needs netem: {reason}")
        self._install_sigterm()
        atexit.register(self.close)
        self._active = True
        try:
            self._build()
        except BaseException:
            try:
                self.close()
            except TestbedError:
                pass  # the build error is the one to report
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread

        def _on_sigterm(signum, frame):
            raise TestbedTerminated()

        self._old_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
        self._sigterm_installed = True

    def _build(self) -> None:
        self.tag = _ns_tag(self.prefix)
        self.hub_ns = f"{self.tag}-br"
        hosts = list(itertools.islice(self.subnet.hosts(), self.workers))
        self.addresses = [str(h) for h in hosts]
        self.namespaces = [f"{self.tag}-w{i}" for i in range(self.workers)]
        plen = self.subnet.prefixlen

        def add_ns(ns: str) -> None:
            _run(["ip", "netns", "add", ns])
            self._created_ns.append(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            # no IPv6 on the test links: keeps DAD/MLD/router solicitations out of the counters
            _run(["ip", "netns", "exec", ns, "sh", "-c",
                  "for f in /proc/sys/net/ipv6/conf/all/disable_ipv6 "
                  "/proc/sys/net/ipv6/conf/default/disable_ipv6; do "
                  "[ -w $f ] && echo 1 > $f; done; true"])

        # /etc/hosts inside each worker namespace: the testbed's names, and this machine's host
        # name -> the worker's own address, so that name lookups (c10d's reverse lookup of
        # peers, gloo's fallback when GLOO_SOCKET_IFNAME is unset) resolve locally
        host = socket.gethostname()
        # (also as IPv4-mapped IPv6: c10d's TCPStore listens dual-stack and looks up ::ffff:a.b.c.d)
        names = "".join(f"{a}\t{self.prefix}w{i}\n::ffff:{a}\t{self.prefix}w{i}\n"
                        for i, a in enumerate(self.addresses))

        add_ns(self.hub_ns)
        hub = ["ip", "-n", self.hub_ns]
        _run([*hub, "link", "add", self.bridge, "type", "bridge", "stp_state", "0",
              "forward_delay", "0"])
        _run([*hub, "link", "set", self.bridge, "up"])
        for i, (ns, spec) in enumerate(zip(self.namespaces, self.links)):
            wif, hif = self.ifnames[i], self.hub_ifnames[i]
            add_ns(ns)
            _write_etc_netns(ns, "hosts", "127.0.0.1\tlocalhost\n::1\tlocalhost\n"
                             f"{self.addresses[i]}\t{host}\n{names}")
            # created directly inside the two namespaces: nothing ever appears in the root ns
            _run(["ip", "link", "add", wif, "netns", ns, "mtu", str(spec.mtu), "type", "veth",
                  "peer", "name", hif, "netns", self.hub_ns, "mtu", str(spec.mtu)])
            _run([*hub, "link", "set", hif, "master", self.bridge])
            _run([*hub, "link", "set", hif, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/{plen}", "dev", wif])
            _run(["ip", "-n", ns, "link", "set", wif, "up"])
            for args in spec.tc_commands(wif):  # worker upload
                _run(["tc", "-n", ns, *args])
            for args in spec.tc_commands(hif):  # worker download
                _run(["tc", "-n", self.hub_ns, *args])

    def close(self) -> None:
        """Kill started processes, delete every namespace (idempotent)."""
        if not self._active:
            return
        # a second SIGTERM/SIGINT must not cut teardown short: hold them, re-deliver after
        held: list[int] = []
        old = {}
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            for sig in (signal.SIGTERM, signal.SIGINT):
                old[sig] = signal.signal(sig, lambda s, f: held.append(s))
        errors: list[str] = []
        try:
            self._kill_procs()
            for ns in reversed(self._created_ns):
                err = _delete_ns(ns)
                if err:
                    errors.append(err)
            self._created_ns = [ns for ns in self._created_ns if ns in _netns_list()]
        finally:
            self._active = False
            try:
                atexit.unregister(self.close)
            except Exception:
                pass
            if in_main:
                for sig, h in old.items():
                    signal.signal(sig, h)
                if self._sigterm_installed:
                    signal.signal(signal.SIGTERM, self._old_sigterm
                                  if self._old_sigterm is not None else signal.SIG_DFL)
                    self._sigterm_installed = False
            for sig in dict.fromkeys(held):
                os.kill(os.getpid(), sig)
        if errors:
            raise TestbedError("teardown left: " + "; ".join(errors))

    def _kill_procs(self) -> None:
        alive = [p for p in self._procs if p.poll() is None]
        for p in alive:
            self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace_s
        for p in alive:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in alive:
            self._signal(p, signal.SIGKILL)  # the group too: children may outlive the leader
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    @staticmethod
    def _signal(p: subprocess.Popen, sig: int) -> None:
        try:
            if getattr(p, "_testbed_pgid", None):
                os.killpg(p._testbed_pgid, sig)  # type: ignore[attr-defined]
            elif p.poll() is None:
                p.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    # -- use ------------------------------------------------------------------------------

    def _check_active(self) -> None:
        if not self._active:
            raise TestbedError("the testbed is not up (use it inside `with Testbed(...) as tb:`)")

    def env_for(self, rank: int) -> dict[str, str]:
        """Variables popen() adds to a worker's environment."""
        return {
            "GLOO_SOCKET_IFNAME": self.ifnames[rank],
            "TP_SOCKET_IFNAME": self.ifnames[rank],
            "MASTER_ADDR": self.addresses[0],
            "TESTBED_RANK": str(rank),
            "TESTBED_WORLD_SIZE": str(self.workers),
            "TESTBED_ADDR": self.addresses[rank],
            "TESTBED_IFNAME": self.ifnames[rank],
            "TESTBED_ADDRESSES": ",".join(self.addresses),
        }

    def wrap(self, rank: int, argv: Sequence[str], cpu: str | int | None = None) -> list[str]:
        """argv prefixed so that it runs in worker ``rank``'s namespace (and on ``cpu``)."""
        self._check_active()
        if not 0 <= rank < self.workers:
            raise IndexError(f"rank {rank} out of range for {self.workers} workers")
        out = ["ip", "netns", "exec", self.namespaces[rank]]
        if cpu is not None:
            if shutil.which("taskset") is None:
                raise TestbedError(_missing_tool_message("taskset"))
            out += ["taskset", "-c", str(cpu)]
        return out + [str(a) for a in argv]

    def popen(
        self,
        rank: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cpu: str | int | None = None,
        **kw,
    ) -> subprocess.Popen:
        """Start ``argv`` in worker ``rank``'s namespace; ``cpu`` is a taskset CPU list ('0', '0-1').

        The process gets its own session (``start_new_session=True`` unless given) so teardown
        can kill it with its children. ``ip netns exec`` and ``taskset`` exec the program, so
        ``.pid`` is the program itself.
        """
        full_env = dict(os.environ)
        full_env.update(self.env_for(rank))
        if env:
            full_env.update(env)
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.wrap(rank, argv, cpu), env=full_env, **kw)
        if kw["start_new_session"]:
            p._testbed_pgid = p.pid  # type: ignore[attr-defined]
        self._procs.append(p)
        return p

    def run(self, rank: int, argv: Sequence[str], check: bool = True, timeout: float = 60.0,
            **kw) -> subprocess.CompletedProcess:
        """Run a short command in worker ``rank``'s namespace and return its output."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        p = self.popen(rank, argv, **kw)  # tracked, so teardown kills it if it hangs
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._signal(p, signal.SIGKILL)
            raise
        cp = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            cp.check_returncode()
        return cp

    def _sys_counters(self, ns: str, dev: str, names: Sequence[str]) -> dict[str, int]:
        self._check_active()
        paths = [f"/sys/class/net/{dev}/statistics/{n}" for n in names]
        # `ip netns exec` remounts /sys for the namespace: read the counters from inside
        cp = _run(["ip", "netns", "exec", ns, "cat", *paths])
        return dict(zip(names, (int(x) for x in cp.stdout.split())))

    def counters(self, rank: int) -> dict[str, int]:
        """tx/rx bytes and packets of worker ``rank``'s veth end, read inside its namespace."""
        return self._sys_counters(self.namespaces[rank], self.ifnames[rank],
                                  ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"))

    def tx_bytes(self, rank: int) -> int:
        """Bytes worker ``rank`` sent (Ethernet frames incl. headers, its veth end)."""
        return self._sys_counters(self.namespaces[rank], self.ifnames[rank], ("tx_bytes",))["tx_bytes"]

    def rx_bytes(self, rank: int) -> int:
        """Bytes worker ``rank`` received (its veth end)."""
        return self._sys_counters(self.namespaces[rank], self.ifnames[rank], ("rx_bytes",))["rx_bytes"]

    def qdisc_stats(self, rank: int) -> dict[str, dict[str, int]]:
        """tbf statistics of worker ``rank``'s link: {'up': {...}, 'down': {...}} with
        bytes, packets, drops, overlimits, requeues, backlog."""
        self._check_active()
        out = {}
        for side, ns, dev in (("up", self.namespaces[rank], self.ifnames[rank]),
                              ("down", self.hub_ns, self.hub_ifnames[rank])):
            cp = _run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev])
            stats: dict[str, int] = {}
            for q in json.loads(cp.stdout or "[]"):
                if q.get("kind") == "tbf":
                    stats = {k: int(q.get(k, 0)) for k in
                             ("bytes", "packets", "drops", "overlimits", "requeues", "backlog")}
            out[side] = stats
        return out

    def __repr__(self) -> str:
        state = "up" if self._active else "down"
        return (f"Testbed({self.workers} workers, {self.link.rate} delay {self.link.delay_ms}ms, "
                f"tag={self.tag or '-'}, {state})")
