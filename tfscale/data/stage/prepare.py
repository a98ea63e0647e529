"""A run's shard directory, ready to read: staged to node-local disk first when `data.stage_dir` is set,
then checked against the conversion manifest (`prepare_data_dir`, called by the training and benchmark
set-up). Apart from the staging command (stage.py), which does not import TensorFlow.
"""

from __future__ import annotations

import ml_collections

from tfscale.data.input import shard_dir
from tfscale.data.stage.stage import stage
from tfscale.data.stage.stage_plan import Readers


def prepare_data_dir(data_cfg: ml_collections.ConfigDict, *, num_train_examples: int, num_eval_examples: int,
                     worker_ranks: tuple[int, ...] | None = None, num_workers: int | None = None) -> str:
    """The directory to read shards from: staged to `data.stage_dir` first when set; checked.

    Staging copies every eval shard and, with `worker_ranks` (of `num_workers`), only the train shards
    those workers read under data.assignment; without them every shard. Training and benchmarking
    (tfscale.training.engine) pass each worker's own rank: the workers of a node share the stage dir and take
    turns under its lock, so the node's copy holds what its workers read.
    A staged copy may lack other workers' train shards: each worker checks its own when it builds
    its dataset. Anywhere else every shard must be there.
    """
    if data_cfg.dataset != "tfrecord":
        return data_cfg.data_dir
    data_dir = data_cfg.data_dir
    shard_dir.check_same_classes(data_cfg)  # before staging: a wrong eval split is not worth copying
    if data_cfg.stage_dir:
        readers = None
        # Evaluating on the train split reads every file of it on every worker: then stage it whole.
        if worker_ranks is not None and data_cfg.eval_split != data_cfg.train_split:
            readers = Readers(tuple(worker_ranks), num_workers, data_cfg.assignment, data_cfg.copies,
                              data_cfg.assignment_level)
        data_dir = stage(data_dir, data_cfg.stage_dir, splits=(data_cfg.train_split, data_cfg.eval_split),
                         train_split=data_cfg.train_split, readers=readers).dest_dir
    for split, num_examples in ((data_cfg.train_split, num_train_examples), (data_cfg.eval_split, num_eval_examples)):
        # Train shards of a staged copy may be another node's: each worker checks its own in _worker_records.
        partial = split == data_cfg.train_split != data_cfg.eval_split and shard_dir.is_staged_copy(data_dir)
        shards = shard_dir.list_shards(data_dir, split)
        if not partial:
            shard_dir.require_present(shards, data_dir, f"of {split}")
        shard_dir.check_against_manifest(data_cfg, data_dir, split, num_examples, allow_missing=partial)
    return data_dir
