"""Metric histories logged while they grow (a training's loss curves), each point once."""

from __future__ import annotations

from typing import Dict

from qexp.tracking.store import Tracker


class CurveLog:
    """Metric histories logged as they grow (a training's curves during the training): each call logs the
    points past those an earlier call logged, so the finished curves are logged once, point by point."""

    def __init__(self):
        self.logged: Dict[str, int] = {}

    def __call__(self, curves: Dict[str, list]) -> None:
        new = {name: points[self.logged.get(name, 0):] for name, points in curves.items()}
        Tracker.metric_history(new)
        self.logged.update({name: len(points) for name, points in curves.items()})
