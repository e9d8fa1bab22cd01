"""Rewrite tests/durations.txt (the seconds tests/conftest.py orders xdist's work by) from pytest's report, or from
the per-test lines QEXP_TEST_CPU writes (their wall seconds).

    .venv/bin/python -m pytest -n 3 --dist loadgroup --no-loadscope-reorder --durations=0 tests | tee /tmp/pytest.log
    .venv/bin/python scripts/test_durations.py /tmp/pytest.log
    QEXP_TEST_CPU=/tmp/cpu.jsonl make test && .venv/bin/python scripts/test_durations.py /tmp/cpu.jsonl

Setup, call and teardown are summed per test; tests under 5 s are left out (conftest gives an unknown test 5 s).
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^([0-9.]+)s (setup|call|teardown)\s+(\S+)$")
OUT = Path(__file__).resolve().parent.parent / "tests" / "durations.txt"


def main(log: str) -> None:
    seconds: dict = defaultdict(float)
    for line in Path(log).read_text().splitlines():
        if log.endswith(".jsonl") and line.strip():
            row = json.loads(line)
            seconds[row["test"].split("@")[0]] += row["wall"]
            continue
        match = LINE.match(line.strip())
        if match:
            seconds[match.group(3).split("@")[0]] += float(match.group(1))  # xdist's loadgroup suffix dropped
    if not seconds:
        sys.exit(f"{log}: no pytest --durations lines in it (run pytest with --durations=0, or QEXP_TEST_CPU=<.jsonl>)")
    kept = sorted(((s, n) for n, s in seconds.items() if s >= 5), reverse=True)
    OUT.write_text("".join(f"{s:.0f} {n}\n" for s, n in kept))
    print(f"{OUT}: {len(kept)} tests, {sum(s for s, _ in kept):.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
