#!/usr/bin/env python3
r"""Image folders -> TFRecord shards in the standard ImageNet layout, plus a manifest.

    python tools/tfrecord_convert.py --input_dir=/data/ILSVRC/train --output_dir=/data/tfrecords \
        --split=train --num_shards=1024 [--class_order_file=F] [--class_text_file=F] \
        [--labels_file=F] [--resize_shorter=N] [--strict] [--num_workers=N] [--seed=0]

Same as the `tfscale-convert` console script; the logic and full documentation are in
tfscale/data/convert/convert.py and the modules its docstring names (`--help` lists the flags).
"""

import os
import sys

# Runs from a checkout too, without `pip install -e .`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfscale.data.convert import convert  # noqa: E402

if __name__ == "__main__":
    convert.run()
