"""A qexp recipe (a `quant` + `observer` config) written out as an ExecuTorch `StaticLLMQuantRecipe` class: the file
upstream's static llama (examples/qualcomm/oss_scripts/llama) takes as a model's recipe.

The class is written from the same builder calls qexp's own quantizer is built from (recipe.recipe_steps), so the
two annotate a graph alike (tests/test_recipe_export.py checks it op by op). What the recipe class cannot carry
refuses with one line: qexp's percentile observer (not upstream's), the QDQ-only research schemes and
`weight_range=full` (HTP runs neither). Calibration, SeqMSE and the algorithms are not part of a recipe: upstream's
llama.py has its own flags for them.
"""

from __future__ import annotations

import re
from typing import Any, List

import torch

from qexp.core.config import (FLOAT_ACTIVATION_SCHEME, NO_QUANT, QDQ_ONLY_SCHEMES, ObserverConfig, ObserverKind,
                         QuantConfig, WeightRange)
from qexp.core.errors import ConfigError

_HEADER = '''"""{title}

Written by qexp (python -m qexp.recipe export {source}): {what}.
Use it as upstream's static llama uses its recipes (static_llm_quant_recipe.py): the model's `quant_recipe`.
"""

import torch
from executorch.backends.qualcomm.quantizer.quant_recipe import QuantGranularity, QuantRecipe
from executorch.backends.qualcomm.quantizer.quantizer import QuantDtype
from executorch.examples.qualcomm.oss_scripts.llama.static_llm_quant_recipe import StaticLLMQuantRecipe
'''


def check_exportable(quant: QuantConfig, observer: ObserverConfig) -> None:
    if quant.scheme == NO_QUANT:
        raise ConfigError(f"quant={quant.name} is the float model: there is no recipe to export",
                          "export a quantized recipe (a quant config or a run of one)")
    if quant.scheme in QDQ_ONLY_SCHEMES:
        raise ConfigError(f"quant.scheme={quant.scheme} is a QDQ-only research scheme: HTP has no such weights",
                          "export a 4-, 8- or 16-bit scheme")
    if quant.scheme == FLOAT_ACTIVATION_SCHEME:
        raise ConfigError("quant.scheme=fp16a8w: qexp leaves the embedding unannotated (QnnQuantizer's fp16a8w "
                          "annotation of it fails in prepare_pt2e), which upstream's recipe class cannot say",
                          "export a 4-, 8- or 16-bit integer scheme")
    if WeightRange(quant.get("weight_range", "narrow")) == WeightRange.full:
        raise ConfigError("quant.weight_range=full is a QDQ-only ablation: upstream's recipes use [-7, 7] 4-bit "
                          "weights",
                          "export it with weight_range=narrow")
    if ObserverKind(observer.kind) == ObserverKind.percentile:
        raise ConfigError("observer=percentile is qexp's own observer: upstream's recipes take torchao's",
                          "export with observer=minmax or observer=moving_average")


def class_name(name: str) -> str:
    """mp_smollm2_135m_16a4w_block_b4_38 -> MpSmollm2135m16a4wBlockB438QuantRecipe."""
    words = [w for w in re.split(r"[^0-9A-Za-z]+", name) if w]
    return "".join(w[:1].upper() + w[1:] for w in words) + "QuantRecipe" if words else "QexpQuantRecipe"


def recipe_source(quant: QuantConfig, observer: ObserverConfig, name: str, source: str) -> str:
    """The Python source of a StaticLLMQuantRecipe subclass called `name` for the recipe."""
    from qexp.quant.recipe import recipe_steps

    check_exportable(quant, observer)
    (_, args, kwargs), *calls = recipe_steps(quant, observer)
    observer_lines, observer_name = _observer(observer)
    annotations = [a[0] for method, a, _ in calls if method == "annotation"]
    imports = [f"from torchao.quantization.pt2e import {_observer_base(observer)}"]
    if annotations:
        imports.append("from executorch.backends.qualcomm.quantizer.custom_annotation import "
                       + ", ".join(sorted(set(annotations))))
    what = (f"quant={quant.name} ({quant.scheme}, {len(quant.overrides)} override(s)), "
            f"observer={ObserverKind(observer.kind).value}")
    lines = [_HEADER.format(title=f"{name}: {quant.name}, exported from qexp.", source=source, what=what).rstrip()]
    lines += imports + ["", ""] + observer_lines
    lines += [f"class {name}(StaticLLMQuantRecipe):", f"    default_quant_dtype = {_value(args[0])}", "",
              "    def __init__(self, verbose: bool = False):", "        super().__init__()",
              "        self.recipe = ("]
    lines += _call("QuantRecipe", _arguments(args, kwargs, observer_name) + ["verbose=verbose"])
    for method, call_args, call_kwargs in calls:
        if method != "annotation":
            lines += _call(f".{method}", _arguments(call_args, call_kwargs, observer_name))
    lines.append("        )")
    lines += [f"        self.recipe.custom_quant_annotations.append({a})" for a in annotations]
    return "\n".join(lines) + "\n"


def _observer_base(observer: ObserverConfig) -> str:
    return "MinMaxObserver" if ObserverKind(observer.kind) == ObserverKind.minmax else "MovingAverageMinMaxObserver"


def _observer(observer: ObserverConfig) -> tuple[List[str], str]:
    """Source lines defining the activation observer (a subclass carrying qexp's averaging constant) and its name."""
    if ObserverKind(observer.kind) == ObserverKind.minmax:
        return [], "MinMaxObserver"
    constant = float(observer.averaging_constant)
    return [
        "class ConfiguredMovingAverageMinMaxObserver(MovingAverageMinMaxObserver):",
        f'    """torchao\'s moving-average observer with qexp\'s averaging constant ({constant!r})."""', "",
        "    def __init__(self, **kwargs):",
        f"        kwargs.setdefault(\"averaging_constant\", {constant!r})",
        "        super().__init__(**kwargs)", "", "",
    ], "ConfiguredMovingAverageMinMaxObserver"


def _call(name: str, arguments: List[str]) -> List[str]:
    """One builder call, an argument per line (as upstream's recipes are written)."""
    return [f"            {name}("] + [f"                {a}," for a in arguments] + ["            )"]


def _arguments(args: tuple, kwargs: dict, observer_name: str) -> List[str]:
    parts = [_value(a) for a in args]
    parts += [f"{k}={observer_name if k == 'act_observer' else _value(v)}" for k, v in kwargs.items()]
    return parts


def _pattern(regex: str) -> str:
    return f"r'{regex}'" if "'" not in regex and not regex.endswith("\\") else repr(regex)


def _value(value: Any) -> str:
    import enum

    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, torch._ops.OpOverload):
        return f"torch.ops.{value}"
    if isinstance(value, (set, frozenset)):  # add_regex's patterns (as raw strings), add_node_target's ops
        return "{" + ", ".join(sorted(_pattern(v) if isinstance(v, str) else _value(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_value(k)}: {_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, (str, bool, int, float)) or value is None:
        return repr(value)
    raise TypeError(f"no source form for {value!r}")
