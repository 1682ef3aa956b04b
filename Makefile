# privfl: `make demo` runs the main job on embedded data; `make test` runs the test suite.
# Both create .venv and install privfl into it on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PRIVFL := $(VENV)/bin/privfl
STAMP := $(VENV)/.installed
FLOWER_STAMP := $(VENV)/.installed-flower
PIP_INSTALL := $(PY) -m pip install --quiet -c constraints.txt

.PHONY: setup demo test test-all test-fast bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PIP_INSTALL) -e '.[all,dev]'
	touch $(STAMP)

# The Flower runtime's tests run in CI: `make test` installs the optional extra too (flwr with Ray).
$(FLOWER_STAMP): $(STAMP)
	$(PIP_INSTALL) -e '.[all,dev,flower,flower-datasets]'
	touch $(FLOWER_STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PRIVFL) compare experiments/configs/default.toml --out-dir runs/compare --json runs/compare/results.json
	$(PRIVFL) audit runs/compare/ledgers/fola-eps3-seed0.sqlite --delta 1e-5 --png runs/compare/fola_eps3_audit.png

# The tests run in TEST_WORKERS processes (pytest-xdist; work stealing, so that a worker that finishes early takes
# tests queued on the other: the Flower deployments, which mostly wait on their SuperNodes, overlap the CPU-bound
# tests). TEST_WORKERS=0 runs them in this process. pytest exits 5 when it collects no test (e.g. a -k filter that
# matches nothing): say so and do not fail on it.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)
test: $(FLOWER_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "WARNING: pytest collected no tests"; exit 0; fi; exit $$rc

# every test, the slow Flower deployments included
test-all: $(FLOWER_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) -m 'slow or not slow' $(PYTEST_ARGS)

# every benchmark at full size (about 45 minutes on 2 cores, bench_accounting ~30 of them), then the names of those
# that failed; each one's smallest configuration runs in `make test` (tests/experiments/test_bench_smoke.py)
bench: $(STAMP)
	@failed=""; for b in experiments/bench_*.py; do echo "== $$b"; \
	$(PY) $$b || { echo "FAILED (exit $$?): $$b" >&2; failed="$$failed $$b"; }; done; \
	if [ -n "$$failed" ]; then echo "benchmarks that failed:$$failed" >&2; exit 1; fi

clean:
	rm -rf $(VENV) runs .pytest_cache build *.egg-info
