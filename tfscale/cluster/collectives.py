"""The backend half of `distribute.Cluster`: how replicas and processes reduce, broadcast and shard.

`Collectives` is the interface; `StrategyCollectives` (one_device, mirrored, mwms) and
`HorovodCollectives` (horovod) implement it. `distribute.setup` picks one and the Cluster delegates
to it, so the Cluster's methods hold no backend branches. The rest of tfscale calls the Cluster
methods of the same names, never these classes; this module imports neither Horovod nor any cluster
environment (`distribute` passes it the horovod module).
"""

from __future__ import annotations

import abc
import itertools
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.python.data.ops import multi_device_iterator_ops  # see untune_device_datasets
from tensorflow.python.ops import collective_ops  # sub-group all-reduce; tf.distribute's API has none

from tfscale import compat

# Collective keys of household all-reduces under tf.distribute: far above the small group keys
# MultiWorkerMirroredStrategy allocates from 1 upwards, so they never collide.
_HOUSEHOLD_GROUP_KEY_BASE = 1 << 20
_HOUSEHOLD_INSTANCE_KEY = 1 << 20

InputFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]


def device_input_options(prefetch_batches: int) -> tf.distribute.InputOptions:
    """Batches go to the replicas' devices ahead of the step: `prefetch_batches` per replica.

    On GPUs the host-to-device copy of the next batches then overlaps the current step (TensorFlow
    fetches to the device by default, one batch deep); on CPU-only hosts the "device" is host memory.
    """
    return tf.distribute.InputOptions(experimental_fetch_to_device=True,
                                      experimental_per_replica_buffer_size=prefetch_batches)


def untune_device_datasets() -> None:
    """The per-device datasets behind every tf.distribute input run without tf.data's autotuner.

    tf.distribute feeds replicas through a MultiDeviceIterator, which wraps each device's share in
    a dataset of its own (a generator plus a one-batch prefetch) with default options, so autotune
    on: tensorflow/python/data/ops/multi_device_iterator_ops.py, `_create_device_dataset` (TF
    2.19-2.21). Each such iterator then owns an autotune model thread, and deleting it joins that
    thread, which sleeps up to a minute between tuning rounds: `make demo` spent 55 s ending its
    input. A one-batch prefetch has nothing to tune, and no InputOptions reaches these datasets
    (PER_REPLICA mode would, but MultiWorkerMirroredStrategy refuses it), so tfscale wraps the
    private builder. If a TensorFlow release renames it, the input still works; only the stall
    may return, which the warning says.
    """
    build = getattr(multi_device_iterator_ops, "_create_device_dataset", None)
    if build is None:
        logging.warning("tf.distribute's per-device input datasets keep tf.data's autotuner: %s. A run's end "
                        "may wait for its model thread",
                        compat.hook_note("tensorflow", "multi_device_iterator_ops._create_device_dataset"))
        return
    if getattr(build, "untuned", False):
        return

    def build_untuned(*args, **kwargs):
        options = tf.data.Options()
        options.autotune.enabled = False
        return build(*args, **kwargs).with_options(options)

    build_untuned.untuned = True
    multi_device_iterator_ops._create_device_dataset = build_untuned


def gradient_buckets(grads: list[tf.Tensor | None], bucket_bytes: int) -> list[list[int]]:
    """Indexes of `grads` in buckets of at most `bucket_bytes` (a larger tensor alone; 0: one bucket),
    filled from the last gradient to the first: the order a backward pass produces them."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if not bucket_bytes:
        return [present[::-1]] if present else []
    buckets, size = [], 0
    for index in reversed(present):
        grad_bytes = grads[index].shape.num_elements() * grads[index].dtype.size
        if not buckets or size + grad_bytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(index)
        size += grad_bytes
    return buckets


class Collectives(abc.ABC):
    """How one backend reduces across replicas and processes (see the Cluster method of the same name)."""

    saving_is_collective: bool  # every worker must take part in a checkpoint save
    averages_gradients: bool  # the gradient reduction averages (True) or sums (False) the replicas'

    @abc.abstractmethod
    def reduce_gradients(self, grads: list[tf.Tensor | None]) -> list[tf.Tensor | None]: ...

    @abc.abstractmethod
    def mean_over_replicas(self, values: list[tf.Tensor]) -> list[tf.Tensor]:
        """Replica-context mean of each tensor."""

    @abc.abstractmethod
    def mean_over_household(self, values: list[tf.Tensor]) -> list[tf.Tensor]:
        """Replica-context mean of each tensor over this replica's household (local SGD)."""

    @abc.abstractmethod
    def sum_over_processes(self, tensor: tf.Tensor) -> tf.Tensor: ...

    @abc.abstractmethod
    def sum_over_workers(self, rows: np.ndarray) -> np.ndarray:
        """Eager sum of a [num_workers, n] array that each worker passes with only its own row filled."""

    @abc.abstractmethod
    def broadcast_from_chief(self, variables) -> None: ...

    @abc.abstractmethod
    def distribute_dataset(self, input_fn: InputFn): ...


class StrategyCollectives(Collectives):
    """tf.distribute (one_device, mirrored, mwms): the strategy's own all-reduces; replicas start and stay equal."""

    saving_is_collective = True
    averages_gradients = False

    def __init__(self, strategy: tf.distribute.Strategy, device_prefetch_batches: int = 1, bucket_bytes: int = 0,
                 household_size: int = 0, communication_hint: str = "auto"):
        self.strategy = strategy
        self.bucket_bytes = bucket_bytes  # gradients go in buckets of this many bytes (0: one all-reduce)
        self.input_options = device_input_options(device_prefetch_batches)
        self.household_size = household_size  # replicas per household (0: no households, everyone)
        # The household all-reduce is a raw collective op: it gets the strategy's implementation
        # ("nccl" on GPUs) as its hint, or TensorFlow would reduce it over rings (tfscale.cluster.devices).
        self.communication_hint = communication_hint
        # One instance key per traced call site, as MWMS allocates its own: every worker traces the
        # same functions in the same order, so they agree on the keys.
        self._household_instance_keys = itertools.count(_HOUSEHOLD_INSTANCE_KEY)

    def reduce_gradients(self, grads):
        if self.strategy.num_replicas_in_sync == 1:
            return list(grads)  # nothing to sum; the strategy's all-reduce would add an identity per gradient
        # The strategy's all-reduce (MWMS: NCCL or rings, with its communication options), one call per
        # bucket, the last layer's first. One call for all would wait for every gradient: the replica
        # context's all_reduce joins its inputs first (an identity_n under its custom gradient:
        # tensorflow/python/distribute/distribute_lib.py, ReplicaContext.all_reduce, TF 2.21), although
        # MWMS reverses and packs them inside "so as to overlap calculation with communication"
        # (cross_device_ops.py, CollectiveAllReduce). A bucket's call waits for its own gradients only, and
        # MWMS launches the calls' collectives in this order (its ordering token).
        reduced = list(grads)
        context = tf.distribute.get_replica_context()
        for bucket in gradient_buckets(grads, self.bucket_bytes):
            for index, value in zip(bucket, context.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in bucket])):
                reduced[index] = value
        return reduced

    def mean_over_replicas(self, values):
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.MEAN, values)

    def mean_over_household(self, values):
        if self.household_size in (0, self.strategy.num_replicas_in_sync):
            return self.mean_over_replicas(values)
        # tf.distribute has no sub-group all-reduce in its API; its collective ops do (the ops MWMS
        # itself runs), keyed by a group key the household's replicas share. The tensors travel as
        # one flat vector: one all-reduce per call, as the strategy's own packing would do.
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        flat = tf.concat([tf.reshape(tf.cast(v, tf.float32), [-1]) for v in values], axis=0)
        mean = collective_ops.all_reduce_v2(
            flat, group_size=self.household_size,
            group_key=_HOUSEHOLD_GROUP_KEY_BASE + tf.cast(replica, tf.int32) // self.household_size,
            instance_key=next(self._household_instance_keys), merge_op="Add", final_op="Div",
            communication_hint=self.communication_hint)
        pieces = tf.split(mean, [int(np.prod(v.shape)) for v in values])
        return [tf.cast(tf.reshape(p, v.shape), v.dtype) for p, v in zip(pieces, values)]

    def sum_over_processes(self, tensor):
        # A strategy reduce sums over replicas; each worker's replicas share its value (one all-reduce).
        # Each replica returns a tensor of its own: one tensor returned by all is not per-replica, and
        # MirroredStrategy refuses to sum it.
        share = tensor / len(self.strategy.extended.worker_devices)
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, self.strategy.run(lambda: tf.identity(share)),
                                    axis=None)

    def sum_over_workers(self, rows):
        # A strategy reduce sums over replicas; each worker's replicas share its row.
        share = tf.constant(rows / (self.strategy.num_replicas_in_sync // len(rows)))

        @tf.function(autograph=False)
        def sum_rows():
            return self.strategy.reduce(tf.distribute.ReduceOp.SUM, self.strategy.run(lambda: share), axis=None)

        return sum_rows().numpy()

    def broadcast_from_chief(self, variables):
        pass  # MWMS initialises and restores replicas identically itself

    def distribute_dataset(self, input_fn):
        untune_device_datasets()
        return self.strategy.distribute_datasets_from_function(input_fn, options=self.input_options)


class HorovodCollectives(Collectives):
    """Horovod ranks, each its own one-device strategy: every reduction is an hvd collective.

    A plain tape plus grouped_allreduce is the Horovod path that works on Keras 3:
    hvd.DistributedOptimizer runs there but silently skips the averaging.
    """

    saving_is_collective = False
    averages_gradients = True

    def __init__(self, hvd: Any, strategy: tf.distribute.Strategy | None, fp16_allreduce: bool = False,
                 bucket_bytes: int = 0, device_prefetch_batches: int = 1, household=None):
        self.hvd = hvd  # the horovod.tensorflow module
        self.household = household  # this rank's household as a Horovod process set (None: all ranks)
        self.strategy = strategy
        self.fp16_allreduce = fp16_allreduce  # gradients travel as float16
        self.bucket_bytes = bucket_bytes  # gradients go in buckets of this many bytes (0: one group)
        self.input_options = device_input_options(device_prefetch_batches)

    def reduce_gradients(self, grads):
        # One grouped all-reduce per bucket, the buckets in the order the backward pass produces the
        # gradients (the last layer's first), as MWMS packs them: a bucket's all-reduce is submitted as
        # soon as its gradients exist, while the backward pass computes the rest.
        reduced = list(grads)
        for bucket in gradient_buckets(grads, self.bucket_bytes):
            for index, value in zip(bucket, self._average([grads[i] for i in bucket])):
                reduced[index] = value
        return reduced

    def _average(self, grads):
        if not self.fp16_allreduce:
            return self.hvd.grouped_allreduce(grads, op=self.hvd.Average)
        # hvd.Average divides after summing: N loss-scaled float16 gradients would overflow N times
        # sooner (float16 ends at 65504). Each rank scales its share by 1/N first, then they are summed.
        return self.hvd.grouped_allreduce(grads, op=self.hvd.Sum, prescale_factor=1.0 / self.hvd.size(),
                                          compression=self.hvd.Compression.fp16)

    def mean_over_replicas(self, values):
        return self.hvd.grouped_allreduce(values, op=self.hvd.Average)

    def mean_over_household(self, values):
        if self.household is None:
            return self.mean_over_replicas(values)
        return self.hvd.grouped_allreduce(values, op=self.hvd.Average, process_set=self.household)

    def sum_over_processes(self, tensor):
        return self.hvd.allreduce(tensor, op=self.hvd.Sum)

    def sum_over_workers(self, rows):
        return self.hvd.allreduce(tf.constant(rows), op=self.hvd.Sum).numpy()

    def broadcast_from_chief(self, variables):
        # Ranks start from whatever each initialised or restored. Keras 3 variables go as the
        # tf.Variable they wrap (`.value`): broadcast_variables needs `.ref()`, which they lack.
        tf_variables = [v.value if isinstance(v, keras.Variable) else v for v in variables]
        self.hvd.broadcast_variables(tf_variables, root_rank=0)

    def distribute_dataset(self, input_fn):
        # Each rank is its own one-device "strategy", so tell input_fn about the whole Horovod job.
        size, rank = self.hvd.size(), self.hvd.rank()
        context = tf.distribute.InputContext(num_input_pipelines=size, input_pipeline_id=rank,
                                             num_replicas_in_sync=size)
        untune_device_datasets()
        return self.strategy.distribute_datasets_from_function(lambda _: input_fn(context), options=self.input_options)
