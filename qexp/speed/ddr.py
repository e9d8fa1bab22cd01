"""QNN's DDR bandwidth summary: what HTP's graph preparation says one call of a graph reads from and writes to DRAM.

For every SoC and every graph it prepares, libQnnHtp prints

    ====== DDR bandwidth summary ======
    spill_bytes=...
    fill_bytes=...
    write_total_bytes=...
    read_total_bytes=...

(deterministic for a given program). The lines name no graph, so qexp captures the native output of each graph's
lowering on its own (`captured`) and keeps the graph's figures in the program's meta.json. A graph split into
several QNN contexts (backend.num_sharding) prints one summary per context: they are summed.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Dict, Iterator, List, Optional

HEADER = "DDR bandwidth summary"
FIELDS = ("spill_bytes", "fill_bytes", "write_total_bytes", "read_total_bytes")
_FIELD = re.compile(r"\b(" + "|".join(FIELDS) + r")=(\d+)")


def parse(text: str) -> List[Dict[str, int]]:
    """Every summary in `text`, in order: each the four fields that follow its header."""
    summaries: List[Dict[str, int]] = []
    current: Optional[Dict[str, int]] = None
    for line in text.splitlines():
        if HEADER in line:
            current = {}
            summaries.append(current)
            continue
        match = _FIELD.search(line)
        if current is not None and match and match.group(1) not in current:
            current[match.group(1)] = int(match.group(2))
    return [s for s in summaries if all(k in s for k in FIELDS)]


def total(summaries: List[Dict[str, int]]) -> Optional[Dict[str, int]]:
    """The sum of a graph's summaries (one per QNN context), or None when it printed none."""
    if not summaries:
        return None
    return {k: sum(s[k] for s in summaries) for k in FIELDS}


@contextlib.contextmanager
def captured() -> Iterator[List[str]]:
    """What native code prints to fds 1 and 2 meanwhile, as one text in the yielded list once the block ends; the
    text is then written on to the fds it was taken from (an outer capture, native.log, or the terminal), so nothing
    is lost."""
    from qexp.tracking.runlog import fds_captured

    out: List[str] = []
    data: list = []
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        with fds_captured() as data:
            yield out
            sys.stdout.flush()
            sys.stderr.flush()
    finally:
        raw = b"".join(data)
        out.append(raw.decode("utf-8", errors="replace"))
        view = memoryview(raw)
        while view:
            view = view[os.write(2, view):]
