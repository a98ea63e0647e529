"""Local multi-process launcher: runs N copies of a Python command as one multi-worker job on this host.

    python -m tfscale.launch --num_workers=2 [--backend=mwms|horovod] -- -m tfscale.train \
        --config=configs/smoke.py --workdir=runs/x

Each worker is `sys.executable <args after -->` with the cluster environment its backend reads:
`TF_CONFIG` on free loopback ports for MultiWorkerMirroredStrategy (`mwms`), or the Gloo rendezvous
variables horovodrun sets for a single-host job (`horovod`, with horovodrun's rendezvous HTTP server
running inside this process). Every worker also gets `TFSCALE_LOCAL_RANK/SIZE` and thread limits, and
`-m tfscale.train` / `-m tfscale.benchmark` get `--config.distribute.backend` set to the same backend.

The launcher is a supervisor, not a trainer: it never imports TensorFlow (seconds and hundreds of MB
per launch for nothing). It prefixes worker output with `[rank r] `, forwards SIGINT/SIGTERM (Slurm
sends SIGTERM before killing a job, and the workers checkpoint on it), stops the whole job as soon as
one worker fails, and exits with the first failing worker's code. Workers run in their own sessions
so that the launcher can signal and kill each worker's whole process group, grandchildren included:
no process it started outlives it, also when the launcher itself is killed (the workers then get
SIGTERM, and tfscale's checkpoint and end within --grace_period_s: `tfscale.launch.launcher_death`). That
supervision lives in `tfscale.launch.supervise`; this module builds the workers' environment and the command line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import socket
import sys
from typing import Sequence

from absl import flags

from tfscale import cli
from tfscale.cluster import devices
from tfscale.errors import EXIT_CLUSTER_UNAVAILABLE, EXIT_USAGE, LaunchError
from tfscale.launch import netbed
from tfscale.launch.rendezvous import HorovodRendezvous
from tfscale.launch.supervise import SignalRecorder, run_workers, say

LOOPBACK = "127.0.0.1"
BACKENDS = ("mwms", "horovod")


# ----------------------------------------------------------------------------------------------
# Cluster environment


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports that are free on the loopback interface right now.

    All sockets are held open together so the kernel cannot hand out the same port twice, then
    released: the workers bind them a moment later. Another process could grab a port in between,
    so call this immediately before starting the workers.
    """
    sockets = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((LOOPBACK, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def available_cores() -> int:
    """Cores this process may run on: its affinity mask (Slurm, taskset), capped by SLURM_CPUS_PER_TASK."""
    return devices.usable_cores()


def default_threads_per_worker(num_workers: int) -> int:
    """An equal share of the cores per worker, so N workers do not oversubscribe the host."""
    return max(1, available_cores() // num_workers)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the workers run: every one on this host's loopback (the default), or worker i on host i of a
    test bed (`tfscale.launch.netbed`), at `addresses[i]`, with Gloo on `iface` and the rendezvous server
    of a Horovod job at `rendezvous_address`, an address of this host that every worker reaches."""

    addresses: tuple[str, ...] | None = None
    iface: str = "lo"
    rendezvous_address: str = LOOPBACK

    def address(self, rank: int) -> str:
        return self.addresses[rank] if self.addresses else LOOPBACK

    def one_host(self) -> bool:
        return not self.addresses

    def slots(self, num_workers: int) -> list[str]:
        """horovodrun's -H list: every worker on this host, or one on each host of the bed."""
        if self.one_host():
            return [f"{LOOPBACK}:{num_workers}"]
        return [f"{self.address(rank)}:1" for rank in range(num_workers)]


LOCAL = Placement()


def _tf_config(rank: int, ports: Sequence[int], placement: Placement = LOCAL) -> str:
    cluster = {"worker": [f"{placement.address(i)}:{port}" for i, port in enumerate(ports)]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": rank}})


def _horovod_env(rank: int, num_workers: int, rendezvous_port: int, placement: Placement = LOCAL) -> dict[str, str]:
    """What horovodrun's gloo_run sets for one slot (create_run_env_vars + create_slot_env_vars). One host:
    local == global and there is one cross group. A bed: one rank per host, so each is local rank 0 of 1,
    and the ranks make one cross group."""
    local_rank, local_size, cross_rank, cross_size = (
        (rank, num_workers, 0, 1) if placement.one_host() else (0, 1, rank, num_workers))
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": placement.rendezvous_address,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": placement.iface,
        # Must equal the host name in the rendezvous server's plan: it names the `local_<host>` scope.
        "HOROVOD_HOSTNAME": placement.address(rank),
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(num_workers),
        "HOROVOD_LOCAL_RANK": str(local_rank),
        "HOROVOD_LOCAL_SIZE": str(local_size),
        "HOROVOD_CROSS_RANK": str(cross_rank),
        "HOROVOD_CROSS_SIZE": str(cross_size),
    }


def _thread_env(threads: int) -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": str(threads),
        "TF_NUM_INTRAOP_THREADS": str(threads),
        "TF_NUM_INTEROP_THREADS": str(threads),
    }


def worker_env(
    rank: int,
    num_workers: int,
    ports_or_rendezvous: Sequence[int] | int,
    backend: str,
    threads: int | None,
    placement: Placement = LOCAL,
) -> dict[str, str]:
    """The variables the launcher sets for worker `rank` (on top of the inherited environment).

    `ports_or_rendezvous`: for `mwms` the list of `num_workers` worker ports; for `horovod` the
    rendezvous server's port. `threads=None` leaves the thread variables alone.
    """
    if backend == "mwms":
        ports = list(ports_or_rendezvous) if not isinstance(ports_or_rendezvous, int) else []
        if len(ports) != num_workers:
            raise ValueError(f"backend mwms needs {num_workers} worker ports, got {ports_or_rendezvous!r}")
        env = {"TF_CONFIG": _tf_config(rank, ports, placement)}
    elif backend == "horovod":
        if not isinstance(ports_or_rendezvous, int):
            raise ValueError(f"backend horovod needs the rendezvous port, got {ports_or_rendezvous!r}")
        env = _horovod_env(rank, num_workers, ports_or_rendezvous, placement)
    else:
        raise ValueError(f"backend={backend!r} is not one of: {', '.join(BACKENDS)}")
    env["TFSCALE_LOCAL_RANK"] = str(rank)
    env["TFSCALE_LOCAL_SIZE"] = str(num_workers)
    if threads is not None:
        env.update(_thread_env(threads))
    # Python block-buffers stdout into a pipe: lines would reach the launcher late, and be lost
    # entirely if the worker is killed. horovodrun sets this for the same reason.
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _child_env(base: dict[str, str], overrides: dict[str, str], backend: str) -> dict[str, str]:
    env = dict(base)
    if backend != "mwms":
        # An inherited TF_CONFIG (e.g. from an outer launcher) would describe some other cluster.
        env.pop("TF_CONFIG", None)
    env.update(overrides)
    return env


# What MWMS workers open, said once at start-up where someone else could reach it (docs/security.md).
MWMS_REACHABLE = ("note: each MWMS worker's TensorFlow server listens on every interface of this host for the whole run "
                  "(TensorFlow binds 0.0.0.0 and has no authentication: whoever reaches its port can run TensorFlow "
                  "graphs as you); on a shared node, --backend=horovod keeps every port on loopback (docs/security.md)")


def has_other_interfaces() -> bool:
    """True when this host has a network interface besides loopback: someone else could reach its ports."""
    return any(name != "lo" for _, name in socket.if_nameindex())


# ----------------------------------------------------------------------------------------------
# The job


# Programs whose config has `distribute.backend`: the launcher sets it to match the environment it builds.
_TFSCALE_PROGRAMS = ("tfscale.train", "tfscale.benchmark")


def with_backend(argv: list[str], backend: str) -> list[str]:
    """`argv` with `--config.distribute.backend=BACKEND` added for tfscale's own programs.

    The launcher's --backend decides the environment (TF_CONFIG or a Gloo rendezvous), so the config
    must say the same; an explicit override that contradicts it is an error, not a silent winner.
    """
    if not (len(argv) >= 2 and argv[0] == "-m" and argv[1] in _TFSCALE_PROGRAMS):
        return list(argv)
    prefix = "--config.distribute.backend="
    given = [arg[len(prefix):] for arg in argv if arg.startswith(prefix)]
    if given and given[-1] != backend:
        raise ValueError(
            f"--backend={backend} but the worker command says {prefix}{given[-1]}: drop the override "
            f"(the launcher sets it) or launch with --backend={given[-1]}"
        )
    return list(argv) if given else [*argv, prefix + backend]


def launch(
    argv: list[str],
    *,
    num_workers: int,
    backend: str = "mwms",
    threads_per_worker: int | None = None,
    grace_period_s: float = 10.0,
    env: dict | None = None,
    netbed_prefix: str | None = None,
) -> int:
    """Runs `sys.executable *argv` as `num_workers` workers of one job; returns the job's exit code.

    `threads_per_worker=None` gives each worker an equal share of the cores. `env` is the environment
    to inherit (default: this process's). `netbed_prefix`: worker i runs on host i of that test bed
    (`tfscale.launch.netbed`) instead of this host. Raises ValueError for bad arguments and LaunchError
    when the backend cannot start (e.g. horovod not installed, no such bed); otherwise the exit code is 0 if
    every worker exited 0, else the first failing worker's code (128 + S for a worker killed by signal S).
    """
    _check_launch_args(argv, num_workers, backend, threads_per_worker)
    bed = _load_bed(netbed_prefix, num_workers) if netbed_prefix else None
    placement = _bed_placement(bed, num_workers) if bed else LOCAL
    threads = threads_per_worker or default_threads_per_worker(num_workers)
    argv = with_backend(argv, backend)
    base_env = dict(os.environ if env is None else env)
    # Resolved now, not at import: callers (and pytest's capture) may have replaced the streams.
    out, err = sys.stdout, sys.stderr

    rendezvous = HorovodRendezvous(num_workers, placement.rendezvous_address, placement.slots(num_workers)) \
        if backend == "horovod" else None
    # The recorder stays installed through the clean-up too: a SIGTERM arriving then must not kill
    # the launcher before it has killed the workers.
    with SignalRecorder() as signals:
        try:
            # Ports last, right before the workers start, to keep the window for port theft small.
            endpoint = rendezvous.port if rendezvous else free_ports(num_workers)
            where = f" on hosts {', '.join(placement.addresses)} of netbed {bed.prefix}" if bed else ""
            say(f"starting {num_workers} worker(s){where}, backend {backend}, {threads} thread(s) each: "
                f"{shlex.join([sys.executable, *argv])}")
            if backend == "mwms" and has_other_interfaces():
                say(MWMS_REACHABLE)
            envs = [_child_env(base_env, worker_env(rank, num_workers, endpoint, backend, threads, placement), backend)
                    for rank in range(num_workers)]
            commands = [[sys.executable, *argv] for _ in range(num_workers)]
            if bed:
                commands = [bed.host_command(rank, command) for rank, command in enumerate(commands)]
            code = run_workers(commands, envs, grace_period_s, signals, out, err)
            if code == EXIT_CLUSTER_UNAVAILABLE:
                say(f"exit code {code} (EX_UNAVAILABLE): a worker was not there. Either the cluster did not come up "
                    "(the workers' 'tfscale pre-flight:' lines above name the workers, ports or host names at fault) "
                    "or a worker stopped answering mid-run (the line above names it and where to resume)")
            return code
        finally:
            if rendezvous:
                rendezvous.stop()


def _load_bed(prefix: str, num_workers: int) -> netbed.Bed:
    try:
        bed = netbed.load(prefix)
    except netbed.NetbedError as err:
        raise LaunchError(str(err)) from None
    if num_workers > len(bed.hosts):
        raise ValueError(f"--num_workers={num_workers} but netbed {prefix!r} has {len(bed.hosts)} hosts: one worker "
                         "per host")
    return bed


def _bed_placement(bed: netbed.Bed, num_workers: int) -> Placement:
    return Placement(addresses=tuple(host.address for host in bed.hosts[:num_workers]), iface=netbed.HOST_IFACE,
                     rendezvous_address=bed.bridge_address)


def _check_launch_args(argv: list[str], num_workers: int, backend: str, threads_per_worker: int | None) -> None:
    """Raises ValueError for `launch` arguments that cannot make a job."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if not argv:
        raise ValueError("nothing to run: give the worker's Python arguments")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of: {', '.join(BACKENDS)}")
    if threads_per_worker is not None and threads_per_worker < 1:
        raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")


# ----------------------------------------------------------------------------------------------
# Command line


USAGE = ("python -m tfscale.launch --num_workers=N [--backend=mwms|horovod] [--threads_per_worker=K] "
         "[--grace_period_s=10] [--netbed=PREFIX] -- <python args...>")


def _define_flags(values: flags.FlagValues) -> None:
    flags.DEFINE_integer("num_workers", None, "worker processes to start (>= 1)", flag_values=values, required=True)
    flags.DEFINE_enum("backend", "mwms", BACKENDS,
                      "mwms: TF_CONFIG for MultiWorkerMirroredStrategy; horovod: Gloo rendezvous", flag_values=values)
    flags.DEFINE_integer("threads_per_worker", None, "OMP/TF thread pool size per worker (default: cores // "
                         "num_workers, >= 1)", flag_values=values)
    flags.DEFINE_float("grace_period_s", 10.0, "seconds workers get to exit after SIGTERM before SIGKILL",
                       flag_values=values)
    flags.DEFINE_string("netbed", None, "run worker i on host i of the test bed with this prefix (tools/netbed.py "
                        "up), one worker per host, instead of all on this host", flag_values=values)


def _parse(argv: Sequence[str]) -> tuple[flags.FlagValues, list[str]]:
    """Launcher flags before `--`, the worker's Python arguments after it (never parsed here)."""
    args, command = cli.split_command(argv, _define_flags, command_hint="-m tfscale.train ...")
    if args.num_workers < 1:
        raise cli.UsageError(f"--num_workers must be >= 1, got {args.num_workers}")
    if args.threads_per_worker is not None and args.threads_per_worker < 1:
        raise cli.UsageError(f"--threads_per_worker must be >= 1, got {args.threads_per_worker}")
    if args.grace_period_s < 0:
        raise cli.UsageError(f"--grace_period_s must be >= 0, got {args.grace_period_s:g}")
    return args, command


def main(argv: Sequence[str]) -> int:
    """The command line without the program name; returns the exit code (2 for usage errors)."""
    if argv and argv[0] in ("--help", "-h", "--helpfull"):
        values = flags.FlagValues()
        _define_flags(values)
        print(cli.usage_text(USAGE, values, __name__) + "\nRuns N local workers of one multi-worker job: "
              "sys.executable <python args...>.")
        return 0
    try:
        args, command = _parse(argv)
    except cli.UsageError as err:
        print(f"usage: {USAGE}\nerror: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return launch(
            command,
            num_workers=args.num_workers,
            backend=args.backend,
            threads_per_worker=args.threads_per_worker,
            grace_period_s=args.grace_period_s,
            netbed_prefix=args.netbed,
        )
    except LaunchError as err:
        say(f"error: {err}")
        return 1
    except ValueError as err:  # arguments that contradict each other; nothing was started
        say(f"error: {err}")
        return EXIT_USAGE


def run() -> None:
    """Console script `tfscale-launch`."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    run()
