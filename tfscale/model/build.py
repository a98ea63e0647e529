"""The model a config names: one of tfscale's ResNets, a keras.applications classifier, or the user's own.

`config.model.name` is one of

* a key of `models.MODELS` (``resnet50``, ``cifar_resnet20``, ...): tfscale's ResNets;
* ``keras.applications.<Name>``: any image classifier Keras ships (`application_names`), built with
  ``weights=None``, ``include_top=False`` and global average pooling, under tfscale's float32 ``logits``
  head. It takes tfscale's uint8 0-255 images: tfscale's ImageNet normalisation (`models.ImageNormalization`)
  feeds it, with the application's own preprocessing switched off where it has a switch
  (``include_preprocessing``); EfficientNetB0-B7 always preprocess themselves, so they get the 0-255
  values as floats;
* ``package.module:function`` or ``path/to/file.py:function`` (a path as seen from the working directory):
  the user's builder, called as ``function(num_classes=..., input_shape=(height, width, 3), **options)``.
  It returns a ``keras.Model`` taking uint8 NHWC images of 0-255 values (normalising them itself) and
  returning ``num_classes`` logits (no softmax).

``config.model.options`` are keyword arguments of the builder (e.g. ``dropout_rate`` of an application).
BatchNorm keys reach a foreign model's BatchNormalization layers (`adapt_batchnorm`); the ResNet-only
``zero_init_residual`` is refused for it. `check` builds the model in a throwaway graph before any
worker connects, so a name that does not resolve or a model that is not a classifier of the data's
classes is refused at start-up, naming the key.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
from typing import TYPE_CHECKING, Callable

import keras
import tensorflow as tf
from absl import logging
from keras import layers

from tfscale import compat
from tfscale.errors import ConfigError
from tfscale.model import models

try:
    from keras.src.models.functional import Functional  # Sequential too: a layer graph clone_model rebuilds
except ImportError as err:  # no public name for it
    raise compat.MissingHook("tfscale's user models need a private keras internal: "
                             + compat.hook_note("keras", "keras.src.models.functional.Functional")) from err

if TYPE_CHECKING:
    import ml_collections

APPLICATION_PREFIX = "keras.applications."
# Applications whose preprocessing is built in without a switch: they take 0-255 values.
_SELF_PREPROCESSING = tuple(f"EfficientNetB{k}" for k in range(8))
_APPLICATION_ARGS = {"include_top", "weights", "input_shape", "input_tensor", "classes", "pooling"}
BUILDER_CONTRACT = "function(num_classes, input_shape, **options) -> keras.Model"


@functools.lru_cache(maxsize=None)
def application_names() -> tuple[str, ...]:
    """Every image classifier keras.applications exports (the functions taking include_top, weights, ...)."""
    names = []
    for name in dir(keras.applications):
        function = getattr(keras.applications, name)
        if inspect.isfunction(function) and _APPLICATION_ARGS <= set(inspect.signature(function).parameters):
            names.append(name)
    return tuple(names)


def kind(name: str) -> str:
    """"tfscale", "application" or "user": who defines the model `name`."""
    if name in models.MODELS:
        return "tfscale"
    return "application" if name.startswith(APPLICATION_PREFIX) else "user"


def resolve(name: str) -> Callable[..., keras.Model]:
    """The builder `(num_classes, input_shape, **options) -> keras.Model` of config.model.name `name`."""
    if name in models.MODELS:
        return models.MODELS[name]
    if name.startswith(APPLICATION_PREFIX):
        application = name[len(APPLICATION_PREFIX):]
        if application not in application_names():
            raise ConfigError(f"config.model.name={name!r}: keras.applications has no image classifier "
                              f"{application!r}; it has: {', '.join(application_names())}")
        return functools.partial(_build_application, application)
    if ":" not in name:
        raise ConfigError(f"config.model.name={name!r} is not a tfscale model ({', '.join(models.MODELS)}), not "
                          f"keras.applications.<Name> and not module:function or path/to/file.py:function")
    return _user_builder(name)


def _backbone(application: str, input_shape: tuple[int, int, int], x=None, **options) -> keras.Model:
    """The application without its classifier, global-average-pooled, its switchable preprocessing off."""
    function = getattr(keras.applications, application)
    if "include_preprocessing" in inspect.signature(function).parameters:
        options = {"include_preprocessing": False, **options}
    return function(include_top=False, weights=None, input_tensor=x, input_shape=tuple(input_shape), pooling="avg",
                    **options)


def _build_application(application: str, num_classes: int, input_shape: tuple[int, int, int], **options):
    images = keras.Input(shape=tuple(input_shape), dtype="uint8", name="images")
    if application in _SELF_PREPROCESSING:
        x = models.ImageNormalization((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), name="to_float")(images)
    else:
        x = models.ImageNormalization(models.IMAGENET_MEAN_RGB, models.IMAGENET_STDDEV_RGB, name="normalize")(images)
    backbone = _backbone(application, input_shape, x, **options)
    # float32 head, as tfscale's ResNets: under mixed precision the loss must not see 16-bit logits.
    logits = layers.Dense(num_classes, kernel_initializer=keras.initializers.RandomNormal(stddev=0.01),
                          dtype="float32", name="logits")(backbone.output)
    return keras.Model(images, logits, name=application)


def _user_builder(name: str) -> Callable[..., keras.Model]:
    target, _, function_name = name.rpartition(":")
    module = _load_module(name, target)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError(f"config.model.name={name!r}: {target} has no function {function_name!r}")
    try:
        inspect.signature(function).bind(num_classes=2, input_shape=(32, 32, 3))
    except TypeError as err:
        raise ConfigError(f"config.model.name={name!r}: {function_name}{inspect.signature(function)} cannot be "
                          f"called as {BUILDER_CONTRACT} ({err})") from None
    return function


def _load_module(name: str, target: str):
    try:
        if target.endswith(".py"):
            path = os.path.abspath(target)
            if not os.path.isfile(path):
                raise ConfigError(f"config.model.name={name!r}: no file {path}")
            module_name = f"tfscale_user_model_{os.path.splitext(os.path.basename(path))[0]}"
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module  # so that Keras can find its serializable classes
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(target)
    except ConfigError:
        raise
    except Exception as err:  # the user's module failed to import: say so, with its own error
        raise ConfigError(f"config.model.name={name!r}: importing {target} failed: "
                          f"{type(err).__name__}: {err}") from None


def application_with_weights(cfg: ml_collections.ConfigDict, path: str) -> keras.Model:
    """The config's keras.applications model without its top, holding the weights of a Keras 2 `.h5` file (its
    ImageNet weights downloaded elsewhere, with or without the top): a source for `init_from`."""
    name = cfg.model.name
    if kind(name) != "application":
        raise ConfigError(f"config.model.init_from={path!r}: a Keras 2 .h5 weights file loads into keras.applications "
                          f"models only, not config.model.name={name!r}: save the weights with model.save_weights "
                          "as a .weights.h5 file")
    backbone = _backbone(name[len(APPLICATION_PREFIX):], (cfg.data.image_size, cfg.data.image_size, 3),
                         **_options(cfg.model))
    try:
        backbone.load_weights(path, skip_mismatch=False)
    except Exception as err:  # not an h5 file, or another architecture's
        raise ConfigError(f"config.model.init_from={path!r}: not weights of {name} without its top: "
                          f"{type(err).__name__}: {' '.join(str(err).split())[:300]}") from None
    return backbone


# --- options and BatchNorm ---------------------------------------------------------------------------


def _resnet_options(model_cfg) -> dict:
    """tfscale's ResNets' keyword arguments from config.model (None: the ResNets' own default)."""
    chosen = {"zero_init_residual": model_cfg.zero_init_residual, "bn_momentum": model_cfg.bn_momentum,
              "bn_epsilon": model_cfg.bn_epsilon}
    return {**{k: v for k, v in chosen.items() if v is not None}, "data_format": model_cfg.data_format,
            "sync_bn": model_cfg.sync_bn, "bn_group_size": model_cfg.bn_group_size}


def _options(model_cfg) -> dict:
    """config.model.options as keyword arguments (a run's config.json from before the key: none)."""
    return model_cfg.options.to_dict() if model_cfg.get("options") else {}


def _check_no_options(name: str, options: dict) -> None:
    if options:
        raise ConfigError(f"config.model.options={options}: tfscale's {name} takes its options from config.model's "
                          "own keys; options are for keras.applications and your own builders")


def _check_foreign_keys(model_cfg) -> None:
    """Keys that only tfscale's ResNets can honour, refused by name for any other model."""
    name = model_cfg.name
    if model_cfg.zero_init_residual:
        raise ConfigError(f"config.model.zero_init_residual=True zero-initialises the BatchNorm closing each residual "
                          f"branch of tfscale's ResNets; config.model.name={name!r} has no branches tfscale knows: "
                          "set config.model.zero_init_residual=False")
    if model_cfg.data_format != "channels_last":
        raise ConfigError(f"config.model.data_format={model_cfg.data_format!r} is tfscale's ResNets' own transpose; "
                          f"config.model.name={name!r} follows Keras' image_data_format: set it to 'channels_last'")


def adapt_batchnorm(model: keras.Model, *, sync_bn: bool, group_size: int, momentum=None, epsilon=None) -> keras.Model:
    """`model` with every BatchNormalization synchronized over the replicas (`sync_bn`), over groups of
    `group_size` examples (`models.GhostBatchNormalization`), or with `momentum`/`epsilon` (None: its own).

    Keras rebuilds the layer graph (`keras.models.clone_model`) of the functional or Sequential model
    (`check_classifier`), and of the functional models nested in it, and the copy starts from the
    original's initial weights.
    """
    changes = {k: v for k, v in (("synchronized", sync_bn), ("momentum", momentum), ("epsilon", epsilon)) if v}
    if not changes and not group_size:
        return model

    def clone_layer(layer):
        if isinstance(layer, Functional):
            return keras.models.clone_model(layer, clone_function=clone_layer)
        if not isinstance(layer, layers.BatchNormalization):
            return layer.__class__.from_config(layer.get_config())
        config = {**layer.get_config(), **changes}
        if group_size:
            return models.GhostBatchNormalization.from_config({**config, "group_size": group_size})
        return layers.BatchNormalization.from_config(config)

    clone = keras.models.clone_model(model, clone_function=clone_layer)
    if tf.executing_eagerly():  # not in `check`'s throwaway graph, which has no values
        clone.set_weights(model.get_weights())  # the same start with or without the keys: only BatchNorm's rule changes
    return clone


# --- building and checking ---------------------------------------------------------------------------


def create_from_config(cfg: ml_collections.ConfigDict) -> keras.Model:
    """The model a tfscale config describes; call it inside the strategy scope.

    ``cfg.model.name`` with the ``cfg.model`` options, ``cfg.data.num_classes`` logits and square RGB
    input of ``cfg.data.image_size`` pixels.
    """
    model_cfg = cfg.model
    input_shape = (cfg.data.image_size, cfg.data.image_size, 3)
    options = _options(model_cfg)
    builder = resolve(model_cfg.name)
    if kind(model_cfg.name) == "tfscale":
        _check_no_options(model_cfg.name, options)
        return builder(cfg.data.num_classes, input_shape, **_resnet_options(model_cfg))
    _check_foreign_keys(model_cfg)
    try:
        model = builder(num_classes=cfg.data.num_classes, input_shape=input_shape, **options)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"config.model.name={model_cfg.name!r} with config.model.options={options}: building the "
                          f"model failed: {type(err).__name__}: {err}") from None
    check_classifier(model, model_cfg.name, cfg.data.num_classes, input_shape)
    return adapt_batchnorm(model, sync_bn=model_cfg.sync_bn, group_size=model_cfg.bn_group_size,
                           momentum=model_cfg.bn_momentum, epsilon=model_cfg.bn_epsilon)


def check_classifier(model, name: str, num_classes: int, input_shape: tuple[int, int, int]) -> None:
    """Refuses what tfscale cannot train: not a keras.Model, not one image input, not `num_classes` logits."""
    where = f"config.model.name={name!r}"
    if not isinstance(model, keras.Model):
        raise ConfigError(f"{where} returned {type(model).__name__}, not a keras.Model ({BUILDER_CONTRACT})")
    if not isinstance(model, Functional):
        raise ConfigError(f"{where} returned a subclassed keras.Model ({type(model).__name__}); tfscale needs a functional "
                          "or Sequential one: its layer graph is what the BatchNorm keys and tfscale-export rebuild")
    if len(model.inputs) != 1 or tuple(model.inputs[0].shape[1:]) != tuple(input_shape):
        shapes = [tuple(i.shape) for i in model.inputs]
        raise ConfigError(f"{where}: the model takes {shapes}; tfscale feeds one batch of images of shape "
                          f"(None, {', '.join(map(str, input_shape))}) (config.data.image_size)")
    if len(model.outputs) != 1 or tuple(model.outputs[0].shape[1:]) != (num_classes,):
        shapes = [tuple(o.shape) for o in model.outputs]
        raise ConfigError(f"{where}: the model returns {shapes}; tfscale needs one output of shape (None, {num_classes}): "
                          f"logits of config.data.num_classes={num_classes} classes")
    last = model.layers[-1]
    if getattr(last, "activation", None) in (keras.activations.softmax, keras.activations.sigmoid):
        raise ConfigError(f"{where}: its last layer {last.name!r} applies {last.activation.__name__}; tfscale's loss "
                          "takes logits: build it with activation=None")


def check(cfg: ml_collections.ConfigDict) -> None:
    """Builds the configured model in a throwaway graph: its refusals come before any worker connects.

    A graph of its own keeps TensorFlow's eager context (and so the strategy to come) untouched.
    """
    if kind(cfg.model.name) == "tfscale":
        _check_no_options(cfg.model.name, _options(cfg.model))
        return  # every layer of tfscale's ResNets compiles with XLA
    with tf.Graph().as_default():
        check_xla(cfg, create_from_config(cfg))


def check_xla(cfg: ml_collections.ConfigDict, model: keras.Model) -> None:
    """`jit_compile` off, with a warning naming the layers, when a layer says XLA cannot compile it
    (`supports_jit=False`): what Keras' compile does with such a model (keras/src/trainers/trainer.py,
    the `jit_compile` setter: "Model doesn't support `jit_compile=True`. Proceeding with `jit_compile=False`")."""
    unsupported = [layer.name for layer in _all_layers(model) if not layer.supports_jit]
    if cfg.jit_compile and unsupported:
        logging.warning("config.jit_compile=%s -> False: layer(s) %s of config.model.name=%r set supports_jit=False, "
                        "so XLA cannot compile the step (as Keras' compile falls back)", cfg.jit_compile,
                        ", ".join(unsupported[:5]), cfg.model.name)
        cfg.jit_compile = False


def _all_layers(layer: keras.layers.Layer):
    """`layer` and every layer nested in it (the layers of sub-models too)."""
    yield layer
    for inner in getattr(layer, "layers", ()):
        yield from _all_layers(inner)
