"""The optimizer's update of a step as one XLA-compiled function (`optim.compiled_update`).

Keras' `apply_gradients` under tf.distribute runs its update variable by variable through the strategy
(`extended.update`, one call per variable: keras/src/backend/tensorflow/optimizer.py lines 127-139,
Keras 3.15.1), and float16 loss scaling adds a finite check, an unscaling and a select per variable:
for ResNet-50's 161 variables about 1,800 small ops a step, each dispatched on its own. `make_update`
runs the same arithmetic, in the same order, as one compiled function per replica:

  finite check (float16 loss scaling)  ->  unscaling  ->  the hook on the reduced gradients (clipping)
  ->  each variable's `update_step` (momentum SGD, LARS: Keras' own or tfscale's)  ->  the weights' EMA
  ->  the loss scale's growth or halving

and leaves outside it only the step counter, `optimizer.iterations`, the one variable Keras keeps
"only first replica" (base_optimizer.py line 163): updating such a variable inside a replica needs a
`merge_call`, which a compiled function cannot make (tensorflow/python/distribute/values.py lines
116-124, TF 2.21). Every other variable of the optimizer and the model is updated on this replica's own
copy, as Keras' `update` does when it runs without `merge_call` (mirrored_strategy.py lines 844-858):
the gradients are the same on every replica (`Cluster.reduce_gradients`), so the copies stay equal.

What Keras' `apply` would also do and tfscale's optimizers never need is refused by `check_supported`:
gradient accumulation inside the optimizer, Keras' own clipping and decoupled weight decay, variable
constraints, and an EMA that overwrites the weights.
"""

from __future__ import annotations

import keras
import tensorflow as tf


def check_supported(optimizer: keras.optimizers.Optimizer, variables) -> None:
    """Raises ValueError naming what `make_update` would leave out of `optimizer.apply`."""
    inner = _inner(optimizer)
    unsupported = {
        "gradient_accumulation_steps": inner.gradient_accumulation_steps,
        "clipnorm": inner.clipnorm, "clipvalue": inner.clipvalue, "global_clipnorm": inner.global_clipnorm,
        "weight_decay": inner.weight_decay, "ema_overwrite_frequency": inner.ema_overwrite_frequency,
        "loss_scale_factor": inner.loss_scale_factor,
    }
    named = [f"{key}={value!r}" for key, value in unsupported.items() if value]
    if not getattr(inner, "applies_reduced_gradients", False):
        named.append("the replicas' gradient sum (this optimizer sums them itself: optim.make_optimizer's "
                     "reduced_gradients=False)")
    named += [f"a constraint on {v.path}" for v in variables if getattr(v, "constraint", None) is not None]
    named += [f"overwrite_with_gradient on {v.path}" for v in variables if getattr(v, "overwrite_with_gradient", False)]
    if named:
        raise ValueError(f"the compiled update (config.optim.compiled_update=True) does not apply {', '.join(named)} "
                         f"of {type(inner).__name__}: set config.optim.compiled_update=False")


def make_update(optimizer: keras.optimizers.Optimizer, variables):
    """`update(grads)`: `optimizer.apply_gradients(zip(grads, variables))` with the arithmetic compiled.

    Call it inside a replica step with gradients already reduced over the replicas. Under a
    `LossScaleOptimizer` a step whose gradients hold inf or NaN changes no weight, halves the scale and
    is not counted in `iterations`, as Keras' own does.
    """
    variables = list(variables)
    check_supported(optimizer, variables)
    inner = _inner(optimizer)
    loss_scaled = inner is not optimizer

    def apply(grads):
        if loss_scaled:
            grads = [g / tf.cast(optimizer.dynamic_scale, g.dtype) for g in grads]
        # The hook where Keras sums the replicas' gradients: tfscale's optimizers pass them on (already
        # reduced) or clip them by global norm (optim.applying_reduced_gradients, optim.clipping_global_norm).
        grads_and_vars = inner._all_reduce_sum_gradients(list(zip(grads, variables)))
        learning_rate = inner._get_current_learning_rate()
        for grad, variable in grads_and_vars:
            inner.update_step(grad, variable, learning_rate)
        if inner.use_ema:
            inner._update_model_variables_moving_average(variables)

    @tf.function(jit_compile=True, autograph=False)  # no Python branch on a tensor: tf.cond below
    def compiled(grads):
        if not loss_scaled:
            apply(grads)
            return tf.constant(True)
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        tf.cond(finite, lambda: _applied(apply, grads), _no_op)
        _update_loss_scale(optimizer, finite)
        return finite

    def update(grads):
        if any(g is None for g in grads):
            missing = [v.path for g, v in zip(grads, variables) if g is None]
            raise ValueError(f"no gradient for {', '.join(missing)}: the compiled update needs one for every "
                             "trainable variable (set config.optim.compiled_update=False)")
        applied = compiled(list(grads))
        inner.iterations.assign_add(tf.cast(applied, inner.iterations.dtype))

    return update


def _inner(optimizer):
    return optimizer.inner_optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else optimizer


def _applied(apply, grads):
    apply(grads)
    return tf.constant(True)


def _no_op():
    return tf.constant(True)


def _update_loss_scale(optimizer: keras.optimizers.LossScaleOptimizer, finite) -> None:
    """Keras' dynamic loss scaling (loss_scale_optimizer.py lines 213-244): after `dynamic_growth_steps`
    finite steps in a row the scale doubles; a non-finite step halves it and restarts the count."""
    grow = tf.logical_and(finite, tf.equal(optimizer.step_counter, optimizer.dynamic_growth_steps - 1))
    scale = optimizer.dynamic_scale
    scale.assign(tf.where(grow, scale * 2.0, tf.where(finite, scale, scale * 0.5)))
    counter = optimizer.step_counter
    counter.assign(tf.where(finite & ~grow, counter + 1, tf.zeros_like(counter)))
