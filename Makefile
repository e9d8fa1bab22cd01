# The two commands of the README: `make run` (set up, run the default experiment) and `make test`.
VENV_PY := .venv/bin/python
EXPERIMENT ?= 16a4w_wikitext

.PHONY: setup setup-test run test test-fast bench ui notebook docs results

setup:
	@bash scripts/setup.sh

run: setup
	$(VENV_PY) -m qexp +experiment=$(EXPERIMENT)

# Three pytest workers: most tests run single-threaded Python (export, QNN's graph preparation) or wait on subprocesses
# and services, so two workers left the two cores ~40% idle (docs/testing-and-benchmarks.md has the runs compared).
# --dist loadgroup --no-loadscope-reorder: tests/conftest.py groups a file's tests that share module fixtures and hands
# the units out longest first (tests/durations.txt). PYTEST_WORKERS=2 (or 1) if memory is short.
PYTEST_WORKERS ?= 3

setup-test:
	@bash scripts/setup.sh test

test: setup-test
	@bash scripts/setup_test_system.sh
	$(VENV_PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=25 tests

test-fast: setup-test
	$(VENV_PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not slow" tests

bench: setup
	$(VENV_PY) benchmarks/bench_default.py

ui: setup
	$(VENV_PY) -m qexp.ui

# results/leaderboard.md and the README's headline table, regenerated from the committed tables
# (results/leaderboard.yaml lists them); tests/test_leaderboard.py fails until what this writes is committed.
results: setup
	$(VENV_PY) -m qexp.report leaderboard

# Re-execute notebooks/compare.ipynb against the committed results and save it with its outputs.
notebook: setup
	$(VENV_PY) scripts/build_notebook.py

# The manual (docs/) as a static site in site/, built strictly (a broken link or a missing page fails).
docs: setup-test
	.venv/bin/mkdocs build --strict -d site
