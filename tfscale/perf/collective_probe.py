"""One all-reduce through tfscale's own start-up path, in a process of its own (tfscale-doctor starts it).

    python -m tfscale.perf.collective_probe mwms [AUTO|NCCL|RING] [BYTES CALLS]   a MultiWorkerMirroredStrategy
                                                      worker of TF_CONFIG, or of the Slurm step it runs in (one
                                                      per task); with BYTES, it also times CALLS chained
                                                      all-reduces of BYTES through training's own call
    python -m tfscale.perf.collective_probe horovod   hvd.init() as training does, then training's gradient
                                                      reduction (a grouped Average of 2 tensors)

`distribute.setup` makes the decisions training makes (the GPU of this local rank, NCCL for AUTO, the
connection time-out, the pre-flight all-reduce); then every worker all-reduces its rank + 1, on its GPU
where it has one, and checks the result. The last line of stdout is JSON: {"ok", "detail", "implementation"
(what the live strategy runs its all-reduces with)}. Anything that
fails (a port in use, a worker that does not answer, a CUDA call the driver refuses) ends the process
with its message on stderr, which the doctor reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import NamedTuple

import tensorflow as tf

from tfscale import config as tfs_config
from tfscale import errors
from tfscale.cluster import distribute, horovod_start
from tfscale.launch import launch
from tfscale.perf import allreduce_bench

CONNECT_TIMEOUT_S = 60.0  # the doctor's peers start together: a minute is plenty, and a FAIL comes quickly
PROBE_TIMEOUT_S = 240.0  # a probe process still running after this is killed and named
PEER_GRACE_S = 10.0  # after one probe fails, the others get this long to report before they are stopped
# Where a launcher says how many ranks it started (horovod_start): a lone Horovod probe inside a Slurm step of
# several tasks must not read the step's task count as its own.
_LAUNCHER_KEYS = (*horovod_start.LAUNCHER_SIZE_KEYS, "HOROVOD_RANK", "HOROVOD_LOCAL_RANK",
                  "HOROVOD_GLOO_RENDEZVOUS_ADDR", "PMIX_RANK", "TF_CONFIG")


def _expected(size: int) -> float:
    return size * (size + 1) / 2  # ranks 0..size-1 each contribute rank + 1


def mwms_all_reduce(cluster) -> tuple[list[float], list[float], str, str]:
    """(got, expected, device, implementation): the sum of rank + 1 over the workers, the device it was reduced
    on, and the implementation the live strategy hands its collectives: the communication hint of every
    all-reduce it runs (tensorflow/python/distribute/collective_all_reduce_strategy.py: _communication_options,
    passed as `communication_hint=options.implementation.value` in cross_device_utils.py, TF 2.21)."""
    strategy = cluster.strategy

    @tf.function(autograph=False)
    def reduce():
        def replica():
            value = tf.fill([1024], tf.cast(cluster.rank + 1, tf.float32))
            return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value)
        return strategy.experimental_local_results(strategy.run(replica))

    (result,) = reduce()
    options = getattr(strategy.extended, "_communication_options", None)
    implementation = options.implementation.name if options is not None else "unknown"
    return [float(result[0])], [_expected(cluster.size)], result.device, implementation


def horovod_all_reduce(cluster) -> tuple[list[float], list[float], str, str]:
    """(got, expected, device, implementation) of training's own gradient reduction (`Cluster.reduce_gradients`:
    a grouped Average, through Horovod's fusion buffer and, on a GPU, its scaling kernels) of two tensors."""
    device = "/gpu:0" if tf.config.list_logical_devices("GPU") else "/cpu:0"
    with tf.device(device):
        grads = [tf.fill([1024], tf.cast(cluster.rank + 1, tf.float32)),
                 tf.fill([3, 333], tf.cast(2 * (cluster.rank + 1), tf.float32))]
        reduced = cluster.reduce_gradients(grads)
    mean = _expected(cluster.size) / cluster.size
    got = [float(tf.reshape(value, [-1])[0]) for value in reduced]
    return got, [mean, 2 * mean], reduced[0].device, cluster.all_reduce


# --- the doctor's side: starting probes and reading their verdicts -----------------------------------------


class ProbeResult(NamedTuple):
    ok: bool
    detail: str
    implementation: str  # what the live strategy ran its all-reduces with ("" when the probe reported none)
    seconds_per_all_reduce: float  # of the timed all-reduces (0 when none were asked for)


def _report(stdout: str) -> dict:
    """The probe's JSON line (its last one); {} when it printed none."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def _verdict(process: subprocess.Popen, stdout: str, stderr: str) -> tuple[bool, str]:
    report = _report(stdout)
    if report:
        return bool(report["ok"]), report["detail"]
    code = process.returncode
    how = f"killed by signal {-code}" if code and code < 0 else f"exited with {code}"
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    # tfscale's own error line (absl's "ERROR:absl:..."), else whatever came last (an abort's message).
    errors_said = [line for line in lines if line.startswith(("ERROR:", "FATAL", "terminate called", "what():"))]
    said = (errors_said or lines or ["(nothing on stderr)"])[-1].removeprefix("ERROR:absl:")
    return False, f"the probe process {how}: {said[:600]}"


def run_probes(envs: list[dict], backend: str, collective_impl: str = "AUTO",
               timed: tuple[int, int] = (0, 0)) -> list[ProbeResult]:
    """Starts one probe per environment, together; each one's result. `timed` (bytes, calls): the MWMS workers
    also time that many chained all-reduces of that size. Once one fails, the others (which would wait for it
    until their connect time-out) get PEER_GRACE_S, then are stopped."""
    command = [sys.executable, "-m", "tfscale.perf.collective_probe", backend, collective_impl]
    if timed[0]:
        command += [str(timed[0]), str(timed[1])]
    processes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for env in envs]
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in processes):
            deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
        time.sleep(0.2)
    results = []
    for p in processes:
        stopped = p.poll() is None
        if stopped:
            p.kill()
        stdout, stderr = p.communicate()
        ok, detail = _verdict(p, stdout, stderr)
        report = _report(stdout)
        results.append(ProbeResult(ok, "stopped: a peer failed first, or no answer within the time-out" if stopped
                                   else detail, report.get("implementation", ""),
                                   float(report.get("seconds_per_all_reduce", 0.0))))
    return results


def local_mwms_envs(num_gpus: int, port_base: int = 0, num_workers: int = 2) -> list[dict]:
    """`num_workers` MWMS workers on 127.0.0.1, one GPU each (local ranks 0, 1, ...), as training runs one
    process per GPU. One GPU cannot serve two NCCL ranks: then they all run on the CPU."""
    ports = list(range(port_base, port_base + num_workers)) if port_base else launch.free_ports(num_workers)
    workers = [f"127.0.0.1:{port}" for port in ports]
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_KEYS}
    base.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    envs = []
    for rank in range(num_workers):
        env = {**base, "TFSCALE_LOCAL_RANK": str(rank),
               "TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})}
        if num_gpus == 1:
            env["CUDA_VISIBLE_DEVICES"] = "-1"
        envs.append(env)
    return envs


def horovod_env() -> dict:
    """A lone Horovod rank (size 1, Gloo controller): its all-reduce still runs the whole op path, NCCL and CUDA
    included. Without the MPI/PMIx variables of a Slurm step, which would make MPI_Init join the step's world."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_KEYS and not k.startswith(("PMIX_", "PMI_", "OMPI_"))}
    return {**env, "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}


def in_multi_task_step(env: dict | None = None) -> int:
    """The number of tasks of the Slurm step this process is one of, when several (DOCTOR=all: one per node)."""
    env = os.environ if env is None else env
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    return int(tasks) if tasks.isdigit() and int(tasks) > 1 and "SLURM_PROCID" in env else 0


# --- the probe process ---------------------------------------------------------------------------------------


def probe(backend: str, collective_impl: str = "AUTO", message_bytes: str = "0", num_calls: str = "0") -> dict:
    cfg = tfs_config.base_config()
    cfg.distribute.backend = backend
    cfg.distribute.collective_impl = collective_impl
    cfg.distribute.connect_timeout_s = CONNECT_TIMEOUT_S
    start = time.perf_counter()
    cluster = distribute.setup(cfg.distribute)
    got, expected, device, implementation = (mwms_all_reduce if backend == "mwms" else horovod_all_reduce)(cluster)
    how = f"{cluster.size} workers all-reduced with {cluster.all_reduce}" if backend == "mwms" else \
        f"training's grouped Average of 2 tensors after hvd.init() ({cluster.size} rank)"
    what = "sum" if backend == "mwms" else "means"
    detail = (f"{how} on {device.split('device:')[-1]}: {what} {', '.join(f'{g:g}' for g in got)}, expected "
              f"{', '.join(f'{e:g}' for e in expected)} ({time.perf_counter() - start:.1f} s from start)")
    result = {"ok": got == expected, "rank": cluster.rank, "implementation": implementation}
    if backend == "mwms":
        detail += f"; the strategy's collectives ran with communication hint {implementation}"
        if int(message_bytes):
            result["seconds_per_all_reduce"] = allreduce_bench.chained_seconds(cluster, int(message_bytes),
                                                                               int(num_calls))
    return {**result, "detail": detail}


def main(argv: list[str]) -> int:
    try:
        result = probe(*argv)
    except Exception as err:  # noqa: BLE001 - the doctor reports the message; a crash below Python aborts anyway
        result = {"ok": False, "detail": f"{type(err).__name__}: {errors.one_line(err)[:600]}"}
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
