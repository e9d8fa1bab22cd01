"""`python -m qexp.tasks build --out DIR [--texts wikitext news austen]`: qexp's offline tasks as lm-eval task
folders (YAML + data.jsonl), for lm-eval's `--include_path DIR`.

`python -m qexp.tasks lm_eval <lm-eval's arguments>`: lm-eval's own command line with qexp's programs registered as
`--model qexp` (lm-eval 0.4 finds models only in its own registry, which a package can fill only once imported):

    python -m qexp.tasks lm_eval run --model qexp --model_args run=<run id>,phase=qdq \\
        --tasks qexp_lastword_wikitext --include_path DIR
    python -m qexp.tasks lm_eval run --model qexp --model_args "overrides=quant=16a8w,phase=fp" --tasks my_task \\
        --include_path my_tasks/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qexp.core.errors import QexpError


def build(out: str, texts) -> None:
    from qexp.cache import Cache
    from qexp.compose import compose
    from qexp.data.text import load_corpus
    from qexp.tasks.offline import KINDS, write_task

    cfg = compose(["backend=none"])
    root = Path(out)
    for text in texts:
        corpus = load_corpus(cfg.text, Cache(cfg.cache_dir), source=text)
        for kind in KINDS:
            task = write_task(kind, text, list(corpus.test["text"]), corpus.source, corpus.sha256, root)
            print(f"{task.name}: {task.n_items} items, sha256 {task.sha256[:16]} ({task.described}) -> {task.data}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lm_eval"]:
        import qexp.lm_eval_model  # noqa: F401 - registers --model qexp
        from lm_eval.__main__ import cli_evaluate

        sys.argv = ["lm_eval", *argv[1:]]
        try:
            cli_evaluate()
        except QexpError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    parser = argparse.ArgumentParser(prog="python -m qexp.tasks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write qexp's offline tasks as lm-eval task folders")
    b.add_argument("--out", required=True, help="folder to write (pass it to lm-eval as --include_path)")
    b.add_argument("--texts", nargs="+", default=["wikitext", "news"], choices=["wikitext", "news", "austen"])
    sub.add_parser("lm_eval", help="lm-eval's command line with --model qexp registered")
    args = parser.parse_args(argv)
    try:
        build(args.out, args.texts)
    except QexpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
