"""A qexp recipe exported as an ExecuTorch StaticLLMQuantRecipe class (python -m qexp.recipe export) annotates the
static llama as qexp's own quantizer does: the class is loaded from the written file, handed to upstream's
QnnQuantizer, and the prepared graphs compared node by node and observer by observer."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from helpers import REPO, TINY


def _prepared(static, quantizer):
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    from qexp.quant.calibrate import EXPORT_STRICT

    graph = torch.export.export(static.module, static.example_inputs(), strict=EXPORT_STRICT).module()
    return prepare_pt2e(graph, quantizer)


def _observers(prepared) -> list:
    """Each observer of a prepared graph: its node, class and the settings that decide its quantization."""
    keys = ("dtype", "quant_min", "quant_max", "qscheme", "ch_axis", "block_size", "averaging_constant", "eps")
    out = []
    for name, module in prepared.named_modules():
        if "observer" in type(module).__name__.lower():
            out.append((name, type(module).__name__, {k: str(getattr(module, k)) for k in keys if hasattr(module, k)}))
    return out


@pytest.mark.parametrize("quant, observer", [
    ("recipe_llama3_2_1b", "minmax"),  # LPBQ blocks, two 8-bit overrides (both match the tiny model), 8-bit KV
    ("mixed/mp_smollm2_135m_16a4w_block_b4_38", "moving_average"),  # a synthesized recipe, qexp's averaging constant
    ("16a8w", "minmax"),
])
def test_an_exported_recipe_annotates_as_qexps_quantizer(compose, tiny_model, tmp_path, quant, observer):
    from qexp.models.static_llama import StaticLlama
    from qexp.quant.recipe import make_quantizer
    from qexp.upstream import QcomChipset, QnnQuantizer

    written = tmp_path / "exported_recipe.py"
    out = subprocess.run([sys.executable, "-m", "qexp.recipe", "export", quant, "--observer", observer,
                          "--name", "ExportedRecipe", "-o", str(written)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stderr == "", out.stderr[-2000:]
    spec = importlib.util.spec_from_file_location("exported_recipe", written)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    upstream = QnnQuantizer(soc_model=QcomChipset.SM8650)
    upstream.set_recipe(module.ExportedRecipe().recipe)

    cfg = compose(TINY + [f"quant={quant}", f"observer={observer}"], tracked=False)
    static = StaticLlama(tiny_model, 32)
    ours = _prepared(static, make_quantizer(cfg.quant, cfg.observer, "SM8650"))
    theirs = _prepared(static, upstream)
    assert theirs.code == ours.code
    assert _observers(theirs) == _observers(ours) and len(_observers(ours)) > 50
    if quant == "recipe_llama3_2_1b":  # the overrides took: 8-bit per-channel weights beside 4-bit blocks
        dtypes = {o[2].get("quant_max") for o in _observers(ours)}
        assert {"7", "127"} <= dtypes, dtypes


@pytest.mark.parametrize("args, says", [
    (["fp32"], "the float model"),
    (["16a3w_block"], "QDQ-only research scheme"),
    (["16a4w", "--observer", "percentile"], "qexp's own observer"),
    (["no_such_recipe"], "not a run id, a .yaml file or a config of conf/quant/"),
])
def test_a_recipe_that_cannot_be_exported_is_one_line(args, says):
    out = subprocess.run([sys.executable, "-m", "qexp.recipe", "export", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1 and says in out.stderr, out.stderr
