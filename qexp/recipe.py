"""A qexp recipe as an ExecuTorch recipe class, for upstream's static llama:

    python -m qexp.recipe export recipe_llama3_2_1b                     # a config of conf/quant/
    python -m qexp.recipe export mixed/mp_smollm2_135m_16a4w_block_b4_38 -o smollm2_b4_38.py
    python -m qexp.recipe export path/to/recipe.yaml                    # a recipe the sensitivity analysis wrote
    python -m qexp.recipe export 161f40f7f1d9416a884d694aa2ac06dd      # the recipe a logged run used

The class (a StaticLLMQuantRecipe) annotates a graph as qexp's quantizer does for that recipe (qexp/quant/export.py).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from qexp.core.errors import QexpError

RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def load(source: str, observer: str | None, tracking_uri: str | None):
    """(quant, observer) configs of a run id, a recipe YAML file or a conf/quant name."""
    from omegaconf import OmegaConf

    from qexp.compose import CONF_DIR, compose, logged_config
    from qexp.core.config import QuantConfig
    from qexp.core.errors import ConfigError

    overrides = [f"observer={observer}"] if observer else []
    if RUN_ID.match(source):
        cfg = logged_config(source, tracking_uri)
        if observer:
            cfg.observer = compose(overrides).observer
        return cfg.quant, cfg.observer
    path = Path(source)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"{source}: no such recipe file", "give a quant YAML file, a conf/quant name or a run id")
        try:
            quant = OmegaConf.merge(OmegaConf.structured(QuantConfig), OmegaConf.load(path))
        except Exception as exc:  # noqa: BLE001 - a key QuantConfig does not have, a wrong type: one line
            raise ConfigError(f"{source} is not a quant recipe: {str(exc).splitlines()[0]}",
                              "give a file of the quant group's keys (name, scheme, overrides, ...)") from exc
        return quant, compose(overrides).observer
    if not (CONF_DIR / "quant" / f"{source}.yaml").is_file():
        raise ConfigError(f"{source}: not a run id, a .yaml file or a config of conf/quant/",
                          "e.g. recipe_llama3_2_1b, mixed/<name>, path/to/recipe.yaml or a 32-character run id")
    cfg = compose([f"quant={source}", *overrides])
    return cfg.quant, cfg.observer


def main(argv=None) -> int:
    import logging

    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # torchao's import-time notices to torch
    from qexp.quant.export import class_name, recipe_source

    parser = argparse.ArgumentParser(prog="python -m qexp.recipe", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write a recipe as an ExecuTorch StaticLLMQuantRecipe class")
    export.add_argument("source", help="a conf/quant name, a recipe .yaml file or a run id")
    export.add_argument("--observer", help="the activation observer (default: the run's, else conf's default)")
    export.add_argument("--name", help="the class name (default: from the recipe's name)")
    export.add_argument("-o", "--output", type=Path, help="the .py file to write (default: the terminal)")
    export.add_argument("--tracking-uri", help="the store of a run id (default: MLFLOW_TRACKING_URI or the repo's)")
    args = parser.parse_args(argv)
    try:
        quant, observer = load(args.source, args.observer, args.tracking_uri)
        source = recipe_source(quant, observer, args.name or class_name(quant.name), args.source)
    except QexpError as exc:
        print(f"qexp.recipe: error: {exc}", file=sys.stderr)
        return 2
    if args.output:
        args.output.write_text(source)
        print(f"qexp.recipe: wrote {args.output}")
    else:
        sys.stdout.write(source)
    return 0


if __name__ == "__main__":
    sys.exit(main())
