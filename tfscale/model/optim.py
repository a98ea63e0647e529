"""Optimizers for ResNet training: momentum SGD with classic L2, and LARS.

Two recipes, two ways of applying weight decay (wd):

* ``sgd``: ``keras.optimizers.SGD`` with momentum. Weight decay is the classic L2 term the training
  loop adds to the loss, ``l2_loss = 0.5 * wd * sum ||w||^2`` over conv/dense kernels, whose
  gradient is ``wd * w`` (Goyal et al. 2017, "Accurate, Large Minibatch SGD", sec. 2 and appendix:
  no decay on BatchNorm gamma/beta or biases).
* ``lars``: Layer-wise Adaptive Rate Scaling (You, Gitman & Ginsburg 2017,
  https://arxiv.org/abs/1708.03888). The decay is applied inside the optimizer, where it also enters
  the trust ratio, so the loop must *not* add ``l2_loss`` as well (``loss_weight_decay`` says 0).

The LARS update matches ``tf.contrib.opt.LARSOptimizer`` in its final TF 1.x form
(tensorflow/tensorflow, ``tensorflow/contrib/opt/python/training/lars_optimizer.py`` at commit
66bb198a: ``compute_lr`` + ``ResourceApplyMomentum(lr=1, grad=scaled_lr * (g + wd * w))``), the
optimizer Google's MLPerf ResNet-50 TPU submissions used with ``skip_list=["batch_normalization",
"bias"]``. Note it differs from TF Model Garden's ``official/modeling/optimization/lars_optimizer.py``
(which folds the decay into the gradient *before* the norm: ``eta * ||w|| / ||g + wd * w||``, no
epsilon) and from the earliest contrib version (no decay term in the update).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfscale import compat

OPTIMIZERS = ("sgd", "lars")


def is_decayed(variable) -> bool:
    """True if `variable` gets weight decay and LARS adaptation: conv/dense kernels only.

    BatchNorm gamma/beta and biases are excluded, as in Goyal et al. 2017 and the MLPerf LARS
    recipe: decaying them only fights the normalisation and slows training. The decision uses the
    Keras variable's ``path`` (e.g. ``"resnet50/conv1/kernel"``), falling back to ``name``; a raw
    tf.Variable name like ``"dense/kernel:0"`` is handled by dropping the ``":0"`` suffix.
    Depthwise/pointwise kernels (``*_kernel``) count as kernels.
    """
    path = getattr(variable, "path", None) or getattr(variable, "name", "") or ""
    return str(path).split(":")[0].endswith("kernel")


def l2_loss(variables, weight_decay: float) -> tf.Tensor:
    """Classic L2 regulariser ``0.5 * wd * sum_{w kernel} ||w||_2^2``, in float32.

    Its gradient is ``wd * w``, i.e. the "weight decay" of the SGD ResNet recipes. Only variables
    for which `is_decayed` is true count. Computed in float32 whatever the variables' dtype so the
    sum over ~25M weights does not overflow or lose precision under mixed precision.

    Under a tf.distribute strategy the optimizer *sums* replica gradients, so the loop must scale
    this per-replica term by ``1 / num_replicas_in_sync`` like the data loss (Keras ``fit`` does this
    for losses it computes).
    """
    squares = [
        tf.reduce_sum(tf.square(tf.cast(tf.convert_to_tensor(v), tf.float32)))
        for v in variables
        if is_decayed(v)
    ]
    if not squares:
        return tf.constant(0.0, tf.float32)
    return tf.constant(0.5 * weight_decay, tf.float32) * tf.add_n(squares)


def _trust_ratio(w, g, eta: float, weight_decay: float, epsilon: float) -> tf.Tensor:
    """LARS local learning-rate multiplier for one layer (float32 inputs).

    ``eta * ||w|| / (||g|| + wd * ||w|| + epsilon)`` if ``||w|| > 0`` and ``||g|| > 0``, else 1.
    The fallback keeps freshly zero-initialised kernels (and layers with no gradient signal)
    trainable at the global rate instead of freezing them with a zero ratio.
    """
    w_norm = tf.norm(w, ord=2)
    g_norm = tf.norm(g, ord=2)
    usable = tf.logical_and(w_norm > 0.0, g_norm > 0.0)
    denominator = g_norm + weight_decay * w_norm + epsilon
    # Both tf.where branches are evaluated; a safe denominator keeps the unused one free of inf/nan.
    safe_denominator = tf.where(usable, denominator, tf.ones_like(denominator))
    return tf.where(usable, eta * w_norm / safe_denominator, tf.ones_like(w_norm))


class LARS(keras.optimizers.Optimizer):
    """Layer-wise Adaptive Rate Scaling with heavy-ball (optionally Nesterov) momentum.

    For a decayed variable (conv/dense kernel, see `is_decayed`) ``w`` with gradient ``g``::

        trust_ratio = eta * ||w|| / (||g|| + wd * ||w|| + epsilon)   (1 if ||w|| == 0 or ||g|| == 0)
        step = lr * trust_ratio * (g + wd * w)
        v <- momentum * v + step
        w <- w - v                           (nesterov: w <- w - (momentum * v + step))

    Excluded variables (BatchNorm gamma/beta, biases) get plain momentum SGD without decay:
    ``step = lr * g``. Source: You et al. 2017 (arXiv:1708.03888, Algorithm 1, local LR
    ``eta * ||w|| / (||g|| + wd * ||w||)``); update form of tf.contrib.opt.LARSOptimizer as used by
    MLPerf ResNet-50 (see module docstring).

    Weight decay is LARS's own (``lars_weight_decay``) and is never handed to the Keras base class,
    whose ``weight_decay`` is a *decoupled* decay applied before ``update_step``: passing it there
    would decay kernels twice. The base ``weight_decay`` therefore stays None.

    Under tf.distribute ``update_step`` receives the raw per-replica tf.Variable, which has no
    Keras ``path``, so the exclusion decision is made once in `build` (Keras variables) and stored
    by variable index.
    """

    def __init__(
        self,
        learning_rate=0.1,
        momentum=0.9,
        weight_decay=1e-4,
        eta=0.001,
        epsilon=0.0,
        nesterov=False,
        name="lars",
        **kwargs,
    ):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"LARS momentum must be in [0, 1), got {momentum!r}")
        if weight_decay < 0.0 or eta <= 0.0 or epsilon < 0.0:
            raise ValueError(
                f"LARS needs weight_decay >= 0, eta > 0, epsilon >= 0; got "
                f"weight_decay={weight_decay!r}, eta={eta!r}, epsilon={epsilon!r}"
            )
        self.momentum = float(momentum)
        self.lars_weight_decay = float(weight_decay)
        self.eta = float(eta)
        self.epsilon = float(epsilon)
        self.nesterov = bool(nesterov)

    def build(self, variables):
        """Create one velocity slot per variable and record which variables LARS adapts/decays."""
        if self.built:
            return
        super().build(variables)
        self._velocities = self.add_optimizer_variables(variables, "velocity")
        # Decided here, on Keras variables with paths; update_step only sees raw tf.Variables.
        self._lars_adapted = tuple(is_decayed(v) for v in variables)

    def update_step(self, gradient, variable, learning_rate):
        """Apply one LARS (or, for excluded variables, plain momentum) step; math in float32."""
        index = self._get_variable_index(variable)
        velocity = self._velocities[index]
        if isinstance(gradient, tf.IndexedSlices):
            # The trust ratio needs the full gradient norm; ResNets never produce sparse grads.
            gradient = tf.convert_to_tensor(gradient)
        # Keras mixed precision keeps variables in float32 but gradients may arrive as
        # float16/bfloat16; norms of low-precision tensors overflow or lose the small updates.
        g = tf.cast(gradient, tf.float32)
        w = tf.cast(tf.convert_to_tensor(variable), tf.float32)
        lr = tf.cast(learning_rate, tf.float32)

        if self._lars_adapted[index]:
            wd = self.lars_weight_decay
            scaled_lr = lr * _trust_ratio(w, g, self.eta, wd, self.epsilon)
            step = scaled_lr * (g + wd * w)
        else:
            step = lr * g

        v = self.momentum * tf.cast(tf.convert_to_tensor(velocity), tf.float32) + step
        self.assign(velocity, v)
        update = self.momentum * v + step if self.nesterov else v
        self.assign_sub(variable, update)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "momentum": self.momentum,
                # Our own decay, under the constructor's name so from_config round-trips; the
                # base class's (decoupled) weight_decay is always None for LARS.
                "weight_decay": self.lars_weight_decay,
                "eta": self.eta,
                "epsilon": self.epsilon,
                "nesterov": self.nesterov,
            }
        )
        return config


def _check_name(optim_cfg) -> str:
    name = optim_cfg.name
    if name not in OPTIMIZERS:
        raise ValueError(f"Unknown optimizer optim.name={name!r}; expected one of {OPTIMIZERS}")
    return name


def make_optimizer(optim_cfg, learning_rate: float, *, reduced_gradients: bool = True) -> keras.optimizers.Optimizer:
    """Build the optimizer named by ``optim_cfg.name`` with a settable float learning rate.

    The learning rate is a plain float (stored by Keras in a variable) rather than a schedule so a
    callback can set ``optimizer.learning_rate = x`` every batch. ``sgd`` carries no weight decay:
    the loop adds `l2_loss` with coefficient `loss_weight_decay` instead. `reduced_gradients`: the
    caller hands over gradients already reduced over replicas (tfscale's step: `Cluster.reduce_gradients`);
    False for Keras' `fit`, whose replicas hand over their own.
    """
    name = _check_name(optim_cfg)
    learning_rate = float(learning_rate)  # Keras rejects ints and numpy scalars
    ema = ema_kwargs(optim_cfg)
    if name == "sgd":
        optimizer = keras.optimizers.SGD(
            learning_rate=learning_rate,
            momentum=float(optim_cfg.momentum),
            nesterov=bool(optim_cfg.nesterov),
            **ema,
        )
    else:
        optimizer = LARS(
            learning_rate=learning_rate,
            momentum=float(optim_cfg.momentum),
            weight_decay=float(optim_cfg.weight_decay),
            eta=float(optim_cfg.lars_eta),
            epsilon=float(optim_cfg.lars_epsilon),
            nesterov=bool(optim_cfg.nesterov),
            **ema,
        )
    if reduced_gradients:
        optimizer = applying_reduced_gradients(optimizer)
    clip_norm = float(optim_cfg.get("clip_global_norm", 0.0))
    return clipping_global_norm(optimizer, clip_norm) if clip_norm else optimizer


def _subclassed(optimizer: keras.optimizers.Optimizer, prefix: str, methods: dict) -> keras.optimizers.Optimizer:
    """A copy of `optimizer` (its config) whose class is its own with `methods` overridden."""
    base = type(optimizer)
    compat.require(callable(getattr(base, "_all_reduce_sum_gradients", None)), "keras",
                   "TensorFlow optimizer hook _all_reduce_sum_gradients", f"tfscale's {prefix} optimizer")
    subclass = type(f"{prefix}{base.__name__}", (base,), methods)
    return subclass.from_config(optimizer.get_config())


def applying_reduced_gradients(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The same optimizer, applying the gradients it is given as they are: they arrive already summed
    over the replicas (`Cluster.reduce_gradients`), so Keras must not sum them again.

    Keras' TensorFlow optimizer sums the replicas' gradients inside ``apply_gradients`` when it finds a
    replica context (``TFOptimizer._all_reduce_sum_gradients``, called from ``_backend_update_step``:
    Keras 3.15.1, keras/src/backend/tensorflow/optimizer.py lines 113-124 and 141-178). tfscale runs that
    all-reduce itself, before the update, so that float16 loss scaling checks the summed gradients: one
    replica's overflow is in every replica's sum, and all skip the step together with no collective of
    their own (``LossScaleOptimizer.check_finite`` runs before the inner update:
    keras/src/optimizers/loss_scale_optimizer.py lines 246-253, 262-274).
    """

    def _all_reduce_sum_gradients(self, grads_and_vars):
        return list(grads_and_vars)

    return _subclassed(optimizer, "Reduced", {"_all_reduce_sum_gradients": _all_reduce_sum_gradients,
                                              "applies_reduced_gradients": True})


def clipping_global_norm(optimizer: keras.optimizers.Optimizer, clip_norm: float) -> keras.optimizers.Optimizer:
    """The same optimizer, the gradients of every update clipped to global L2 norm `clip_norm`
    (``tf.clip_by_global_norm``) AFTER they are summed over all replicas and workers.

    Where the gradients are summed: ``TFOptimizer._all_reduce_sum_gradients``, which ``_backend_update_step``
    calls right before the update (Keras 3.15.1, keras/src/backend/tensorflow/optimizer.py lines 113-124 and
    141), is where Keras' `fit` sums the replicas' gradients; tfscale's step hands them over already
    reduced over every replica and rank (`applying_reduced_gradients`); in local SGD's steps (applied
    outside ``strategy.run``) each worker's own gradient, or its household's mean, is clipped. Clipping
    after that hook is clipping the global batch's gradient on every backend. Keras' own ``global_clipnorm`` is not used: it clips in ``_clip_gradients`` before
    ``_backend_update_step`` (keras/src/optimizers/base_optimizer.py line 588), i.e. each replica's share.
    Under a ``LossScaleOptimizer`` this optimizer is the inner one, which receives unscaled gradients, and a
    step skipped for non-finite gradients never reaches it.

    `grad_norm(optimizer)` reads the global norm of the last update's gradients before clipping.
    """
    base = type(optimizer)
    # Not an attribute of the optimizer, so checkpoints do not track it. ON_READ + ONLY_FIRST_REPLICA: each
    # replica writes its own copy (no merge_call in the step; all copies are equal), a read takes the first.
    norm_before_clip = tf.Variable(0.0, trainable=False, name="grad_norm", dtype=tf.float32,
                                   synchronization=tf.VariableSynchronization.ON_READ,
                                   aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def _all_reduce_sum_gradients(self, grads_and_vars):
        grads, variables = zip(*base._all_reduce_sum_gradients(self, grads_and_vars))
        clipped, norm = tf.clip_by_global_norm(list(grads), clip_norm)
        norm_before_clip.assign(tf.cast(norm, tf.float32))
        return list(zip(clipped, variables))

    def grad_norm_variable(self) -> tf.Variable:
        return norm_before_clip

    clipping = _subclassed(optimizer, "GlobalNormClipping", {"_all_reduce_sum_gradients": _all_reduce_sum_gradients,
                                                             "grad_norm_variable": grad_norm_variable})
    clipping.clip_global_norm = clip_norm
    return clipping


def grad_norm(optimizer: keras.optimizers.Optimizer) -> float | None:
    """The global norm of the last update's gradients before clipping (None without optim.clip_global_norm).

    `optimizer` may be the LossScaleOptimizer around the clipping one; the norm is of unscaled gradients.
    """
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    read = getattr(optimizer, "grad_norm_variable", None)
    return None if read is None else float(read().numpy())


def ema_kwargs(optim_cfg) -> dict:
    """Keras' own weight EMA from ``optim.ema_decay`` (0: off): ``use_ema``/``ema_momentum`` for the optimizer.

    After every applied update Keras sets ``average = d * average + (1 - d) * w`` for each trainable
    variable ``w`` (``average = w`` at the optimizer's first update), in the variable's dtype: float32,
    also under mixed precision. The averages are optimizer variables, hence in every checkpoint.
    ``ema_overwrite_frequency`` stays None: training always continues from the raw weights.
    """
    decay = float(optim_cfg.get("ema_decay", 0.0))
    if not decay:
        return {}
    return {"use_ema": True, "ema_momentum": decay}


def loss_weight_decay(optim_cfg) -> float:
    """L2 coefficient the training loop adds to the loss via `l2_loss`.

    ``optim_cfg.weight_decay`` for sgd; 0.0 for lars, which decays inside its update (and trust
    ratio), so adding the L2 loss too would decay twice.
    """
    name = _check_name(optim_cfg)
    return float(optim_cfg.weight_decay) if name == "sgd" else 0.0


def averaging_optimizer(optimizer: keras.optimizers.Optimizer, cluster) -> keras.optimizers.Optimizer:
    """`hvd.DistributedOptimizer` for Keras 3: the same optimizer, averaging gradients over Horovod
    ranks before every update, for users porting a Horovod `model.fit` script.

    Horovod's own wrapper runs on Keras 3 but never averages (it hooks a method Keras 3 no longer
    calls), so ranks silently drift apart. `cluster` is `distribute.setup(...)` with backend horovod.
    """
    base = type(optimizer)

    class Averaging(base):
        def apply_gradients(self, grads_and_vars):
            grads, variables = zip(*grads_and_vars)
            return super().apply_gradients(zip(cluster.reduce_gradients(list(grads)), variables))

    Averaging.__name__ = Averaging.__qualname__ = f"Averaging{base.__name__}"
    return Averaging.from_config(optimizer.get_config())
