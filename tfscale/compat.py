"""The private TensorFlow and Keras internals tfscale reaches into, and what it says where one is missing.

pyproject.toml holds TensorFlow and Keras to the minor versions tested together (TESTED). An environment
installed without the constraints may have another release, which may lack a hook: each place that uses
one checks for it where it first needs it and says in one line which hook, the version installed and the
version tested, then stops (the hook is needed) or says what goes on without it. The hooks:

  keras       TFOptimizer._all_reduce_sum_gradients      model/optim.py: LARS, clipping, reduced gradients
  keras       backend.tensorflow.core.Variable
              ._copy_trackable_to_cpu                     training/checkpoints.py: asynchronous checkpoints
  keras       keras.src.models.functional.Functional      model/build.py: a user's functional model
  keras       RandAugment's operation sub-layers          data/input/batch_augment.py: the fast path
  tensorflow  context().configure_coordination_service    cluster/connect.py: the MWMS heartbeat time-out
  tensorflow  multi_device_iterator_ops
              ._create_device_dataset                     cluster/collectives.py: untuned per-device input
  tensorflow  python.ops.collective_ops                   cluster/collectives.py: households' sub-group all-reduce
  tensorflow  tsl.profiler.protobuf.xplane_pb2            tools/step_timeline.py: reading a trace

The standard library only: it runs before TensorFlow's import.
"""

from __future__ import annotations

import importlib.metadata

TESTED = {"tensorflow": "2.21", "keras": "3.15"}  # minor versions; the exact releases are in the constraints
_DISTRIBUTIONS = {"tensorflow": ("tensorflow", "tensorflow-cpu"), "keras": ("keras",)}


class MissingHook(RuntimeError):
    """A private TensorFlow or Keras internal tfscale needs is not in the installed release."""


def installed_version(package: str) -> str:
    for distribution in _DISTRIBUTIONS[package]:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "(not installed)"


def hook_note(package: str, hook: str) -> str:
    """'keras 3.10.0 has no X; tfscale is tested with keras 3.15 (...)': the versions, and how to get the tested one."""
    tested = TESTED[package]
    return (f"{package} {installed_version(package)} has no {hook}; tfscale is tested with {package} {tested} "
            f"(pyproject.toml holds it there: pip install the checkout with -c requirements/constraints-cpu.txt, "
            f"or {package}=={tested}.*)")


def require(present: bool, package: str, hook: str, used_for: str) -> None:
    """MissingHook naming the hook and both versions unless `present`."""
    if not present:
        raise MissingHook(f"{used_for} needs a private {package} internal: {hook_note(package, hook)}")
