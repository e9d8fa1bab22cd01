"""How far do a sensitivity analysis' selection figures carry? Mixed-precision recipes scored with weight-only fake
quantization (as `python -m qexp.sensitivity` measures them) on three sets of windows: the analysis' selection
windows (the calibration half's second half, 8 x 96 tokens), the same text in 8 windows of 256 tokens, and the test
windows of the run (eval.limit x eval.seq_len). Prints each recipe's perplexity ratio to FP on each set, with every
group low and every group high for reference. Compare the test column with the recipe's QDQ run to see what
16-bit activations add.

    .venv/bin/python diagnostics/diag_recipe_windows.py mp_smollm2_135m_16a4w_block_030 [RECIPE ...] \\
        [-- quant=16a4w_block quant.block_size=32 eval.limit=32]       # recipes from conf/quant/mixed/
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import qexp.backends  # noqa: F401 - registers the config schemas
    from qexp.data.windows import make_windows
    from qexp.pipeline import prepare
    from qexp.sensitivity.analysis import high_grid, low_grid
    from qexp.sensitivity.groups import grids_for, model_groups
    from qexp.sensitivity.measure import GroupWeights
    from qexp.sensitivity.replay import LayerReplay
    from qexp.models.static_llama import StaticLlama

    args = sys.argv[1:]
    recipes, overrides = (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else (args, [])
    overrides = overrides or ["quant=16a4w_block", "quant.block_size=32", "eval.limit=32"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    state = prepare(cfg, through="text")
    groups = model_groups({k: tuple(v.shape) for k, v in state.model.state_dict.items()})
    low, high = low_grid(cfg.quant), high_grid("16a8w")
    patterns = {name: [re.compile(o["pattern"]) for o in OmegaConf.load(REPO / "conf/quant/mixed" / f"{name}.yaml")
                       ["overrides"]] for name in recipes}
    text = state.corpus.joined("calibration")
    tail, tokenizer, bos = text[len(text) // 2 :], state.model.tokenizer, state.model.add_bos
    sets = {"selection (calibration half, 8 x 96)": make_windows(tail, tokenizer, 96, 8, bos),
            "calibration half, 8 x 256": make_windows(tail, tokenizer, 256, 8, bos),
            f"test, {state.windows.n_windows} x {state.windows.seq_len}": state.windows}
    for label, windows in sets.items():
        static = StaticLlama.private_copy(state.model, windows.seq_len, cfg.model)
        replay, weights = LayerReplay(static, windows), GroupWeights(static.module, groups)
        fp = math.exp(-replay.loglik(0).mean())
        chosen = {"all low": lambda g: False, "all high": lambda g: True}
        chosen.update({name: (lambda g, p=p: any(x.search(g.module_path) for x in p)) for name, p in patterns.items()})
        cells = []
        for name, promoted in chosen.items():
            weights.put_all(lambda g: grids_for(g, low, high)[1 if promoted(g) or not g.in_recipes else 0])
            cells.append(f"{name} {math.exp(-replay.loglik(0).mean()) / fp - 1:+.2%}")
        print(f"{label}: FP {fp:.2f} | " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
