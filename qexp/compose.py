"""A qexp config without the command line: composed from conf/ with Hydra overrides, or rebuilt from a logged run's
resolved config.yaml (what `python -m qexp.lm_eval --model_args run=<id>` and the speed estimator use)."""

from __future__ import annotations

import os
from typing import List, Optional

from qexp.core.provenance import REPO_ROOT

CONF_DIR = REPO_ROOT / "conf"


def compose(overrides: List[str], config_name: str = "config"):
    """conf/<config_name>.yaml with `overrides`, validated against qexp's schemas."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


def logged_config(run_id: str, tracking_uri: Optional[str] = None):
    """The resolved config a run logged (its config.yaml artifact) on qexp's schemas: its backend's group composed
    first, so the backend's own schema types the backend section, then the logged values merged onto it."""
    from mlflow.tracking import MlflowClient
    from omegaconf import OmegaConf

    from qexp.core.errors import ConfigError

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    try:
        path = MlflowClient(tracking_uri).download_artifacts(run_id, "config.yaml")
    except Exception as exc:  # noqa: BLE001 - unknown run, unreachable store: one line either way
        raise ConfigError(f"run {run_id}: cannot read its config.yaml ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160]})",
                          "pass the id of a qexp run in this store (tracking_uri=... for another store)") from exc
    logged = OmegaConf.load(path)
    return OmegaConf.merge(compose([f"backend={logged.backend.name}"]), logged)
