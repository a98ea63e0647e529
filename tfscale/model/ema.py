"""Exponential moving average (EMA) of the weights, `config.optim.ema_decay`: reading it and using it.

The average is Keras' own optimizer EMA (`use_ema=True, ema_momentum=d`, set by
`optim.make_optimizer`). After every applied optimizer update, for each trainable variable `w`:

    average = w                                   at the optimizer's first update
    average = d * average + (1 - d) * w           at every later one

with `w` the value after the update, in `w`'s dtype: float32, also under mixed precision (Keras keeps
variables in float32). "The weights" are the trainable variables. BatchNorm moving mean/variance are
already averages and are not averaged again: evaluating or exporting "the EMA weights" means the
averaged trainables with the model's current BatchNorm moving statistics, as Keras and TF Model Garden
do. A float16 step that loss scaling skips is no update, so it does not move the average either.

The averages are optimizer variables (of the inner optimizer under `LossScaleOptimizer`), created in
the strategy scope with the optimizer's other slots, so every checkpoint holds them and a resumed run
continues the very same average. They are updated inside `apply_gradients`, in the replica context of
`strategy.run`, each replica its own copy from its (identical) updated weights; verified to stay equal
across replicas under `mirrored`, float32 and mixed_float16, SGD and LARS (tests/test_ema.py).
`ema_overwrite_frequency` stays off: training always continues from the raw weights.

    with ema.swapped_in(model, optimizer):    # the model computes with the EMA weights here
        results = engine.evaluate(...)
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

# The Keras attribute holding the averages (one per trainable variable, None for variables updated by
# overwrite_with_gradient). Private, present unchanged since Keras 3.0; verified on Keras 3.15.
_AVERAGES_ATTRIBUTE = "_model_variables_moving_average"


def base_optimizer(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The optimizer that updates the weights: the inner one of a `LossScaleOptimizer`, else `optimizer`."""
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def is_on(optimizer: keras.optimizers.Optimizer) -> bool:
    """True when `optimizer` (or the one a LossScaleOptimizer wraps) keeps an EMA of the weights."""
    return bool(getattr(base_optimizer(optimizer), "use_ema", False))


def ema_variables(optimizer: keras.optimizers.Optimizer) -> list | None:
    """The EMA variables, in the order of the trainable variables the optimizer was built on; None when off.

    The optimizer must be built (`engine.build_optimizer` builds it).
    """
    inner = base_optimizer(optimizer)
    if not getattr(inner, "use_ema", False):
        return None
    if not inner.built:
        raise ValueError("the optimizer is not built yet: it has no EMA variables (call optimizer.build(...))")
    averages = getattr(inner, _AVERAGES_ATTRIBUTE, None)
    if averages is None:
        raise RuntimeError(
            f"Keras {keras.__version__}'s optimizer has no {_AVERAGES_ATTRIBUTE}: tfscale.model.ema reads Keras' "
            "optimizer EMA there (verified on Keras 3.15); adapt tfscale/model/ema.py to this Keras"
        )
    return list(averages)


def _pairs(model: keras.Model, optimizer: keras.optimizers.Optimizer) -> list[tuple]:
    """(model trainable variable, its EMA variable) for every trainable variable that has one."""
    averages = ema_variables(optimizer)
    if averages is None:
        raise ValueError("the optimizer keeps no EMA of the weights (config.optim.ema_decay is 0)")
    variables = model.trainable_variables
    if len(variables) != len(averages):
        raise ValueError(f"the model has {len(variables)} trainable variables but the optimizer averages "
                         f"{len(averages)}: was it built on this model?")
    pairs = []
    for variable, average in zip(variables, averages):
        if average is None:
            continue
        if tuple(variable.shape) != tuple(average.shape):
            raise ValueError(f"EMA of {variable.path} has shape {tuple(average.shape)}, the variable "
                             f"{tuple(variable.shape)}: the optimizer was built on another model")
        pairs.append((variable, average))
    return pairs


@contextlib.contextmanager
def swapped_in(model: keras.Model, optimizer: keras.optimizers.Optimizer):
    """Within the block the model's trainable variables hold their EMA values; the raw values come back
    on exit, also when the block raises (bit-exact: they are copied, not recomputed).

    Call it in cross-replica context (outside `strategy.run`), e.g. around `engine.evaluate`: the
    assignments then write every replica's copy. BatchNorm moving statistics are left as they are.
    Raises ValueError when the optimizer keeps no EMA.
    """
    pairs = _pairs(model, optimizer)
    raw = [tf.identity(variable.value) for variable, _ in pairs]
    try:
        for variable, average in pairs:
            variable.assign(average.value)
        yield model
    finally:
        for (variable, _), value in zip(pairs, raw):
            variable.assign(value)


def copy_into(model: keras.Model, optimizer: keras.optimizers.Optimizer) -> int:
    """Assigns the EMA values to the model's trainable variables for good (export); returns how many."""
    pairs = _pairs(model, optimizer)
    for variable, average in pairs:
        variable.assign(average.value)
    return len(pairs)
