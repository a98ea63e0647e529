"""What the planner does not know: a band around each efficiency it predicts, drawn from its errors on the runs
it has been checked against (docs/scaling.md: the published runs, and the test bed's two-host runs).

The band of a predicted efficiency p at N GPUs is [p - hi * w, p - lo * w]: lo and hi are the 10th and 90th
percentiles of the checked errors (predicted minus measured, in efficiency points), so that a new run erring as
the checked ones did falls inside 80 % of the time; w is 1 up to the largest GPU count checked, N_max, and
1 + log2(N / N_max) past it: each doubling beyond what any checked run reached widens the band by its own width
again. `held_out()` checks the claim the only fair way: the band drawn without one group of runs (one system),
tried on that group's points.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

COVERAGE = 0.8  # the band's nominal share of runs inside it: the 10th to the 90th percentile of the errors

# (group, GPUs, error points) of every checked point: predicted minus measured efficiency, in points.
# The published runs: the error column of `tfscale-plan --published` (docs/scaling.md, "Checked against published
# runs"; its calibration runs left out; a test keeps the two equal).
PUBLISHED = (
    *(("p100_ib_4gpu", n, e) for n, e in ((2, 5.1), (4, 0.2), (8, 4.4), (16, 4.3), (24, 11.0), (32, 14.3))),
    *(("p100_ib_4gpu", n, e) for n, e in ((2, 6.1), (4, 3.5), (16, 3.6), (24, 4.2), (32, 6.0))),
    *(("p100_ib_4gpu", n, e) for n, e in ((2, 4.7), (4, 1.6), (8, 3.2), (16, 3.6), (24, 3.1), (32, 9.7))),
    *(("k80_ec2_p2_8xlarge", n, e) for n, e in ((8, 7.9), (32, 6.1), (64, 5.6))),
    *(("k80_ec2_p2_8xlarge", n, e) for n, e in ((8, 2.2), (16, -1.5), (32, -1.6), (64, -1.5))),
    *(("k80_ec2_p2_8xlarge", n, e) for n, e in ((8, 2.3), (16, -7.5), (32, -9.3), (64, 0.5))),
    *(("pascal_roce_25g", n, e) for n, e in ((16, 0.3), (128, -2.1), (128, -6.2), (16, -7.8), (128, -6.8))),
    *(("pascal_roce_25g", n, e) for n, e in ((512, 3.2), (512, -0.4), (512, 0.0))),
    *(("pascal_tcp_40g", n, e) for n, e in ((64, 8.5), (64, 16.8))),
)
# The test bed (docs/scaling.md, "Checked on a test bed of two hosts"): 2 workers, one message then buckets at
# 50, 200, 1,000 Mbit/s and unshaped, each backend's median of 3 rounds against the prediction from the bed's own
# microbenchmarks (a test keeps these equal to the tables there).
BED = (
    *(("netbed_mwms", 2, e) for e in (-1.0, 0.1, -2.4, 6.8, 0.0, 20.8, 0.9, 23.2)),
    *(("netbed_horovod", 2, e) for e in (1.6, -3.2, 7.4, 5.6, 12.1, 27.6, 22.9, 30.5)),
    # With a straggler ("A straggler on the bed"), the planner told of the slowest GPU: MWMS then Horovod.
    *(("netbed_straggler", 2, e) for e in (-1.5, -2.2, 0.3, 5.3, 0.2, 2.9, 13.6, 12.5)),
)
CHECKED = PUBLISHED + BED


@dataclasses.dataclass(frozen=True)
class Band:
    low_error_points: float  # the errors' 10th percentile: the planner at its most pessimistic but for 1 in 10
    high_error_points: float  # their 90th: at its most optimistic but for 1 in 10
    max_checked_gpus: int  # the largest GPU count of a checked run: past it the band widens

    def widening(self, gpus: int) -> float:
        return 1.0 + max(0.0, math.log2(gpus / self.max_checked_gpus))

    def around(self, efficiency: float, gpus: int) -> tuple[float, float]:
        """(low, high) efficiency of the band around a prediction at `gpus` GPUs."""
        w = self.widening(gpus)
        return (max(0.0, efficiency - self.high_error_points * w / 100),
                min(1.0, efficiency - self.low_error_points * w / 100))

    def holds(self, gpus: int, error_points: float) -> bool:
        """Whether a run the planner missed by `error_points` at `gpus` GPUs lies inside the band."""
        w = self.widening(gpus)
        return self.low_error_points * w <= error_points <= self.high_error_points * w


def band_from(points=CHECKED) -> Band:
    """The band drawn from (group, GPUs, error points) triples."""
    errors = [error for _, _, error in points]
    deciles = statistics.quantiles(errors, n=10, method="inclusive")
    return Band(deciles[0], deciles[-1], max(gpus for _, gpus, _ in points))


BAND = band_from()


def attach(rows: list[dict], band: Band = BAND) -> list[dict]:
    """Adds each plan row's "efficiency_band": (low, high) around its efficiency against one GPU."""
    for row in rows:
        row["efficiency_band"] = band.around(row["efficiency"], row["gpus"]) if row["gpus"] > 1 else (1.0, 1.0)
    return rows


def held_out(points=CHECKED) -> list[dict]:
    """For each group: the band drawn from every other group's points, and how many of this group's lie inside."""
    rows = []
    for group in dict.fromkeys(g for g, _, _ in points):
        band = band_from([p for p in points if p[0] != group])
        mine = [(gpus, error) for g, gpus, error in points if g == group]
        rows.append({"group": group, "band": band, "points": len(mine),
                     "inside": sum(band.holds(gpus, error) for gpus, error in mine),
                     "widened": sum(band.widening(gpus) > 1 for gpus, _ in mine)})
    return rows


def markdown(rows: list[dict]) -> str:
    inside, total = sum(r["inside"] for r in rows), sum(r["points"] for r in rows)
    lines = [f"The band: the 10th to 90th percentile of {len(CHECKED)} checked errors, {BAND.low_error_points:+.1f} "
             f"to {BAND.high_error_points:+.1f} points (predicted minus measured), widening past "
             f"{BAND.max_checked_gpus} GPUs. Each group held out, its band drawn from the others:", "",
             "| held out | points | band (points) | widened (past the others' largest GPU count) | inside |",
             "|---|---|---|---|---|"]
    for r in rows:
        band = r["band"]
        lines.append(f"| {r['group']} | {r['points']} | {band.low_error_points:+.1f} to {band.high_error_points:+.1f} "
                     f"up to {band.max_checked_gpus} GPUs | {r['widened']} | {r['inside']} of {r['points']} |")
    published = [r for r in rows if not r["group"].startswith("netbed")]
    inside_published, published_total = sum(r["inside"] for r in published), sum(r["points"] for r in published)
    lines += ["", f"Held out, {inside} of {total} points ({100 * inside / total:.0f} %) fall inside their band, "
                  f"{inside_published} of the {published_total} published ones "
                  f"({100 * inside_published / published_total:.0f} %); stated: {100 * COVERAGE:.0f} %."]
    return "\n".join(lines)
