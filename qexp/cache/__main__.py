"""`python -m qexp.cache list|verify|prune`: what the cache holds, which runs used it, and keeping it bounded.

    python -m qexp.cache list [--kind qdq]
    python -m qexp.cache verify                      # check every entry's files; damaged ones are quarantined
    python -m qexp.cache prune --older-than 30 --max-gb 20 [--dry-run]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from qexp.cache import Cache, damage
from qexp.cache.usage import entries, leftovers, prune


def _default_root() -> str:
    return os.environ.get("QEXP_CACHE_DIR") or os.path.expanduser("~/.cache/qexp")


def _table(found) -> pd.DataFrame:
    return pd.DataFrame([{
        "kind": e.kind, "key": e.key, "size_mb": round(e.bytes / 2**20, 1),
        "built": time.strftime("%Y-%m-%d %H:%M", time.localtime(e.built)),
        "last_use": time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_use)),
        "uses": e.uses, "runs": ",".join(r[:8] for r in e.runs[-3:]) + (" ..." if len(e.runs) > 3 else ""),
    } for e in found], columns=["kind", "key", "size_mb", "built", "last_use", "uses", "runs"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qexp.cache", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=_default_root(), help="cache root (default: $QEXP_CACHE_DIR or ~/.cache/qexp)")
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="entries: kind, key, size, built, last use, uses, runs (last three)")
    listing.add_argument("--kind")
    sub.add_parser("verify", help="check every entry's files against its manifest; quarantine damaged ones")
    pruning = sub.add_parser("prune", help="remove entries by age and/or total size (least recently used first)")
    pruning.add_argument("--older-than", type=float, metavar="DAYS", help="entries unused for more than DAYS")
    pruning.add_argument("--max-gb", type=float, help="then the least recently used until the cache fits")
    pruning.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    root = Path(args.dir).expanduser()
    if not root.is_dir():
        print(f"qexp.cache: error: no cache at {root} (--dir or $QEXP_CACHE_DIR)", file=sys.stderr)
        return 2
    if args.command == "list":
        found = [e for e in entries(root) if not args.kind or e.kind == args.kind]
        table = _table(found)
        print(table.to_string(index=False) if not table.empty else "(empty)")
        extra = leftovers(root, min_age_s=0)
        print(f"{len(found)} entries, {sum(e.bytes for e in found) / 2**30:.2f} GiB"
              + (f"; {len(extra)} quarantined or unfinished (prune removes them)" if extra else ""))
    elif args.command == "verify":
        cache, damaged = Cache(root), 0
        for entry in entries(root):
            problem = damage(entry.path)
            if problem:
                damaged += 1
                cache._quarantine(entry.kind, entry.key, problem)
                print(f"damaged: {entry.kind}/{entry.key}: {problem} (quarantined; the next run rebuilds it)")
        print(f"verified {len(entries(root)) + damaged} entries: {damaged} damaged")
        return 1 if damaged else 0
    else:
        if args.older_than is None and args.max_gb is None:
            print("qexp.cache: error: prune needs --older-than DAYS and/or --max-gb GB", file=sys.stderr)
            return 2
        removed = prune(root, max_bytes=None if args.max_gb is None else int(args.max_gb * 2**30),
                        older_than_s=None if args.older_than is None else args.older_than * 86400,
                        dry_run=args.dry_run)
        verb = "would remove" if args.dry_run else "removed"
        for e in removed:
            print(f"{verb} {e.kind}/{e.key} ({e.bytes / 2**20:.1f} MiB, last used "
                  f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(e.last_use))})")
        print(f"{verb} {len(removed)} entries, {sum(e.bytes for e in removed) / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
