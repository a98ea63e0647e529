"""The heartbeat that ends a job whose peer stopped answering (tfscale.cluster.heartbeat), in one process.

Two monitors, rank 0 and rank 1, over a real TCP connection on 127.0.0.1; a rank that "hangs" is one
whose heartbeat threads never run, as under SIGSTOP. The whole path with real workers, SIGSTOP and both
backends is tests/test_reliability.py::test_a_hung_peer_ends_the_job_in_bounded_time_with_one_line_and_the_rerun_resumes.
"""

import queue
import socket
import time

import pytest
import tensorflow as tf

from tfscale.cluster import heartbeat

TIMEOUT_S, INTERVAL_S = 0.6, 0.1


@pytest.fixture
def connected():
    """(rank 0's socket to rank 1, rank 1's socket to rank 0)."""
    listener = socket.create_server(("127.0.0.1", 0))
    to_rank0 = socket.create_connection(listener.getsockname())
    to_rank1, _ = listener.accept()
    listener.close()
    yield to_rank1, to_rank0
    to_rank1.close()
    to_rank0.close()


def monitor(rank, peer, connection):
    ended = queue.Queue()
    return heartbeat.Monitor(rank, {peer: connection}, TIMEOUT_S, INTERVAL_S, end=ended.put), ended


def test_a_silent_peer_ends_rank_0_naming_it_and_rank_0_tells_the_others(connected):
    to_rank1, to_rank0 = connected
    rank0, rank0_ended = monitor(0, 1, to_rank1)
    rank1, rank1_ended = monitor(1, 0, to_rank0)
    started = time.monotonic()
    rank0.start()
    line = rank0_ended.get(timeout=10)  # rank 1 never beats: it hangs
    assert TIMEOUT_S - 0.05 <= time.monotonic() - started < TIMEOUT_S + 2  # the socket's timeout, to its clock
    assert line.startswith(f"worker 1 stopped answering: no heartbeat for distribute.heartbeat_timeout_s={TIMEOUT_S:g} s")
    rank1.start()  # what rank 0 sent before it ended reaches rank 1, which ends with the same verdict
    told = rank1_ended.get(timeout=10)
    assert told.startswith("worker 1 stopped answering") and told.endswith("(found by worker 0)"), told


def test_beating_peers_run_on_and_a_goodbye_ends_the_watch(connected):
    to_rank1, to_rank0 = connected
    rank0, rank0_ended = monitor(0, 1, to_rank1)
    rank1, rank1_ended = monitor(1, 0, to_rank0)
    rank0.start()
    rank1.start()
    time.sleep(3 * TIMEOUT_S)  # both beat: nobody ends
    assert rank0_ended.empty() and rank1_ended.empty()
    rank1.say_goodbye()  # rank 1 finished its run: rank 0 stops watching it, and is not ended by its silence
    time.sleep(3 * TIMEOUT_S)
    assert rank0_ended.empty() and rank1_ended.empty()


def test_tensorflows_unhealthy_task_error_becomes_the_one_line():
    heartbeat.describe_resume_with(lambda: "The last checkpoint is step 40 (runs/x/checkpoints/ckpt-40): rerun.")
    message = ("Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks are unhealthy "
               "(stopped sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have crashed.")
    line = heartbeat.lost_peer_line(tf.errors.UnavailableError(None, None, message), 60)
    assert line == ("worker 1 stopped answering: no heartbeat for distribute.heartbeat_timeout_s=60 s (a hung or "
                    "unreachable node, or a stopped process); the job ends. The last checkpoint is step 40 "
                    "(runs/x/checkpoints/ckpt-40): rerun.")
    assert heartbeat.lost_peer_line(tf.errors.UnavailableError(None, None, "Socket closed"), 60) is None
    silent_service = ("Collective ops is aborted by: Deadline Exceeded\n\nRPC: /tensorflow.CoordinationService/Heartbeat\n"
                      "The error could be from a previous operation. Restart your program to reset.")
    assert heartbeat.lost_peer_line(tf.errors.DeadlineExceededError(None, None, silent_service), 60).startswith(
        "worker 0 (it hosts TensorFlow's coordination service) stopped answering: no heartbeat for")
