"""Reading constants out of a converted program's FX graph: a node's argument as the value it stands for.

The weights of a QDQ program are `get_attr` nodes (integer tensors, scales, zero points) feeding its dequantize ops;
both the weight folding (qexp.quant.fold) and the HTP arithmetic pass (qexp.quant.htp_arithmetic_pass) read them.
"""

from __future__ import annotations

import torch


def constant_value(module: torch.fx.GraphModule, arg):
    if isinstance(arg, torch.fx.Node):
        if arg.op != "get_attr":
            raise ValueError("not a constant")
        value = module
        for part in arg.target.split("."):
            value = getattr(value, part)
        return value
    if isinstance(arg, (list, tuple)):
        return type(arg)(constant_value(module, a) for a in arg)
    return arg
