"""The benchmark in its three modes, on one and two workers: what it prints is what it saves."""

import glob
import json
import os
import re
import statistics
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, load_config, run_cli

from tfscale.config import validation
from tfscale.data.convert import convert
from tfscale.perf import baselines, benchmark
from tfscale.workdir import layout


@pytest.fixture(scope="module")
def photo_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    photos, shards = str(root / "photos"), str(root / "shards")
    subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "make_photo_tree.py"), photos, "--classes", "3", "--per_class", "12"],
        check=True, capture_output=True,
    )
    convert.convert(photos, shards, "train", 4, num_workers=1)
    return photos, shards


@pytest.mark.slow
def test_input_benchmark_prints_and_saves_every_pipeline_rate(photo_shards, tmp_path):
    photos, shards = photo_shards
    result = run_cli(
        "tfscale.benchmark", "--config=configs/r50_1gpu.py", f"--workdir={tmp_path}",
        "--config.benchmark.mode=input", "--config.data.dataset=tfrecord", f"--config.data.data_dir={shards}",
        f"--config.benchmark.image_dir={photos}", "--config.data.global_batch_size=8",
        "--config.data.image_size=64", "--config.benchmark.num_batches=4", "--config.benchmark.num_warmup_batches=1",
        "--config.benchmark.rounds=2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    printed = json.loads(lines[-1])  # the last line is the JSON summary
    # DALI's row is there when `make dali` installed it (make test does).
    dali = ("tfscale_dali",) if baselines.dali_installed() else ()
    assert set(printed) == {f"{name}_images_per_sec" for name in
                            ("tfscale", "tfscale_buffer_shuffle", "tfscale_no_shuffle", "model_garden", "decode_only", "keras_baseline", *dali)}
    assert all(rate > 0 for rate in printed.values())
    with open(os.path.join(tmp_path, layout.BENCHMARK)) as f:
        saved = json.load(f)
    for key, rate in printed.items():
        assert saved[key] == rate
        assert len(saved["rounds"][key.replace("_images_per_sec", "")]) == 2
    # the ratios are medians of ratios within rounds (each round ran both sides back to back), with their range
    rounds = saved["rounds"]

    def within_rounds(ours, theirs):
        return sorted(a / b for a, b in zip(rounds[ours], rounds[theirs]))

    # benchmark.json keeps the rates rounded, the printed ratios come from the unrounded ones: 0.002 apart at most
    decode = within_rounds("tfscale", "decode_only")
    ratio_line = next(line for line in lines if "decode-only" in line)
    printed_ratio = re.search(r"tfscale = ([\d.]+)x \(rounds ([\d.]+)-([\d.]+)\)", ratio_line)
    assert printed_ratio, ratio_line
    assert [float(x) for x in printed_ratio.groups()] == pytest.approx(
        [statistics.median(decode), decode[0], decode[-1]], abs=0.002)
    ratio_line = next(line for line in lines if line.strip().startswith("vs Model-Garden-style"))
    garden = statistics.median(within_rounds("tfscale", "model_garden"))
    assert float(re.search(r"tfscale ([\d.]+)x", ratio_line).group(1)) == pytest.approx(garden, abs=0.002)
    if dali:
        assert saved["tfscale_dali_vs_tfdata"] == pytest.approx(statistics.median(within_rounds("tfscale_dali", "tfscale")),
                                                                abs=0.001)
        assert "DALI (cpu decoding)" in next(line for line in lines if "DALI" in line)


def test_input_benchmark_needs_shards(tmp_path):
    result = run_cli("tfscale.benchmark", "--config=configs/r50_1gpu.py", f"--workdir={tmp_path}",
                     "--config.benchmark.mode=input")
    assert result.returncode != 0
    assert "dataset='tfrecord'" in result.stderr


# --- train / synthetic modes ----------------------------------------------------------------------

# One display line: step, per-worker rate, standard error, jitter, loss.
STEP_LINE = re.compile(r"^(?:\[rank 0\] )?(\d+)\timages/sec: ([\d.]+) \+/- ([\d.]+) \(jitter = ([\d.]+)\)\t([-\d.na]+)$")
BUCKET_BYTES, BUCKETS = 65536, 6  # the smoke model's 315 KB of gradients in 64 KiB buckets
SMALL_RUN = ("--config=configs/smoke.py", "--config.benchmark.num_batches=12", "--config.benchmark.num_warmup_batches=3",
             "--config.benchmark.display_every=5", "--config.benchmark.breakdown_batches=3")


def test_speed_stats_follow_tf_cnn_benchmarks():
    # 32 images per step; steps of 0.1, 0.2, 0.1, 0.1 s -> rates 320, 160, 320, 320
    stats = benchmark.speed_stats([0.1, 0.2, 0.1, 0.1], 32)
    assert stats["images_per_sec"] == pytest.approx(32 / 0.125)  # batch / mean time, not mean of rates
    assert stats["stderr"] == pytest.approx(np.std([320, 160, 320, 320]) / 2)
    assert stats["jitter"] == 0.0  # 1.4826 x median |rate - 320| = 0: one outlier does not move it
    assert benchmark.speed_text(stats) == "images/sec: 256.0 +/- 34.6 (jitter = 0.0)"


def check_report_against_output(stdout: str, report: dict) -> None:
    """Every printed figure is what benchmark.json's own step times give."""
    warmup, per_worker_batch = report["num_warmup_batches"], report["per_worker_batch_size"]
    step_s = [(i + c) / 1000 for i, c in zip(report["steps_ms"]["input_wait"], report["steps_ms"]["compute"])]
    assert len(step_s) == warmup + report["num_batches"]
    lines = [m.groups() for m in map(STEP_LINE.match, stdout.splitlines()) if m]
    assert [int(g[0]) for g in lines] == [1, 5, 10, 12]  # the first, every display_every, the last
    for step, rate, stderr, jitter, loss in lines:
        expected = benchmark.speed_stats(step_s[warmup:warmup + int(step)], per_worker_batch)
        assert f"{expected['images_per_sec']:.1f}" == rate
        assert f"{expected['stderr']:.1f}" == stderr and f"{expected['jitter']:.1f}" == jitter
        assert f"{report['losses'][warmup + int(step) - 1]:.3f}" == loss
    last = stdout.strip().splitlines()[-1]
    assert last.split("total images/sec: ")[1] == f"{report['total_images_per_sec']:.2f}"
    assert report["total_images_per_sec"] == pytest.approx(sum(w["images_per_sec"] for w in report["per_worker"]), abs=0.02)
    assert [w["rank"] for w in report["per_worker"]] == list(range(report["num_workers"]))
    # the chief's own rate is its entry, and the figure with warm-up is lower (the first step traces)
    assert report["per_worker"][0]["images_per_sec"] == pytest.approx(report["chief"]["images_per_sec"], abs=0.01)
    assert report["total_images_per_sec_incl_warmup"] < report["total_images_per_sec"]
    breakdown = report["breakdown_ms"]
    assert breakdown["compute"] > 0 and breakdown["forward_backward"] > 0 and breakdown["gradient_allreduce"] >= 0
    assert breakdown["update_and_other"] == pytest.approx(
        breakdown["compute"] - breakdown["forward_backward"] - breakdown["gradient_allreduce"], abs=0.002)
    assert report["versions"]["tensorflow"] and report["host"]["cpu_count"] >= 1 and report["config"]["seed"] == 0


def read_report(workdir) -> dict:
    with open(os.path.join(workdir, layout.BENCHMARK)) as f:
        return json.load(f)


@pytest.mark.slow
def test_synthetic_mode_one_process_with_profiler_trace(tmp_path):
    result = run_cli("tfscale.benchmark", *SMALL_RUN, f"--workdir={tmp_path}", "--config.benchmark.mode=synthetic",
                     "--config.profile_steps=5,6")
    assert result.returncode == 0, result.stderr[-3000:]
    report = read_report(tmp_path)
    check_report_against_output(result.stdout, report)
    assert report["mode"] == "synthetic" and report["num_workers"] == 1 and report["config"]["data"]["dataset"] == "synthetic"
    # the device-resident batch: no step waits on an input pipeline
    assert max(report["steps_ms"]["input_wait"]) < 5
    traces = glob.glob(os.path.join(tmp_path, layout.TENSORBOARD, "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 1000, "profile_steps=5,6 must leave one trace for TensorBoard"


@pytest.mark.slow
@pytest.mark.alone  # the first bucket's all-reduce under way before the backward pass ends: a matter of timing
@pytest.mark.parametrize("backend, mode", [("mwms", "train"), ("horovod", "synthetic")])
def test_two_workers_chief_reports_both(backend, mode, tmp_path, monkeypatch):
    if backend == "horovod":
        pytest.importorskip("horovod.tensorflow", reason="Horovod is not installed: run `make horovod`")
        monkeypatch.setenv("HOROVOD_TIMELINE", str(tmp_path / "horovod_timeline.json"))
    # Gradients in 64 KiB buckets (the model's 0.3 MB in 6), two threads a worker: a bucket's all-reduce
    # can run beside the rest of the backward pass, which check_step_timeline asserts.
    result = run_cli("tfscale.launch", "--num_workers=2", f"--backend={backend}", "--threads_per_worker=2", "--",
                     "-m", "tfscale.benchmark", *SMALL_RUN, f"--workdir={tmp_path}", f"--config.benchmark.mode={mode}",
                     f"--config.distribute.backend={backend}", "--config.profile_steps=5,7",
                     f"--config.distribute.pack_bytes={BUCKET_BYTES}")
    assert result.returncode == 0, result.stderr[-3000:]
    report = read_report(tmp_path)
    check_report_against_output(result.stdout, report)
    assert report["num_workers"] == 2 and report["per_worker_batch_size"] == 16 and report["backend"] == backend
    assert all(w["images_per_sec"] > 0 for w in report["per_worker"])
    assert "[rank 1] Step" not in result.stdout  # only the chief prints the figures
    if backend == "horovod":
        assert report["versions"]["horovod"] == "0.28.1"
    if mode == "train":  # real input: learnable synthetic examples made on the host every step
        assert report["config"]["data"]["dataset"] == "synthetic_learnable"
    check_step_timeline(backend, tmp_path)


def check_step_timeline(backend: str, workdir) -> None:
    """tools/step_timeline.py on the run's trace: each step's collectives, as docs/benchmarking.md reads them,
    and the first gradient bucket's all-reduce under way before the backward pass ends."""
    tool = [sys.executable, "tools/step_timeline.py"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    if backend == "horovod":  # a step sends its gradients, grouped, and nothing else
        out = subprocess.run([*tool, f"--horovod_timeline={workdir / 'horovod_timeline.json'}"], cwd=REPO, env=env,
                             capture_output=True, text=True, check=True).stdout
        assert re.search(r"^ALLREDUCE .* gradient_all_reduce/HorovodGroupedAllreduce_", out, re.M), out
        assert "HorovodAllreduce_stack" not in out, out
        overlap = re.search(r"^(\d+) gradient buckets: the first began its all-reduce (-?[\d.]+) ms before", out, re.M)
        assert overlap and int(overlap[1]) == BUCKETS and float(overlap[2]) > 0, out
        return
    subprocess.run([*tool, str(workdir)], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    with open(workdir / "step_timeline.json") as f:
        summary = json.load(f)
    assert summary["steps"] == 3 and 0 < summary["compute_busy"] <= summary["step"]
    # Per step under MWMS: the gradients' all-reduce (`Cluster.reduce_gradients`' name scope), nothing else: the
    # losses with the stop flag are summed and BatchNorm's statistics averaged once per loop, not per step.
    assert set(summary["collectives"]) == {"gradient_all_reduce/CollectiveReduceV2"}
    # One a bucket. At most: on a loaded 2-core host a step's all-reduce event has been seen outside its
    # step's event in the trace, and step_timeline counts only events wholly inside a step.
    assert 0 < summary["collectives"]["gradient_all_reduce/CollectiveReduceV2"]["calls"] <= BUCKETS
    assert summary["first_gradient_all_reduce"] < summary["backward_end"], summary


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mwms", "horovod"])
def test_allreduce_mode_measures_every_size_and_the_models_gradients(backend, tmp_path):
    if backend == "horovod":
        pytest.importorskip("horovod.tensorflow", reason="Horovod is not installed: run `make horovod`")
    result = run_cli("tfscale.launch", "--num_workers=2", f"--backend={backend}", "--threads_per_worker=1", "--", "-m",
                     "tfscale.benchmark", *SMALL_RUN, f"--workdir={tmp_path}", "--config.benchmark.mode=allreduce",
                     "--config.benchmark.allreduce_max_bytes=65536", "--config.benchmark.num_batches=5")
    assert result.returncode == 0, result.stderr[-3000:]
    report = read_report(tmp_path)
    assert [r["size_bytes"] for r in report["allreduce"]] == [1024, 4096, 16384, 65536]
    for row in [*report["allreduce"], report["model_gradients"]]:
        assert row["algbw_GBps"] == pytest.approx(row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"])  # 2 (n-1) / n = 1 for two replicas
    from tfscale.model import build

    cfg = load_config("smoke")
    model = build.create_from_config(cfg)
    gradient_bytes = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights)
    assert report["model_gradients"]["size_bytes"] == gradient_bytes
    assert report["model_gradients"]["tensors"] == len(model.trainable_weights)
    assert "[rank 1]" not in "".join(line for line in result.stdout.splitlines() if "size(B)" in line)  # chief only
    last = result.stdout.strip().splitlines()[-1]
    assert re.search(rf"model gradients \(cifar_resnet8, {gradient_bytes / 1e6:.1f} MB\): busbw [\d.]+ GB/s$", last), last


@pytest.mark.slow
def test_train_loop_vs_keras_fit_as_users_run_it_and_matched(tmp_path):
    # tfscale with XLA on a CPU: Keras' compile defaults leave XLA off here (Keras 3 on a CPU-only machine), so
    # both Keras settings run, and each ratio comes from its own rounds.
    result = run_cli("tfscale.benchmark", *SMALL_RUN, f"--workdir={tmp_path}", "--config.benchmark.mode=train",
                     "--config.benchmark.compare_keras_fit=True", "--config.benchmark.rounds=2", "--config.jit_compile=True")
    assert result.returncode == 0, result.stderr[-3000:]
    comparison = read_report(tmp_path)["keras_fit_comparison"]
    assert comparison["tfscale_jit_compile"] is True
    assert comparison["keras_jit_compile"] == {"keras_fit": False, "keras_fit_matched": True}
    for keras_name, ratio_key, label in (("keras_fit", "paired_ratio", "model.fit as Keras users run it"),
                                         ("keras_fit_matched", "paired_ratio_matched", "model.fit matched")):
        assert len(comparison["rounds"][keras_name]) == 2 and comparison[f"{keras_name}_images_per_sec"] > 0
        # The ratios come from the unrounded rates; the stored rounds are rounded to 0.1 images/sec.
        within = sorted(a / b for a, b in zip(comparison["rounds"]["tfscale_loop"], comparison["rounds"][keras_name]))
        ratio = comparison[ratio_key]
        assert ratio["median"] == pytest.approx(statistics.median(within), abs=0.002)
        assert (ratio["min"], ratio["max"]) == pytest.approx((within[0], within[-1]), abs=0.002)
        assert f"tfscale = {ratio['median']:.3f}x (rounds {ratio['min']:.3f}-{ratio['max']:.3f}) {label}" in result.stdout
    assert comparison["tfscale_vs_keras_fit"] == comparison["paired_ratio"]["median"]
    assert comparison["tfscale_vs_keras_fit_matched"] == comparison["paired_ratio_matched"]["median"]
    assert "(no XLA, compile's defaults)" in result.stdout and "(XLA, matched to tfscale)" in result.stdout


def test_keras_fit_comparison_refuses_several_workers(tmp_path):
    result = run_cli("tfscale.benchmark", *SMALL_RUN, f"--workdir={tmp_path}", "--config.benchmark.compare_keras_fit=True",
                     "--config.distribute.backend=mirrored", "--config.distribute.num_cpu_devices=2")
    assert result.returncode != 0
    assert "compare_keras_fit=True compares one process on one device" in result.stderr
    assert not os.path.exists(os.path.join(tmp_path, layout.BENCHMARK))


@pytest.mark.parametrize("window", ["5", "6,5", "0,3", "a,b", "1,2,3"])
def test_profile_window_rejects_malformed(window):
    cfg = load_config("smoke", f"--config.profile_steps={window}")
    with pytest.raises(ValueError, match="config.profile_steps"):
        validation.validate(cfg)


def test_rounds_run_back_to_back_in_alternating_order_and_ratios_pair_within_rounds():
    """A host that drifts within a run must not favour a side: the order flips every round, and a ratio
    is taken inside each round (a ratio of medians would pair one round's tfscale with another's baseline)."""
    calls = []
    drift = iter(range(1, 100))  # the host speeds up with every measurement

    def candidate(name, speed):
        return lambda: calls.append(name) or speed * next(drift)

    rates = baselines.interleaved_rounds({"tfscale": candidate("tfscale", 1.0), "other": candidate("other", 1.0)}, 3)
    assert calls == ["tfscale", "other", "other", "tfscale", "tfscale", "other"]
    paired = baselines.paired_ratio(rates, "tfscale", "other")
    within = sorted(a / b for a, b in zip(rates["tfscale"], rates["other"]))  # 1/2, 4/3, 5/6
    assert paired == {"median": round(within[1], 3), "min": round(within[0], 3), "max": round(within[2], 3)}
    assert baselines.ratio_text(paired) == f"{within[1]:.3f}x (rounds {within[0]:.3f}-{within[2]:.3f})"
