"""A TensorFlow or Keras release without one of the private hooks tfscale uses: one line naming the hook, the
installed version and the tested one (pyproject.toml holds both packages to the tested minor versions)."""

import importlib.metadata
import os
import tomllib

import keras
import pytest
from conftest import REPO

from tfscale import compat
from tfscale.model import optim
from tfscale.training import checkpoints


def test_the_tested_versions_are_the_installed_ones_and_pyprojects():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert "keras>=3.15,<3.16" in project["dependencies"]
    assert project["optional-dependencies"]["cpu"] == ["tensorflow-cpu>=2.21,<2.22"]
    for package, tested in compat.TESTED.items():
        assert compat.installed_version(package).startswith(tested + "."), package


def test_an_optimizer_without_keras_all_reduce_hook_is_refused_naming_both_versions(monkeypatch):
    sgd = keras.optimizers.SGD(0.1)
    for cls in type(sgd).__mro__:  # Keras' TensorFlow optimizer defines it on a base class
        if "_all_reduce_sum_gradients" in vars(cls):
            monkeypatch.delattr(cls, "_all_reduce_sum_gradients")
    with pytest.raises(compat.MissingHook) as refused:
        optim.clipping_global_norm(sgd, 1.0)
    keras_version = importlib.metadata.version("keras")
    assert str(refused.value) == (
        f"tfscale's GlobalNormClipping optimizer needs a private keras internal: keras {keras_version} has no "
        "TensorFlow optimizer hook _all_reduce_sum_gradients; tfscale is tested with keras 3.15 (pyproject.toml "
        "holds it there: pip install the checkout with -c requirements/constraints-cpu.txt, or keras==3.15.*)")


def test_a_keras_variable_without_its_host_copy_hook_stops_asynchronous_checkpoints(monkeypatch):
    from keras.src.backend.tensorflow import core

    monkeypatch.delattr(core.Variable, "_copy_trackable_to_cpu")
    with pytest.raises(compat.MissingHook, match=r"^tfscale's asynchronous checkpoints needs a private keras internal: "
                                                 r"keras \S+ has no keras.src.backend.tensorflow.core.Variable."
                                                 r"_copy_trackable_to_cpu; tfscale is tested with keras 3.15"):
        checkpoints._fix_keras_async_copy()
