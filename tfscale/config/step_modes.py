"""How a step runs, for the keys whose default is `auto`: XLA for each replica's forward and backward pass
(`jit_compile`), the optimizer's update as one XLA call (`optim.compiled_update`), and the gradient buckets'
size as set (`distribute.pack_bytes`). The auto keys are decided once the worker's replicas are known
(tfscale.training.step_choices), logged with why, and recorded in config.json. No TensorFlow here.
"""

from __future__ import annotations

import ml_collections
from absl import logging

from tfscale.config.names import JIT_AUTO, PACK_AUTO
from tfscale.errors import ConfigError


def fixed_pack_bytes(dist_cfg: ml_collections.ConfigDict) -> int:
    """`distribute.pack_bytes` as set, 0 while it is still `auto` (decided once the job's size is known)."""
    return 0 if dist_cfg.pack_bytes == PACK_AUTO else dist_cfg.pack_bytes


def xla_conflict(cfg: ml_collections.ConfigDict) -> str | None:
    """What in `cfg` XLA cannot give (None: nothing). `jit_compile=auto` then runs without XLA: the key the
    user set wins over a default."""
    if fixed_pack_bytes(cfg.distribute) > 0:  # auto follows XLA's choice instead
        return (f"config.distribute.pack_bytes={cfg.distribute.pack_bytes} asks for gradient buckets sent while the "
                "backward pass runs, and inside one XLA call no gradient leaves before the pass ends (set "
                "jit_compile=True and pack_bytes=0 to prefer XLA's compute)")
    if cfg.model.sync_bn and cfg.distribute.backend == "mwms":
        return ("config.model.sync_bn=True under mwms all-reduces BatchNorm statistics across workers inside the "
                "step, which XLA cannot compile")
    return None


def resolve(cfg: ml_collections.ConfigDict, *, on_gpus: bool) -> str | None:
    """Decides both compile keys for replicas that are GPUs or not (`resolve_jit_compile`,
    `resolve_compiled_update`); returns why XLA is on or off for the pass (None: `jit_compile` was set)."""
    resolve_compiled_update(cfg, on_gpus=on_gpus)
    return resolve_jit_compile(cfg, on_gpus=on_gpus)


def resolve_jit_compile(cfg: ml_collections.ConfigDict, *, on_gpus: bool) -> str | None:
    """Turns `jit_compile="auto"` into True or False in place (once: config.json records the choice); returns
    why, as logged (None: the value was set, nothing decided).

    As Keras 3's `compile(jit_compile="auto")` decides on TensorFlow (keras/src/trainers/trainer.py,
    `_resolve_auto_jit_compile`): no XLA on a CPU-only worker, XLA where the replicas are GPUs. Keras also
    leaves XLA off under any tf.distribute strategy; tfscale does not, because its XLA function is one
    replica's forward and backward pass with no collective inside (training/engine.make_loss_and_grads),
    the shape NVIDIA's multi-GPU ResNet-50 runs compile. A config asking for what XLA cannot give
    (`xla_conflict`) runs without it, and a model whose layers cannot be compiled falls back at build time,
    as in Keras (tfscale.model.build.check_xla). Every choice is logged.
    """
    check_auto_or_bool("jit_compile", cfg.jit_compile)
    if isinstance(cfg.jit_compile, bool):
        return None
    conflict = xla_conflict(cfg)
    if not on_gpus:
        reason = ("the replicas are CPUs, where Keras' compile leaves XLA off too (on a CPU with oneDNN, TensorFlow's "
                  "default on AVX-512 CPUs, the step without XLA is the faster one: docs/benchmarking.md)")
    elif conflict:
        reason = conflict
    else:
        reason = "XLA compiles each GPU replica's forward and backward pass (--config.jit_compile=False turns it off)"
    cfg.jit_compile = on_gpus and not conflict
    logging.info("config.jit_compile=auto -> %s: %s", cfg.jit_compile, reason)
    return reason


def resolve_compiled_update(cfg: ml_collections.ConfigDict, *, on_gpus: bool) -> str | None:
    """Turns `optim.compiled_update="auto"` into True on GPU replicas, False on CPU ones; returns why, as logged
    (None: the value was set).

    What the compiled update removes is dispatch: Keras' update launches ~1,800 small ops a ResNet-50 step
    under float16 loss scaling, each a kernel launch after the all-reduce, which costs a GPU step whose
    compute takes ~50 ms. A CPU runs those ops as cheap function calls, and the extra XLA call's threads
    contend with the step's own: on 2 CPU cores the compiled update made a Fashion-MNIST ResNet step about
    5 % slower (docs/benchmarking.md).
    """
    check_auto_or_bool("optim.compiled_update", cfg.optim.compiled_update)
    if isinstance(cfg.optim.compiled_update, bool):
        return None
    if on_gpus:
        reason = ("the update runs as one XLA call per GPU replica instead of Keras' op-by-op launches "
                  "(--config.optim.compiled_update=False turns it off)")
    else:
        reason = "the replicas are CPUs, where Keras' op-by-op update costs no kernel launches and runs faster"
    cfg.optim.compiled_update = on_gpus
    logging.info("config.optim.compiled_update=auto -> %s: %s", on_gpus, reason)
    return reason


def check_auto_or_bool(key: str, value) -> None:
    if not (isinstance(value, bool) or value == JIT_AUTO):
        raise ConfigError(f"config.{key} must be {JIT_AUTO!r}, True or False, got {value!r}")
