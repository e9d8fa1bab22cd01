# The two commands of the README: `make run` (set up, run the default experiment) and `make test`.
VENV_PY := .venv/bin/python
EXPERIMENT ?= 16a4w_wikitext

.PHONY: setup run test test-fast bench ui

setup:
	@bash scripts/setup.sh

run: setup
	$(VENV_PY) -m qexp +experiment=$(EXPERIMENT)

test: setup
	$(VENV_PY) -m pytest tests

test-fast: setup
	$(VENV_PY) -m pytest -m "not slow" tests

bench: setup
	$(VENV_PY) benchmarks/bench_default.py

ui: setup
	.venv/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlruns.db --host 127.0.0.1 --port 5000
