"""The vocabulary every other package builds on: the config schema, errors, the metric catalog, devices,
provenance, timing, registries and stable hashes. Nothing here imports from another qexp package, so any package may
import it (tests/test_lint.py keeps the packages layered)."""
