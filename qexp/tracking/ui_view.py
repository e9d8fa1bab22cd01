"""The MLflow UI view qexp installs in each of its experiments: the runs table with the columns that matter and a
charts section for comparing runs.

MLflow 3.17's UI opens every experiment on its GenAI overview (traces, token usage: empty for qexp) whatever the
experiment's `mlflow.experimentKind` tag says; the "Model training" switch, kept in the browser, or
`?workflowType=machine_learning` in the URL picks the runs table. Its table state (columns, widths, charts) can be
shared as an experiment tag `mlflow.sharedViewState.<key>` and opened with `?viewStateShareKey=<key>`: qexp writes one
such view, and `landing_url` is the address that opens it (`make ui` prints it).
"""

from __future__ import annotations

import json
from typing import Dict, List

VIEW_KEY = "qexp"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
_SECTION = "qexp-comparison"

# The runs table: what was run (the name), what came of it (the description: ppl, Δ vs FP, deployed, speed, time),
# then the metrics a researcher sorts by (the phone-speed estimate as HTP runs log it) and the dataset (text and
# windows) that decides what is comparable: as many columns as the first screen shows. Each name is in the metric
# catalog (a test says so).
TABLE_METRICS = ("ppl_fp", "ppl_qdq", "ppl_qdq_vs_fp", "ppl_deployed", "ppl_deployed_vs_qdq", "decode_tok_s_est",
                 "weights_mb")
_PARALLEL_PARAMS = ("quant.name", "algorithm", "observer.name")


def _column(kind: str, name: str) -> str:
    return f"{kind}.`{name}`"  # MLflow's canonical column key


def _chart(uuid: str, chart_type: str, **settings) -> Dict:
    return {"uuid": uuid, "type": chart_type, "runsCountToCompare": 100, "metricSectionId": _SECTION,
            "deleted": False, "isGenerated": False, **settings}


def _charts() -> List[Dict]:
    return [
        _chart("qexp-parallel", "PARALLEL", selectedParams=list(_PARALLEL_PARAMS), selectedMetrics=["ppl_qdq"],
               showAllRuns=False),
        _chart("qexp-ppl-qdq", "BAR", metricKey="ppl_qdq"),
        _chart("qexp-delta-vs-fp", "BAR", metricKey="ppl_qdq_vs_fp"),
        _chart("qexp-ppl-vs-size", "SCATTER", xaxis={"key": "weights_mb", "type": "METRIC"},
               yaxis={"key": "ppl_qdq", "type": "METRIC"}),
        _chart("qexp-ppl-deployed", "BAR", metricKey="ppl_deployed"),
    ]


def view_state() -> Dict:
    run_name, description = _column("attributes", "Run Name"), _column("attributes", "Description")
    return {
        "orderByKey": "attributes.start_time",
        "orderByAsc": False,
        "selectedColumns": [description] + [_column("metrics", m) for m in TABLE_METRICS]
        + [_column("attributes", "Dataset")],
        "columnOrder": [run_name, description],
        "columnWidths": {run_name: 400, description: 330},
        "compareRunCharts": _charts(),
        "compareRunSections": [{"uuid": _SECTION, "name": "qexp: compare runs", "display": True,
                                "isReordered": False}],
        "hideEmptyCharts": True,
    }


def view_json() -> str:
    return json.dumps(view_state(), sort_keys=True)


def landing_url(base_url: str, experiment_id: str, charts: bool = False) -> str:
    """The runs table of an experiment in qexp's view (or its charts, to compare runs)."""
    mode = "&compareRunsMode=CHART" if charts else ""
    return (f"{base_url.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
            f"&viewStateShareKey={VIEW_KEY}{mode}")
