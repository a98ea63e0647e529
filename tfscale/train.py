"""`python -m tfscale.train --config=PATH[:ARG] --workdir=DIR [--config.a.b=v ...]`: the training command.

An entry point only; the run lives in tfscale.training.train (the console script `tfscale-train` is the same).
"""

from tfscale import logs

logs.quiet_tensorflow_banner(__name__)  # TensorFlow's C++ INFO banner off, before TensorFlow is imported

from tfscale.training.train import run  # noqa: E402

if __name__ == "__main__":
    run()
