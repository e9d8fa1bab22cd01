"""What every part of the report shares: its error and its result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import pandas as pd

from qexp.core.errors import QexpError


class ReportError(QexpError):
    pass


@dataclass
class Report:
    table: pd.DataFrame  # display table (headers as in the seeds)
    data: pd.DataFrame  # one row per run, raw values and ids (the CSV)
    notes: List[str] = field(default_factory=list)
    pivot: Optional[pd.DataFrame] = None


def column(runs: pd.DataFrame, name: str) -> pd.Series:
    """runs[name], or all-NaN when no run logged it (MLflow has no column for a name nobody logged)."""
    return runs[name] if name in runs else pd.Series([np.nan] * len(runs), index=runs.index)


def algorithms_from_params(runs: pd.DataFrame) -> pd.Series:
    """The algorithms a run logged settings for (params.algorithm.<name>.*), for runs from before the algorithm tag."""
    names = sorted({c.split(".")[2] for c in runs if c.startswith("params.algorithm.") and c.count(".") >= 3})
    logged = [runs[[c for c in runs if c.startswith(f"params.algorithm.{n}.")]].notna().any(axis=1).rename(n)
              for n in names]
    if not logged:
        return pd.Series(np.nan, index=runs.index)
    found = pd.concat(logged, axis=1)
    return found.apply(lambda row: ",".join(n for n in names if row[n]) or np.nan, axis=1)
