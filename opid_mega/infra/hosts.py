"""Which address this node's servers bind and advertise, whether an address is this machine's, and the run's API key
(DESIGN.md "Multi-node rules"; standard library only, so every layer may use it).

    host = bind_host(cfg.deploy.bind_host)          # "auto" | an address | an interface name -> one address
    url = http_url(host, port)                       # http://10.0.0.5:30000, http://[fd00::5]:30000
    is_local_url("http://node1:30000")               # is that server on this machine? (exact, never a substring)
    key = run_api_key()                              # the key of a run's servers and router: random per run

deploy.bind_host:
* ``auto`` (the default): the address of the interface that routes to the rendezvous host, MASTER_ADDR (torchrun sets
  it on every rank to global rank 0's agent address; a single process has none, or 127.0.0.1). It is found by
  connecting a UDP socket there, which sends nothing: the kernel picks the source address it would use. A rendezvous
  host on this machine's loopback (a one-node run: localhost, 127.x, ::1; also a host name that a stock Debian
  /etc/hosts maps to 127.0.1.1) gives 127.0.0.1: the servers of that node stay off the network, and only global rank
  0, on that same node, talks to them.
* an IPv4/IPv6 address of this machine: exactly that one (a wildcard such as 0.0.0.0 is refused: a server must
  advertise an address others can reach, and would otherwise listen on every network).
* an interface name (``eth0``, ``ib0``): that interface's IPv4 address (the same config on every node of a cluster).

Local or remote is decided on the parsed host of a URL: a loopback name or address, or an address that this machine
can bind (``socket.bind((addr, 0))`` succeeds only for its own addresses). `//node1` is never `//node12`.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import ipaddress
import os
import secrets
import socket
import struct
from typing import Optional
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"
API_KEY_ENV = "OPID_SGLANG_API_KEY"  # how a launched server / the router receives its key (opid_mega.infra.keyed)


class BindHostError(ValueError):
    """deploy.bind_host cannot give an address on this node (the message is one line naming the key)."""


def _ip(host: str) -> Optional[ipaddress._BaseAddress]:
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


def _resolve(host: str) -> list[str]:
    """The addresses `host` resolves to here (empty when it does not resolve)."""
    if _ip(host) is not None:
        return [host.strip("[]")]
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError, OSError):
        return []
    out = []
    for info in infos:
        addr = info[4][0]
        if addr not in out:
            out.append(addr)
    return out


def _own_address(addr: str) -> bool:
    """True when `addr` is an address of this machine (only those can be bound)."""
    ip = _ip(addr)
    if ip is None:
        return False
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((str(ip), 0))
        return True
    except OSError:
        return False


def url_host(url: str) -> str:
    """The host part of a URL ("http://h:1/x" -> "h"; also "h:1"), lower-cased, without IPv6 brackets."""
    text = url if "//" in url else "//" + url
    return (urlsplit(text).hostname or "").lower()


@functools.lru_cache(maxsize=256)
def is_local_host(host: str) -> bool:
    """True when `host` (a name or an address) is this machine: a loopback name/address, or one this machine has."""
    host = host.strip().strip("[]").lower()
    if not host:
        return False
    if host == "localhost":
        return True
    ip = _ip(host)
    if ip is not None and ip.is_unspecified:  # 0.0.0.0 / :: in a URL: a server listening here on every address
        return True
    addrs = _resolve(host)
    return bool(addrs) and any(_own_address(a) for a in addrs)


def is_local_url(url: str) -> bool:
    """True when the server at `url` runs on this machine (exact comparison of its parsed host)."""
    return is_local_host(url_host(url))


def http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def interface_address(name: str) -> Optional[str]:
    """The IPv4 address of network interface `name` (None when it has none or does not exist)."""
    SIOCGIFADDR = 0x8915
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def route_source(target: str) -> Optional[str]:
    """The source address this machine uses to reach `target` (a name or an address); None when it cannot."""
    for addr in _resolve(target):
        ip = _ip(addr)
        family = socket.AF_INET6 if ip is not None and ip.version == 6 else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((addr, 9))  # UDP connect: a route lookup, nothing is sent
                return s.getsockname()[0]
        except OSError:
            continue
    return None


def rendezvous_host() -> str:
    """Where this run's ranks meet: MASTER_ADDR (set by torchrun and the launchers), else this machine."""
    return os.environ.get("MASTER_ADDR", "").strip() or LOOPBACK


def bind_host(spec: str = "auto", target: Optional[str] = None) -> str:
    """The address this node's servers bind and advertise, by deploy.bind_host (`spec`, see the module docstring).
    `target`: the host the address must reach (auto; default: the rendezvous host). Raises BindHostError."""
    spec = (spec or "auto").strip()
    if spec == "auto":
        target = (target or rendezvous_host()).strip().strip("[]")
        addrs = _resolve(target)
        if not addrs:
            raise BindHostError(f"deploy.bind_host=auto: the rendezvous host {target!r} (MASTER_ADDR) does not "
                                "resolve on this node; set deploy.bind_host to this node's cluster address or interface")
        if any(_ip(a).is_loopback for a in addrs if _ip(a) is not None):
            return LOOPBACK  # a one-node run (or rank 0's own node under a stock /etc/hosts): stay off the network
        src = route_source(target)
        if src is None:
            raise BindHostError(f"deploy.bind_host=auto: no route from this node to the rendezvous host {target!r}; "
                                "set deploy.bind_host to this node's cluster address or interface")
        return src
    ip = _ip(spec)
    if ip is not None:
        if ip.is_unspecified:
            raise BindHostError(f"deploy.bind_host={spec}: a wildcard address would put the servers on every network "
                                "and is no address to advertise; give this node's cluster address, an interface "
                                "name, or auto")
        if not _own_address(spec):
            raise BindHostError(f"deploy.bind_host={spec} is not an address of this node ({socket.gethostname()})")
        return str(ip)
    addr = interface_address(spec)
    if addr is None:
        raise BindHostError(f"deploy.bind_host={spec}: not an address and not a network interface with an IPv4 "
                            "address on this node (allowed: auto, an address, an interface name)")
    return addr


def interface_of(addr: str) -> Optional[str]:
    """The name of the network interface that holds IPv4 address `addr` (None: no interface here has it)."""
    for _, name in socket.if_nameindex():
        if interface_address(name) == addr:
            return name
    return None


def _is_up(name: str) -> bool:
    SIOCGIFFLAGS, IFF_UP = 0x8913, 0x1
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            reply = fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, struct.pack("256s", name.encode()[:15]))
        return bool(struct.unpack("H", reply[16:18])[0] & IFF_UP)
    except OSError:
        return False


def cluster_interfaces() -> list[str]:
    """The interfaces of this machine that are up and hold an IPv4 address other than a loopback one."""
    out = []
    for _, name in socket.if_nameindex():
        addr = interface_address(name)
        if addr and not _ip(addr).is_loopback and _is_up(name):
            out.append(name)
    return out


def socket_ifname(rendezvous: str, nodes: int, node_addr: str = "",
                  rendezvous_fix: str = "give RDZV_ENDPOINT as node 0's cluster address") -> str:
    """The interface gloo and NCCL use on this node (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME when the user set
    none): the interface holding `node_addr` (this node's cluster address, the launcher's NODE_ADDR) when given, else
    the one that routes to the rendezvous host (deploy.bind_host=auto's rule). A rendezvous host on this machine's
    loopback in a one-node run, or spelled as loopback (localhost, 127.0.0.1: every node on this machine): the
    loopback interface (nothing listens on the network). On a multi-node run, a host NAME that resolves to loopback
    here (a stock Debian/Ubuntu /etc/hosts maps the node's own name to 127.0.1.1: the rendezvous is on this node)
    gives this node's one cluster interface (`cluster_interfaces`: up, with an IPv4 address that is not loopback);
    with several, which one the other nodes reach cannot be told: BindHostError, one line naming the fix
    (`rendezvous_fix`: how this launch names the rendezvous host by address)."""
    fix = "set NODE_ADDR to this node's cluster address (or GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to its interface)"
    if node_addr:
        addrs = [a for a in _resolve(node_addr.strip("[]")) if _ip(a) is not None and _ip(a).version == 4]
        name = next((n for n in (interface_of(a) for a in addrs) if n), None)
        if name is None:
            raise BindHostError(f"NODE_ADDR={node_addr} is not an IPv4 address of an interface of this node "
                                f"({socket.gethostname()}); {fix}")
        return name
    target = rendezvous.strip().strip("[]")
    addrs = _resolve(target)
    if not addrs:
        raise BindHostError(f"the rendezvous host {target!r} does not resolve on this node ({socket.gethostname()}); "
                            f"{rendezvous_fix}")
    loop = [a for a in addrs if _ip(a) is not None and _ip(a).is_loopback]
    if loop:
        named = target.lower() != "localhost" and _ip(target) is None  # a host name, not loopback by its spelling
        if nodes <= 1 or not named:  # one node, or every node on this machine (localhost, 127.0.0.1)
            return interface_of(LOOPBACK) or "lo"
        found = cluster_interfaces()
        if len(found) == 1:  # the rendezvous is on this node: its one cluster interface is where the others reach it
            return found[0]
        raise BindHostError(f"the rendezvous host {target!r} resolves to {loop[0]} (loopback) on this node "
                            f"({socket.gethostname()}) in a {nodes}-node run, which names no cluster interface, and "
                            f"this node has {len(found)} ({', '.join(found) or 'none'}); {fix}, or {rendezvous_fix}")
    src = route_source(target)
    name = interface_of(src) if src else None
    if name is None:
        raise BindHostError(f"no interface of this node ({socket.gethostname()}) routes to the rendezvous host "
                            f"{target!r}; {fix}")
    return name


IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def job_nodes(environ=os.environ) -> int:
    """The job's node count as a rank sees it: torchrun's GROUP_WORLD_SIZE (the Ray launcher sets it too), NNODES,
    else 1 when every rank is on this node (WORLD_SIZE = LOCAL_WORLD_SIZE, or neither set), else 2 (several)."""
    for key in ("GROUP_WORLD_SIZE", "NNODES"):
        value = environ.get(key, "").strip()
        if value.isdigit() and int(value) >= 1:
            return int(value)
    world, local = environ.get("WORLD_SIZE", "1"), environ.get("LOCAL_WORLD_SIZE", "")
    return 1 if not local or local == world else 2


def set_socket_ifname(environ=os.environ) -> Optional[str]:
    """At process-group set-up (every launcher: torchrun.sh, a plain torchrun, SLURM, Ray, one process): each of
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME that is unset becomes socket_ifname(MASTER_ADDR, job_nodes(), NODE_ADDR),
    so that gloo never takes the address the host name resolves to (127.0.1.1 under a stock Debian/Ubuntu
    /etc/hosts: the other nodes cannot reach it). A lone process (WORLD_SIZE 1) meets no one: GLOO_SOCKET_IFNAME is
    the loopback interface, NCCL_SOCKET_IFNAME is left to NCCL (the groups it forms with servers elsewhere need a
    reachable interface, which NCCL's own default never takes from the host name). Returns the interface set (None:
    nothing was unset). Raises BindHostError (one line naming the fix) when no interface can be told."""
    if int(environ.get("WORLD_SIZE", "1") or 1) == 1:
        names, name = ("GLOO_SOCKET_IFNAME",), interface_of(LOOPBACK) or "lo"
    else:
        names = IFNAME_VARS
        if all(environ.get(k) for k in names):
            return None
        name = socket_ifname(environ.get("MASTER_ADDR", "").strip() or LOOPBACK, job_nodes(environ),
                             environ.get("NODE_ADDR", "").strip(),
                             rendezvous_fix="give node 0's cluster address to its launcher (torchrun --local-addr "
                                            "ADDR, which becomes MASTER_ADDR)")
    unset = [k for k in names if not environ.get(k)]
    for key in unset:
        environ[key] = name
    return name if unset else None


@contextlib.contextmanager
def gloo_interface(host: str):
    """GLOO_SOCKET_IFNAME set to the interface holding `host` (an address of this machine; loopback for a loopback
    address) while a gloo group is made inside the block: gloo reads it when a group is constructed, and a group
    with peers elsewhere (a weight-update group with another node's server) must listen where they reach it."""
    ip = _ip(host)
    name = (interface_of(LOOPBACK) or "lo") if ip is not None and ip.is_loopback else interface_of(host)
    old = os.environ.get("GLOO_SOCKET_IFNAME")
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield name
    finally:
        if old is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = old


def new_api_key() -> str:
    """A fresh random API key (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def run_api_key() -> str:
    """The API key of a run's launched servers and router: $OPID_SGLANG_API_KEY when the operator set one (to reach
    the servers by hand; it is then in the trainer's environment, their choice), else a fresh random one."""
    return os.environ.get(API_KEY_ENV, "").strip() or new_api_key()


def main(argv: Optional[list] = None) -> int:
    """`python -m opid_mega.infra.hosts socket-ifname RENDEZVOUS_HOST NODES [NODE_ADDR]`: print socket_ifname's
    answer; a BindHostError is one line on stderr and exit code 2 (tools/launch/torchrun.sh)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (3, 4) or args[0] != "socket-ifname" or not args[2].isdigit():
        print("usage: python -m opid_mega.infra.hosts socket-ifname RENDEZVOUS_HOST NODES [NODE_ADDR]", file=sys.stderr)
        return 2
    try:
        print(socket_ifname(args[1], int(args[2]), args[3] if len(args) == 4 else ""))
    except BindHostError as exc:
        print(f"opid: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
