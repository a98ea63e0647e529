"""`python -m tfscale.benchmark --config=PATH --workdir=DIR ...`: the tf_cnn_benchmarks-style benchmark.

An entry point only; the benchmark lives in tfscale.perf.benchmark (the console script `tfscale-bench` is the same).
"""

from tfscale import logs

logs.quiet_tensorflow_banner(__name__)  # TensorFlow's C++ INFO banner off, before TensorFlow is imported

from tfscale.perf.benchmark import run  # noqa: E402

if __name__ == "__main__":
    run()
