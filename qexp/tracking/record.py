"""A run's config as the store keeps it: one param per leaf key, and the resolved config as config.yaml, secrets
masked in both."""

from __future__ import annotations

from typing import Dict

from omegaconf import DictConfig, OmegaConf

from qexp.core.redact import redact


def config_yaml(cfg: DictConfig) -> str:
    """The resolved config as the run's config.yaml artifact, secrets masked."""
    return OmegaConf.to_yaml(redact(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)))


def flatten(cfg: DictConfig | dict, prefix: str = "") -> Dict[str, str]:
    """Resolved config -> {"quant.scheme": "16a4w", ...} (lists as their YAML-ish repr), secrets masked."""
    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if OmegaConf.is_config(cfg) else cfg
    container = redact(container)
    out: Dict[str, str] = {}
    for key, value in container.items():
        name = f"{prefix}{key}"
        if value is None and not prefix:  # a section an experiment does not use (sensitivity)
            continue
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = str(value)[:6000]  # MLflow's param value limit
    return out
