"""The leaderboard (python -m qexp.report leaderboard): results/leaderboard.md and the README's headline table are
regenerated from the committed tables and must match what is committed, so neither drifts from the tables or is
edited by hand; the ranking keeps evaluation sets apart and classes programs by their bits; a store's runs rank the
same way."""

from __future__ import annotations

import pandas as pd
import pytest

from helpers import REPO, TINY


def test_the_committed_board_and_readme_table_are_a_regeneration():
    from qexp.report.leaderboard import (SUMMARY_END, SUMMARY_START, board, from_results, main_section, markdown,
                                         summary)

    sections = board(from_results())
    committed = (REPO / "results" / "leaderboard.md").read_text()
    assert committed == markdown(sections, "python -m qexp.report leaderboard"), \
        "results/leaderboard.md differs from a regeneration: run `make results` and commit what it writes"
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index(SUMMARY_START):readme.index(SUMMARY_END) + len(SUMMARY_END)]
    assert block == summary(sections, main_section()), \
        "the README's headline table differs from a regeneration: run `make results`, do not edit it by hand"
    # what the check would catch: a figure edited by hand
    assert block.replace("+9.9%", "+8.9%") != summary(sections, main_section())


@pytest.mark.parametrize("row, expected", [
    ({"tags.weight_grid": "int4 sym per channel", "weight_bits_decoder": 4.0}, "4-bit per channel"),
    ({"params.quant.name": "16a4w"}, "4-bit per channel"),  # an older table: no grid, no bits
    ({"tags.weight_grid": "int4 sym block 16 (LPBQ scales: nearest)"}, "LPBQ <= 4.5 bits"),
    ({"tags.weight_grid": "int4 sym block 32 (LPBQ scales: nearest)", "weight_bits_decoder": 4.375},
     "LPBQ <= 4.5 bits"),
    ({"tags.weight_grid": "int4 sym block 32 (LPBQ scales: nearest)", "weight_bits_decoder": 4.96}, "<= 5 bits"),
    ({"tags.weight_grid": "int8 sym per channel"}, "8-bit weights"),
    ({"params.quant.name": "16a8w"}, "8-bit weights"),
    ({"tags.weight_grid": "int4 sym block 32 (LPBQ scales: nearest)", "weight_bits_decoder": 6.59}, "other"),
])
def test_budget_classes(row, expected):
    from qexp.report.leaderboard import budget_class

    assert budget_class(pd.Series(row)) == expected


def test_evaluation_sets_are_ranked_apart():
    from qexp.report.leaderboard import board

    rows = pd.DataFrame([
        dict(model="m", text="a", n_windows=32, window_len=256, run_id="r1", delta_vs_fp=0.10, delta_vs_fp_ci_low=0.09,
             delta_vs_fp_ci_high=0.11, algorithm="RTN", **{"params.quant.name": "16a8w"}),
        dict(model="m", text="a", n_windows=8, window_len=256, run_id="r2", delta_vs_fp=0.01, delta_vs_fp_ci_low=0.0,
             delta_vs_fp_ci_high=0.02, algorithm="RTN", **{"params.quant.name": "16a8w"}),
        dict(model="m", text="a", n_windows=32, window_len=256, run_id="r3", delta_vs_fp=0.05, delta_vs_fp_ci_low=0.04,
             delta_vs_fp_ci_high=0.06, algorithm="qat(lr=0.0001)", **{"params.quant.name": "16a8w"}),
    ])
    sections = board(rows)
    assert list(sections) == [("m", "a", 32, 256), ("m", "a", 8, 256)]
    assert sorted(zip(sections[("m", "a", 32, 256)]["method"], sections[("m", "a", 32, 256)]["run_id"])) == [
        ("PTQ", "r1"), ("QAT", "r3")]


def test_a_stores_runs_rank_as_the_tables_do(compose, tmp_path):
    from qexp.pipeline import run_experiment
    from qexp.report.leaderboard import board, from_store, markdown

    uri = f"sqlite:///{tmp_path / 'board.db'}"
    for quant in ("16a8w", "16a4w"):
        run_experiment(compose(TINY + [f"quant={quant}", f"tracking.uri={uri}", "tracking.experiment=board"]))
    sections = board(from_store(uri))
    [(key, best)] = sections.items()
    assert key[0] == "tiny" and sorted(best["class"]) == ["4-bit per channel", "8-bit weights"]
    assert "experiment board" in markdown(sections, "python -m qexp.report leaderboard --tracking-uri x")
