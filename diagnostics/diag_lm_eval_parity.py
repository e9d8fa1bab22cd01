"""Does qexp's lm-eval model score as lm-eval's own `hf` model does? The FP phase's log-likelihoods (the static llama,
packed calls) against `hf` on the model's Hugging Face folder, item by item, on the first N items of qexp's offline
tasks of one text. Prints the largest and median absolute difference per item and per target token, and whether the
greedy flags agree. (tests/test_tasks.py checks the same on the tiny model.)

With --float64 both programs compute in float64 (qexp's static llama and its inputs cast, `hf` with dtype float64):
what is left is the adapter's own difference, without float32's rounding of two differently written models (the
static llama's 1x1 convolutions against HF's linears).

    .venv/bin/python diagnostics/diag_lm_eval_parity.py [N] [--float64] [-- overrides]   # SmolLM2, 100 items per task
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    import qexp  # noqa: F401  (first: it sets the hub offline before lm-eval imports `datasets`)
    import numpy as np
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from qexp.cache import Cache
    from qexp.data.text import load_corpus
    from qexp.lm_eval_model import phase_program
    from qexp.tasks.lm import QexpLM
    from qexp.tasks.offline import write_task

    argv = sys.argv[1:]
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    head = argv[: argv.index("--")] if "--" in argv else argv
    float64 = "--float64" in head
    head = [a for a in head if a != "--float64"]
    n = int(head[0]) if head else 100
    program = phase_program(overrides=" ".join(["backend=none", *overrides]), phase="fp")
    if float64:
        import torch

        scorer = program.scorer
        scorer.module = scorer.module.to(torch.float64)
        scorer._masks = [m.to(torch.float64) for m in scorer._masks]
        scorer._caches = tuple(c.to(torch.float64) for c in scorer._caches)
    ours = QexpLM(program.scorer, program.tokenizer, program.add_bos)
    from qexp.compose import compose
    from qexp.models.sources import load_model

    cfg = compose(["backend=none", *overrides])
    model = load_model(cfg.model, Cache(cfg.cache_dir))
    dtype = "float64" if float64 else "float32"
    hf = HFLM(pretrained=model.hf_dir, dtype=dtype, max_length=ours.max_length, add_bos_token=model.add_bos,
              batch_size=8, device="cpu")
    corpus = load_corpus(cfg.text, Cache(cfg.cache_dir))
    with tempfile.TemporaryDirectory() as root:
        names = [write_task(k, "wikitext", list(corpus.test["text"]), corpus.source, corpus.sha256, Path(root)).name
                 for k in ("lastword", "choice")]
        tasks = TaskManager(include_path=root, include_defaults=False).load(names)["tasks"]
        requests = []
        for task in tasks.values():
            task.build_all_requests(limit=n, rank=0, world_size=1)
            requests += list(task.instances)
        a, b = ours.loglikelihood(requests), hf.loglikelihood(requests)
    diff = np.array([abs(x[0] - y[0]) for x, y in zip(a, b)])
    tokens = np.array([max(1, len(ours.tok_encode(r.args[0] + r.args[1])) - len(ours.tok_encode(r.args[0])))
                       for r in requests])
    greedy = sum(x[1] == y[1] for x, y in zip(a, b))
    print(f"{len(requests)} requests ({n} items per task, {model.name}, {dtype}): |qexp - hf| per item max "
          f"{diff.max():.3g}, median {np.median(diff):.3g}; per target token max {(diff / tokens).max():.3g}; "
          f"items over 1e-4: {int((diff > 1e-4).sum())}; greedy flags agree on {greedy}/{len(requests)}")


if __name__ == "__main__":
    main()
