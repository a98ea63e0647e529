#!/usr/bin/env python3
r"""Copy TFRecord shards from the shared file system to node-local storage before training.

    python tools/stage_data.py --src_dir=/shared/tfrecords [--dest_dir=$TMPDIR/tfscale_data] \
        [--splits=train,validation] [--files=train-00000-of-01024,...] [--verify=sha256|size] \
        [--lock_timeout_s=3600] [--num_threads=4]

Run it once per node (or from every process: one copies, the others wait). Prints the staged
directory on stdout, so a job script can do DATA_DIR=$(python tools/stage_data.py ...).
The logic and full documentation are in tfscale/data/stage.py (`--help` lists the flags).
"""

import os
import sys

# Runs from a checkout too, without `pip install -e .`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfscale.data import stage  # noqa: E402

if __name__ == "__main__":
    stage.run()
