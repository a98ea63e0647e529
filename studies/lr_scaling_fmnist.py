"""Linear LR scaling and warmup at growing global batch, the per-replica batch fixed: the LR-scaling thesis's Exps 5-9.

    make fashion-mnist
    tfscale-convert --format=idx --input_dir=/usr/share/datasets/fashion-mnist --output_dir=runs/fmnist55k \
        --validation_examples=5000
    python -m tfscale.study studies/lr_scaling_fmnist.py --workdir=runs/study_lr_scaling

The thesis (ResNet-50 on ImageNet, 90 epochs) grows the global batch by adding GPUs at 128 images per
GPU (32 only in Exp 7), so every BatchNorm sees the same batch at every scale. Here a "replica" is a
BatchNorm group of 32 images (ghost BatchNorm, `model.bn_group_size`): batch 1024 is 32 replicas x 32,
as batch 4096 is 32 GPUs x 128 in the thesis, and every LR is the thesis's at the same replica count:
0.05 a replica (its 1-GPU LR), 1.6 at 32 replicas. At 32 images a replica, not 128, that is 0.4 per
256 images where the thesis ran 0.1: four times its LR per image. The cells:

  b32             1 replica, LR 0.05, no warmup (the thesis's 1-GPU run; one run, the figure's reference)
  linear          32 replicas, LR 1.6, no warmup (Exp 5)
  stepping1       + a 1-epoch stepping warmup per epoch: 0.8, then 1.6 (Exp 6)
  stepping1_b256  the same at a quarter of the batch, 8 replicas, LR 0.4 (Exp 7: 32 images per GPU,
                  a quarter of the global batch at the same GPU count; here the replica stays 32 images)
  gradual1        + a 1-epoch gradual warmup per epoch from the 1-replica LR 0.05 (Exp 8)
  gradual2        + a 2-epoch gradual warmup per epoch: 0.05, 0.825, then 1.6 (Exp 9)

Scaled down: ResNet-8 on the whole 55,000-image Fashion-MNIST training split (5,000 held out for
evaluation), 9 epochs with the LR / 10 at 3, 6 and 8 (the thesis's 30/60/80 of 90), weight decay 1e-4 as
in the thesis. Batch 1024 makes 53 steps an epoch, 477 in all. A per-epoch warmup cannot be shorter than
an epoch, so the thesis's 5- and 10-epoch warmups (1/18 and 1/9 of its run) become 1 and 2 epochs here
(1/9 and 2/9). The pilots that chose batch 1024 at LR 1.6 are studies/pilots/. Report:
docs/studies/lr_scaling.md; raw per-run values: docs/studies/lr_scaling.json.

`lr_scaling_fmnist.py:thesis` is the thesis's own version (ResNet-50, ImageNet, 32 GPUs; Exps 4-9) as a
Slurm job array (docs/studies.md):

    python tools/make_sbatch.py --study=studies/lr_scaling_fmnist.py:thesis --nodes=8 --gpus_per_node=4 \
        --backend=mwms --config.data.data_dir=/shared/imagenet --time=24:00:00 ...
"""

DATA_DIR = "runs/fmnist55k"
REPLICA_BATCH = 32  # images per BatchNorm group, the same in every cell
REPLICA_LR = 0.05  # the thesis's 1-GPU LR; linear scaling gives 0.05 x replicas
EPOCHS = 9
LR_PER_256 = REPLICA_LR * 256 / REPLICA_BATCH  # 0.4

# cell -> (replicas, warmup, warmup epochs); the thesis's experiment in the docstring above
CELLS = {
    "b32": (1, "none", 0),
    "linear": (32, "none", 0),
    "stepping1": (32, "stepping", 1),
    "stepping1_b256": (8, "stepping", 1),
    "gradual1": (32, "gradual", 1),
    "gradual2": (32, "gradual", 2),
}


def cell_overrides(replicas: int, warmup: str, warmup_epochs: int) -> list[str]:
    return [f"--config.data.global_batch_size={replicas * REPLICA_BATCH}",
            f"--config.schedule.warmup={warmup}", f"--config.schedule.warmup_epochs={warmup_epochs}"]


def comparisons(stepping: str, gradual: str, gradual_long: str, stepping_quarter_batch: str) -> list[dict]:
    """The thesis's questions, by the cells' names: does a warmup help, does a longer one, does Exp 7 differ, and
    is a gradual warmup on par with a stepping one (its Exp 8 finding)?"""
    return [*({"cell": warmup, "against": "linear", "alternative": "greater"} for warmup in (stepping, gradual,
                                                                                             gradual_long)),
            {"cell": gradual_long, "against": gradual, "alternative": "two-sided"},  # Exp 9 against Exp 8
            {"cell": stepping_quarter_batch, "against": stepping, "alternative": "two-sided"},  # Exp 7 against 6
            {"cell": gradual, "against": stepping, "alternative": "two-sided"}]  # Exp 8 against 6: "on par"


def get_study(scale: str = ""):
    if scale == "thesis":
        return thesis_study()
    if scale:
        raise ValueError(f"lr_scaling_fmnist.py:{scale}: the versions are this file (no argument) and :thesis")
    cells = {name: {"overrides": cell_overrides(*spec),
                    "plot_values": {"global batch": spec[0] * REPLICA_BATCH,
                                    "warmup": "none" if spec[2] == 0 else f"{spec[1]} {spec[2]} ep"}}
             for name, spec in CELLS.items()}
    cells["b32"]["plot_values"]["warmup"] = sorted({v["plot_values"]["warmup"] for v in cells.values()})  # every
    # line starts at the 1-replica run, which is the reference point of the figure: one run, no Welch test (it
    # takes the longest, 1,718 steps an epoch; the thesis's own 1-GPU run, 75.028 % top-1, is one run too)
    cells["b32"]["seeds"] = [0]
    return {
        "config": "configs/fmnist_resnet.py",
        "overrides": [f"--config.data.data_dir={DATA_DIR}", "--config.data.num_train_examples=55000",
                      "--config.data.shuffle_buffer=55000", f"--config.model.bn_group_size={REPLICA_BATCH}",
                      f"--config.optim.lr_per_256={LR_PER_256}", "--config.optim.weight_decay=1e-4",
                      f"--config.schedule.warmup_init_lr={REPLICA_LR}", "--config.schedule.warmup_granularity=epoch",
                      f"--config.train.epochs={EPOCHS}", "--config.schedule.decay_epochs=(3, 6, 8)",
                      f"--config.checkpoint.every_epochs={EPOCHS}", f"--config.train.eval_every_epochs={EPOCHS}",
                      "--config.train.log_every_steps=50"],
        "cells": cells,
        "seeds": [0, 1, 2, 3, 4],
        "baseline": "linear",  # the warmups' question: does one do better than linear scaling alone?
        "comparisons": comparisons("stepping1", "gradual1", "gradual2", "stepping1_b256"),
        "plot": {"x": "global batch", "series": "warmup", "x_label": "global batch (32 images a replica)",
                 "log_x": True},
        "title": "LR scaling and warmup, 32 images a replica: ResNet-8, Fashion-MNIST 55k, 9 epochs",
    }


def thesis_study():
    """The thesis's own Exps 4-9 (configs/seed000_r50.py's methods): ResNet-50 on ImageNet, 32 GPUs x 128,
    90 epochs, 5- and 10-epoch warmups. Every cell runs on the job's 32 GPUs (Exp 7 with 32 images a GPU);
    the 1-GPU run is a job of its own (configs/seed000_r50.py's docstring)."""
    stepping5 = ["--config.schedule.warmup=stepping", "--config.schedule.warmup_epochs=5"]
    cells = {"naive": ["--config.optim.lr_per_256=0.00625"],  # LR 0.1 at batch 4096 (Exp 4)
             "linear": [],  # LR 1.6 (Exp 5)
             "stepping5": stepping5,  # Exp 6
             "stepping5_32": [*stepping5, "--config.data.global_batch_size=1024"],  # Exp 7: 32 images a GPU
             "gradual5": ["--config.schedule.warmup=gradual", "--config.schedule.warmup_epochs=5"],  # Exp 8
             "gradual10": ["--config.schedule.warmup=gradual", "--config.schedule.warmup_epochs=10"]}  # Exp 9
    return {
        "config": "configs/seed000_r50.py:linear",
        "overrides": [],  # data.data_dir: the job's (tools/make_sbatch.py --config.data.data_dir=...)
        "cells": cells,
        "seeds": [0, 1, 2, 3, 4],
        "baseline": "linear",
        "comparisons": comparisons("stepping5", "gradual5", "gradual10", "stepping5_32"),
        "title": "LR scaling and warmup: ResNet-50, ImageNet, 32 GPUs (the LR-scaling thesis's Exps 4-9)",
    }
