#!/usr/bin/env python3
"""Conversion tool throughput: all cores vs one process, measured side by side in one run.

    python tools/bench_convert.py --input_dir=runs/photos --num_shards=16 [--rounds=3]

Converts the same image tree into fresh shard directories with `num_workers=1` and with every
available core, in turn for `--rounds` rounds (so background load hits both alike), and prints the
median images/sec of each and their ratio. The shards are deleted after each conversion: a second
conversion into the same directory would resume and skip the work.
"""

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from tfscale import io as tfio  # noqa: E402
from tfscale.data.convert import convert, parallel  # noqa: E402

_INPUT_DIR = flags.DEFINE_string("input_dir", None, "Class-folder image tree to convert.", required=True)
_NUM_SHARDS = flags.DEFINE_integer("num_shards", 16, "Shards per conversion.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds; the median is reported.")
_OUTPUT = flags.DEFINE_string("output", None, "Optional JSON file for the figures.")


def images_per_sec(num_workers: int) -> float:
    output_dir = tempfile.mkdtemp(prefix="tfscale_bench_convert_")
    try:
        start = time.perf_counter()
        manifest = convert.convert(_INPUT_DIR.value, output_dir, "train", _NUM_SHARDS.value, num_workers=num_workers)
        return manifest["num_examples"] / (time.perf_counter() - start)
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)


def main(argv):
    all_cores = parallel.default_num_workers()
    rates = {1: [], all_cores: []}
    for _ in range(_ROUNDS.value):
        for workers in rates:
            rates[workers].append(images_per_sec(workers))
    one, many = statistics.median(rates[1]), statistics.median(rates[all_cores])
    print(f"conversion, images/sec (median of {_ROUNDS.value} rounds, {_NUM_SHARDS.value} shards):")
    print(f"  1 process        {one:8.1f}")
    print(f"  {all_cores} processes      {many:8.1f}   = {many / one:.2f}x")
    result = {"one_process_images_per_sec": round(one, 1), "all_cores_images_per_sec": round(many, 1),
              "all_cores": all_cores, "speedup": round(many / one, 3),
              "rounds": {str(k): [round(r, 1) for r in v] for k, v in rates.items()}}
    if _OUTPUT.value:
        tfio.write_json(_OUTPUT.value, result)
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
