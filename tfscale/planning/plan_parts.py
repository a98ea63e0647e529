"""What each part of the step is worth at N GPUs: `tfscale-plan --parts`.

The plan of a config with its step's parts switched off, then on one at a time, each row keeping the
ones above it: the finite-flag all-reduce a skip decided before the gradients' sum would need (tfscale
decides on the sum: Cluster.reduce_gradients), Keras' update launched variable by variable
(optim.compiled_update), a checkpoint every worker waits for (checkpoint.async_save). The last row
sends the gradients in buckets while the backward pass runs, which needs jit_compile=False: it is
planned at the XLA one-GPU rate, an upper bound, beside the rate without XLA at which it breaks even.
"""

from __future__ import annotations

import dataclasses

from tfscale.planning.plan_model import System, Workload, best_bucket_bytes, keras_update_ops, predict_point

SKIP_FLAG_BYTES = 4  # one float32: did any replica's gradients overflow?


def variants(precision: str, workload: Workload, system: System, num_gpus: int) -> list[tuple[str, Workload]]:
    """(what changed, the workload): everything off, each part on in turn, then buckets instead of XLA."""
    step = dataclasses.replace(workload, step_collectives=(SKIP_FLAG_BYTES,), async_checkpoint=False,
                               update_ops=keras_update_ops(precision, workload.num_variables))
    rows = [("a finite-flag all-reduce before the gradients', Keras' update, synchronous checkpoints", step)]
    step = dataclasses.replace(step, step_collectives=())
    rows.append(("+ the skip decided on the summed gradients", step))
    step = dataclasses.replace(step, update_ops=0)
    rows.append(("+ the update compiled (optim.compiled_update)", step))
    step = dataclasses.replace(step, async_checkpoint=True)
    rows.append(("+ asynchronous checkpoints (checkpoint.async_save)", step))
    pack_bytes, _ = best_bucket_bytes(step, system, num_gpus)
    rows.append((f"gradients in buckets of {pack_bytes >> 20} MiB while the backward pass runs, instead of XLA",
                 dataclasses.replace(step, overlap="buckets", fusion_bytes=pack_bytes)))
    return rows


def break_even_rate(xla: Workload, bucketed: Workload, system: System, num_gpus: int) -> float:
    """The one-GPU images/sec without XLA at which `bucketed` is as fast at `num_gpus` as `xla` at the system's."""
    target = predict_point(xla, system, num_gpus)["images_per_sec"]
    low, high = 0.0, system.gpu_images_per_sec * 2
    for _ in range(50):  # bisection: the bucketed rate grows with the one-GPU rate
        mid = (low + high) / 2
        rate = predict_point(bucketed, dataclasses.replace(system, gpu_images_per_sec=mid), num_gpus)["images_per_sec"]
        low, high = (mid, high) if rate < target else (low, mid)
    return high


def table(precision: str, workload: Workload, system: System, gpu_counts: list[int]) -> str:
    """A markdown table per GPU count: each variant's images/sec, efficiency and where its time goes."""
    lines = []
    for gpus in gpu_counts:
        rows = variants(precision, workload, system, gpus)
        lines += [f"{gpus} GPUs ({system.name}):", "",
                  "| step | images/sec | of N x 1 GPU | step ms | all-reduce exposed ms | update ms | eval+ckpt "
                  f"| {workload.epochs:g} epochs |", "|---|---|---|---|---|---|---|---|"]
        for what, variant in rows:
            r = predict_point(variant, system, gpus)
            efficiency = r["images_per_sec"] / (gpus * system.gpu_images_per_sec)
            lines.append(f"| {what} | {r['images_per_sec']:.0f} | {efficiency:.3f} | {r['step_ms']:.1f} | "
                         f"{r['exposed_ms']:.1f} | {r['update_ms']:.1f} | {100 * r['eval_checkpoint_share']:.1f}% | "
                         f"{r['hours_for_epochs']:.2f} h |")
        rate = break_even_rate(rows[-2][1], rows[-1][1], system, gpus)
        lines += ["", f"Buckets win at {gpus} GPUs only if the one-GPU rate without XLA reaches {rate:.0f} images/sec "
                      f"({rate / system.gpu_images_per_sec:.0%} of the XLA rate, {system.gpu_images_per_sec:g}).", ""]
    return "\n".join(lines).strip()
