#!/usr/bin/env python3
r"""Copy TFRecord shards from the shared file system to node-local storage before training.

    python tools/stage_data.py --src_dir=/shared/tfrecords [--dest_dir=$TMPDIR/tfscale_data] \
        [--splits=train,validation] [--files=train-00000-of-01024,...] [--verify=sha256|size] \
        [--num_workers=W --worker_ranks=0-3 [--assignment=disjoint|full|coarse|medium_coarse|fine_grained|overlap] [--copies=C]] \
        [--config=configs/r50_32gpu.py [--config.data.assignment=...]] \
        [--lock_timeout_s=3600] [--num_threads=4] [--progress_every_s=30] [--read_attempts=4 --read_retry_delay_s=1]

Run it once per node (or from every process: one copies, the others wait). Prints the staged
directory on stdout, so a job script can do DATA_DIR=$(python tools/stage_data.py ...).
With --num_workers and --worker_ranks (this node's training workers) only the train shards those
workers read are staged (every eval shard always); --config takes the splits and the assignment
scheme from the training config and its overrides, as the Slurm templates do. Default: every shard.
The logic and full documentation are in tfscale/data/stage/stage.py and the modules its docstring names
(`--help` lists the flags).
"""

import os
import sys

# Runs from a checkout too, without `pip install -e .`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfscale.data.stage import stage  # noqa: E402

if __name__ == "__main__":
    stage.run()
