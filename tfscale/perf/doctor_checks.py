"""The names of tfscale-doctor's checks, without TensorFlow: tools/make_sbatch.py validates --doctor with
them before every job, and importing tfscale.perf.doctor would cost it TensorFlow's import (~3 s)."""

CHECK_NAMES = ("gpus", "driver", "memory-growth", "all-reduce", "horovod", "xla-step", "float16-step", "dali",
               "gpu-bandwidth", "throughput")  # in the order they run
SLOW_CHECKS = ("xla-step", "float16-step", "throughput")  # each compiles ResNet-50; --fast skips them
