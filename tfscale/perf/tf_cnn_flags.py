"""tf_cnn_benchmarks' command line for tfscale-bench: the lines of published studies and guides, run unchanged.

    mpirun -np 4 tfscale-bench --model resnet50 --batch_size 32 --variable_update horovod \
        --data_dir /data/imagenet --data_name imagenet --num_batches=200

A command line with tf_cnn_benchmarks' flags and no --config is translated into tfscale's own before absl
parses it (one line on stderr says into what), then runs as any tfscale-bench run: the same step, the same
tf_cnn-style output, benchmark.json in --train_dir (default runs/tf_cnn_benchmarks); tfscale's own
`--config.x.y=v` overrides may follow the line and win (tfscale.launch adds the backend's). What the flags mean
there (tensorflow/benchmarks scripts/tf_cnn_benchmarks/benchmark_cnn.py) and here:

  --model              resnet50 (tfscale's is v1.5, as NVIDIA's and MLPerf's), resnet101, resnet152
  --batch_size         per GPU, as there: the global batch is it x the job's GPUs (the launcher's world
                       size, x --num_gpus with replicated)
  --num_batches, --num_warmup_batches, --display_every     the same
  --use_fp16           precision mixed_float16           --xla, --xla_compile   jit_compile=True
  --data_dir           TFRecord shards (the training step on real data, input included); without it,
                       synthetic data as there           --data_name imagenet only
  --data_format        NCHW -> channels_first, NHWC -> channels_last
  --optimizer          momentum (0.9, its default) or sgd
  --variable_update    horovod -> backend horovod, collective_all_reduce -> mwms, replicated -> mirrored
  --num_gpus           GPUs of a replicated process; 1 with horovod and collective_all_reduce
  --train_dir          the workdir

Any other tf_cnn_benchmarks flag (parameter servers, --forward_only, --eval, ...) is refused by name: a
figure measured with a flag tfscale ignored would not be the figure asked for. The standard library only.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Mapping

MODELS = {"resnet50": "resnet50", "resnet50_v1.5": "resnet50", "resnet101": "resnet101", "resnet152": "resnet152"}
BACKENDS = {"horovod": "horovod", "collective_all_reduce": "mwms", "replicated": "mirrored"}
OPTIMIZER_MOMENTUM = {"momentum": 0.9, "sgd": 0.0}
DATA_FORMATS = {"NCHW": "channels_first", "NHWC": "channels_last"}
BOOLEAN_FLAGS = ("use_fp16", "xla", "xla_compile")
VALUE_FLAGS = ("model", "batch_size", "num_batches", "num_warmup_batches", "display_every", "data_dir", "data_name",
               "data_format", "optimizer", "variable_update", "num_gpus", "train_dir")
DEFAULT_WORKDIR = "runs/tf_cnn_benchmarks"
# Where a launcher says how many processes it started (mpirun, horovodrun, srun); tfscale.launch writes TF_CONFIG.
_WORLD_SIZE_KEYS = ("OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS")


class Refused(ValueError):
    """A tf_cnn_benchmarks command line tfscale-bench cannot run as asked."""


def is_tf_cnn_command(argv: list[str]) -> bool:
    """Whether `argv` (without the program) is a tf_cnn_benchmarks command line: its flags, no --config recipe
    (`--config.x.y=v` overrides may follow: tfscale.launch adds the backend's)."""
    names = {_name(arg)[0] for arg in argv if arg.startswith("--")}
    return "config" not in names and bool(names & {"model", "batch_size", "variable_update", "num_batches"})


def _overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(tf_cnn_benchmarks' arguments, tfscale's `--config.x.y=v` overrides) of `argv`."""
    overrides = [arg for arg in argv if arg.startswith("--config.")]
    return [arg for arg in argv if not arg.startswith("--config.")], overrides


def _name(arg: str) -> tuple[str, str | None]:
    name, eq, value = arg[2:].partition("=")
    return name, value if eq else None


def parse(argv: list[str]) -> dict[str, str | bool]:
    """{flag: value} of a tf_cnn_benchmarks command line ("--flag value", "--flag=value", "--flag" and "--noflag"
    for booleans); Refused naming any other argument."""
    flags, rest = {}, list(argv)
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("--"):
            raise Refused(f"unexpected argument {arg!r}: tf_cnn_benchmarks' flags only")
        name, value = _name(arg)
        if name in BOOLEAN_FLAGS or (name.startswith("no") and name[2:] in BOOLEAN_FLAGS):
            flags[name.removeprefix("no")] = (not name.startswith("no")) if value is None else \
                value.lower() in ("true", "1")
        elif name in VALUE_FLAGS:
            if value is None:
                if not rest:
                    raise Refused(f"--{name} needs a value")
                value = rest.pop(0)
            flags[name] = value
        else:
            raise Refused(f"--{name} is a flag tfscale-bench does not run (tf_cnn_benchmarks flags it runs: "
                          f"{', '.join('--' + f for f in (*VALUE_FLAGS, *BOOLEAN_FLAGS))})")
    return flags


def world_size(env: Mapping[str, str]) -> int:
    """Processes in the job, as its launcher says (1 without one)."""
    if "TF_CONFIG" in env:
        return len(json.loads(env["TF_CONFIG"])["cluster"]["worker"])
    for key in _WORLD_SIZE_KEYS:
        if env.get(key, "").isdigit():
            return int(env[key])
    return 1


def _choice(flags: dict, name: str, choices: Mapping, default: str):
    value = flags.get(name, default)
    if value not in choices:
        raise Refused(f"--{name}={value} is not one tfscale-bench runs ({', '.join(choices)})")
    return choices[value]


def tfscale_argv(argv: list[str]) -> list[str]:
    """`argv` (a whole command line, the program first) as tfscale-bench parses it: a tf_cnn_benchmarks line
    translated, the translation said on stderr; a refused one ends the process naming why; others unchanged."""
    if not is_tf_cnn_command(argv[1:]):
        return argv
    try:
        translated = translate(argv[1:])
    except Refused as err:
        sys.exit(f"tfscale-bench: {err}")
    print(f"tfscale-bench: tf_cnn_benchmarks' command line runs as: tfscale-bench {' '.join(translated)}",
          file=sys.stderr, flush=True)
    return [argv[0], *translated]


def translate(argv: list[str], env: Mapping[str, str] | None = None) -> list[str]:
    """tfscale-bench's arguments for a tf_cnn_benchmarks command line `argv` (without the program)."""
    env = os.environ if env is None else env
    argv, overrides = _overrides(argv)
    flags = parse(argv)
    model = _choice(flags, "model", MODELS, "resnet50")  # tf_cnn's default model is trivial: refused unless named
    backend = _choice(flags, "variable_update", BACKENDS, "replicated")
    gpus_per_process = int(flags.get("num_gpus", 1))
    if gpus_per_process != 1 and backend != "mirrored":
        raise Refused(f"--num_gpus={gpus_per_process} with --variable_update={flags['variable_update']}: one GPU per "
                      "process (start one process per GPU)")
    per_gpu = int(flags.get("batch_size", 32))  # tf_cnn's default batch is model-dependent; 32 for ResNet-50
    args = ["--config=r50_1gpu", f"--workdir={flags.get('train_dir', DEFAULT_WORKDIR)}",
            f"--config.model.name={model}", f"--config.distribute.backend={backend}",
            f"--config.data.global_batch_size={per_gpu * gpus_per_process * world_size(env)}",
            f"--config.data.max_per_replica_batch_size={per_gpu}",
            f"--config.optim.momentum={_choice(flags, 'optimizer', OPTIMIZER_MOMENTUM, 'momentum')}"]
    for name, key in (("num_batches", "num_batches"), ("num_warmup_batches", "num_warmup_batches"),
                      ("display_every", "display_every")):
        if name in flags:
            args.append(f"--config.benchmark.{key}={int(flags[name])}")
    if "data_dir" in flags:
        if flags.get("data_name", "imagenet") != "imagenet":
            raise Refused(f"--data_name={flags['data_name']}: tfscale-bench reads ImageNet-style TFRecords only "
                          "(data_name imagenet)")
        # tf_cnn_benchmarks reads the training shards only, and a benchmark evaluates nothing.
        args += [f"--config.data.data_dir={flags['data_dir']}", "--config.data.dataset=tfrecord",
                 "--config.data.eval_split=train", "--config.benchmark.mode=train"]
    else:
        args += ["--config.data.dataset=synthetic", "--config.benchmark.mode=synthetic"]
    if "data_format" in flags:
        args.append(f"--config.model.data_format={_choice(flags, 'data_format', DATA_FORMATS, 'NHWC')}")
    if flags.get("use_fp16"):
        args.append("--config.precision=mixed_float16")
    if flags.get("xla") or flags.get("xla_compile"):
        args.append("--config.jit_compile=True")
    return args + overrides  # last: they win
