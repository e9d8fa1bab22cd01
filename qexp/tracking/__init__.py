"""Tracking: the MLflow store and run lifecycle (store.py), the run.log artifact (runlog.py), multirun bookkeeping
(sweep.py)."""
