#!/usr/bin/env python3
"""Where a step's time goes: medians per step from a TensorFlow profiler trace, or from Horovod's timeline;
and whether the gradients' all-reduce overlapped the backward pass (with `distribute.pack_bytes` buckets).

    python tools/step_timeline.py WORKDIR [--step_event=batch_step]   # a run with --config.profile_steps=A,B
    python tools/step_timeline.py --horovod_timeline=FILE             # a run started with HOROVOD_TIMELINE=FILE

The profiler trace (the chief's, under WORKDIR/tensorboard/plugins/profile/) gives, for each profiled
step (an execution of the tf.function named `--step_event`: the benchmark's `batch_step`, a training
run's `train_loop`): its wall time, the time TensorFlow's compute threads were busy (the union of their
op executions), the rest (those threads idle: waiting on a collective or on the host), and each
collective op by name (MultiWorkerMirroredStrategy's CollectiveReduceV2; the gradients' all-reduce
runs under the name scope `gradient_all_reduce/`). Horovod runs its collectives on a thread of its
own that the trace does not show; its timeline does: per tensor group, NEGOTIATE_ALLREDUCE (from this
rank submitting it to every rank having submitted it: the wait for the slowest rank) and ALLREDUCE
(the transfer itself). docs/benchmarking.md reads both for 1 vs 2 loopback workers.

On a GPU the host's events of the backward pass are kernel launches, which say when each op was queued, not
when it ran. When the trace has device planes (`/device:GPU:N`, CUPTI's kernels on their streams, each tagged
with the TensorFlow op that launched it in its `tf_op` stat), the overlap is read from them instead: the
backward pass ends with the last kernel of a `gradient_tape/` op, the gradients' all-reduce starts with the
first kernel of a `gradient_all_reduce/` op or the first NCCL kernel (`nccl...`: Horovod's and MWMS's NCCL
run outside TensorFlow's ops). `overlap_source` says which was read.
"""

import collections
import glob
import json
import os
import re
import statistics
import sys

from absl import app, flags

from tfscale import compat
from tfscale.workdir import layout

_STEP_EVENT = flags.DEFINE_string("step_event", "batch_step", "Name of the tf.function whose executions are steps.")
_HOROVOD_TIMELINE = flags.DEFINE_string("horovod_timeline", None, "A Horovod timeline (HOROVOD_TIMELINE) to summarise.")


def _union_ps(intervals) -> int:
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total, end = total + stop - start, stop
        elif stop > end:
            total, end = total + stop - end, stop
    return total


def load_trace(workdir: str):
    """The XSpace of the newest profiler trace under `workdir`."""
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2  # TensorFlow's own trace format
    except ImportError:
        sys.exit(f"step_timeline: {compat.hook_note('tensorflow', 'tensorflow.tsl.profiler.protobuf.xplane_pb2')}")

    traces = sorted(glob.glob(os.path.join(workdir, layout.TENSORBOARD, "plugins", "profile", "*", "*.xplane.pb")))
    if not traces:
        sys.exit(f"step_timeline: no profiler trace under {workdir}/tensorboard/plugins/profile "
                 "(run with --config.profile_steps=START,END)")
    space = xplane_pb2.XSpace()
    with open(traces[-1], "rb") as f:
        space.ParseFromString(f.read())
    return space


def _plane_events(plane):
    """(line name, event name, start ps, end ps, event) of every event of an XPlane."""
    names = {key: meta.name for key, meta in plane.event_metadata.items()}
    for line in plane.lines:
        origin_ps = line.timestamp_ns * 1000
        for event in line.events:
            start = origin_ps + event.offset_ps
            yield line.name, names.get(event.metadata_id, "?"), start, start + event.duration_ps, event


def host_events(space) -> list[tuple[str, str, int, int]]:
    """(thread, event name, start ps, end ps) of the trace's host plane."""
    plane = next(p for p in space.planes if p.name == "/host:CPU")
    return [(line, name, start, end) for line, name, start, end, _ in _plane_events(plane)]


def device_events(space) -> list[tuple[str, str, str, int, int]]:
    """(stream, kernel name, TensorFlow op that launched it or "", start ps, end ps) of every GPU plane."""
    events = []
    for plane in space.planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        stat_names = {key: meta.name for key, meta in plane.stat_metadata.items()}
        for line, name, start, end, event in _plane_events(plane):
            tf_op = ""
            for stat in event.stats:
                if stat_names.get(stat.metadata_id) == "tf_op":
                    # A string stat, or a reference to a stat metadata entry whose name is the string.
                    tf_op = stat.str_value or stat_names.get(stat.ref_value, "")
            events.append((f"{plane.name}/{line}", name, tf_op, start, end))
    return events


def _device_overlap_ms(device, step_start: int, step_end: int) -> dict:
    """`_overlap_ms` from the kernels that ran on the GPUs within the step (empty without such kernels)."""
    inside = [(name, tf_op, start, end) for _, name, tf_op, start, end in device if step_start <= start < step_end]
    backward = [end for _, tf_op, _, end in inside if tf_op.startswith("gradient_tape/")]
    reduces = [start for name, tf_op, start, _ in inside
               if tf_op.startswith("gradient_all_reduce/") or name.lower().startswith("nccl")]
    if not backward or not reduces:
        return {}
    backward_end, first_reduce = (max(backward) - step_start) / 1e9, (min(reduces) - step_start) / 1e9
    return {"backward_end": backward_end, "first_gradient_all_reduce": first_reduce,
            "overlap": backward_end - first_reduce, "overlap_source": "device"}


def step_breakdown(events, step_event: str, device=()) -> dict:
    """Median ms per step of wall, compute busy and compute idle; each collective op's mean ms and calls per step;
    the overlap from the GPUs' kernels (`device`: `device_events`) where there are any, else from the host's ops."""
    steps = sorted((start, end) for _, name, start, end in events if name == step_event)
    if not steps:
        sys.exit(f"step_timeline: the trace has no event named {step_event!r} (see --step_event)")
    rows, collectives = [], collections.defaultdict(list)
    for first, last in steps:
        inside = [(thread, name, start, end) for thread, name, start, end in events if first <= start and end <= last]
        busy = _union_ps([(start, end) for thread, name, start, end in inside
                          if thread.startswith("tf_Compute") and name == "ExecutorState::Process"])
        row = {"step": (last - first) / 1e9, "compute_busy": busy / 1e9, "compute_idle": (last - first - busy) / 1e9}
        rows.append(row)
        row.update(_device_overlap_ms(device, first, last) or _overlap_ms(inside, first))
        per_name = collections.defaultdict(list)
        for _, name, start, end in inside:
            if _op_type(name) in ("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveBcastRecvV2"):
                # A graph's second op of a name gets "_1" (one per MWMS pack): one entry for them all.
                per_name[re.sub(r"_\d+$", "", name.split(":")[0])].append((start, end))
        for name, intervals in per_name.items():
            collectives[name].append((_union_ps(intervals) / 1e9, len(intervals)))
    keys = dict.fromkeys(key for row in rows for key in row if key != "overlap_source")  # overlap: where any
    summary = {key: statistics.median(row[key] for row in rows if key in row) for key in keys}
    if "overlap" in summary:
        summary["overlap_source"] = "device" if any(row.get("overlap_source") == "device" for row in rows) else "host"
    summary["steps"] = len(rows)
    summary["collectives"] = {name: {"ms": sum(ms for ms, _ in found) / len(rows), "calls": sum(n for _, n in found) / len(rows)}
                              for name, found in sorted(collectives.items())}
    return summary


def _op_type(event_name: str) -> str:
    """The op type of a trace event named `scope/op_name:OpType` ("" for other events)."""
    return event_name.rsplit(":", 1)[1] if ":" in event_name else ""


def _overlap_ms(inside, step_start: int) -> dict:
    """When the step's first gradient all-reduce started against the end of its backward pass (ms from the
    step's start): `overlap` > 0 means it started that long before the backward pass's last op ended.

    Backward ops run in the gradient tape's name scope (`gradient_tape/`); the gradient all-reduce in
    `gradient_all_reduce/` (MWMS's CollectiveReduceV2, Horovod's grouped all-reduce op). Under
    jit_compile the backward pass is one XLA call and has no op of its own: no figure then."""
    backward = [end for _, name, _, end in inside if name.startswith("gradient_tape/")]
    reduces = [start for _, name, start, _ in inside if name.startswith("gradient_all_reduce/")
               and _op_type(name) in ("CollectiveReduceV2", "HorovodGroupedAllreduce")]
    if not backward or not reduces:
        return {}
    backward_end, first_reduce = (max(backward) - step_start) / 1e9, (min(reduces) - step_start) / 1e9
    return {"backward_end": backward_end, "first_gradient_all_reduce": first_reduce,
            "overlap": backward_end - first_reduce, "overlap_source": "host"}


def _horovod_spans(path: str) -> list[tuple[str, str, str, float, float]]:
    """(tensor group, tensor, activity, begin ms, end ms) of a Horovod timeline (rank 0's view)."""
    with open(path) as f:
        text = f.read().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")  # still open while the job runs
    tensors = {e["pid"]: e["args"].get("name", "?") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    open_events, spans = collections.defaultdict(list), []
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "B":
            open_events[key].append(e)
        elif e.get("ph") == "E" and open_events[key]:
            begin = open_events[key].pop()
            tensor = tensors.get(e["pid"], "?")
            # A grouped all-reduce shows one process per tensor ("..._3of29"): fold them into one group.
            group = re.sub(r"_\d+of\d+$", "", tensor)
            spans.append((group, tensor, begin.get("name"), begin["ts"] / 1000, e["ts"] / 1000))
    return spans


def horovod_activities(path: str) -> dict:
    """{(tensor group, activity): [durations ms]} of a Horovod timeline (rank 0's view)."""
    durations = collections.defaultdict(list)
    for group, _, activity, begin, end in _horovod_spans(path):
        durations[(group, activity)].append(end - begin)
    return durations


def horovod_overlap_ms(path: str) -> dict | None:
    """Per step, from a Horovod timeline: how long before every rank had submitted the last gradient bucket
    (the slowest rank's backward pass done: that bucket's NEGOTIATE_ALLREDUCE ends) the first bucket's
    all-reduce began to move data (ALLREDUCE begins); medians over steps. > 0: gradients went out while a
    backward pass still ran. None without buckets (distribute.pack_bytes=0)."""
    begins = collections.defaultdict(list)  # (group, activity, tensor) -> (begin ms, end ms), one per step
    for group, tensor, activity, begin, end in _horovod_spans(path):
        if group.startswith("gradient_all_reduce/"):
            begins[(group, activity, tensor)].append((begin, end))
    counts = collections.Counter()
    for (group, activity, _), found in begins.items():
        if activity == "NEGOTIATE_ALLREDUCE":
            counts[group] = max(counts[group], len(found))
    # The training step's buckets are the groups sent most often (the benchmark's breakdown all-reduces
    # the gradients alone a few times, as buckets of other names).
    groups = sorted(g for g, n in counts.items() if n == max(counts.values(), default=0))
    if len(groups) < 2:
        return None

    def per_step(group, activity, edge):  # the group's first tensor to reach `activity`'s edge, step by step
        series = [[span[edge] for span in spans] for (g, a, _), spans in begins.items() if g == group and a == activity]
        return [min(step) for step in zip(*series)]

    submitted = {g: per_step(g, "NEGOTIATE_ALLREDUCE", 0) for g in groups}
    all_submitted = {g: per_step(g, "NEGOTIATE_ALLREDUCE", 1) for g in groups}
    moving = {g: per_step(g, "ALLREDUCE", 0) for g in groups}
    num_steps = min(len(x) for x in (*submitted.values(), *moving.values()))
    overlaps = []
    for step in range(num_steps):
        first = min(groups, key=lambda g: submitted[g][step])
        last_all_submitted = max(all_submitted[g][step] for g in groups)
        overlaps.append(last_all_submitted - moving[first][step])
    return {"buckets": len(groups), "steps": num_steps, "overlap": statistics.median(overlaps)}


def main(argv):
    if _HOROVOD_TIMELINE.value:
        for (group, activity), ms in sorted(horovod_activities(_HOROVOD_TIMELINE.value).items()):
            print(f"{activity:28s} median {statistics.median(ms):7.3f} ms over {len(ms):5d} events  {group[:80]}")
        overlap = horovod_overlap_ms(_HOROVOD_TIMELINE.value)
        if overlap:
            print(f"{overlap['buckets']} gradient buckets: the first began its all-reduce {overlap['overlap']:.2f} ms "
                  f"before every rank had submitted the last (median of {overlap['steps']} steps)")
        return
    if len(argv) != 2:
        sys.exit("usage: step_timeline.py WORKDIR | --horovod_timeline=FILE")
    space = load_trace(argv[1])
    summary = step_breakdown(host_events(space), _STEP_EVENT.value, device_events(space))
    print(f"{summary['steps']} profiled steps, median ms: step {summary['step']:.2f}, compute busy "
          f"{summary['compute_busy']:.2f}, compute idle {summary['compute_idle']:.2f}")
    if "overlap" in summary:
        print(f"  backward pass ends at {summary['backward_end']:.2f} ms, the first gradient all-reduce starts at "
              f"{summary['first_gradient_all_reduce']:.2f} ms: {summary['overlap']:.2f} ms of overlap (median; "
              f"{'the GPU streams' if summary['overlap_source'] == 'device' else 'the host ops'})")
    for name, figures in summary["collectives"].items():
        print(f"  {name:40s} {figures['ms']:7.2f} ms per step (mean), {figures['calls']:.1f} calls")
    with open(os.path.join(argv[1], "step_timeline.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    app.run(main)
