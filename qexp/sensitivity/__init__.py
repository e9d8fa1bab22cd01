"""Per-group sensitivity between two weight precisions, and mixed-precision recipes synthesized from it.

`python -m qexp.sensitivity` (conf/sensitivity.yaml; docs/mixed-precision.md): groups (groups.py), one-layer-on
replays of the selection windows (replay.py), the measurements (measure.py), the cached table (analysis.py), recipes
(synthesis.py), the heatmap (plot.py) and the tracked run (run.py).
"""
