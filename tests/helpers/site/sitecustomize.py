"""Start-up of every process the test suite starts (conftest puts this directory on PYTHONPATH).

Importing TensorFlow and Keras imports three optional libraries for parts tfscale never uses, each
behind a guarded `try: import ... except ImportError` that takes a "not installed" branch:
- Keras' `keras.wrappers` (the SKLearn* classes) imports scikit-learn, ~0.85 s. A user's training venv
  (`pip install tfscale[cpu]`) has no scikit-learn; the test venv has it for the example-data tools.
- Keras' `keras.visualization.plot_image_gallery` imports matplotlib.pyplot, ~0.45 s.
- TensorFlow's legacy `tensorflow.python.keras` (the v1 training loops, not Keras 3) imports
  scipy.sparse, ~0.2 s, to accept scipy sparse matrices as inputs.
Together that is ~1.5 s of every process's ~3.5 s import, and a `make test` starts ~400 such processes.
So here, and only for those importers, the library looks absent: they take their own "not installed"
branch. Every other importer, tfscale, a tool or a test, gets the library as usual.
"""

import sys

# importer module (itself or a submodule) -> the top-level package it is refused
_HIDDEN = {"keras.src.wrappers": "sklearn", "keras.src.visualization": "matplotlib",
           "tensorflow.python.keras": "scipy"}
_IMPORT_MACHINERY = ("importlib", "_frozen_importlib")


def _importer(frame) -> str:
    """The module whose `import` statement is running: the first frame outside the import machinery."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(_IMPORT_MACHINERY):
            return name
        frame = frame.f_back
    return ""


class _HiddenFromUnusedImporters:
    """A meta-path finder that refuses a library of _HIDDEN while one of its importers there imports it."""

    def find_spec(self, name, path=None, target=None):
        package = name.partition(".")[0]
        if package not in _HIDDEN.values():
            return None
        importer = _importer(sys._getframe(1))
        for hidden_from, hidden in _HIDDEN.items():
            if package == hidden and (importer == hidden_from or importer.startswith(hidden_from + ".")):
                raise ModuleNotFoundError(f"No module named {name!r} (hidden from {hidden_from} by the tests)",
                                          name=name)
        return None


sys.meta_path.insert(0, _HiddenFromUnusedImporters())
