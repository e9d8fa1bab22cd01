"""The report's plots: Pareto fronts, collapsed points off the y axis, identical points named together,
the caption's text and windows, no overlapping text, and --replot of a committed report. No model runs."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from qexp.report import plots
from qexp.report.plot_figure import pareto_front

RESULTS = Path(__file__).resolve().parents[1] / "results"
EVAL = {"text": "gensim-enwiki-excerpt", "n_windows": 8, "window_len": 256}


def _data(rows):
    """Report data rows: (scheme, observer, target, size MB, ppl QDQ)."""
    return pd.DataFrame([{"model": "smollm2_135m", "scheme": s, "observer": o, "target": t, "size_mb": mb,
                          "ppl_qdq": ppl, **EVAL} for s, o, t, mb, ppl in rows])


# a crowded grid: neighbours within a marker, an exact tie, and two collapsed schemes side by side
CROWDED = _data([("fp32", "-", "pytorch", 651.3, 24.92), ("fp32", "-", "cpu", 652.0, 24.92),
                 ("16a16w", "minmax", "pytorch", 325.4, 25.18), ("16a8w", "minmax", "pytorch", 190.9, 25.18),
                 ("16a8w", "percentile", "pytorch", 190.9, 25.18), ("16a4w", "minmax", "pytorch", 137.8, 47.25),
                 ("16a4w_block", "minmax", "pytorch", 137.8, 36.26), ("16a4w", "percentile", "pytorch", 137.8, 47.0),
                 ("8a8w", "minmax", "pytorch", 162.4, 1.19e5), ("8a8w", "percentile", "pytorch", 170.0, 3.4e4),
                 ("8a8w_with_a_long_name_in_the_middle", "percentile", "pytorch", 380.0, 2e4)])


@pytest.fixture
def figures():
    made = []
    yield made
    for fig in made:
        plt.close(fig)


def _texts(fig):
    """Every piece of text the saved figure shows, laid out as it is drawn."""
    fig.canvas.draw()
    ax, legend = fig.axes[0], fig.axes[0].get_legend()
    shown = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts, *legend.get_texts(), legend.get_title(),
             *_tick_labels(ax.xaxis), *_tick_labels(ax.yaxis)]
    return [t for t in shown if t.get_visible() and t.get_text().strip()]


def _tick_labels(axis):
    """The labels of the ticks inside the axis (matplotlib also lays out a tick either side, never drawn)."""
    low, high = sorted(axis.get_view_interval())
    return [tick.label1 for tick in axis.get_major_ticks() if low <= tick.get_loc() <= high]


def _legend(fig):
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_pareto_front_minimising_both():
    size = np.array([100.0, 200.0, 150.0, 300.0, 200.0])
    ppl = np.array([50.0, 30.0, 60.0, 25.0, 35.0])  # (150, 60) is beaten by (100, 50); (200, 35) by (200, 30)
    assert list(pareto_front(size, ppl, larger_x_better=False)) == [0, 1, 3]
    assert list(pareto_front(size, ppl)) == [3]  # larger x better: (300, 25) beats every other point


def test_collapsed_point_is_flagged_and_left_out_of_the_y_axis(figures):
    ppl = np.array([25.0, 31.0, 36.0, 47.0, 60.0, 1e5])
    assert list(plots.collapsed(ppl)) == [False] * 5 + [True]
    data = _data([("16a8w", "minmax", "pytorch", 190 - i, p) for i, p in enumerate(ppl[:-1])]
                 + [("8a8w", "minmax", "pytorch", 162.4, 1e5)])
    fig = plots.size_figure(data)
    figures.append(fig)
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    assert low < 25 and 60 < high < 100 and ax.get_yscale() == "linear"  # the others use the whole axis
    notes = [t.get_text() for t in ax.texts[:-1]]  # the last text is the caption
    assert notes == ["▲ 8a8w (ppl 1e+05)"]  # its value written out on the plot
    assert any("off scale" in entry for entry in _legend(fig))


def test_points_at_one_spot_are_drawn_side_by_side_each_named(figures):
    fig = plots.size_figure(CROWDED)
    figures.append(fig)
    entries = [e for e in _legend(fig) if not e.startswith("Pareto front")]
    assert len(entries) == len(CROWDED)  # one marker and one entry per point, identical points too
    drawn = {c.get_label(): c.get_offset_transform().transform(c.get_offsets())[0] for c in fig.axes[0].collections}
    tie = [xy for e, xy in drawn.items() if "16a8w · minmax" in e or "16a8w · percentile" in e]
    assert len(tie) == 2 and abs(tie[0][0] - tie[1][0]) >= 5  # same x and y in data: apart on the figure
    assert all(any(f"{s} · {o}".replace(" · -", "") in e for e in entries) for s, o in CROWDED[["scheme", "observer"]]
               .itertuples(index=False))


def _overlapping(fig):
    """Pairs of texts whose drawn boxes overlap."""
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in _texts(fig)]
    assert len(boxes) > 15
    return [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2) if box_a.overlaps(box_b)]


def test_no_two_texts_overlap(figures):
    speeds = np.geomspace(0.2, 200, len(CROWDED))
    for fig in (plots.size_figure(CROWDED), plots.speed_figure(CROWDED.assign(decode_tok_s=speeds))):
        figures.append(fig)
        assert not _overlapping(fig)
    ax = figures[0].axes[0]
    notes = [t.get_text() for t in ax.texts[:-1]]  # the last text is the caption
    assert len(notes) == 3 and "ppl 1.19e+05" in notes[0] and "ppl 3.4e+04" in notes[1]  # a row per collapsed one
    frame = ax.get_window_extent()
    assert all(frame.x0 <= t.get_window_extent().x0 and t.get_window_extent().x1 <= frame.x1 for t in ax.texts[:-1])


@pytest.mark.parametrize("name", ["quant_grid", "htp_smollm2", "algorithms_spread", "algorithms"])
def test_committed_reports_plot_without_overlapping_text(name, figures):
    data = plots.read_report_csv(RESULTS / f"{name}.csv")
    drawn = [fig for fig in (plots.size_figure(data), plots.speed_figure(data)) if fig is not None]
    figures.extend(drawn)
    assert drawn and not any(_overlapping(fig) for fig in drawn)


def test_caption_names_text_windows_and_emulator(figures):
    data = CROWDED.assign(decode_tok_s=1.0, target=["x86_emulator"] + ["cpu"] * (len(CROWDED) - 1))
    fig = plots.speed_figure(data)
    figures.append(fig)
    caption = " ".join(fig.axes[0].texts[-1].get_text().split())
    assert "token-level" in caption and "text gensim-enwiki-excerpt, 8 windows x 256 tokens" in caption
    assert "not phone speed" in caption and "10x the median" in caption
    assert fig.axes[0].get_xlabel().startswith("decode speed (tokens/s)")
    assert plots.size_figure(data).axes[0].get_xlabel() == "size (MB)"


def test_report_data_carries_text_and_windows():
    from qexp.report import build_report

    runs = pd.DataFrame([{"run_id": "a", "tags.config_hash": "1", "tags.scheme": "16a4w",
                          "params.quant.scheme": "16a4w", "params.eval.text_source": "gensim",
                          "params.eval.n_windows": "8", "params.eval.window_len": "256", "metrics.ppl_fp": 24.9,
                          "metrics.ppl_qdq": 30.0, "metrics.weights_mb": 100.0}])
    data = build_report(runs).data
    assert data.loc[0, ["text", "n_windows", "window_len", "algorithm"]].tolist() == ["gensim", 8, 256, "RTN"]


def test_replot_redraws_a_committed_report_from_its_csv(tmp_path):
    from qexp.report import main

    for suffix in (".csv", ".md"):
        shutil.copy(RESULTS / f"quant_grid{suffix}", tmp_path)
    csv_before = (tmp_path / "quant_grid.csv").read_bytes()
    assert main(["--replot", "quant_grid", "--out-dir", str(tmp_path)]) == 0
    for kind in plots.PLOTS:
        assert (tmp_path / f"quant_grid_{kind}.png").stat().st_size > 10_000
    assert (tmp_path / "quant_grid.csv").read_bytes() == csv_before  # only the images are rewritten
    # the committed CSV predates the text/window columns and names the deployed phase by backend
    data = plots.read_report_csv(tmp_path / "quant_grid.csv")
    assert data[["text", "n_windows", "window_len"]].iloc[0].tolist() == list(EVAL.values())
    assert data.set_index("scheme").loc["8da4w", "ppl_deployed"] == pytest.approx(36.294, abs=1e-3)
    assert main(["--replot", "missing", "--out-dir", str(tmp_path)]) == 2


def test_no_speed_plot_says_why():
    """A table whose --columns leave decode speed out must not claim that no run measured it."""
    left_out = _data([("16a8w", "minmax", "x86_emulator", 393.2, 25.5)])
    assert "columns leave decode speed out" in plots.no_speed_plot_note(left_out)
    assert "no run in the table measured" in plots.no_speed_plot_note(left_out.assign(decode_tok_s=np.nan))
    assert plots.no_speed_plot_note(left_out.assign(decode_tok_s=0.14)) is None


def test_the_size_axis_is_bits_per_decoder_weight_when_every_row_has_them(figures):
    quantized = CROWDED[~CROWDED["scheme"].str.startswith("fp32")].copy()
    quantized["weight_bits_decoder"] = [16, 8, 8, 4, 4.125, 4, 8, 8, 8]
    quantized["weight_bits_lm_head"] = 8.0
    fig = plots.size_figure(quantized)
    figures.append(fig)
    ax = fig.axes[0]
    assert ax.xaxis.label.get_text().startswith("average bits per decoder-linear weight")
    assert "the lm head at 8 bits in every row" in " ".join(ax.texts[-1].get_text().split())
    assert ax.get_xlim()[1] < 20  # bits, not MB
    quantized.loc[quantized.index[0], "weight_bits_decoder"] = np.nan  # a run from before the metric: MB again
    fig = plots.size_figure(quantized)
    figures.append(fig)
    assert fig.axes[0].xaxis.label.get_text().startswith("size (MB)")


def test_labels_name_recipes_of_one_scheme_and_repeat_nothing():
    data = pd.DataFrame({"scheme": ["16a8w", "16a4w_block", "16a4w_block"],
                         "params.quant.name": ["16a8w", "recipe_llama3_2_1b", "mp_b4_50"], "observer": ["minmax"] * 3})
    labels, shared = plots._labels(data)
    assert list(labels) == ["16a8w", "16a4w_block · recipe_llama3_2_1b", "16a4w_block · mp_b4_50"]
    assert shared == "minmax"


def test_estimated_speeds_carry_their_band_as_bars(figures):
    """Each estimated point's 10-90% band is drawn (and said in the legend and caption); a point without one has
    no bar."""
    data = _data([("16a4w", "minmax", "pytorch", 137.8, 30.0), ("16a8w", "minmax", "pytorch", 190.9, 25.5),
                  ("16a4w_block", "minmax", "pytorch", 140.0, 28.0)])
    data["decode_tok_s"] = [250.0, 180.0, 240.0]
    data["decode_tok_s_low"], data["decode_tok_s_high"] = [230.0, 166.0, np.nan], [272.0, 196.0, np.nan]
    data["speed_source"] = ["estimate SM8650", "estimate SM8650", "estimate SM8650"]
    fig = plots.speed_figure(data)
    figures.append(fig)
    bars = [c for c in fig.axes[0].collections if c.__class__.__name__ == "LineCollection"]
    segments = [seg for c in bars for seg in c.get_segments()]
    assert sorted((round(s[0][0]), round(s[1][0])) for s in segments) == [(166, 196), (230, 272)]
    assert "estimate's 10-90% band" in _legend(fig)
    assert "10-90% band" in fig.axes[0].texts[-1].get_text() or any("10-90% band" in t.get_text()
                                                                     for t in fig.axes[0].texts)
