"""The ops a ResNet-50 mixed_float16 step runs outside XLA: with the update compiled, a bounded few.

Keras' apply_gradients dispatches the finite check, the unscaling and the momentum update variable by
variable (161 variables: about 1,800 ops a step); tfscale's compiled update (optim.compiled_update)
runs them as one XLA call. The step is traced, not run: the counts are of its graph
(`perf.step_ops.ops_outside_xla`).
"""

import pytest
import tensorflow as tf
from conftest import load_config

from tfscale.data.input import pipeline
from tfscale.perf import step_ops
from tfscale.training import engine

BOUND = 100  # ops a step may run outside XLA with the update compiled


def traced_step_ops(*overrides):
    cfg = load_config("smoke", "--config.model.name=resnet50", "--config.precision=mixed_float16",
                      "--config.jit_compile=True", "--config.data.image_size=32", "--config.data.num_classes=10",
                      *overrides)
    run = engine.setup(cfg)
    with engine.precision_policy(cfg.precision):
        model, optimizer = engine.build_model_and_optimizer(cfg, run.cluster)
        with run.cluster.strategy.scope():
            step = tf.Variable(0, dtype=tf.int64)
        train_loop = engine.make_train_loop(cfg, run.cluster, model, optimizer, step=step)
        iterator = iter(run.cluster.distribute_dataset(pipeline.train_input_fn(cfg.data, seed=0, start_step=0)))
        function = train_loop.get_concrete_function(iterator, tf.constant(0.0), tf.constant(1))
    return step_ops.ops_outside_xla(function), len(model.trainable_variables)


@pytest.mark.slow
def test_a_mixed_float16_resnet50_step_runs_under_100_ops_outside_xla():
    compiled, num_variables = traced_step_ops("--config.optim.compiled_update=True")  # a GPU replica's default
    keras_apply, _ = traced_step_ops("--config.optim.compiled_update=False")
    assert num_variables == 161
    assert sum(compiled.values()) < BOUND, compiled.most_common(20)
    # What the compiled update removes: per-variable finite checks, unscaling and momentum updates.
    assert keras_apply["IsFinite"] == num_variables and compiled["IsFinite"] == 0
    assert sum(keras_apply.values()) > 10 * sum(compiled.values()), keras_apply.most_common(20)
