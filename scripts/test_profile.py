"""What each test file costs in CPU seconds, from a run with QEXP_TEST_CPU set (tests/conftest.py).

    QEXP_TEST_CPU=/tmp/cpu.jsonl make test
    .venv/bin/python scripts/test_profile.py /tmp/cpu.jsonl [--tests 25]

Prints one row per file (tests, wall seconds summed over its tests, CPU seconds of the worker and of the subprocesses
its tests reaped), the most expensive first, then the most expensive tests. On a 2-core host the suite is CPU-bound:
its wall time is about the CPU seconds over 2, whatever the order.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="the QEXP_TEST_CPU file (one JSON line per test)")
    parser.add_argument("--tests", type=int, default=25, help="how many of the most expensive tests to list")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in Path(args.log).read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{args.log}: no test lines in it (run the tests with QEXP_TEST_CPU={args.log})")
    files: dict = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for row in rows:
        entry = files[row["test"].split("::")[0]]
        entry[0] += 1
        entry[1] += row["wall"]
        entry[2] += row["cpu"]
        entry[3] += row["cpu_children"]
    total_cpu = sum(r["cpu"] + r["cpu_children"] for r in rows)
    print(f"{len(rows)} tests, {sum(r['wall'] for r in rows):,.0f} s of wall time summed, "
          f"{total_cpu:,.0f} CPU s ({total_cpu / 2:,.0f} s on 2 cores)")
    print(f"{'file':44} {'tests':>5} {'wall s':>7} {'CPU s':>7} {'of it children':>14} {'share':>6}")
    for name, (count, wall, own, children) in sorted(files.items(), key=lambda kv: -(kv[1][2] + kv[1][3])):
        cpu = own + children
        print(f"{name:44} {count:5d} {wall:7.0f} {cpu:7.0f} {children:14.0f} {cpu / total_cpu:6.1%}")
    print(f"\nthe {args.tests} most expensive tests (CPU s, wall s):")
    for row in sorted(rows, key=lambda r: -(r["cpu"] + r["cpu_children"]))[:args.tests]:
        print(f"{row['cpu'] + row['cpu_children']:7.0f} {row['wall']:7.0f}  {row['test']}")


if __name__ == "__main__":
    main()
