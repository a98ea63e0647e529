"""`python -m tfscale.doctor [--only=gpus,horovod] [--json=PATH]`: the GPU node's self-check, as the sbatch
templates run it before training.

An entry point only; the checks live in tfscale.perf.doctor (the console script `tfscale-doctor` is the same).
"""

from tfscale import logs

logs.quiet_tensorflow_banner(__name__)  # TensorFlow's C++ INFO banner off, before TensorFlow is imported

from tfscale.perf.doctor import run  # noqa: E402

if __name__ == "__main__":
    run()
