# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv when missing and install torch==2.13.0 first: a looser spec would pull
# gigabytes of CUDA packages, while the pinned version picks up the local CPU build.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.autoscale-installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,bench,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -q

lint: $(STAMP)
	$(PY) -m ruff check autoscale passes tests examples
	$(PY) -m mypy

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
