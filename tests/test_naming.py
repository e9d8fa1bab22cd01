"""What the MLflow UI shows first: run names short and distinct within a sweep, one-line descriptions."""

from __future__ import annotations

from qexp.tracking.naming import failed_description, run_description, run_name
from qexp.tracking.sweep import varied_keys


def test_single_run_names_say_model_scheme_algorithm_backend(compose):
    assert run_name(compose(["model=tiny", "quant=16a4w"], tracked=False), "16a4w") == "tiny · 16a4w · RTN · none"
    cfg = compose(["model=tiny", "quant=16a4w_block", "quant.block_size=64", "algorithm=[rotation,gptq]",
                   "backend=htp", "observer=moving_average"], tracked=False)
    assert run_name(cfg, "16a4w_block") == "tiny · 16a4w_block/b64 · rotation+gptq · htp · observer=moving_average"


def test_sweep_jobs_get_distinct_names_from_what_the_sweep_varies():
    task = ["+sweep=observer_ablation", "model=tiny", "eval.limit=3", "quant=8a8w,16a4w", "calibration.limit=2,8"]
    varied = varied_keys(task, {"observer": "minmax,moving_average"})
    assert varied == ["calibration.limit", "observer", "quant"]
    from hydra import compose as hydra_compose, initialize_config_dir

    import qexp.backends  # noqa: F401 - registers the config schemas (qexp.core.config's and each backend's)

    from helpers import CONF
    from hydra.core.global_hydra import GlobalHydra

    names = set()
    for observer in ("minmax", "moving_average"):
        for limit in (2, 8):
            job = ["model=tiny", "eval.limit=3", "quant=16a4w", f"calibration.limit={limit}", f"observer={observer}"]
            GlobalHydra.instance().clear()
            with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
                cfg = hydra_compose(config_name="config", overrides=job)
            names.add(run_name(cfg, "16a4w", job, varied))
    assert len(names) == 4  # distinct, and the overrides every job shares (eval.limit) are not in them
    assert "tiny · 16a4w · RTN · none · calibration.limit=8 observer=moving_average" in names
    assert not any("eval.limit" in name for name in names)
    # a group's own settings are not in the base name: a sweep over them shows them
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=["model=tiny", "model.masked_softmax=true"])
    varied = ["model.masked_softmax", "quant", "tracking.sweep"]
    assert run_name(cfg, "16a8w", ["quant=16a8w", "model.masked_softmax=true", "tracking.sweep=x"], varied) == \
        "tiny · 16a8w · RTN · none · model.masked_softmax=true"
    # an algorithm's settings are in its name (once), like its tag
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=["model=tiny", "algorithm=[weight_clip,gptq]",
                                                             "algorithm.gptq.damp=0.1"])
    varied = ["algorithm.gptq.damp", "quant"]
    assert run_name(cfg, "16a4w", ["quant=16a4w", "algorithm.gptq.damp=0.1"], varied) == \
        "tiny · 16a4w · weight_clip+gptq(damp=0.1) · none"


def test_descriptions_are_the_one_line_result():
    metrics = {"ppl_fp": 24.92, "ppl_qdq": 47.29, "ppl_qdq_vs_fp": 0.8973, "ppl_deployed": 44.15,
               "decode_tok_s": 0.131, "time_total_s": 972.0}
    assert run_description(metrics, {"target": "x86_emulator"}, "htp") == \
        "ppl 47.3 (+89.7% vs FP) · HTP 44.1 (x86_emulator) · 0.131 tok/s emulated · 16.2 min"
    assert run_description({"ppl_fp": 24.92, "time_total_s": 30}, {}, "none") == "ppl 24.9 (FP) · 0.5 min"
    assert failed_description(ValueError("bad block size\nmore")) == "FAILED: ValueError: bad block size"
