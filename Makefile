# privfl: `make demo` runs the main job on embedded data; `make test` runs the test suite.
# Both create .venv and install privfl into it on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PRIVFL := $(VENV)/bin/privfl
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	mkdir -p runs
	rm -f runs/demo.sqlite runs/demo.sqlite-wal runs/demo.sqlite-shm
	$(PRIVFL) run --algorithm dp_fedavg --dataset mnist5k --clients 10 --rounds 20 --epsilon 3 --delta 1e-5 \
		--ledger runs/demo.sqlite --json runs/demo.json
	$(PRIVFL) audit runs/demo.sqlite --delta 1e-5 --png runs/demo_epsilon.png

# pytest exits 5 when it collects no test (e.g. a -k filter that matches nothing): say so and do not fail on it.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "WARNING: pytest collected no tests"; exit 0; fi; exit $$rc

bench: $(STAMP)
	for b in experiments/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache build *.egg-info
