#!/usr/bin/env python
"""A cluster in a box: N network namespaces ("nodes") on this machine, for checking a multi-node config's wiring.

    sudo python tools/cluster_sim.py --nodes 2 -- tools/launch/torchrun.sh --config F --run-dir runs/x
    sudo python tools/cluster_sim.py --nodes 2 -- sh -c 'echo node $NODE_RANK is $(hostname) at $NODE_ADDR'
    sudo python tools/cluster_sim.py --cleanup          # remove what killed runs of this tool left behind

    from cluster_sim import Cluster                     # tests: tools/ on sys.path
    with Cluster(2) as c:
        p = c.popen(0, ["python", "-m", "http.server", "8000", "--bind", c.nodes[0].addr])
        c.run(1, ["python", "-c", f"import urllib.request as u; u.urlopen('http://node0:8000')"])
        c.link_down(1); ...; c.link_up(1)              # node 1's cable out and back in

What a node is, as on a real cluster:
* its own network namespace with its own loopback (127.0.0.1 of one node is not another node's) and one interface,
  `eth0`, with its own address, 198.18.0.<k+1>/24 (198.18.0.0/15 is reserved for network tests, RFC 2544: no real
  host has such an address). The interfaces are veth links to a bridge that lives in a namespace of its own (the
  "switch"), so nothing of the simulated cluster is in this machine's own network namespace: the nodes reach each
  other and nothing else, and nothing outside reaches them. No default route: traffic to any other address fails.
* its own host name, `node<k>` (every command runs in a UTS namespace of its own: `unshare --uts`), and a hosts file
  naming every node (`/etc/netns/<namespace>/hosts`, which `ip netns exec` mounts over /etc/hosts). Like a stock
  Debian/Ubuntu host, a node's hosts file also maps its OWN name to 127.0.1.1 (first, so `gethostbyname(gethostname())`
  is 127.0.1.1 there, and is not an address other nodes can reach); `stock_hosts=False` / `--no-stock-hosts` leaves
  that line out.
* the same file system as this machine (a shared cluster file system), the same users, the same CPUs.
* commands get the node's identity in the environment: NODE_RANK, NODE_ADDR, NODE_NAME, NNODES, MASTER_ADDR (node
  0's address), and GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME = eth0 (the interface gloo and NCCL must use: without
  them gloo picks the address its host name resolves to, 127.0.1.1 above). `interface_env=False` /
  `--no-interface-env` leaves out NODE_ADDR, GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME, as a user's shell on a real
  cluster would (tools/launch/torchrun.sh then finds the interface itself). In the CLI's command, {node}, {addr},
  {name}, {nnodes} and {master} are replaced by the same values.

Everything it made is removed however it ends (normal exit, an exception, Ctrl-C, SIGTERM/SIGHUP, interpreter exit):
every process in the nodes' namespaces (SIGTERM, then SIGKILL: `ip netns pids`), the namespaces (which deletes the
veth links and the bridge) and the /etc/netns/<namespace> directories. Names carry this process's pid
(`opidsim<pid>x<n>-node<k>`, `...-switch`; the prefix is $OPID_SIM_PREFIX when set), so parallel runs never collide,
and every start first removes the instances of dead processes of the same prefix (a SIGKILLed run cannot clean up
after itself).

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2's `ip` and util-linux's `unshare`; `unavailable_reason()`
says why a cluster cannot be made here (tests skip with that line).
"""
from __future__ import annotations

import argparse
import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

# names of what it makes start with this ($OPID_SIM_PREFIX: letters, digits, '-', to keep several users' or CI
# jobs' clusters and their stale-instance sweeps apart on one machine)
PREFIX = os.environ.get("OPID_SIM_PREFIX", "") if re.fullmatch(r"[A-Za-z][A-Za-z0-9-]{0,11}",
                                                                os.environ.get("OPID_SIM_PREFIX", "")) else "opidsim"
NETWORK = "198.18.0.0/15"  # RFC 2544 benchmarking range: never a real host's address
SUBNET_BASE = "198.18.0."  # node k: 198.18.0.<k+1>/24 (inside NETWORK)
IFNAME = "eth0"
NETNS_ETC = "/etc/netns"
_counter = itertools.count()


class ClusterError(RuntimeError):
    """A cluster could not be made or used (the message says what failed)."""


def _ip(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def unavailable_reason() -> Optional[str]:
    """Why network namespaces cannot be made here (one line), or None when they can."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN); run as root"
    for tool, pkg in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (install {pkg})"
    probe = f"{PREFIX}{os.getpid()}probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    try:
        r = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "--", "true"], capture_output=True,
                           text=True, timeout=30)
        if r.returncode != 0:
            return f"`unshare --uts` inside a network namespace failed: {r.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_list() -> list[str]:
    r = _ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def netns_pids(name: str) -> list[int]:
    """The processes in network namespace `name` (`ip netns pids`)."""
    r = _ip("netns", "pids", name, check=False)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


def _kill_netns(name: str, grace_s: float = 3.0) -> None:
    """SIGTERM every process in the namespace, then SIGKILL what is left, until none is (bounded)."""
    pids = netns_pids(name)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = netns_pids(name)
    for _ in range(50):
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
        pids = netns_pids(name)


def _remove_netns(name: str) -> None:
    _kill_netns(name)
    _ip("netns", "del", name, check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Remove the namespaces (and their processes and /etc/netns entries) of `prefix` whose creating process is dead.
    Returns their names."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)x\d+-")
    removed = []
    names = set(_netns_list())
    if os.path.isdir(NETNS_ETC):
        names |= {n for n in os.listdir(NETNS_ETC) if pattern.match(n)}
    for name in sorted(names):
        m = pattern.match(name)
        if m and not _alive(int(m.group(1))):
            _remove_netns(name)
            removed.append(name)
    return removed


@dataclass
class Node:
    index: int
    name: str  # host name, node<k>
    netns: str  # network namespace
    addr: str  # cluster address (eth0)
    ifname: str = IFNAME


class Cluster:
    """N simulated nodes (see the module docstring). A context manager; `close()` is idempotent."""

    def __init__(self, nodes: int = 2, *, prefix: str = PREFIX, stock_hosts: bool = True, interface_env: bool = True):
        if not 1 <= int(nodes) <= 200:
            raise ValueError(f"nodes={nodes}: allowed 1..200")
        self.prefix = prefix
        self.tag = f"{prefix}{os.getpid()}x{next(_counter)}"
        self.switch = f"{self.tag}-switch"
        self.nodes = [Node(k, f"node{k}", f"{self.tag}-node{k}", f"{SUBNET_BASE}{k + 1}") for k in range(int(nodes))]
        self.stock_hosts = stock_hosts
        self.interface_env = interface_env
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._closed = False
        self._started = False
        self._old_handlers: dict = {}

    # ---- life cycle -------------------------------------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "Cluster":
        if self._started:
            return self
        reason = unavailable_reason()
        if reason:
            raise ClusterError(f"cannot make a simulated cluster here: {reason}")
        self._started = True
        atexit.register(self.close)
        self._install_signal_handlers()
        cleanup_stale(self.prefix)
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        hosts = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        hosts += [f"{n.addr}\t{n.name}" for n in self.nodes]
        for n in self.nodes:
            _ip("netns", "add", n.netns)
            self._made.append(n.netns)
            port = f"port{n.index}"
            # both ends are created inside their namespaces: nothing ever appears in this machine's namespace
            _ip("link", "add", n.ifname, "netns", n.netns, "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", n.netns, "addr", "add", f"{n.addr}/24", "dev", n.ifname)
            _ip("-n", n.netns, "link", "set", n.ifname, "up")
            _ip("-n", n.netns, "link", "set", "lo", "up")
            etc = os.path.join(NETNS_ETC, n.netns)
            os.makedirs(etc, exist_ok=True)
            own = [f"127.0.1.1\t{n.name}"] if self.stock_hosts else []  # stock Debian/Ubuntu: own name on loopback
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write("\n".join(hosts[:2] + own + hosts[2:]) + "\n")

    def close(self) -> None:
        """Stop every process in the nodes, remove the namespaces and /etc/netns entries. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for p in self._procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGTERM)
                    except (ProcessLookupError, PermissionError):
                        pass
            for name in reversed(self._made):
                _remove_netns(name)
            for p in self._procs:  # reap
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            self._restore_signal_handlers()
            try:
                atexit.unregister(self.close)
            except Exception:  # noqa: BLE001
                pass

    def _install_signal_handlers(self) -> None:
        """SIGTERM / SIGHUP end the process through SystemExit (so `finally` and `with` blocks tear down); a handler
        already installed by the caller is kept and called first."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            old = signal.getsignal(sig)
            if old is signal.SIG_IGN:
                continue
            self._old_handlers[sig] = old

            def handler(signum, frame, old=old):
                if callable(old) and old not in (signal.SIG_DFL, signal.SIG_IGN):
                    old(signum, frame)
                self.close()
                raise SystemExit(128 + signum)

            signal.signal(sig, handler)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):
                pass
        self._old_handlers.clear()

    # ---- running commands -------------------------------------------------------------------------------------------
    def node_env(self, k: int) -> dict:
        """The variables that tell a command which node it runs on."""
        n = self.nodes[k]
        env = {"NODE_RANK": str(k), "NODE_NAME": n.name, "NNODES": str(len(self.nodes)),
               "MASTER_ADDR": self.nodes[0].addr}
        if self.interface_env:
            env.update(NODE_ADDR=n.addr, GLOO_SOCKET_IFNAME=n.ifname, NCCL_SOCKET_IFNAME=n.ifname)
        return env

    def format(self, k: int, arg: str) -> str:
        """{node}, {addr}, {name}, {nnodes}, {master} in `arg` replaced by node k's values (other braces kept)."""
        n = self.nodes[k]
        values = {"node": str(k), "addr": n.addr, "name": n.name, "nnodes": str(len(self.nodes)),
                  "master": self.nodes[0].addr}
        return re.sub(r"\{(node|addr|name|nnodes|master)\}", lambda m: values[m.group(1)], arg)

    def command(self, k: int, argv: Sequence[str]) -> list[str]:
        """`argv` as it runs on node k: in its network namespace and a UTS namespace of its own named node<k>."""
        n = self.nodes[k]
        return ["ip", "netns", "exec", n.netns, "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', n.name, *[self.format(k, str(a)) for a in argv]]

    def popen(self, k: int, argv: Sequence[str], env: Optional[dict] = None, **kwargs) -> subprocess.Popen:
        """Start `argv` on node k (environment: `env` or this process's, plus node_env(k)); its own session, so
        `os.killpg(p.pid, sig)` reaches what it started in that session. Stopped by close() at the latest."""
        if not self._started or self._closed:
            raise ClusterError("the cluster is not running (use `with Cluster(...)` or start())")
        full = {**(os.environ if env is None else env), **self.node_env(k)}
        if not self.interface_env:  # as a user's shell: nothing of this process's own settings either
            for key in ("NODE_ADDR", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                full.pop(key, None)
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(self.command(k, argv), env=full, **kwargs)
        self._procs.append(p)
        return p

    def run(self, k: int, argv: Sequence[str], timeout: float = 120, env: Optional[dict] = None,
            **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` on node k to its end (text output captured unless told otherwise)."""
        if kwargs.pop("capture_output", True):
            kwargs.setdefault("stdout", subprocess.PIPE)
            kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("text", True)
        p = self.popen(k, argv, env=env, **kwargs)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            raise ClusterError(f"node {k}: {' '.join(map(str, argv))} did not finish in {timeout:g} s "
                               f"(stderr: {(err or '')[-500:]})") from None
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def pids(self, k: int) -> list[int]:
        """Every process now running on node k (whoever started it)."""
        return netns_pids(self.nodes[k].netns)

    def kill_node(self, k: int, sig: int = signal.SIGKILL) -> list[int]:
        """Send `sig` to every process on node k (SIGKILL: the node's power is cut). Returns the pids signalled."""
        pids = self.pids(k)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def link_down(self, k: int) -> None:
        """Node k's cable out: its switch port goes down (the node keeps its address; packets to and from it are
        lost until link_up, so TCP connections stall rather than fail at once, as on a real network)."""
        _ip("-n", self.switch, "link", "set", f"port{k}", "down")

    def link_up(self, k: int) -> None:
        _ip("-n", self.switch, "link", "set", f"port{k}", "up")


# ---- CLI -----------------------------------------------------------------------------------------------------------
def _pump(stream, label: str, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(f"[{label}] ".encode() + line)
        out.flush()


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        own, cmd = argv[:i], argv[i + 1:]
    else:
        own, cmd = argv, []
    p = argparse.ArgumentParser(prog="cluster_sim.py", description=__doc__.splitlines()[0],
                                epilog="Everything after -- runs once per node ({node} {addr} {name} {nnodes} {master} "
                                       "substituted; NODE_RANK, NODE_ADDR, NODE_NAME, NNODES, MASTER_ADDR, "
                                       "GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME set).")
    p.add_argument("--nodes", type=int, default=2, help="nodes [2]")
    p.add_argument("--timeout", type=float, default=None, help="seconds before every node is stopped [none]")
    p.add_argument("--no-stock-hosts", action="store_true",
                   help="leave out the stock-Debian line mapping a node's own name to 127.0.1.1")
    p.add_argument("--no-interface-env", action="store_true",
                   help="leave NODE_ADDR, GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME unset in the nodes' commands")
    p.add_argument("--cleanup", action="store_true", help="remove what dead runs of this tool left, and exit")
    a = p.parse_args(own)
    reason = unavailable_reason()
    if reason:
        print(f"cluster_sim.py: cannot make a simulated cluster here: {reason}", file=sys.stderr)
        return 2
    if a.cleanup:
        removed = cleanup_stale()
        print(f"cluster_sim.py: removed {len(removed)} stale namespace(s)" + (f": {' '.join(removed)}" if removed
                                                                              else ""), file=sys.stderr)
        return 0
    if not cmd:
        p.error("no command (give it after --)")
    with Cluster(a.nodes, stock_hosts=not a.no_stock_hosts, interface_env=not a.no_interface_env) as c:
        for n in c.nodes:
            print(f"cluster_sim.py: node {n.index}: {n.name} {n.addr} ({n.netns})", file=sys.stderr, flush=True)
        procs = [c.popen(k, cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for k in range(a.nodes)]
        pumps = [threading.Thread(target=_pump, args=(pr.stdout, f"node{k}", sys.stdout.buffer), daemon=True)
                 for k, pr in enumerate(procs)]
        for t in pumps:
            t.start()
        deadline = None if a.timeout is None else time.monotonic() + a.timeout
        rc = 0
        try:
            while any(pr.poll() is None for pr in procs):
                if deadline is not None and time.monotonic() > deadline:
                    print(f"cluster_sim.py: still running after {a.timeout:g} s; stopping every node",
                          file=sys.stderr, flush=True)
                    rc = 124
                    break
                failed = [k for k, pr in enumerate(procs) if pr.poll() not in (None, 0)]
                if failed:  # one node failed: the others would wait for it; stop them (as srun --kill-on-bad-exit)
                    k = failed[0]
                    print(f"cluster_sim.py: node {k} exited with code {procs[k].returncode}; stopping the others",
                          file=sys.stderr, flush=True)
                    rc = procs[k].returncode
                    break
                time.sleep(0.2)
        except KeyboardInterrupt:
            rc = 130
        if rc == 0:
            rc = next((pr.returncode for pr in procs if pr.returncode), 0)
        for t in pumps:
            t.join(timeout=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
