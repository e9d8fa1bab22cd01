"""Every extension point registers through one helper (qexp/core/registry.py) that refuses a name registered twice."""

from __future__ import annotations

import dataclasses

import pytest


def test_each_extension_point_refuses_a_second_extension_under_a_taken_name():
    from qexp.backends import BACKENDS
    from qexp.backends.registry import register_backend
    from qexp.models.families import FAMILIES, LLAMA, register_family
    from qexp.transforms import TRANSFORMS, register_transform

    gptq, htp = TRANSFORMS["gptq"], BACKENDS["htp"]
    with pytest.raises(ValueError, match="algorithm 'gptq' is registered twice"):
        register_transform(type("CopiedGptq", (gptq,), {}))
    with pytest.raises(ValueError, match="backend 'htp' is registered twice"):
        register_backend(type("CopiedHtp", (htp,), {}))
    with pytest.raises(ValueError, match="model family 'llama' is registered twice"):
        register_family(dataclasses.replace(LLAMA, hf_architectures=("OtherForCausalLM",)))
    # the same extension again (a module imported twice) is not a conflict, and nothing was replaced
    assert register_transform(gptq) is gptq and register_family(LLAMA) is LLAMA
    assert TRANSFORMS["gptq"] is gptq and BACKENDS["htp"] is htp and FAMILIES["llama"] is LLAMA
