# Two commands for a fresh clone: `make demo` and `make test`. Both build .venv from this repo's files.
PYTHON ?= python3
VENV ?= .venv
# TensorFlow wheel: cpu here, gpu on CUDA hosts (make TF_EXTRA=gpu demo).
TF_EXTRA ?= cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(TF_EXTRA)

.PHONY: venv demo test test-fast test-slow clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==25.3
	# Constraints pin every transitive package to the set tested together.
	$(PY) -m pip install --quiet -c requirements/constraints-cpu.txt -e ".[$(TF_EXTRA),test]"
	touch $@

demo: venv
	$(PY) tools/digits_demo.py --workdir=runs/demo

test: venv
	$(PY) -m pytest -q

test-fast: venv
	$(PY) -m pytest -q -m "not slow"

test-slow: venv
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache
