"""A test bed of hosts on one machine: network namespaces on a private bridge, each link shaped to a rate.

    python tools/netbed.py up --hosts=3 --rate_mbit=100     # hosts tfsnb-h0..h2 on a free 10.213.X.0/24
    python -m tfscale.launch --netbed=tfsnb --num_workers=2 -- -m tfscale.train ...
    python tools/netbed.py down                             # removes exactly what `up` made

Each host is a network namespace with one interface, `eth0`, at its own address on the bed's subnet,
joined by a veth pair to a bridge in this namespace (the bridge holds the subnet's last address, where a
launcher here reaches the hosts). A rate shapes each host's link in both directions with a token bucket
(`tc ... tbf` on both ends of its veth pair; this kernel has no netem, so links can be slowed but not
delayed). A host can also be given a share of the machine's CPU (`set_cpu`: a cgroup CPU quota on every
process started on it), to make one host a straggler. A command run on a host (`host_command`) also gets its
own host name (a UTS namespace) and an /etc/hosts naming every host of the bed (`ip netns exec` mounts
/etc/netns/NS/hosts over /etc/hosts), so `socket.gethostname()` there resolves to the host's own address.

Traffic stays inside the bed: the namespaces have no route beyond the subnet, and `up` refuses a subnet that
any route of this machine already covers. Every name starts with the bed's prefix, and the plan of what `up`
makes is written to a state file before anything is made, so `down` after a kill -9 at any point of `up` (or
of a job) still removes every namespace, link, bridge, qdisc (they go with their links) and CPU cgroup, then sweeps
anything else whose name carries the prefix. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
from typing import Sequence

DEFAULT_PREFIX = "tfsnb"
SUBNETS = tuple(f"10.213.{octet}.0/24" for octet in range(77, 255))  # `up` takes the first free one by default
STATE_DIR = "/run/tfscale-netbed"  # tmpfs: a reboot, which removes every namespace, removes the plans too
NETNS_ETC = "/etc/netns"  # `ip netns exec NS` bind-mounts the files of /etc/netns/NS over /etc
HOST_IFACE = "eth0"  # each host's one interface, inside its namespace
MAX_PREFIX_CHARS = 8  # interface names hold 15 characters: PREFIX-br, PREFIX-vNN, PREFIX-pNN
TBF_LATENCY_MS = 50  # the longest a packet waits in the bucket's queue before it is dropped
# A host's CPU quota is enforced per period: 10 ms, shorter than a step, makes the host uniformly slower (as an
# older or throttled node is) rather than stalling it for a whole step once in a while, as 100 ms (the default) would.
CPU_PERIOD_US = 10_000
CGROUP_V1_CPU = "/sys/fs/cgroup/cpu"  # cgroup v1's cpu controller (cpu.cfs_quota_us)
CGROUP_V2 = "/sys/fs/cgroup"  # cgroup v2's unified tree (cpu.max)


class NetbedError(RuntimeError):
    """The bed cannot be made, found or used; the message says which name or command failed."""


@dataclasses.dataclass(frozen=True)
class Host:
    index: int
    namespace: str  # also the host's name (its UTS host name and its /etc/hosts entry)
    address: str
    veth: str  # this namespace's end of the host's link, on the bridge
    peer: str  # the other end's name before it moves into the namespace and becomes HOST_IFACE
    cpu_cgroup: str = ""  # set by `set_cpu`: the cgroup every process started on the host joins
    cpu_fraction: float | None = None  # its quota, in cores; None: unlimited


@dataclasses.dataclass(frozen=True)
class Bed:
    prefix: str
    subnet: str
    bridge: str
    bridge_address: str  # this namespace's address on the bed: where hosts reach a launcher run here
    rate_mbit: float | None  # each link's rate in both directions; None: unshaped
    hosts: tuple[Host, ...]

    def host_command(self, index: int, argv: Sequence[str]) -> list[str]:
        """`argv` run on host `index`: in its namespace, under its own host name (same pid: every step execs)."""
        host = self.host(index)
        command = ["ip", "netns", "exec", host.namespace, "unshare", "--uts", "sh", "-c",
                   'hostname "$0" && exec "$@"', host.namespace, *argv]
        if host.cpu_cgroup:  # joined before `ip netns exec`, whose fresh /sys has no cgroup tree mounted
            command = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(host.cpu_cgroup, "cgroup.procs"),
                       *command]
        return command

    def host(self, index: int) -> Host:
        if not 0 <= index < len(self.hosts):
            raise NetbedError(f"netbed {self.prefix!r} has hosts 0-{len(self.hosts) - 1}, not host {index}")
        return self.hosts[index]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Bed":
        return cls(**{**data, "hosts": tuple(Host(**host) for host in data["hosts"])})


def state_path(prefix: str) -> str:
    return os.path.join(STATE_DIR, f"{prefix}.json")


def plan(prefix: str, num_hosts: int, subnet: str = SUBNETS[0], rate_mbit: float | None = None) -> Bed:
    """What `up` makes, made of nothing yet: names and addresses only. Raises ValueError for bad arguments."""
    if not (prefix and prefix.isalnum() and prefix.islower() and len(prefix) <= MAX_PREFIX_CHARS):
        raise ValueError(f"netbed prefix {prefix!r}: 1-{MAX_PREFIX_CHARS} lower-case letters or digits (it starts "
                         "every interface name, which holds 15 characters)")
    network = ipaddress.ip_network(subnet)
    if network.version != 4 or not network.is_private:
        raise ValueError(f"netbed subnet {subnet}: must be a private IPv4 network")
    addresses = list(network.hosts())
    if not 1 <= num_hosts <= min(99, len(addresses) - 1):
        raise ValueError(f"netbed hosts: 1-{min(99, len(addresses) - 1)} fit subnet {subnet}, got {num_hosts}")
    if rate_mbit is not None and rate_mbit <= 0:
        raise ValueError(f"netbed rate_mbit must be > 0 (or None for unshaped links), got {rate_mbit}")
    hosts = tuple(Host(i, f"{prefix}-h{i}", str(addresses[i]), f"{prefix}-v{i}", f"{prefix}-p{i}")
                  for i in range(num_hosts))
    return Bed(prefix, str(network), f"{prefix}-br", str(addresses[-1]), rate_mbit, hosts)


def load(prefix: str = DEFAULT_PREFIX) -> Bed:
    """The bed `up` made under `prefix`. Raises NetbedError if there is none."""
    try:
        with open(state_path(prefix)) as f:
            return Bed.from_json(json.load(f))
    except FileNotFoundError:
        raise NetbedError(f"no netbed {prefix!r}: {state_path(prefix)} does not exist (bring it up first: "
                          f"python tools/netbed.py up --prefix={prefix} --hosts=N)") from None


# ----------------------------------------------------------------------------------------------
# Up and down


def _run(*command: str, missing_ok: bool = False) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 and not (missing_ok and _is_missing(result.stderr)):
        raise NetbedError(f"{' '.join(command)}: exit {result.returncode}: {result.stderr.strip()}")


def _is_missing(stderr: str) -> bool:
    return any(text in stderr for text in ("Cannot find device", "No such file", "does not exist", "not found",
                                           "handle of zero"))  # the last: no qdisc of ours to delete


def _tbf(rate_mbit: float) -> list[str]:
    """A token bucket of `rate_mbit`. Its burst must hold at least one timer tick of traffic at that rate
    (the kernel refills it every tick; HZ is 100-1000), or the link runs below its rate."""
    burst_bytes = max(64 * 1024, int(rate_mbit * 1e6 / 8 / 100))
    return ["root", "tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst_bytes), "latency", f"{TBF_LATENCY_MS}ms"]


def _routes() -> list[tuple[ipaddress.IPv4Network, str]]:
    """(destination, device) of every IPv4 route of this machine, default routes aside."""
    out = subprocess.run(["ip", "-4", "-j", "route", "show", "table", "all"], capture_output=True, text=True,
                         check=True).stdout
    found = []
    for route in json.loads(out or "[]"):
        destination = route.get("dst", "")
        if destination in ("", "default") or route.get("type") in ("local", "broadcast"):
            continue
        found.append((ipaddress.ip_network(destination if "/" in destination else destination + "/32", strict=False),
                      route.get("dev", "?")))
    return found


def _check_subnet_free(subnet: str) -> None:
    """Refuses a subnet that a route of this machine (another network, or another bed) already covers."""
    for destination, device in _routes():
        if destination.overlaps(ipaddress.ip_network(subnet)):
            raise NetbedError(f"netbed subnet {subnet} overlaps route {destination} (dev {device}): "
                              "choose another with --subnet, or take the other bed down")


def free_subnet() -> str:
    """The first of SUBNETS that no route of this machine covers."""
    taken = [destination for destination, _ in _routes()]
    for subnet in SUBNETS:
        if not any(destination.overlaps(ipaddress.ip_network(subnet)) for destination in taken):
            return subnet
    raise NetbedError(f"every netbed subnet from {SUBNETS[0]} to {SUBNETS[-1]} is in use: take a bed down")


def up(prefix: str = DEFAULT_PREFIX, num_hosts: int = 2, subnet: str | None = None,
       rate_mbit: float | None = None) -> Bed:
    """Makes the bed and returns it (`subnet=None`: the first free of SUBNETS). Refuses a prefix whose
    state file exists (`down` it first)."""
    bed = plan(prefix, num_hosts, subnet or free_subnet(), rate_mbit)
    if os.path.exists(state_path(prefix)):
        raise NetbedError(f"netbed {prefix!r} is up already ({state_path(prefix)}): take it down first: "
                          f"python tools/netbed.py down --prefix={prefix}")
    _check_subnet_free(bed.subnet)
    _write_state(bed)  # the plan first: whatever of it exists when `up` is killed, `down` finds by it
    try:
        _make(bed)
    except BaseException:
        down(prefix)
        raise
    return bed


def _make(bed: Bed) -> None:
    length = ipaddress.ip_network(bed.subnet).prefixlen
    _run("ip", "link", "add", bed.bridge, "type", "bridge")
    _run("ip", "addr", "add", f"{bed.bridge_address}/{length}", "dev", bed.bridge)
    _run("ip", "link", "set", bed.bridge, "up")
    hosts_file = "127.0.0.1\tlocalhost\n" + "".join(f"{h.address}\t{h.namespace}\n" for h in bed.hosts)
    for host in bed.hosts:
        ns = host.namespace
        os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
        with open(os.path.join(NETNS_ETC, ns, "hosts"), "w") as f:
            f.write(hosts_file)
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", host.peer)
        _run("ip", "link", "set", host.peer, "netns", ns)
        _run("ip", "-n", ns, "link", "set", host.peer, "name", HOST_IFACE)
        _run("ip", "-n", ns, "addr", "add", f"{host.address}/{length}", "dev", HOST_IFACE)
        # lo too: a process's traffic to its own address goes through lo.
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", ns, "link", "set", HOST_IFACE, "up")
        _run("ip", "link", "set", host.veth, "master", bed.bridge)
        _run("ip", "link", "set", host.veth, "up")
    if bed.rate_mbit is not None:
        set_rate(bed, bed.rate_mbit)


def set_rate(bed: Bed, rate_mbit: float | None) -> Bed:
    """Reshapes every link of a running bed to `rate_mbit` both ways (None: unshaped); returns the bed as it is now,
    its state file rewritten."""
    if rate_mbit is not None and rate_mbit <= 0:
        raise ValueError(f"netbed rate_mbit must be > 0 (or None for unshaped links), got {rate_mbit}")
    for host in bed.hosts:
        # tbf shapes what leaves an interface: the bridge's end shapes traffic to the host, eth0 traffic from it.
        for where in ([], ["-n", host.namespace]):
            iface = HOST_IFACE if where else host.veth
            if rate_mbit is None:
                _run("tc", *where, "qdisc", "del", "dev", iface, "root", missing_ok=True)
            else:
                _run("tc", *where, "qdisc", "replace", "dev", iface, *_tbf(rate_mbit))
    bed = dataclasses.replace(bed, rate_mbit=rate_mbit)
    _write_state(bed)
    return bed


def set_cpu(bed: Bed, index: int, fraction: float | None) -> Bed:
    """Limits every process started on host `index` from now on to `fraction` of one core (None: no limit), by a
    CPU quota on the host's cgroup (made here, named after the host); returns the bed as it is now."""
    if fraction is not None and fraction <= 0:
        raise ValueError(f"netbed cpu fraction must be > 0 (or None for no limit), got {fraction}")
    host = bed.host(index)
    root, version = _cpu_root()
    cgroup = host.cpu_cgroup or os.path.join(root, host.namespace)
    os.makedirs(cgroup, exist_ok=True)
    quota_us = -1 if fraction is None else max(1000, round(fraction * CPU_PERIOD_US))
    if version == 1:
        _write(os.path.join(cgroup, "cpu.cfs_period_us"), CPU_PERIOD_US)
        _write(os.path.join(cgroup, "cpu.cfs_quota_us"), quota_us)
    else:
        _write(os.path.join(cgroup, "cpu.max"), f"{'max' if quota_us < 0 else quota_us} {CPU_PERIOD_US}")
    hosts = list(bed.hosts)
    hosts[index] = dataclasses.replace(host, cpu_cgroup=cgroup, cpu_fraction=fraction)
    bed = dataclasses.replace(bed, hosts=tuple(hosts))
    _write_state(bed)
    return bed


def _cpu_root() -> tuple[str, int]:
    """(the directory under which a host's CPU cgroup goes, the cgroup version)."""
    if os.path.exists(os.path.join(CGROUP_V1_CPU, "cpu.cfs_quota_us")):
        return CGROUP_V1_CPU, 1
    controllers = os.path.join(CGROUP_V2, "cgroup.controllers")
    if os.path.exists(controllers) and "cpu" in open(controllers).read().split():
        return CGROUP_V2, 2
    raise NetbedError(f"no cgroup cpu controller at {CGROUP_V1_CPU} (v1) or {CGROUP_V2} (v2): a host's CPU share "
                      "cannot be limited on this machine")


def _write(path: str, value) -> None:
    try:
        with open(path, "w") as f:
            f.write(f"{value}\n")
    except OSError as err:
        raise NetbedError(f"{path}: cannot write {value!r}: {err}") from None


def _write_state(bed: Bed) -> None:
    os.makedirs(STATE_DIR, exist_ok=True)
    tmp = state_path(bed.prefix) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(bed.to_json(), f, indent=1)
    os.replace(tmp, state_path(bed.prefix))


def down(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Removes everything of the bed `prefix` that exists, by its plan and then by name; returns what it
    removed. Safe to run again, and after a kill -9 at any point."""
    removed = []
    try:
        bed = load(prefix)
        namespaces = [h.namespace for h in bed.hosts]
        links = [bed.bridge, *(h.veth for h in bed.hosts), *(h.peer for h in bed.hosts)]
        cgroups = [h.cpu_cgroup for h in bed.hosts if h.cpu_cgroup]
    except NetbedError:
        namespaces, links, cgroups = [], [], []
    cgroups += [cgroup for cgroup in _cgroups(prefix) if cgroup not in cgroups]
    existing_ns = set(_namespaces())
    namespaces += sorted(ns for ns in existing_ns if ns.startswith(f"{prefix}-") and ns not in namespaces)
    links += [link for link in _links() if link.startswith(f"{prefix}-") and link not in links]
    for ns in namespaces:
        if ns in existing_ns:
            # A namespace lives on while a process is in it (a job's orphan, say), and so do its links.
            _kill_processes_in(ns)
            _run("ip", "netns", "delete", ns, missing_ok=True)
            removed.append(f"netns {ns}")
        if os.path.isdir(os.path.join(NETNS_ETC, ns)):
            shutil.rmtree(os.path.join(NETNS_ETC, ns))
    existing_links = set(_links())
    for link in links:  # deleting one end of a veth pair deletes both, and a link its qdisc
        if link in existing_links:
            _run("ip", "link", "delete", link, missing_ok=True)
            removed.append(f"link {link}")
    for cgroup in cgroups:
        if os.path.isdir(cgroup):
            _remove_cgroup(cgroup)
            removed.append(f"cgroup {cgroup}")
    if os.path.exists(state_path(prefix)):
        os.remove(state_path(prefix))
    return removed


def _remove_cgroup(cgroup: str) -> None:
    """rmdir, once every process in it (one started on the host, say, then moved out of its namespace) is gone."""
    for _ in range(100):
        with open(os.path.join(cgroup, "cgroup.procs")) as f:
            pids = [int(pid) for pid in f.read().split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.rmdir(cgroup)
            return
        except OSError:  # EBUSY until the killed processes have exited
            time.sleep(0.05)
    raise NetbedError(f"{cgroup}: still busy after its processes were killed")


def _cgroups(prefix: str) -> list[str]:
    found = []
    for root in (CGROUP_V1_CPU, CGROUP_V2):
        if os.path.isdir(root):
            found += [os.path.join(root, d) for d in sorted(os.listdir(root)) if d.startswith(f"{prefix}-")
                      and os.path.isdir(os.path.join(root, d))]
    return found


def _kill_processes_in(namespace: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in map(int, pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links() -> list[str]:
    out = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True).stdout
    return [link["ifname"] for link in json.loads(out or "[]")]


def leftovers(prefix: str) -> list[str]:
    """Every namespace, link, /etc/netns directory, CPU cgroup or state file whose name carries `prefix`: [] when the bed is gone."""
    found = [f"netns {ns}" for ns in _namespaces() if ns.startswith(f"{prefix}-")]
    found += [f"link {link}" for link in _links() if link.startswith(f"{prefix}-")]
    if os.path.isdir(NETNS_ETC):
        found += [f"{NETNS_ETC}/{d}" for d in os.listdir(NETNS_ETC) if d.startswith(f"{prefix}-")]
    found += [f"cgroup {cgroup}" for cgroup in _cgroups(prefix)]
    if os.path.exists(state_path(prefix)):
        found.append(state_path(prefix))
    return found


def qdiscs(bed: Bed) -> dict[str, str]:
    """{interface: its root qdisc's kind} for both ends of every host's link (`tc -j qdisc show`)."""
    found = {}
    for host in bed.hosts:
        for where, iface in ((["-n", host.namespace], HOST_IFACE), ([], host.veth)):
            out = subprocess.run(["tc", *where, "-j", "qdisc", "show", "dev", iface], capture_output=True,
                                 text=True).stdout
            roots = [q["kind"] for q in json.loads(out or "[]") if q.get("root")]
            found[f"{host.namespace}:{iface}" if where else iface] = roots[0] if roots else ""
    return found
