"""tfscale-plan: the performance model's formulas against hand-computed values, its sanity, its inputs and its CLI."""

import dataclasses
import itertools
import json
import math
import os
import re

import pytest
from conftest import REPO, load_config, run_cli

from tfscale.perf import allreduce_bench, plan
from tfscale.planning import plan_band, plan_model, plan_workload
from tfscale.planning.plan_model import System, Workload

SYSTEM = System(name="test", gpus_per_node=4, gpu_images_per_sec=400.0, intra_node_GBps=12.0,
                intra_node_latency_us=5.7, inter_node_GBps=3.0, inter_node_latency_us=14.0)
S = 100e6  # bytes


def test_ring_allreduce_is_nccl_tests_formula():
    # 2 (n-1)/n S / B + 2 (n-1) latency: 1.5 x 100 MB / 10 GB/s = 15 ms, plus 6 steps of 5 us.
    assert plan_model.ring_allreduce_s(S, 4, 10.0, 5.0) == pytest.approx(0.015 + 6 * 5e-6)
    assert plan_model.ring_allreduce_s(S, 1, 10.0, 5.0) == 0.0


def test_allreduce_in_one_node_and_across_nodes():
    base = plan_model.NCCL_BASE_LATENCY_US * 1e-6
    # One node of 4: the GPUs' link, 6 steps at the in-node latency.
    assert plan_model.allreduce_s(S, 4, SYSTEM) == pytest.approx(base + 1.5 * S / 12e9 + 6 * 5.7e-6)
    # Two nodes, one ring of 8: the network's bandwidth; of its 14 steps, 2 cross nodes (NCCL's tuner).
    assert plan_model.allreduce_s(S, 8, SYSTEM) == pytest.approx(base + 2 * 7 / 8 * S / 3e9 + 12 * 5.7e-6 + 2 * 14e-6)
    # Hierarchical: a ring all-reduce's worth in the node, then MPI (Rabenseifner) over 4 nodes: 2 log2(4) latencies.
    in_node = 2 * 3 / 4 * S / 12e9 + 6 * 5.7e-6
    between = 2 * 3 / 4 * S / 3e9 + 2 * 2 * 14e-6
    assert plan_model.allreduce_s(S, 16, SYSTEM, "hierarchical") == pytest.approx(base + in_node + between)


def test_nccls_tree_as_its_tuner_models_it_and_the_choice():
    # 16 GPUs on 4 nodes, 1 MiB (log2(2^20 / 64) = 14: correction 0.5): latency 2 (3 x 28 + 2 x 50) us; bandwidth
    # half of min(0.9 x 3 GB/s, 80), corrected.
    tree = plan_model.allreduce_s(1 << 20, 16, SYSTEM, "tree")
    assert tree == pytest.approx(2 * (3 * 28 + 2 * 50) * 1e-6 + (1 << 20) / (0.5 * 0.9 * 3e9 * 0.5))
    # Small messages across many nodes: the tree's log2(nodes) latency wins; a big one in a node: the ring.
    many_nodes = dataclasses.replace(SYSTEM, gpus_per_node=1)
    assert plan_model.nccl_choice(4096, 256, many_nodes) == "tree"
    assert plan_model.nccl_choice(S, 4, SYSTEM) == "ring"
    assert plan_model.allreduce_s(4096, 256, many_nodes, "nccl") == plan_model.allreduce_s(4096, 256, many_nodes, "tree")


def test_fusion_packs_consecutive_tensors():
    assert plan_model.buckets([10, 20, 30, 40], 50) == [30, 30, 40]
    assert plan_model.buckets([10, 20, 30], 0) == [60]  # no fusion limit: one message
    assert plan_model.buckets([10, 20, 30], 1) == [10, 20, 30]  # each tensor alone


def workload(**fields) -> Workload:
    layers = ((4_000, 1e9), (8_000_000, 4e9), (40_000_000, 2e9), (4_000_000, 1e8))  # forward order
    return Workload(model="toy", per_gpu_batch=64, layers=layers, **fields)


def test_after_the_backward_pass_nothing_hides():
    w = workload(overlap="none", fusion_bytes=0)
    total, exposed = plan_model.exposed_allreduce_s(w, SYSTEM, 8, compute_s=0.16)
    assert exposed == total == pytest.approx(plan_model.allreduce_s(w.gradient_bytes, 8, SYSTEM))


def test_tensor_by_tensor_hides_what_the_backward_pass_covers():
    w = workload(overlap="per_tensor", fusion_bytes=64 << 20, cycle_ms=1.0)
    total, exposed = plan_model.exposed_allreduce_s(w, SYSTEM, 8, compute_s=1.0)  # a long backward pass
    assert exposed < 0.2 * total  # only the last-ready layers' message after the backward pass ends
    no_overlap = dataclasses.replace(SYSTEM, overlap_efficiency=0.0)
    assert plan_model.exposed_allreduce_s(w, no_overlap, 8, compute_s=1.0)[1] == pytest.approx(total)


def test_calibration_recovers_the_overlap_efficiency_it_was_given():
    w = workload(overlap="per_tensor", fusion_bytes=64 << 20, cycle_ms=5.0)
    system = dataclasses.replace(SYSTEM, overlap_efficiency=0.37, gpu_images_per_sec=200.0)
    efficiency = plan_model.predict(w, system, [16])[0]["efficiency"]
    assert plan_model.calibrate_overlap(w, system, 16, efficiency) == pytest.approx(0.37, abs=1e-9)


def test_more_bandwidth_or_less_latency_never_predicts_slower():
    w = workload(overlap="per_tensor", fusion_bytes=8 << 20, cycle_ms=5.0)
    gpus = [1, 2, 4, 8, 16, 32, 64, 128]
    for algorithm, field in itertools.product(("ring", "hierarchical"),
                                              ("intra_node_GBps", "inter_node_GBps", "overlap_efficiency")):
        w = dataclasses.replace(w, algorithm=algorithm)
        values = [0.2, 0.5, 1.0] if field == "overlap_efficiency" else [1.0, 3.0, 12.0, 50.0]
        rates = [[r["images_per_sec"] for r in plan_model.predict(w, dataclasses.replace(SYSTEM, **{field: v}), gpus)]
                 for v in values]
        for slower, faster in zip(rates, rates[1:]):
            assert all(f >= s - 1e-9 for s, f in zip(slower, faster)), (algorithm, field)
    for field in ("intra_node_latency_us", "inter_node_latency_us"):
        rates = [[r["images_per_sec"] for r in plan_model.predict(w, dataclasses.replace(SYSTEM, **{field: v}), gpus)]
                 for v in (50.0, 10.0, 1.0)]
        for slower, faster in zip(rates, rates[1:]):
            assert all(f >= s - 1e-9 for s, f in zip(slower, faster)), field


def test_a_node_with_too_few_cores_for_jpeg_decoding_is_input_bound():
    system = dataclasses.replace(SYSTEM, cpu_cores_per_gpu=2, decode_images_per_sec_per_core=100.0)
    row = plan_model.predict(workload(), system, [4])[0]
    assert row["input_bound"] and row["per_gpu_images_per_sec"] == pytest.approx(200.0)
    storage = dataclasses.replace(SYSTEM, read_MBps_per_node=110.0, image_bytes=110e3)  # 1000 images/s per node
    assert plan_model.predict(workload(), storage, [4])[0]["per_gpu_images_per_sec"] == pytest.approx(250.0)


def test_a_nodes_cores_are_shared_by_the_gpus_the_job_uses_on_it():
    # 16 cores at 100 images/s each: one GPU alone gets 1600 images/s, each of 4 on the node 400, of 8 only 200.
    node = dataclasses.replace(SYSTEM, gpus_per_node=8, cpu_cores_per_node=16, decode_images_per_sec_per_core=100.0)
    rows = {r["gpus"]: r for r in plan_model.predict(workload(), node, [1, 4, 8, 16])}
    assert not rows[1]["input_bound"] and not rows[4]["input_bound"]
    assert rows[8]["input_bound"] and rows[8]["per_gpu_images_per_sec"] == pytest.approx(200.0)
    assert rows[16]["per_gpu_images_per_sec"] == pytest.approx(200.0)  # two full nodes


def test_efficiency_against_one_node_and_the_wall_time():
    rows = plan_model.predict(workload(), SYSTEM, [1, 4, 8])
    node = rows[1]["images_per_sec"]
    assert rows[2]["efficiency_vs_node"] == pytest.approx((rows[2]["images_per_sec"] / node) / 2)
    assert rows[1]["efficiency_vs_node"] == pytest.approx(1.0)
    assert rows[0]["hours_for_epochs"] == pytest.approx(90 * 1_281_167 / 400.0 / 3600)


def test_buckets_go_when_full_and_after_the_bucket_before():
    # Backward order: 4 MB (1e8 FLOPs), 40 MB (2e9), 8 MB (4e9), 4 KB (1e9); backward 2/3 s in proportion to
    # FLOPs (7.1e9): ready at 0.00939, 0.19718, 0.57277, 0.66667 s. Buckets of 45 MB: [4 MB + 40 MB], [8 MB + 4 KB].
    w = workload(overlap="buckets", fusion_bytes=45_000_000)
    cost = lambda size: plan_model.allreduce_s(size, 8, SYSTEM)  # noqa: E731
    backward = 2 / 3
    first_done = (0.1e9 + 2e9) / 7.1e9 * backward + cost(44_000_000)
    second_done = max(backward, first_done) + cost(8_004_000)
    total, exposed = plan_model.exposed_allreduce_s(w, SYSTEM, 8, compute_s=1.0)
    assert total == pytest.approx(cost(44_000_000) + cost(8_004_000))
    assert exposed == pytest.approx(max(0.0, second_done - backward))
    # Under XLA (every gradient at once) or with one bucket nothing goes before the backward pass ends.
    assert plan_model.exposed_allreduce_s(workload(overlap="buckets", fusion_bytes=0), SYSTEM, 8, 1.0)[1] == pytest.approx(
        plan_model.allreduce_s(w.gradient_bytes, 8, SYSTEM))


def test_the_config_says_whether_its_buckets_overlap():
    layers = ((4_000, 1e9), (8_000, 2e9))
    assert plan_workload.workload_from_config(load_config("r50_32gpu", "--config.distribute.pack_bytes=4194304"),
                                     layers=layers).overlap == "buckets"
    assert plan_workload.workload_from_config(load_config("r50_32gpu:xla", "--config.distribute.pack_bytes=4194304"),
                                     layers=layers).overlap == "none"
    # MWMS with synchronized BatchNorm: the first bucket waits for the backward pass's BatchNorm all-reduces.
    sync_bn = ("--config.distribute.pack_bytes=4194304", "--config.model.sync_bn=True")
    assert plan_workload.workload_from_config(load_config("r50_32gpu", *sync_bn), layers=layers).overlap == "none"
    assert plan_workload.workload_from_config(load_config("r50_32gpu", *sync_bn, "--config.distribute.backend=horovod",
                                                 "--config.model.sync_bn=False"), layers=layers).overlap == "buckets"


def test_the_best_bucket_size_exposes_no_more_than_any_other():
    w = workload(overlap="none")
    size, exposed = plan_model.best_bucket_bytes(w, SYSTEM, 16)
    compute_s = w.per_gpu_batch / SYSTEM.gpu_images_per_sec
    for other in plan_model.BUCKET_CANDIDATES:
        bucketed = dataclasses.replace(w, overlap="buckets", fusion_bytes=other)
        assert exposed <= plan_model.exposed_allreduce_s(bucketed, SYSTEM, 16, compute_s)[1] + 1e-12
    assert size in plan_model.BUCKET_CANDIDATES
    # Hiding beats one message after the backward pass.
    assert exposed < plan_model.exposed_allreduce_s(w, SYSTEM, 16, compute_s)[1]


def test_eval_and_checkpoint_share_of_the_wall_time():
    w = workload(overlap="none", num_train_examples=1_000_000, num_eval_examples=30_000, eval_every_epochs=2.0,
                 checkpoint_every_epochs=1.0, state_bytes=240_000_000, async_checkpoint=True)
    row = plan_model.predict_point(w, SYSTEM, 8)
    epoch_s = 1_000_000 / row["images_per_sec"]
    eval_s = 30_000 / (8 * 400.0 * 3)  # forward only: 3x the training rate, each GPU its eighth
    checkpoint_s = 240e6 / 12e9  # the host copy at PCIe's 12 GB/s
    between = eval_s / 2 + checkpoint_s
    assert row["eval_checkpoint_share"] == pytest.approx(between / (epoch_s + between))
    # Saved synchronously, the steps wait for the file system's 500 MB/s instead.
    sync = plan_model.predict_point(dataclasses.replace(w, async_checkpoint=False), SYSTEM, 8)
    assert sync["eval_checkpoint_share"] == pytest.approx((eval_s / 2 + 240e6 / 500e6) / (epoch_s + eval_s / 2 + 0.48))


def test_r50_32gpu_spends_under_2_percent_on_eval_and_checkpoints():
    cfg = load_config("r50_32gpu:amp")
    w = plan_workload.workload_from_config(cfg, layers=((102_228_128, 4.1e9),), batchnorm_bytes=212_000)
    a100 = dataclasses.replace(SYSTEM, gpus_per_node=8, gpu_images_per_sec=2600.0)  # NVIDIA's published AMP rate
    for gpus in (8, 32, 256):
        assert plan_model.predict_point(w, a100, gpus)["eval_checkpoint_share"] < 0.02


def test_keras_update_launches_its_ops_after_the_all_reduce_the_compiled_one_does_not():
    cfg = load_config("r50_32gpu:amp", "--config.optim.compiled_update=False")
    layers = ((102_228_128, 4.1e9),)
    keras = plan_workload.workload_from_config(cfg, layers=layers, num_variables=161)
    compiled = plan_workload.workload_from_config(load_config("r50_32gpu:amp"), layers=layers, num_variables=161)
    # Counted in a traced ResNet-50 mixed_float16 step: 2,342 ops outside XLA against 60 compiled.
    assert (keras.update_ops, compiled.update_ops) == (2342 - 60, 0)
    assert plan_workload.workload_from_config(load_config("r50_32gpu:amp_bf16", "--config.optim.compiled_update=False"),
                                     layers=layers, num_variables=161).update_ops == 1509 - 60  # no loss scaling
    slow, fast = (plan_model.predict_point(w, SYSTEM, 8) for w in (keras, compiled))
    assert slow["update_ms"] == pytest.approx((2342 - 60) * SYSTEM.op_launch_us / 1e3)
    assert slow["step_ms"] == pytest.approx(fast["step_ms"] + slow["update_ms"]) and fast["update_ms"] == 0.0


def test_each_part_of_the_step_is_planned_on_and_off():
    from tfscale.planning import plan_parts

    w = dataclasses.replace(workload(overlap="none", eval_every_epochs=1, checkpoint_every_epochs=1,
                                     state_bytes=100_000_000), num_variables=100)
    rows = plan_parts.variants("mixed_float16", w, SYSTEM, 16)
    steps = [plan_model.predict_point(v, SYSTEM, 16) for _, v in rows]
    # Every part switched on makes the step shorter or the run's pauses shorter, none longer.
    assert steps[0]["exposed_ms"] > steps[1]["exposed_ms"]  # the flag's own all-reduce
    assert steps[1]["update_ms"] == pytest.approx(plan_model.keras_update_ops("mixed_float16", 100) * 5e-3)
    assert steps[2]["update_ms"] == 0.0 and steps[2]["step_ms"] < steps[1]["step_ms"]
    assert steps[3]["eval_checkpoint_share"] < steps[2]["eval_checkpoint_share"]
    assert rows[4][1].overlap == "buckets" and steps[4]["exposed_ms"] < steps[3]["exposed_ms"]
    # Break-even: at that one-GPU rate the bucketed step is as fast as the XLA one at the full rate.
    rate = plan_parts.break_even_rate(rows[3][1], rows[4][1], SYSTEM, 16)
    at_rate = plan_model.predict_point(rows[4][1], dataclasses.replace(SYSTEM, gpu_images_per_sec=rate), 16)
    assert rate < SYSTEM.gpu_images_per_sec
    assert at_rate["images_per_sec"] == pytest.approx(steps[3]["images_per_sec"], rel=1e-6)


def test_stragglers_the_step_waits_for_the_slowest_gpu():
    # The expected maximum of N standard normals against its tabulated values (Harter 1961); N = 2: 1/sqrt(pi).
    for n, exact in ((2, 1 / math.sqrt(math.pi)), (10, 1.5388), (100, 2.5076)):
        assert plan_model.slowest_of(n) == pytest.approx(exact, abs=1e-3)
    assert plan_model.slowest_of(1) == 0.0
    w = workload(overlap="none")
    spread = dataclasses.replace(SYSTEM, step_time_cv=0.05)
    steady, straggling = plan_model.predict_point(w, SYSTEM, 16), plan_model.predict_point(w, spread, 16)
    assert straggling["compute_ms"] == pytest.approx(steady["compute_ms"] * (1 + 0.05 * plan_model.slowest_of(16)))
    assert plan_model.predict_point(w, spread, 1)["compute_ms"] == steady["compute_ms"] == pytest.approx(160.0)


def test_a_persistently_slower_gpu_sets_every_steps_pace():
    w = workload(overlap="none")
    slow = dataclasses.replace(SYSTEM, slowest_gpu_images_per_sec=0.7 * SYSTEM.gpu_images_per_sec)
    steady = plan_model.predict_point(w, SYSTEM, 16)
    assert plan_model.predict_point(w, slow, 16)["compute_ms"] == pytest.approx(steady["compute_ms"] / 0.7)
    assert plan_model.predict_point(w, slow, 1)["compute_ms"] == steady["compute_ms"]  # the reference: a normal GPU
    # A spread whose expected slowest draw is slower still decides instead.
    spread = dataclasses.replace(slow, step_time_cv=1.0)
    assert plan_model.predict_point(w, spread, 16)["compute_ms"] == pytest.approx(
        steady["compute_ms"] * (1 + plan_model.slowest_of(16)))


def test_the_spread_comes_from_a_benchmark_report(tmp_path):
    report = {"total_images_per_sec": 250.0, "num_replicas": 1,
              "per_worker": [{"rank": 0, "median_step_ms": 100.0, "p90_step_ms": 106.4, "p99_step_ms": 110.0}]}
    (tmp_path / "benchmark.json").write_text(json.dumps(report))
    overrides = plan.measured_overrides(str(tmp_path / "benchmark.json"), "")
    assert overrides["gpu_images_per_sec"] == 250.0
    assert overrides["step_time_cv"] == pytest.approx(0.064 / 1.2816)


def test_default_gpu_counts():
    assert plan_model.default_gpu_counts(4, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert plan_model.default_gpu_counts(8, 24) == [1, 2, 4, 8, 16, 24]


def test_gradient_bytes_are_the_models_trainable_parameter_bytes():
    cfg = load_config("r50_32gpu")
    w = plan_workload.workload_from_config(cfg)
    assert w.gradient_bytes == 25_557_032 * 4  # ResNet-50's trainable parameters (torchvision's count), float32
    assert w.per_gpu_batch == 128 and w.overlap == "none"  # tfscale all-reduces after the backward pass
    horovod_fp16 = load_config("r50_32gpu:amp", "--config.distribute.backend=horovod",
                               "--config.distribute.horovod_fp16_allreduce=True")
    assert plan_workload.workload_from_config(horovod_fp16, layers=w.layers).wire_factor == 0.5


def test_the_link_fitted_from_an_allreduce_table_gives_its_times_back():
    rows = [{"size_bytes": size, "time_us": 1e6 * plan_model.ring_allreduce_s(size, 2, 0.4, 900.0)}
            for size in (1024, 1 << 20, 64 << 20)]
    bandwidth, latency = plan.link_from_allreduce(rows, num_replicas=2)
    assert (bandwidth, latency) == (pytest.approx(0.4, rel=1e-3), pytest.approx(900.0 + 1024 / 0.4e9 * 1e6 / 2, rel=1e-3))


def test_allreduce_benchmark_uses_nccl_tests_busbw():
    assert allreduce_bench.bus_bandwidth(1e9, 0.1, 8) == (pytest.approx(10.0), pytest.approx(17.5))
    assert allreduce_bench.bus_bandwidth(1e9, 0.1, 2) == (pytest.approx(10.0), pytest.approx(10.0))
    assert allreduce_bench.message_sizes(1024, 16384, 4) == [1024, 4096, 16384]


def test_a_system_file_with_an_unknown_field_is_named(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({**dataclasses.asdict(SYSTEM), "nvlink": True}))
    with pytest.raises(ValueError, match=r"cluster.json: unknown field\(s\) nvlink"):
        plan_workload.load_system(str(path))


def test_the_bands_errors_are_the_published_comparisons():
    """plan_band.PUBLISHED is the error column of docs/scaling.md's comparison (which a test keeps equal to
    `tfscale-plan --published`), calibration runs left out, in order."""
    doc = open(os.path.join(REPO, "docs", "scaling.md")).read()
    begin = doc.index("<!-- tfscale-plan --published: begin -->")
    rows = re.findall(r"^\| (\w+) \| \w+ \| \d+ \| (\d+) \| [\d.]+ \| [\d.]+ \| ([+-]\d+\.\d) \|$",
                      doc[begin:doc.index("<!-- tfscale-plan --published: end -->")], re.MULTILINE)
    assert len(rows) == 38
    assert plan_band.PUBLISHED == tuple((system, int(gpus), float(error)) for system, gpus, error in rows)


def test_the_bands_bed_errors_are_the_bed_tables():
    """plan_band.BED is the one-message and buckets errors of docs/scaling.md's bed tables, MWMS then Horovod,
    then the straggler tables' errors of the planner told of the slowest GPU."""
    doc = open(os.path.join(REPO, "docs", "scaling.md")).read()
    section = doc[doc.index("## Checked on a test bed of two hosts"):doc.index("## The scaling sweep on your cluster")]
    rows = re.findall(r"^\| (?:\d+ Mbit/s|unshaped) \|.* \| ([+-]\d+\.\d) / ([+-]\d+\.\d) / [+-]\d+\.\d \|$", section,
                      re.MULTILINE)
    assert len(rows) == 8
    errors = [float(e) for row in rows for e in row]
    straggler = re.findall(r"^\| (?:\d+ Mbit/s|unshaped) \|.* \| [+-]\d+\.\d / ([+-]\d+\.\d) \|$", section, re.MULTILINE)
    assert len(straggler) == 8
    assert plan_band.BED == tuple((group, 2, e) for group, chunk in (
        ("netbed_mwms", errors[:8]), ("netbed_horovod", errors[8:]), ("netbed_straggler", map(float, straggler)))
        for e in chunk)


def test_the_band_is_the_errors_middle_80_percent_and_widens_past_the_largest_run_checked():
    points = [("a", 8, float(e)) for e in range(-10, 11) if e] + [("b", 64, 0.0)]  # 21 errors, -10 .. +10
    band = plan_band.band_from(points)
    assert (band.low_error_points, band.high_error_points, band.max_checked_gpus) == (-8.0, 8.0, 64)
    # An optimistic planner (error > 0) has its band below its prediction.
    assert band.around(0.9, 64) == pytest.approx((0.82, 0.98))
    assert band.around(0.9, 256) == pytest.approx((0.66, 1.0))  # two doublings past 64: three times as wide
    assert band.holds(64, 7.9) and not band.holds(64, 8.1) and band.holds(128, 15.9) and not band.holds(128, 16.1)
    rows = plan_band.attach([{"gpus": 1, "efficiency": 1.0}, {"gpus": 32, "efficiency": 0.9}], band)
    assert rows[0]["efficiency_band"] == (1.0, 1.0) and rows[1]["efficiency_band"] == pytest.approx((0.82, 0.98))


def test_each_group_held_out_is_checked_against_the_band_of_the_others():
    points = [("a", 8, e) for e in (-1.0, 0.0, 1.0, 2.0)] + [("b", 8, e) for e in (0.5, 1.5)] + [("c", 16, 9.0)]
    rows = {r["group"]: r for r in plan_band.held_out(points)}
    assert rows["c"]["band"] == plan_band.band_from(points[:6]) and rows["c"]["widened"] == 1
    assert rows["c"]["inside"] == 0  # 9 points off, where a band of about -0.5..+1.8, doubled, reaches 3.6
    assert (rows["a"]["points"], rows["b"]["points"]) == (4, 2)


@pytest.mark.slow
def test_plan_prints_the_table_for_the_32_gpu_recipe_on_the_p100_cluster(tmp_path):
    result = run_cli("tfscale.perf.plan", "--config=r50_32gpu", "--system=p100_ib_4gpu", f"--output_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("tfscale-plan: resnet50, 128 images per GPU, 102.2 MB of gradients")
    assert "1 GPU 249.28 images/sec" in lines[0]  # the published one-GPU point at that batch
    rows = [line.split() for line in lines[2:] if re.match(r"\s*\d", line)]
    assert [int(r[0]) for r in rows] == [1, 2, 4, 8, 16, 32, 64]
    written = json.loads((tmp_path / "plan.json").read_text())
    assert [r["gpus"] for r in written["rows"]] == [1, 2, 4, 8, 16, 32, 64]
    # Each prediction carries its band, printed beside it: "0.81-0.97" under "80% band".
    for printed, row in zip(rows[1:], written["rows"][1:]):
        low, high = row["efficiency_band"]
        assert low < row["efficiency"] < high and printed[6] == f"{low:.2f}-{high:.2f}", (printed, row)
    assert (tmp_path / "plan.png").stat().st_size > 10_000


@pytest.mark.parametrize("system", ["a100_ib_200g", "a100_eth_25g"])
def test_the_parts_tables_in_docs_scaling_md_are_what_the_command_prints(system):
    result = run_cli("tfscale.perf.plan", "--config=r50_32gpu:amp", f"--system={system}", "--gpus=32,256", "--parts")
    assert result.returncode == 0, result.stderr[-3000:]
    doc = open(os.path.join(REPO, "docs", "scaling.md")).read()
    begin, end = f"<!-- tfscale-plan --parts {system}: begin -->\n", f"<!-- tfscale-plan --parts {system}: end -->"
    committed = doc[doc.index(begin) + len(begin):doc.index(end)].strip()
    assert committed == result.stdout.strip(), "regenerate the tables with the command above them"


@pytest.mark.slow
def test_the_comparison_in_docs_scaling_md_is_what_the_command_prints():
    result = run_cli("tfscale.perf.plan", "--published")
    assert result.returncode == 0, result.stderr[-3000:]
    doc = open(os.path.join(REPO, "docs", "scaling.md")).read()
    begin, end = "<!-- tfscale-plan --published: begin -->\n", "<!-- tfscale-plan --published: end -->"
    committed = doc[doc.index(begin) + len(begin):doc.index(end)].strip()
    assert committed == result.stdout.strip(), "regenerate docs/scaling.md's table with `tfscale-plan --published`"
    summary = next(line for line in committed.splitlines() if "median absolute error" in line)
    median, worst = map(float, re.search(r"median absolute error (\d+\.\d) .*worst (\d+\.\d)", summary).groups())
    assert math.isfinite(median) and median <= worst


# --- distribute.pack_bytes=auto -------------------------------------------------------------------------------


def test_pack_bytes_auto_is_the_planners_bucket_for_the_jobs_system_and_size(tmp_path):
    auto = ("--config.distribute.pack_bytes=auto", "--config.distribute.plan_system=a100_eth_25g",
            f"--config.data.data_dir={tmp_path}")
    cfg = load_config("r50_32gpu", *auto, "--config.jit_compile=False")
    size, why = plan_workload.auto_pack_bytes(cfg, 32)
    one_message = load_config("r50_32gpu", "--config.jit_compile=False", f"--config.data.data_dir={tmp_path}")
    workload = plan_workload.workload_from_config(one_message, per_gpu_batch=128)
    best, exposed_s = plan_model.best_bucket_bytes(workload, plan_workload.resolve_system("a100_eth_25g", "resnet50", 128), 32)
    assert size == best > 0
    assert why == (f"tfscale-plan's bucket for a100_eth_25g at 32 GPUs, {exposed_s * 1e3:.1f} ms of all-reduce left "
                   "exposed a step")
    # Where buckets cannot help, one message, and why.
    xla = load_config("r50_32gpu", *auto, "--config.jit_compile=True")
    assert plan_workload.auto_pack_bytes(xla, 32) == (0, "jit_compile=True: no gradient leaves an XLA call before the backward "
                                                "pass ends, so one message")
    assert plan_workload.auto_pack_bytes(cfg, 1) == (0, "one replica: nothing to all-reduce")
    no_system = load_config("r50_32gpu", "--config.distribute.pack_bytes=auto", "--config.jit_compile=False",
                            f"--config.data.data_dir={tmp_path}")
    assert plan_workload.auto_pack_bytes(no_system, 32)[0] == 0
    assert "no config.distribute.plan_system to plan buckets for" in plan_workload.auto_pack_bytes(no_system, 32)[1]
    sync_bn = load_config("r50_32gpu", *auto, "--config.jit_compile=False", "--config.model.sync_bn=True")
    size, why = plan_workload.auto_pack_bytes(sync_bn, 32)
    assert size == 0 and "could not overlap" in why and "synchronized BatchNorm" in why


def test_pack_bytes_auto_leaves_xla_on_and_anything_else_is_refused_by_name():
    from tfscale.config import ConfigError, step_modes, validation

    cfg = load_config("smoke", "--config.distribute.pack_bytes=auto")
    assert step_modes.xla_conflict(cfg) is None and validation.bucket_warning(cfg) is None
    with pytest.raises(ConfigError, match=r"config.distribute.pack_bytes must be >= 0 .* or 'auto', got 'big'"):
        validation.validate(load_config("smoke", "--config.distribute.pack_bytes=big"))


def test_a_run_with_pack_bytes_auto_says_what_it_chose_and_records_it(tmp_path):
    # Two CPU replicas of one process, planned as the system in a JSON file: the start-up line, config.json.
    system = {"gpus_per_node": 2, "gpu_images_per_sec": 500.0, "intra_node_GBps": 1.0, "intra_node_latency_us": 50.0,
              "inter_node_GBps": 1.0, "inter_node_latency_us": 50.0}
    (tmp_path / "bed.json").write_text(json.dumps(system))
    workdir = tmp_path / "run"
    result = run_cli("tfscale.train", "--config=configs/smoke.py", f"--workdir={workdir}", "--config.train.epochs=1",
                     "--config.schedule.warmup_epochs=0", "--config.train.eval_every_epochs=1",
                     "--config.distribute.backend=mirrored", "--config.distribute.num_cpu_devices=2",
                     "--config.distribute.pack_bytes=auto", f"--config.distribute.plan_system={tmp_path / 'bed.json'}")
    assert result.returncode == 0, result.stderr[-3000:]
    recorded = json.loads((workdir / "config.json").read_text())
    chosen = recorded["distribute"]["pack_bytes"]
    assert isinstance(chosen, int) and chosen in plan_model.BUCKET_CANDIDATES and recorded["jit_compile"] is False
    assert f"config.distribute.pack_bytes=auto -> {chosen}: tfscale-plan's bucket for bed at 2 GPUs" in result.stderr


def test_tfscale_plan_with_pack_bytes_auto_plans_with_the_bucket_it_advises(tmp_path):
    result = run_cli("tfscale.perf.plan", "--config=r50_32gpu", f"--config.data.data_dir={tmp_path}",
                     "--config.distribute.pack_bytes=auto", "--config.jit_compile=False", "--system=a100_eth_25g")
    assert result.returncode == 0, result.stderr[-3000:]
    chosen = re.search(r"distribute.pack_bytes=auto -> (\d+): tfscale-plan's bucket for a100_eth_25g at 64 GPUs, "
                       r"([\d.]+) ms of all-reduce left exposed a step", result.stdout)
    advised = re.search(r"distribute.pack_bytes=(\d+) exposes the least all-reduce at 64 GPUs: ([\d.]+) ms a step",
                        result.stdout)
    assert chosen and advised and chosen.groups() == advised.groups()
    assert f"in buckets of {int(chosen[1]) >> 20} MiB as they fill" in result.stdout  # the table plans with them
