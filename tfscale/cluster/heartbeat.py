"""A peer that stops answering ends the job within `distribute.heartbeat_timeout_s`, with one line.

A dead peer is noticed at once on every backend: its TCP connections reset and the next collective fails.
A hung one (a node stalled in the kernel, a process stopped, a link dropped without a reset) keeps its
connections open, and the others wait in their collective:
  * MWMS: TensorFlow's coordination service declares a task unhealthy after the heartbeat timeout that
    `connect.py` sets, and aborts the collectives with an UnavailableError naming the task; when worker 0,
    which hosts the service, hangs, the others' heartbeats to it time out (DeadlineExceededError).
    `lost_peer_line` turns either error into tfscale's one line.
  * Horovod has no such service. Gloo's collectives give up after HOROVOD_GLOO_TIMEOUT_SECONDS, but Gloo
    takes the rendezvous timeout from the same variable (horovod/common/gloo/gloo_context.cc:
    `GetTimeoutFromEnv()` feeds both `Rendezvous` and every context's `setTimeout`), which must allow for
    slow starts (`distribute.connect_timeout_s`); MPI's collectives never give up. So tfscale beats a
    heart of its own (`start`): rank 0 listens, every other rank connects to it (the address broadcast
    over Horovod at start-up), and both ends send a byte every few seconds. An end that hears nothing for
    the timeout logs one line naming the rank, the seconds and where to resume, and ends its process with
    exit code 69 (EX_UNAVAILABLE): its main thread may be waiting inside a collective that will never
    return, so it cannot raise there. Rank 0 tells the others which rank it lost before it ends; they end
    with the same line. A peer that ends (normally, with a goodbye, or by dying) is no longer watched.
"""

from __future__ import annotations

import atexit
import logging as std_logging
import os
import re
import socket
import threading
import time
from typing import Callable

from absl import logging

from tfscale import errors

_BEAT, _BYE, _LOST = b".", b"B", b"L"
_MAX_INTERVAL_S = 5.0  # a beat at least this often, and a fifth of the timeout when that is shorter

_describe_resume: Callable[[], str] = lambda: "rerun the same command to resume from the workdir's last checkpoint"


def describe_resume_with(describe: Callable[[], str]) -> None:
    """Where the run can resume, said in the line a lost peer ends the job with (training sets it)."""
    global _describe_resume
    _describe_resume = describe


def lost_peer_message(who: str, timeout_s: float) -> str:
    """The line a job ends with when `who` stopped answering."""
    return (f"{who} stopped answering: no heartbeat for distribute.heartbeat_timeout_s={timeout_s:g} s (a hung or "
            f"unreachable node, or a stopped process); the job ends. {_describe_resume()}")


# --- MWMS: TensorFlow's coordination service ----------------------------------------------------------------------

_UNHEALTHY = re.compile(r"unhealthy \(stopped sending heartbeats\):\s*((?:/job:\S+\s*)+)")


# The coordination service runs in worker 0: when that worker hangs, the others' heartbeats to it time out.
_SERVICE_SILENT = re.compile(r"Deadline Exceeded\s+RPC: /tensorflow\.CoordinationService/Heartbeat")


def lost_peer_line(err: BaseException, timeout_s: float) -> str | None:
    """The one line for a collective TensorFlow aborted because a task stopped answering, else None: the
    service names the tasks that stopped sending heartbeats, or worker 0, which hosts the service, is silent."""
    message = str(getattr(err, "message", err))
    found = _UNHEALTHY.search(message)
    if found:
        tasks = sorted({int(m) for m in re.findall(r"/task:(\d+)", found.group(1))})
        return lost_peer_message(" and ".join(f"worker {task}" for task in tasks) or "a worker", timeout_s)
    if _SERVICE_SILENT.search(message):
        return lost_peer_message("worker 0 (it hosts TensorFlow's coordination service)", timeout_s)
    return None


# --- Horovod: tfscale's heartbeat -----------------------------------------------------------------------------------


def start(hvd, timeout_s: float) -> None:
    """Starts this rank's heartbeat (a collective: every rank calls it after `hvd.init`); nothing on one rank."""
    if hvd.size() == 1:
        return
    interval_s = min(_MAX_INTERVAL_S, timeout_s / 5)
    one_host = hvd.size() == hvd.local_size()
    listener, address = None, None
    if hvd.rank() == 0:
        # One host: loopback only. Several: every interface, as Horovod's own Gloo and MPI ports.
        listener = socket.create_server(("127.0.0.1" if one_host else "", 0), backlog=hvd.size())
        address = ("127.0.0.1" if one_host else socket.gethostname(), listener.getsockname()[1])
    address = hvd.broadcast_object(address, root_rank=0, name="tfscale_heartbeat_address")
    peers: dict[int, socket.socket] = {}
    if listener is not None:
        listener.settimeout(timeout_s)  # every rank connects right after the broadcast
        while len(peers) < hvd.size() - 1:
            connection, _ = listener.accept()
            rank = _read_rank(connection)
            if rank is None or rank in peers or not 0 < rank < hvd.size():
                connection.close()  # not one of this job's ranks
                continue
            peers[rank] = connection
        listener.close()
    else:
        connection = socket.create_connection(address, timeout=timeout_s)
        connection.sendall(f"{hvd.rank():<16d}".encode())
        peers[0] = connection
    monitor = Monitor(hvd.rank(), peers, timeout_s, interval_s)
    atexit.register(monitor.say_goodbye)
    monitor.start()
    logging.info("heartbeat: %s every %.1f s; a peer silent for %g s ends the job (distribute.heartbeat_timeout_s)",
                 "rank 0 and every other rank" if hvd.rank() == 0 else "this rank and rank 0", interval_s, timeout_s)


def _read_rank(connection: socket.socket) -> int | None:
    """The rank a new connection announces (16 bytes), or None for anything else."""
    connection.settimeout(_MAX_INTERVAL_S)
    data = b""
    try:
        while len(data) < 16:
            chunk = connection.recv(16 - len(data))
            if not chunk:
                return None
            data += chunk
        return int(data.decode())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _exit_with(line: str) -> None:
    """Ends this process with `line` and exit code 69, whatever its main thread is waiting for."""
    logging.error("%s (exit code %d)", line, errors.EXIT_CLUSTER_UNAVAILABLE)
    for handler in std_logging.getLogger().handlers + logging.get_absl_logger().handlers:
        handler.flush()
    os._exit(errors.EXIT_CLUSTER_UNAVAILABLE)


class Monitor:
    """One rank's heartbeat connections: to every other rank (rank 0) or to rank 0 (the others).

    `end(line)` is called once, from a heartbeat thread, when a peer stopped answering.
    """

    def __init__(self, rank: int, peers: dict[int, socket.socket], timeout_s: float, interval_s: float,
                 end: Callable[[str], None] = _exit_with):
        self.rank, self.peers, self.timeout_s, self.interval_s, self._end_with = rank, peers, timeout_s, interval_s, end
        self._lock = threading.Lock()
        self._finished: set[int] = set()  # peers that said goodbye
        self._leaving = False

    def start(self) -> None:
        for rank in self.peers:
            threading.Thread(target=self.watch, args=(rank,), name=f"tfscale-heartbeat-{rank}", daemon=True).start()
        threading.Thread(target=self.beat, name="tfscale-heartbeat", daemon=True).start()

    def beat(self) -> None:
        while not self._leaving:
            self._send_all(_BEAT)
            time.sleep(self.interval_s)

    def watch(self, rank: int) -> None:
        connection = self.peers[rank]
        connection.settimeout(self.timeout_s)
        while True:
            try:
                data = connection.recv(64)
            except socket.timeout:
                return self._lost(rank)
            except OSError:
                data = b""
            if self._leaving:
                return
            if _BYE in data:
                with self._lock:
                    self._finished.add(rank)
                return
            if _LOST in data:  # rank 0 lost another rank and is ending the job
                lost = data[data.index(_LOST) + 1:].split(b"\n")[0].decode()
                return self._end(lost_peer_message(f"worker {lost}", self.timeout_s) + " (found by worker 0)")
            if not data:  # it ended: its Horovod connections reset too, and the collective fails by itself
                return

    def _lost(self, rank: int) -> None:
        if self._leaving:
            return
        if self.rank == 0:
            self._send_all(_LOST + str(rank).encode() + b"\n")
        self._end(lost_peer_message(f"worker {rank}", self.timeout_s))

    def _end(self, line: str) -> None:
        with self._lock:
            if self._leaving:
                return
            self._leaving = True
        self._end_with(line)

    def _send_all(self, message: bytes) -> None:
        with self._lock:
            targets = [c for r, c in self.peers.items() if r not in self._finished]
        for connection in targets:
            try:
                connection.sendall(message)
            except OSError:
                pass  # its watcher finds out

    def say_goodbye(self) -> None:
        """At a normal end of this process: the peers stop watching it."""
        if self._leaving:
            return
        self._leaving = True
        self._send_all(_BYE)
