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
* Nodes: ``Testbed(workers=M, ranks_per_node=G)`` makes each worker namespace a node of G
  ranks (global ranks numbered node by node, :meth:`Testbed.node_of`). The G processes of a
  node share its namespace, address and one shaped veth; traffic between them goes to the
  node's own address, which Linux routes over the namespace's loopback (fast, unshaped, not on
  the veth's counters), so the veth counts exactly what the node sends to other nodes. Each
  process gets torchrun's variables (:func:`torchrun_env`). ``ranks_per_node=1`` (the default)
  is the original one-worker-per-link layout, where node i is rank i.
* Teardown deletes the namespaces; deleting a namespace destroys the veths, the bridge and
  the qdiscs in it. Processes still running inside a namespace would keep it alive, so they
  are killed first (those started with :meth:`Testbed.popen` by process group, then anything
  ``ip netns pids`` still reports).

Three files: this one runs a group of workers across the network (build, processes,
counters, teardown); ``benchmarks/shaping.py`` describes one link (rates and sizes in tc
notation, burst, queue and delay: :class:`LinkSpec`); ``benchmarks/netns.py`` is the plumbing
(``ip``/``tc`` calls, deleting namespaces, :func:`cleanup_stale`, :func:`requires_root_reason`).
Their public names are importable from here.

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
import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from typing import Mapping, Sequence

from benchmarks import netns
from benchmarks.netns import TestbedError, cleanup_stale, requires_root_reason
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
    "torchrun_env",
]

DEFAULT_SUBNET = "10.213.0.0/24"
_IFNAMSIZ = 15  # Linux interface names: at most 15 characters
_PREFIX_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,9}$")


class TestbedTerminated(SystemExit):
    """Raised in the with-block when the process gets SIGTERM (exit status 143 if uncaught)."""

    __test__ = False

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def _checked_links(
    workers: int, link: LinkSpec | Sequence[LinkSpec] | None, prefix: str, subnet: str,
    ranks_per_node: int = 1,
) -> list[LinkSpec]:
    """One LinkSpec per worker (node), after checking every argument of :class:`Testbed`."""
    if ranks_per_node < 1:
        raise ValueError("ranks_per_node must be >= 1")
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
    return list(links)


def torchrun_env(rank: int, nodes: int, ranks_per_node: int) -> dict[str, str]:
    """The variables torchrun gives global ``rank`` of ``nodes`` x ``ranks_per_node`` ranks,
    ranks numbered node by node (``GROUP_RANK`` is the node's index, as torchrun's agent sets it)."""
    world = nodes * ranks_per_node
    if not 0 <= rank < world:
        raise IndexError(f"rank {rank} out of range for {nodes} nodes x {ranks_per_node} ranks")
    node, local = divmod(rank, ranks_per_node)
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(ranks_per_node), "GROUP_RANK": str(node),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world)}


class Testbed:
    """``workers`` namespaces (nodes) on one bridge, each behind a shaped veth link, each holding
    ``ranks_per_node`` ranks. See module doc."""

    __test__ = False

    def __init__(
        self,
        workers: int = 2,
        link: LinkSpec | Sequence[LinkSpec] | None = None,
        prefix: str = "acl",
        subnet: str = DEFAULT_SUBNET,
        kill_grace_s: float = 3.0,
        ranks_per_node: int = 1,
    ) -> None:
        self.links: list[LinkSpec] = _checked_links(workers, link, prefix, subnet, ranks_per_node)
        self.workers = workers  # nodes: one namespace and one shaped link each
        self.ranks_per_node = ranks_per_node
        self.link = self.links[0]
        self.prefix = prefix
        self.subnet = ipaddress.ip_network(subnet)
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
        netns.check_privileges()
        if any(s.delay_ms > 0 for s in self.links):
            reason = netns.probe("netem")
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

    # -- building -------------------------------------------------------------------------

    def _build(self) -> None:
        """Names and addresses, the hub namespace with its bridge, then one worker at a time."""
        self.tag = netns.namespace_tag(self.prefix)
        self.hub_ns = f"{self.tag}-br"
        hosts = list(itertools.islice(self.subnet.hosts(), self.workers))
        self.addresses = [str(h) for h in hosts]
        self.namespaces = [f"{self.tag}-w{i}" for i in range(self.workers)]
        self._add_ns(self.hub_ns)
        netns.add_bridge(self.hub_ns, self.bridge)
        for i in range(self.workers):
            self._add_worker(i)

    def _add_ns(self, ns: str) -> None:
        netns.add_namespace(ns)
        self._created_ns.append(ns)  # from here on, teardown deletes it
        netns.prepare_namespace(ns)

    def _add_worker(self, i: int) -> None:
        """Worker ``i``'s namespace, /etc/hosts, veth to the bridge, and both shaped directions."""
        ns, spec = self.namespaces[i], self.links[i]
        wif, hif = self.ifnames[i], self.hub_ifnames[i]
        self._add_ns(ns)
        netns.write_etc_netns(ns, "hosts", self._hosts_file(i))
        netns.add_veth(ns, wif, f"{self.addresses[i]}/{self.subnet.prefixlen}",
                       self.hub_ns, hif, self.bridge, spec.mtu)
        netns.shape(ns, wif, spec)  # worker upload
        netns.shape(self.hub_ns, hif, spec)  # worker download

    def _hosts_file(self, i: int) -> str:
        """/etc/hosts inside worker ``i``'s namespace: the testbed's names, and this machine's
        host name -> the worker's own address, so that name lookups (c10d's reverse lookup of
        peers, gloo's fallback when GLOO_SOCKET_IFNAME is unset) resolve locally."""
        # (also as IPv4-mapped IPv6: c10d's TCPStore listens dual-stack and looks up ::ffff:a.b.c.d)
        names = "".join(f"{a}\t{self.prefix}w{j}\n::ffff:{a}\t{self.prefix}w{j}\n"
                        for j, a in enumerate(self.addresses))
        return ("127.0.0.1\tlocalhost\n::1\tlocalhost\n"
                f"{self.addresses[i]}\t{socket.gethostname()}\n{names}")

    # -- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        """Kill started processes, delete every namespace (idempotent)."""
        if not self._active:
            return
        # a second SIGTERM/SIGINT must not cut teardown short: hold them, re-deliver after
        held: list[int] = []
        old: dict[int, object] = {}
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            for sig in (signal.SIGTERM, signal.SIGINT):
                old[sig] = signal.signal(sig, lambda s, f: held.append(s))
        errors: list[str] = []
        try:
            self._kill_procs()
            errors = self._delete_namespaces()
        finally:
            self._active = False
            with contextlib.suppress(Exception):
                atexit.unregister(self.close)
            if in_main:
                self._restore_signals(old)
            for sig in dict.fromkeys(held):
                os.kill(os.getpid(), sig)
        if errors:
            raise TestbedError("teardown left: " + "; ".join(errors))

    def _delete_namespaces(self) -> list[str]:
        """Delete the namespaces in reverse order of creation; the errors, if any."""
        errors = [err for ns in reversed(self._created_ns) if (err := netns.delete_namespace(ns))]
        self._created_ns = [ns for ns in self._created_ns if ns in netns.list_namespaces()]
        return errors

    def _restore_signals(self, held_handlers: Mapping[int, object]) -> None:
        """Put back the handlers replaced during teardown, then the one before ``__enter__``."""
        for sig, h in held_handlers.items():
            signal.signal(sig, h)
        if self._sigterm_installed:
            signal.signal(signal.SIGTERM, self._old_sigterm
                          if self._old_sigterm is not None else signal.SIG_DFL)
            self._sigterm_installed = False

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

    @property
    def world_size(self) -> int:
        """Ranks in all: nodes x ranks per node."""
        return self.workers * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """The node (namespace, link) global ``rank`` runs on: ranks are numbered node by node."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range for {self.workers} nodes x "
                             f"{self.ranks_per_node} ranks per node")
        return rank // self.ranks_per_node

    def ranks_of(self, node: int) -> range:
        """The global ranks on ``node``."""
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def env_for(self, rank: int) -> dict[str, str]:
        """Variables popen() adds to global ``rank``'s environment: torchrun's (RANK, WORLD_SIZE,
        LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK; :func:`torchrun_env`), MASTER_ADDR (node 0),
        the gloo interface of its node, and the testbed's own TESTBED_* facts."""
        node = self.node_of(rank)
        return {
            **torchrun_env(rank, self.workers, self.ranks_per_node),
            "GLOO_SOCKET_IFNAME": self.ifnames[node],
            "TP_SOCKET_IFNAME": self.ifnames[node],
            "MASTER_ADDR": self.addresses[0],
            "TESTBED_RANK": str(rank),
            "TESTBED_WORLD_SIZE": str(self.world_size),
            "TESTBED_NODE": str(node),
            "TESTBED_NODES": str(self.workers),
            "TESTBED_ADDR": self.addresses[node],
            "TESTBED_IFNAME": self.ifnames[node],
            "TESTBED_ADDRESSES": ",".join(self.addresses),
        }

    def wrap(self, rank: int, argv: Sequence[str], cpu: str | int | None = None) -> list[str]:
        """argv prefixed so that it runs in global ``rank``'s node namespace (and on ``cpu``)."""
        self._check_active()
        out = ["ip", "netns", "exec", self.namespaces[self.node_of(rank)]]
        if cpu is not None:
            if shutil.which("taskset") is None:
                raise TestbedError(netns.missing_tool_message("taskset"))
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
        """Start ``argv`` as global ``rank`` in its node's namespace; ``cpu`` is a taskset CPU list ('0', '0-1').

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
        """Run a short command as global ``rank`` (in its node's namespace) and return its output."""
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

    def _counters(self, node: int, names: Sequence[str]) -> dict[str, int]:
        self._check_active()
        return netns.read_counters(self.namespaces[node], self.ifnames[node], names)

    def counters(self, node: int) -> dict[str, int]:
        """tx/rx bytes and packets of ``node``'s veth end (its one link), read inside its
        namespace. With one rank per node, node i is rank i."""
        return self._counters(node, ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"))

    def tx_bytes(self, node: int) -> int:
        """Bytes ``node`` sent through its link (Ethernet frames incl. headers, its veth end);
        traffic between ranks of one node goes over the namespace's loopback, not counted here."""
        return self._counters(node, ("tx_bytes",))["tx_bytes"]

    def rx_bytes(self, node: int) -> int:
        """Bytes ``node`` received through its link (its veth end)."""
        return self._counters(node, ("rx_bytes",))["rx_bytes"]

    def loopback_tx_bytes(self, node: int) -> int:
        """Bytes sent over ``node``'s loopback: its ranks' traffic with each other (unshaped)."""
        self._check_active()
        return netns.read_counters(self.namespaces[node], "lo", ("tx_bytes",))["tx_bytes"]

    def qdisc_stats(self, node: int) -> dict[str, dict[str, int]]:
        """tbf statistics of ``node``'s link: {'up': {...}, 'down': {...}} with
        bytes, packets, drops, overlimits, requeues, backlog."""
        self._check_active()
        return {"up": netns.tbf_stats(self.namespaces[node], self.ifnames[node]),
                "down": netns.tbf_stats(self.hub_ns, self.hub_ifnames[node])}

    def __repr__(self) -> str:
        state = "up" if self._active else "down"
        layout = (f"{self.workers} workers" if self.ranks_per_node == 1
                  else f"{self.workers} nodes x {self.ranks_per_node} ranks")
        return (f"Testbed({layout}, {self.link.rate} delay {self.link.delay_ms}ms, "
                f"tag={self.tag or '-'}, {state})")
