"""CONTRIBUTING.md's checklists are all an extension needs: in a copy of the repository, a dummy algorithm, model
family, backend and metric are added by following the checklists' steps and nothing else; the copy then runs an
experiment that uses all four on a tiny model, and passes the docs, layering and catalog tests. A step the code needs
that a checklist omits fails here (each write below names its checklist step)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.slow

COPIED = ("qexp", "conf", "docs", "tests", "sweeps", "benchmarks", "diagnostics", "scripts", "mkdocs.yml", "README.md",
          "CONTRIBUTING.md", "pyproject.toml")


def _copy_repository(tree: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest-units")
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=ignore, symlinks=True)
        else:
            shutil.copy2(source, tree / name)
    (tree / "results").mkdir()  # the results pages are not needed: only the folder, which the docs name


def _write(tree: Path, path: str, text: str) -> None:
    (tree / path).parent.mkdir(parents=True, exist_ok=True)
    (tree / path).write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")


def _append(tree: Path, path: str, text: str) -> None:
    with open(tree / path, "a", encoding="utf-8") as f:
        f.write(textwrap.dedent(text))


def _replace(tree: Path, path: str, old: str, new: str) -> None:
    text = (tree / path).read_text(encoding="utf-8")
    assert old in text, f"{path} no longer has {old!r}: update this test's step"
    (tree / path).write_text(text.replace(old, new, 1), encoding="utf-8")


def _architecture_rows(tree: Path, rows: dict) -> None:
    """The modules' rows in docs/architecture.md's "Every module" table (every checklist's docs step)."""
    _append(tree, "docs/architecture.md", "".join(f"| `{path}` | {line} |\n" for path, line in rows.items()))


def _add_algorithm(tree: Path) -> None:
    # Adding an algorithm, 1: the module, its config dataclass and its registered ModelTransform
    _write(tree, "qexp/transforms/scale_weights.py", '''
        """Every linear weight times a constant (a dummy algorithm: factor 1 keeps the model)."""

        from __future__ import annotations

        import dataclasses
        from dataclasses import dataclass

        from qexp.core.errors import ConfigError
        from qexp.transforms.base import ModelTransform, TransformConfig, register_transform


        @dataclass
        class ScaleWeightsConfig(TransformConfig):
            factor: float = 1.0


        @register_transform
        class ScaleWeights(ModelTransform):
            name = "scale_weights"
            config_class = ScaleWeightsConfig

            def validate(self, cfg) -> None:
                if self.config.factor <= 0:
                    raise ConfigError("algorithm.scale_weights.factor must be positive", "use e.g. 1.0")

            def apply(self, model, context):
                scaled = {k: (v * self.config.factor if k.endswith("weight") and v.dim() == 2 and "emb" not in k
                              else v) for k, v in model.state_dict.items()}
                return dataclasses.replace(model, state_dict=scaled)
        ''')
    # 2: imported in qexp/transforms/__init__.py
    _replace(tree, "qexp/transforms/__init__.py", "from qexp.transforms import awq,",
             "from qexp.transforms import scale_weights  # noqa: E402,F401\nfrom qexp.transforms import awq,")
    # 3: its config file
    _write(tree, "conf/algorithm/scale_weights.yaml", "scale_weights:\n  factor: 1.0\n")
    # 5: docs/algorithms.md, docs/configuration.md and its row in docs/architecture.md
    _append(tree, "docs/algorithms.md", "\n`scale_weights`: every linear weight times `factor`.\n")
    _append(tree, "docs/configuration.md", "\n`algorithm=[scale_weights]`: `factor` (1.0).\n")
    _architecture_rows(tree, {"qexp/transforms/scale_weights.py": "a dummy algorithm"})


def _add_family(tree: Path) -> None:
    # Adding a model family, 1: the registered Family, with its tiny builder, imported in qexp/models/__init__.py
    _write(tree, "qexp/models/dummy_llama.py", '''
        """A Llama under another architecture name (a dummy family)."""

        from qexp.models.families import Family, llama_params, llama_state_dict, register_family, tiny_llama

        DUMMY_LLAMA = register_family(Family("dummy_llama", ("DummyLlamaForCausalLM",),
                                             lambda c: llama_params(c, "dummy_llama"), llama_state_dict,
                                             tiny=tiny_llama))
        ''')
    _replace(tree, "qexp/models/__init__.py", "from qexp.models import gemma, qwen",
             "from qexp.models import dummy_llama  # noqa: F401\nfrom qexp.models import gemma, qwen")
    # 2: conf/model/tiny_<family>.yaml
    _write(tree, "conf/model/tiny_dummy_llama.yaml", """
        name: tiny_dummy_llama
        source: tiny
        arch: stories260k
        add_bos: true
        tiny:
          family: dummy_llama
        """)
    # 5: docs/models.md (its row in the families table) and the module in docs/architecture.md
    _replace(tree, "docs/models.md", "| `qwen2` | `Qwen2ForCausalLM`",
             "| `dummy_llama` | `DummyLlamaForCausalLM` | a test's | none | |\n"
             "| `qwen2` | `Qwen2ForCausalLM`")
    _append(tree, "docs/models.md", "\nTiny dummy_llama: `model=tiny_dummy_llama`.\n")
    _architecture_rows(tree, {"qexp/models/dummy_llama.py": "a dummy family"})


def _add_backend(tree: Path) -> None:
    # Adding a backend, 1: the config dataclass
    _write(tree, "qexp/backends/count/config.py", '''
        """Settings of the dummy backend."""

        from dataclasses import dataclass

        from qexp.backends.base import BackendConfig


        @dataclass
        class CountConfig(BackendConfig):
            name: str = "count"
            scale: float = 1.0
        ''')
    # 2: the registered Backend (validate, run -> PhaseResult); its metric goes through the catalog (below)
    _write(tree, "qexp/backends/count/__init__.py", '''
        """backend=count: deploys nothing real; logs how many tokens it was handed (a dummy backend)."""

        from qexp.backends.base import Backend, PhaseInputs, PhaseResult
        from qexp.backends.count.config import CountConfig
        from qexp.backends.registry import register_backend
        from qexp.core.errors import ConfigError


        @register_backend
        class CountBackend(Backend):
            name = "count"
            config_class = CountConfig

            def validate(self, cfg) -> None:
                if cfg.backend.scale <= 0:
                    raise ConfigError("backend.scale must be positive", "use e.g. 1.0")

            def run(self, inputs: PhaseInputs) -> PhaseResult:
                tokens = inputs.windows.ids.size * inputs.cfg.backend.scale
                return PhaseResult(metrics={"count_tokens": float(tokens)})
        ''')
    # 3: imported in qexp/backends/__init__.py
    _replace(tree, "qexp/backends/__init__.py", "from qexp.backends import htp, none, xnnpack",
             "from qexp.backends import count, htp, none, xnnpack")
    # 4: conf/backend/<name>.yaml
    _write(tree, "conf/backend/count.yaml", "defaults:\n  - count_schema\n  - _self_\nscale: 1.0\n")
    # 6: docs/backends/<name>.md, linked from mkdocs.yml and docs/index.md; its modules in docs/architecture.md
    _write(tree, "docs/backends/count.md", "# Count\n\n`backend=count`: logs `count_tokens`.\n")
    _replace(tree, "mkdocs.yml", "      - XNNPACK: backends/xnnpack.md\n",
             "      - XNNPACK: backends/xnnpack.md\n      - Count: backends/count.md\n")
    _append(tree, "docs/index.md", "\n[Count](backends/count.md): a dummy backend.\n")
    _architecture_rows(tree, {"qexp/backends/count/__init__.py": "a dummy backend",
                              "qexp/backends/count/config.py": "its settings"})


def _add_metric(tree: Path) -> None:
    # Adding a metric, 1: its catalog entry
    _replace(tree, "qexp/core/metrics.py", "CATALOG: List[Metric] = [\n",
             'CATALOG: List[Metric] = [\n    Metric("count_tokens", "tokens counted", unit="tokens", doc="a dummy"),\n')
    # 3: docs/metrics.md regenerated by `python -m qexp.core.metrics`
    table = subprocess.run([sys.executable, "-m", "qexp.core.metrics"], cwd=tree, env=_env(tree), capture_output=True,
                           text=True, check=True).stdout
    page = (tree / "docs/metrics.md").read_text(encoding="utf-8")
    (tree / "docs/metrics.md").write_text(page[:page.index("| metric | header |")] + table, encoding="utf-8")


def _env(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree), "QEXP_CHECK_METRICS": "1"}


def test_the_checklists_add_an_algorithm_a_family_a_backend_and_a_metric(tmp_path, cache_dir):
    tree = tmp_path / "repo"
    _copy_repository(tree)
    for add in (_add_algorithm, _add_family, _add_backend, _add_metric):
        add(tree)

    store = f"sqlite:///{tmp_path / 'mlruns.db'}"
    run = subprocess.run([sys.executable, "-m", "qexp", "model=tiny_dummy_llama", "algorithm=[scale_weights]",
                          "backend=count", "quant=16a8w", "eval.seq_len=64", "eval.limit=2", "calibration.limit=2",
                          f"cache_dir={cache_dir}", f"tracking.uri={store}", "tracking.experiment=extending"],
                         cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]

    import mlflow

    client = mlflow.MlflowClient(store)
    (logged,) = client.search_runs([client.get_experiment_by_name("extending").experiment_id])
    assert logged.data.metrics["count_tokens"] == 2 * 64, logged.data.metrics
    assert logged.data.tags["algorithm"] == "scale_weights"
    assert logged.data.params.get("model.tiny.family") == "dummy_llama"

    checks = ["tests/test_docs.py::test_every_config_group_and_file_is_documented",
              "tests/test_docs.py::test_every_module_is_listed_in_the_architecture",
              "tests/test_docs.py::test_every_registered_backend_algorithm_and_family_is_documented",
              "tests/test_docs.py::test_contributing_names_paths_that_exist",
              "tests/test_lint.py::test_no_import_cycles", "tests/test_lint.py::test_no_import_cycles_between_packages",
              "tests/test_lint.py::test_modules_and_functions_stay_small",
              "tests/test_metrics.py::test_the_docs_page_is_the_catalog"]
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *checks],
                           cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert f"{len(checks)} passed" in tests.stdout, tests.stdout[-1000:]
