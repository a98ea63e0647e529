"""The scaling report: speedup and efficiency against a published table, plots, sweeps, bad input."""

import json
import os
import statistics
import subprocess
import sys

import matplotlib.image
import pytest
from conftest import REPO

from tfscale.perf import scaling
from tfscale.workdir import layout

# A published ResNet-50 table: 1 GPU, then 8/16/24/32 GPUs (images/sec).
PUBLISHED = "workers,images_per_sec\n1,249.28\n8,1855.84\n16,3646.30\n24,5439.04\n32,6643.48\n"


def run_tool(name: str, *args: str, timeout_s: float = 600):
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", name), *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})


def test_published_table_speedup_and_efficiency(tmp_path):
    csv_path = tmp_path / "published.csv"
    csv_path.write_text(PUBLISHED)
    plot_path, markdown_path = tmp_path / "published.png", tmp_path / "published.md"
    result = run_tool("scaling_report.py", str(csv_path), "--reference=1", f"--plot={plot_path}",
                      f"--output={markdown_path}")
    assert result.returncode == 0, result.stderr
    row_32 = next(line for line in result.stdout.splitlines() if line.startswith("| published | 32 |"))
    assert row_32 == "| published | 32 | 6643.48 | 26.65x | 83.3% |"
    assert "| published | 8 | 1855.84 | 7.44x | 93.1% |" in result.stdout
    assert "| published | 32 | 6643.48 | 26.65x | 83.3% |" in markdown_path.read_text()
    assert "published.png" in markdown_path.read_text()  # the Markdown links its plot
    image = matplotlib.image.imread(str(plot_path))
    height, width = image.shape[:2]
    assert width > 1000 and height > 400  # two panels side by side, not an empty canvas
    assert image[..., :3].std() > 0.05


def test_reference_other_than_one():
    points = [scaling.Point("p", n, x) for n, x in ((8, 1855.84), (16, 3646.30), (32, 6643.48))]
    rows = {r["workers"]: r for r in scaling.scaling_rows(points, reference_workers=8)["p"]}
    assert rows[8]["speedup"] == 1.0 and rows[8]["efficiency"] == 1.0
    assert rows[32]["speedup"] == pytest.approx(6643.48 / 1855.84)
    assert rows[32]["efficiency"] == pytest.approx(6643.48 / (4 * 1855.84))  # E = X_N / ((N / N_ref) X_ref)


def test_benchmark_json_and_csv_series_together(tmp_path):
    for workers, rate in ((1, 100.0), (2, 180.0)):
        (tmp_path / f"b{workers}.json").write_text(json.dumps(
            {"backend": "horovod", "mode": "synthetic", "num_workers": workers, "total_images_per_sec": rate}))
    (tmp_path / "paper.csv").write_text("series,workers,images_per_sec\nHorovod paper,1,249.28\nHorovod paper,2,490\n")
    tables = scaling.scaling_rows(scaling.load([str(tmp_path / "b1.json"), str(tmp_path / "b2.json"),
                                                str(tmp_path / "paper.csv")]))
    assert set(tables) == {"horovod synthetic", "Horovod paper"}
    assert tables["horovod synthetic"][1]["efficiency"] == pytest.approx(0.9)


@pytest.mark.parametrize("content, message", [
    ("gpus,rate\n1,2\n", "t.csv: needs columns workers,images_per_sec; missing images_per_sec, workers"),
    ("workers,images_per_sec\n1,fast\n", "t.csv:2: cannot read workers='1' images_per_sec='fast'"),
    ("workers,images_per_sec\n2,100\n4,180\n", "no figure for the reference 1 workers (it has 2, 4)"),
    ("workers,images_per_sec\n1,100\n1,110\n", "two figures for 1 workers"),
])
def test_bad_tables_are_named(tmp_path, content, message):
    path = tmp_path / "t.csv"
    path.write_text(content)
    result = run_tool("scaling_report.py", str(path), "--reference=1")
    assert result.returncode != 0
    assert message in result.stderr


def test_missing_input_file(tmp_path):
    result = run_tool("scaling_report.py", str(tmp_path / "nope.json"))
    assert result.returncode != 0 and "scaling input not found" in result.stderr and "nope.json" in result.stderr


@pytest.mark.slow
def test_sweep_runs_one_and_two_workers_and_reports(tmp_path):
    result = run_tool("sweep.py", f"--workdir={tmp_path}", "--workers=1,2", "--backends=mwms", "--num_batches=6",
                      "--num_warmup_batches=2", "--per_worker_batch=8", "--rounds=2", "--",
                      "--config.benchmark.breakdown_batches=2")
    assert result.returncode == 0, result.stderr[-3000:]
    reports = {(n, r): json.loads((tmp_path / f"mwms_{n}_round{r}" / layout.BENCHMARK).read_text())
               for n in (1, 2) for r in (1, 2)}
    assert [reports[n, 1]["num_workers"] for n in (1, 2)] == [1, 2]
    assert [reports[n, 2]["global_batch_size"] for n in (1, 2)] == [8, 16]  # weak scaling: batch per worker fixed
    # Each round's efficiency from its own two runs; the table gives their median (of two: the mean) and range.
    efficiencies = [reports[2, r]["total_images_per_sec"] / (2 * reports[1, r]["total_images_per_sec"]) for r in (1, 2)]
    x2 = statistics.median(reports[2, r]["total_images_per_sec"] for r in (1, 2))
    assert f"| mwms synthetic | 2 | {x2:.2f} | " in result.stdout
    assert (f"| mwms synthetic | 2 | {' / '.join(f'{100 * e:.1f}%' for e in efficiencies)} | "
            f"{100 * statistics.median(efficiencies):.1f}% | {100 * abs(efficiencies[0] - efficiencies[1]):.1f} pts |"
            in result.stdout)
    # The host's ceiling: in each round two independent 1-worker jobs side by side, their mean rate over the round's
    # 1-worker rate, printed beside the efficiency they bound.
    independent = [[json.loads((tmp_path / f"independent_2x1_round{r}" / f"job{i}" / layout.BENCHMARK).read_text())
                    for i in (0, 1)] for r in (1, 2)]
    assert all(job["num_workers"] == 1 and job["global_batch_size"] == 8 for jobs in independent for job in jobs)
    ceilings = [statistics.mean(job["total_images_per_sec"] for job in jobs) / reports[1, r]["total_images_per_sec"]
                for r, jobs in zip((1, 2), independent)]
    assert json.loads((tmp_path / "ceiling.json").read_text()) == {"2": ceilings}
    ceiling, efficiency = statistics.median(ceilings), statistics.median(efficiencies)
    assert (f"| 2 | {' / '.join(f'{100 * c:.1f}%' for c in ceilings)} | {100 * ceiling:.1f}% | "
            f"{100 * efficiency:.1f}% ({efficiency / ceiling:.2f}) |") in result.stdout
    x1, x2 = (reports[n, 1]["total_images_per_sec"] for n in (1, 2))  # the prediction is of the first round
    assert (tmp_path / "report.png").stat().st_size > 10_000
    report = (tmp_path / "report.md").read_text()
    assert "| mwms synthetic | 1 |" in report
    # tfscale-plan's prediction of the 2-worker point from the 1-worker rate and the all-reduce table measured after it.
    assert "## Predicted (tfscale-plan from the 1-worker run and the all-reduce table) vs measured" in report
    [predicted] = json.loads((tmp_path / "prediction.json").read_text())
    assert (predicted["backend"], predicted["workers"]) == ("mwms", 2)
    assert predicted["measured_images_per_sec"] == x2 and 0 < predicted["predicted_efficiency"] <= 1
    allreduce = json.loads((tmp_path / "mwms_2_allreduce" / layout.BENCHMARK).read_text())
    assert allreduce["mode"] == "allreduce" and allreduce["num_replicas"] == 2
