"""Start-up of every process the test suite starts (conftest puts this directory on PYTHONPATH).

Keras 3 imports scikit-learn at start-up when it is installed, for the `keras.wrappers` SKLearn* classes,
which tfscale never uses. A user's training venv (`pip install tfscale[cpu]`) has no scikit-learn; the test
venv has it for the example-data tools (make_photo_tree.py, digits_demo.py). That one import is ~0.85 s of
every process's ~3.5 s TensorFlow import, and a `make test` starts ~400 such processes. So here, and only
for Keras' wrappers module, scikit-learn looks absent, as it is in a training venv: Keras takes its own
"not installed" branch. Every other importer, a tool or a test, gets scikit-learn as usual.
"""

import sys


class _NoSklearnForKerasWrappers:
    """A meta-path finder that refuses `sklearn*` while Keras' wrappers module is the importer."""

    def find_spec(self, name, path=None, target=None):
        if name != "sklearn" and not name.startswith("sklearn."):
            return None
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_globals.get("__name__", "").startswith("keras.src.wrappers"):
                raise ModuleNotFoundError(f"No module named {name!r} (hidden from keras.wrappers by the tests)",
                                          name=name)
            frame = frame.f_back
        return None


sys.meta_path.insert(0, _NoSklearnForKerasWrappers())
