# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv when missing and install torch==2.13.0 first: a looser spec would pull
# gigabytes of CUDA packages, while the pinned version picks up the local CPU build.

# The extras come from the pins the suite last passed with (constraints.txt), so that a fresh
# machine gets what CI passed with; `make test-latest` runs the suite on the newest releases instead.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.autoscale-installed
EXTRAS := .[test,bench,dev,zoo,lightning,huggingface]
LATEST := .venv-latest

.PHONY: demo test test-latest pins lint clean chromium bench-numerics bench-zoo

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e "$(EXTRAS)"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

# Headless Chromium renders the graph diff's HTML page in tests/test_diff.py (skipped without it).
# Installed when missing and apt-get can run (as root, or with passwordless sudo); when it cannot,
# the set-up says so and goes on: the build never fails for it.
APT = $(shell [ "$$(id -u)" = 0 ] && echo apt-get || (sudo -n true 2>/dev/null && echo "sudo -n apt-get"))
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ -n "$(APT)" ] && command -v apt-get >/dev/null 2>&1 && \
	    { $(APT) install -y -qq chromium >/dev/null 2>&1 || \
	      { $(APT) update -qq >/dev/null 2>&1 && $(APT) install -y -qq chromium >/dev/null 2>&1; }; }; } || \
	  echo "chromium could not be installed: the HTML diff tests will be skipped"

# A worker per core (pytest-xdist; at most 4: each holds its own compiled models), each on its
# share of the cores (tests/conftest.py).
PYTEST := -m pytest -m "not slow" -q -n auto --maxprocesses 4 --dist worksteal

test: $(STAMP) chromium
	$(PY) $(PYTEST)

# The suite on the newest releases of every dependency but torch, in a venv of its own; then
# `make pins` writes them to constraints.txt, for a change that moves the pins forward.
test-latest: chromium
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet torch==2.13.0
	$(LATEST)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e "$(EXTRAS)"
	$(LATEST)/bin/python $(PYTEST)

pins:
	{ sed -n '/^#/p' constraints.txt; $(LATEST)/bin/python -m pip freeze --exclude-editable | \
	  grep -v '^-e\|^autoscale\|^#' | sed 's/^torch==\([0-9.]*\)+.*/torch==\1/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

# The numerics benchmark (about an hour on 2 cores; --quick: under 3 minutes): docs/results/numerics.md.
bench-numerics: $(STAMP)
	$(PY) -m benchmarks.numerics

# The public model zoo with Inductor (about half an hour on 2 cores): docs/results/zoo.md.
bench-zoo: $(STAMP)
	$(PY) -m benchmarks.zoo

lint: $(STAMP)
	$(PY) -m ruff check autoscale tests examples benchmarks
	$(PY) -m mypy

clean:
	rm -rf $(VENV) $(LATEST) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
