"""tools/step_timeline.py on a GPU's trace: the overlap read from the device streams, where the host's events of
the backward pass are only kernel launches. The trace is written here as the profiler writes one (an XSpace of a
host plane and a `/device:GPU:0` plane whose kernels carry the `tf_op` that launched them); no GPU needed."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

MS = 10**9  # picoseconds per millisecond
BACKWARD_OP = "gradient_tape/conv/Conv2DBackpropFilter:Conv2DBackpropFilter"
REDUCE_OP = "gradient_all_reduce/CollectiveReduceV2:CollectiveReduceV2"


def write_trace(workdir, with_device: bool) -> None:
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()

    def event(plane, line, name, start_ms, end_ms, tf_op=None, by_reference=False):
        meta_id = len(plane.event_metadata) + 1
        plane.event_metadata[meta_id].id, plane.event_metadata[meta_id].name = meta_id, name
        added = line.events.add(metadata_id=meta_id, offset_ps=int(start_ms * MS),
                                duration_ps=int((end_ms - start_ms) * MS))
        if tf_op is not None:
            stat = added.stats.add(metadata_id=1)
            if by_reference:  # the profiler interns repeated strings as stat metadata and refers to them
                ref = len(plane.stat_metadata) + 1
                plane.stat_metadata[ref].id, plane.stat_metadata[ref].name = ref, tf_op
                stat.ref_value = ref
            else:
                stat.str_value = tf_op

    host = space.planes.add(id=1, name="/host:CPU")
    compute = host.lines.add(id=1, name="tf_Compute", timestamp_ns=0)
    # Two steps of 10 ms; on the host both ops are launches early in the step.
    for offset in (0, 20):
        event(host, compute, "batch_step", offset, offset + 10)
        event(host, compute, BACKWARD_OP, offset + 1.0, offset + 1.1)
        event(host, compute, REDUCE_OP, offset + 2.0, offset + 2.1)
    if with_device:
        gpu = space.planes.add(id=2, name="/device:GPU:0")
        gpu.stat_metadata[1].id, gpu.stat_metadata[1].name = 1, "tf_op"
        kernels = gpu.lines.add(id=7, name="Stream #7(Compute)", timestamp_ns=0)
        nccl = gpu.lines.add(id=9, name="Stream #9(NCCL)", timestamp_ns=0)
        for offset, by_reference in ((0, False), (20, True)):
            event(gpu, kernels, "cutlass_wgrad_kernel", offset + 3, offset + 8, tf_op=BACKWARD_OP,
                  by_reference=by_reference)
            event(gpu, nccl, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", offset + 6, offset + 9)
    trace = workdir / "tensorboard" / "plugins" / "profile" / "2026_11_28" / "node.xplane.pb"
    trace.parent.mkdir(parents=True)
    trace.write_bytes(space.SerializeToString())


@pytest.mark.parametrize("with_device, overlap, source, printed", [(True, 2.0, "device", "the GPU streams"),
                                                                   (False, -0.9, "host", "the host ops")])
def test_the_overlap_comes_from_the_gpu_streams_when_the_trace_has_them(tmp_path, with_device, overlap, source,
                                                                        printed):
    write_trace(tmp_path, with_device)
    result = subprocess.run([sys.executable, "tools/step_timeline.py", str(tmp_path), "--step_event=batch_step"],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "step_timeline.json").read_text())
    assert summary["steps"] == 2
    # On the GPU the backward kernel ran 3-8 ms into the step and NCCL began at 6: 2 ms of overlap. The host's
    # launches (1.1 ms, 2.0 ms) would say the all-reduce began 0.9 ms after the backward pass "ended".
    assert summary["overlap"] == pytest.approx(overlap) and summary["overlap_source"] == source
    assert f"of overlap (median; {printed})" in result.stdout
