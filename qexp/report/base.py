"""What every part of the report shares: its error and its result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import pandas as pd

from qexp.errors import QexpError


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
