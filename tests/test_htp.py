"""HTP deploy on the tiny model: lowering from the calibrated encodings, the emulator runner, KV updaters.

Runs the real QNN libraries (onnxruntime-qnn's x86_64 HTP) on this host: compile and emulation take seconds here.
"""

from __future__ import annotations

import pytest
import torch

from helpers import TINY
from qexp.cache import Cache
from qexp.data.calibration import build_calibration
from qexp.data.windows import make_windows
from qexp.backends.htp.runner import HtpRunner
from qexp.backends.htp.lower import KV_GRAPH, PREFILL_GRAPH, compile_pte
from qexp.core.provenance import library_versions
from qexp.quant.calibrate import quantize
from qexp.models.static_llama import StaticLlama, window_logits
from qexp.core.timing import StageTimer

CONTEXT = 64


@pytest.fixture(scope="module")
def deployed(tiny_model, corpus, compose, cache_dir):
    cfg = compose(TINY + ["quant=16a8w", "backend=htp", "backend.model_mode=hybrid", "backend.prefill_ar_len=16"])
    static = StaticLlama(tiny_model, CONTEXT)
    calibration = build_calibration(cfg.calibration, corpus, tiny_model.tokenizer, True, CONTEXT)
    qdq = quantize(static, cfg.quant, cfg.observer, calibration, Cache(cache_dir), key="htp-tests", soc="SM8650")
    program = compile_pte(tiny_model, cfg, qdq, static.r3, Cache(cache_dir), StageTimer(), library_versions())
    windows = make_windows(corpus.joined("test"), tiny_model.tokenizer, CONTEXT, 2, True)
    return cfg, static, qdq, program, HtpRunner(program), windows


def test_program_is_fully_delegated(deployed):
    _, _, _, program, _, _ = deployed
    assert program.pte_path.exists() and program.pte_bytes > 10_000
    assert set(program.meta["graphs"]) == {KV_GRAPH, PREFILL_GRAPH}
    for graph, counts in program.meta["delegation"].items():
        assert counts["delegated"] > 50, (graph, counts)
        assert counts["non_delegated"] <= 5, (graph, counts)  # only I/O plumbing stays outside the delegate


def test_prefill_matches_cpu_qdq(deployed):
    _, static, qdq, _, runner, windows = deployed
    ids = windows.ids[0]
    htp = runner.prefill_logits(ids)
    cpu = window_logits(qdq.module, static, ids)
    cosine = torch.nn.functional.cosine_similarity(htp, cpu, dim=-1)
    assert cosine.min() > 0.999, cosine.min()
    assert (htp.argmax(-1) == cpu.argmax(-1)).float().mean() > 0.95


def test_prefill_equals_kv_stepping(deployed):
    """AR-N evaluation (many positions per call) equals kv-mode token-by-token evaluation on a short window."""
    _, _, _, _, runner, windows = deployed
    ids = windows.ids[0][:40]
    by_prefill = runner.prefill_logits(ids)
    by_kv, _ = runner.kv_logits(ids)
    lp = lambda logits: torch.log_softmax(logits[:-1].double(), -1).gather(  # noqa: E731
        1, torch.as_tensor(ids[1:], dtype=torch.long)[:, None]).sum()
    assert torch.exp(-lp(by_prefill) / 39).item() == pytest.approx(torch.exp(-lp(by_kv) / 39).item(), rel=1e-3)
    assert (by_prefill.argmax(-1) == by_kv.argmax(-1)).float().mean() > 0.95


def test_kv_updaters_give_the_same_logits(deployed):
    _, static, qdq, _, runner, windows = deployed
    ids = windows.ids[1][:24]
    smart, smart_stats = runner.kv_logits(ids, "smart_mask")
    shift, shift_stats = runner.kv_logits(ids, "shift_pointer")
    cpu = window_logits(qdq.module, static, ids)
    # The same keys are attended; only the masked slots sit before (shift pointer) instead of after (smart mask) the
    # valid ones, which changes HTP's fixed-point accumulation order: the two differ by a few LSB of the 16-bit
    # logits (measured: mean 1.5, bit-identical for the first 8 positions), far less than either differs from the
    # CPU QDQ program (mean ~8 LSB), and never in the predicted token.
    lsb = runner.meta["encodings"][KV_GRAPH]["logits"][0]
    between = ((smart - shift).abs() / lsb).mean()
    to_cpu = min(((smart - cpu).abs() / lsb).mean(), ((shift - cpu).abs() / lsb).mean())
    assert between < 0.5 * to_cpu, (between, to_cpu)
    assert torch.nn.functional.cosine_similarity(smart, shift, dim=-1).min() > 0.99999
    assert (smart.argmax(-1) == shift.argmax(-1)).all()
    for stats in (smart_stats, shift_stats):
        per_token = stats.per_token()
        assert per_token["update_bytes_per_token"] > 0 and len(stats.seconds) == len(ids) - 1


def test_compile_is_cached(deployed, tiny_model, cache_dir):
    cfg, static, qdq, program, _, _ = deployed
    again = compile_pte(tiny_model, cfg, qdq, static.r3, Cache(cache_dir), StageTimer(), library_versions())
    assert again.cache_hit and again.pte_path == program.pte_path


def test_upstreams_one_process_lowering_gives_the_same_program(deployed, tiny_model, tmp_path, monkeypatch):
    """qexp's lowering against upstream's path as it is, in one compile: qexp lowers each graph in its own process
    and QNN context, shares torch's node provenance instead of deep-copying it, re-exports the converted graph
    non-strict (upstream.private.qnn_reexport_non_strict; ExecuTorch's QNN lowering re-exports with strict=True,
    dynamo) and recompiles GraphModules lazily (upstream.private.lazy_graph_module_recompile: a graph's Python source
    generated when run, not after every pass; dynamo needs torch's eager GraphModules, so both are off together) and
    asks the graph signature about placeholders only (upstream.private.signature_lookups_for_placeholders_only).
    Upstream's one-process lowering with all of them off computes the same program: the same metadata (delegation
    included) and bit-identical emulator outputs of both graphs. QNN's context binary is not byte-reproducible (two
    compiles of the same graph differ in ~0.6% of the tiny .pte's bytes), and one shared context is a few bytes
    smaller than two."""
    import contextlib

    import qexp.backends.htp.lower as lower

    cfg, static, qdq, program, runner, windows = deployed
    assert cfg.backend.compile_workers == 2 and program.meta["lowering"]["contexts"] == "per_graph"
    for name in ("provenance_without_deep_copies", "qnn_reexport_non_strict", "lazy_graph_module_recompile",
                 "signature_lookups_for_placeholders_only"):
        monkeypatch.setattr(lower, name, contextlib.nullcontext)
    cfg = cfg.copy()
    cfg.backend.contexts = "shared"  # upstream's one-process lowering: one QNN context for both graphs
    plain = compile_pte(tiny_model, cfg, qdq, static.r3, Cache(str(tmp_path)), StageTimer(), library_versions())
    assert not plain.cache_hit and plain.meta["lowering"]["contexts"] == "shared"
    assert abs(plain.pte_bytes - program.pte_bytes) < 0.02 * program.pte_bytes, (plain.pte_bytes, program.pte_bytes)
    assert {k: v for k, v in plain.meta.items() if k != "lowering"} == \
        {k: v for k, v in program.meta.items() if k != "lowering"}
    _assert_same_outputs(HtpRunner(plain), runner, windows)


def _assert_same_outputs(other, runner, windows) -> None:
    ids = windows.ids[0][:20]
    assert torch.equal(other.prefill_logits(ids), runner.prefill_logits(ids))
    assert torch.equal(other.kv_logits(ids[:6], "smart_mask")[0], runner.kv_logits(ids[:6], "smart_mask")[0])


def test_graphs_lowered_in_turn_with_float_originals_kept_give_the_parallel_program(deployed, tiny_model, cache_dir,
                                                                                    tmp_path, monkeypatch):
    """backend.compile_workers=1 lowers the graphs one after the other in this process into the same per-graph
    contexts as the parallel workers; since how many processes lower it is a speed setting, it is the parallel
    compile's cache entry (a hit, no recompile). And convert_pt2e leaves each weight's float original on the
    converted module beside the integer constant the graph reads; graph.drop_unused_attributes deletes them before
    lowering (the parent's and the workers' memory). One cold compile checks both: lowered in turn with the originals
    kept, the program is the fixture's (the same key and size, bit-identical emulator outputs; two lowerings of one
    graph never give identical bytes: QNN's context binary differs in ~2k scattered bytes each time)."""
    import qexp.backends.htp.graph as graph_module
    import qexp.backends.htp.lower as lower

    cfg, static, qdq, program, runner, windows = deployed
    cfg = cfg.copy()
    cfg.backend.compile_workers = 1
    hit = compile_pte(tiny_model, cfg, qdq, static.r3, Cache(cache_dir), StageTimer(), library_versions())
    assert hit.cache_hit and hit.key == program.key
    stats = torch.load(qdq.stats_path, weights_only=True)
    graph = lower.deploy_graph(tiny_model, cfg, KV_GRAPH, 1, static.r3, stats, StageTimer())["module"]
    read = {n.target for n in graph.graph.nodes if n.op == "get_attr"}
    assert {name for name, _ in graph.named_parameters()} <= read
    # as before the change, for the graph below and the compile after it: the originals kept
    monkeypatch.setattr(graph_module, "drop_unused_attributes", lambda module: 0)
    kept = lower.deploy_graph(tiny_model, cfg, KV_GRAPH, 1, static.r3, stats, StageTimer())["module"]
    assert any(name not in read for name, _ in kept.named_parameters())  # else this test would test nothing
    cold = compile_pte(tiny_model, cfg, qdq, static.r3, Cache(str(tmp_path)), StageTimer(), library_versions())
    assert not cold.cache_hit and cold.key == program.key and cold.pte_bytes == program.pte_bytes
    assert cold.meta["lowering"] == {**program.meta["lowering"], "workers": 1}
    _assert_same_outputs(HtpRunner(cold), runner, windows)


def test_lazy_recompile_is_scoped():
    """Outside the block GraphModules are torch's eager ones again (the patch must not leak into qexp's own graphs)."""
    import torch.fx
    from torch.fx._lazy_graph_module import _LazyGraphModule

    from qexp.upstream.private import lazy_graph_module_recompile

    root = torch.nn.Linear(2, 2)
    with lazy_graph_module_recompile():
        inside = torch.fx.symbolic_trace(root)
        assert isinstance(inside, _LazyGraphModule)
        assert torch.equal(inside(torch.ones(1, 2)), root(torch.ones(1, 2)))  # generated on first call
    assert not isinstance(torch.fx.symbolic_trace(root), _LazyGraphModule)


def test_upstream_reexports_strict():
    """When this fails, upstream no longer re-exports with dynamo: drop upstream.private.qnn_reexport_non_strict."""
    import inspect

    from executorch.backends.qualcomm.utils.utils import to_edge_transform_and_lower_to_qnn

    source = inspect.getsource(to_edge_transform_and_lower_to_qnn)
    assert "torch.export.export(" in source and "strict=True" in source


def test_a_worker_program_read_back_without_delegate_weights_emits_the_same_pte(deployed, tiny_model):
    """A compile worker sends its lowered graph to the parent without the float weights the lowered program no longer
    uses (parallel.drop_unused_weights): the parent's .pte is byte-identical to the one emitted from the program as
    lowered, and what crosses the process boundary no longer carries the weights (nor their copy in the delegate)."""
    import pickle

    from executorch.exir import EdgeProgramManager
    from executorch.backends.qualcomm.utils.utils import qnn_edge_config
    from executorch.exir.serde.serialize import serialize

    from qexp.backends.htp.lower import deploy_graph, lower_graphs
    from qexp.backends.htp.parallel import from_payload, to_payload
    from qexp.upstream.private import executorch_backend_config

    cfg, static, qdq, _, _, _ = deployed
    stats = torch.load(qdq.stats_path, weights_only=True)
    graph = deploy_graph(tiny_model, cfg, KV_GRAPH, 1, static.r3, stats, StageTimer())
    lowered = lower_graphs({KV_GRAPH: graph}).exported_program(KV_GRAPH)

    def pte(program) -> bytes:
        return EdgeProgramManager({KV_GRAPH: program}, compile_config=qnn_edge_config()) \
            .to_executorch(executorch_backend_config()).buffer

    as_lowered = pte(lowered)
    with_weights = len(pickle.dumps(serialize(lowered)))
    payload = pickle.dumps(to_payload(lowered))
    weights = sum(t.numel() * t.element_size() for t in graph["module"].state_dict().values())
    assert len(payload) < with_weights - weights, (len(payload), with_weights, weights)
    assert pte(from_payload(pickle.loads(payload))) == as_lowered


def test_sharded_program_gives_the_same_outputs(deployed, tiny_model, tmp_path):
    """backend.num_sharding (upstream's --num_sharding): each graph split into QNN contexts at a layer boundary, with
    ExecuTorch's llama.fallback op between them on the CPU; the cut edge stays quantized, so the outputs are the
    unsharded program's, bit for bit."""
    cfg, static, qdq, program, runner, windows = deployed
    assert {g["qnn_contexts"] for g in program.meta["delegation"].values()} == {1}
    cfg = cfg.copy()
    cfg.backend.num_sharding = 2
    sharded = compile_pte(tiny_model, cfg, qdq, static.r3, Cache(str(tmp_path)), StageTimer(), library_versions())
    assert not sharded.cache_hit and sharded.meta["lowering"]["num_sharding"] == 2
    assert {g["qnn_contexts"] for g in sharded.meta["delegation"].values()} == {2}
    _assert_same_outputs(HtpRunner(sharded), runner, windows)


def test_parallel_lowering_steps_back_without_memory(monkeypatch, caplog):
    """Not enough memory for a compile worker: the graphs are lowered one after the other, with one warning
    (build_and_lower asks this before forking; the test on the emulator above covers both lowerings)."""
    import psutil

    from qexp.backends.htp.lower import _room_for_workers

    rss = psutil.Process().memory_info().rss
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": rss // 2})())
    assert not _room_for_workers(1)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 3 * rss})())
    assert any("lowering the graphs one after the other" in r.getMessage() for r in caplog.records)
    # the Qwen2.5-0.5B shape's worker peaked at 1.65x its parent's memory when the parent forked with both graphs
    # built; a worker now builds its graph after the fork, from a parent holding none: 4x asked for
    assert not _room_for_workers(1)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 5 * rss})())
    assert _room_for_workers(1) and not _room_for_workers(2)


def test_missing_qnn_libraries(monkeypatch, tmp_path):
    import qexp.backends.htp.qnn_sdk as sdk

    monkeypatch.setattr(sdk, "_loaded", None)
    monkeypatch.setenv("QNN_SDK_ROOT", str(tmp_path))
    with pytest.raises(sdk.QnnLibrariesMissing, match="make setup"):
        sdk.ensure_qnn_sdk(Cache(tmp_path))


HTP_RUN = TINY + ["quant=16a8w", "backend=htp", "backend.prefill_ar_len=16", "backend.eval_tokens=64",
                  "backend.eval_kv_tokens=12", "backend.bench.prompt_len=16", "backend.bench.new_tokens=4",
                  "backend.bench.repeats=2", "backend.bench.emulator=true"]


@pytest.mark.parametrize("mode,path", [("hybrid", "prefill"), ("kv", "kv")])
def test_three_phases_in_one_run(compose, store_uri, mode, path):
    import numpy as np
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from qexp.pipeline import run_experiment

    result = run_experiment(compose(HTP_RUN + [f"backend.model_mode={mode}", "backend.kv_update=shift_pointer"]))
    run = MlflowClient(store_uri).get_run(result.run_id)
    m, tags = run.data.metrics, run.data.tags
    assert run.info.status == "FINISHED" and tags["phases"] == "fp,qdq,htp"
    assert tags["target"] == "x86_emulator" and tags["deployed_eval_path"] == path and tags["deployed_eval_path_reason"]
    assert tags["version.qnn_libs"].startswith("onnxruntime-qnn 2.5.0")
    assert run.data.params["backend.kv_update"] == "shift_pointer" and tags["deployed_phase"] == "htp"
    for name in ("ppl_deployed", "word_ppl_deployed", "bits_per_byte_deployed", "ppl_fp_sub", "ppl_qdq_sub",
                 "ppl_deployed_vs_qdq", "ppl_deployed_vs_fp", "top1_agreement_deployed_vs_qdq", "ttft_ms",
                 "prefill_tok_s", "decode_tok_s", "pte_bytes", "time_compile_s", "time_eval_deployed_s",
                 "kv_update_bytes_per_token", "decode_tok_s_est", "ttft_ms_est", "prefill_tok_s_est",
                 "ddr_read_total_bytes_kv_forward"):
        assert name in m, name
    assert tags["speed_source"].startswith("estimate:") and tags["speed_bytes_source"] == "qnn_ddr_summary"
    assert abs(m["ppl_deployed_vs_qdq"]) < 0.02 and m["top1_agreement_deployed_vs_qdq"] > 0.9
    assert m["deployed_eval_tokens"] == (63 if path == "prefill" else 11)
    # the prefill path scored window 0 whole: its log-likelihood is in the per-window file (reports pair deployed
    # phases by window); the kv path scored part of window 0 only, so it has no per-window figure
    per_window = pd.read_csv(MlflowClient(store_uri).download_artifacts(result.run_id, "eval/per_window.csv"))
    if path == "prefill":
        assert np.exp(-per_window["ll_deployed"][0] / 63) == pytest.approx(m["ppl_deployed"], rel=1e-9)
        assert per_window["ll_deployed"][1:].isna().all()
    else:
        assert "ll_deployed" not in per_window


@pytest.mark.parametrize("scheme", ["8a8w", "8a4w", "16a16w", "16a4w", "16a4w_block", "16a2w"])
def test_every_scheme_reaches_htp_and_matches_qdq(compose, scheme):
    """Every scheme compiles from the calibration's encodings and runs: 8-bit activations keep 8-bit logits and mask
    at the graph's edge (tagged uint16 they gave garbage, ppl 1e110), per-block weights carry their observers'
    attribute statistics (without them convert failed: `Expecting original_dtype to be populated`)."""
    from qexp.pipeline import run_experiment

    m = run_experiment(compose(HTP_RUN + [f"quant={scheme}", "backend.model_mode=kv", "backend.bench.emulator=false"]))\
        .metrics
    assert abs(m["ppl_deployed_vs_qdq"]) < 0.03 and m["top1_agreement_deployed_vs_qdq"] > 0.7, m


def test_unknown_soc_lists_valid(compose):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as err:
        compose(HTP_RUN + ["backend.soc=SM9999"])
    assert "SM8650" in str(err.value.__cause__) and "SM8750" in str(err.value.__cause__)


@pytest.mark.parametrize("override,match", [
    ("quant=fp32", "quantized scheme"),
    ("quant=fp16a8w", "QDQ phase only"),
    ("backend.max_seq_len=128", "calibrated for"),
    ("backend.num_sharding=0", "num_sharding=0"),
    ("backend.num_sharding=99", "use 1 to the model's 2 layers"),
])
def test_bad_htp_configs(compose, override, match):
    from qexp.core.errors import ConfigError
    from qexp.pipeline import validate

    with pytest.raises(ConfigError, match=match):
        validate(compose(HTP_RUN + [override]))


def test_r3_rotation_kept_as_matmul_deploys(compose, store_uri):
    """The SmolLM2 setting (R3 on, HadamardTransform not recomposed) on the tiny model: builds and matches QDQ."""
    from qexp.pipeline import run_experiment

    result = run_experiment(compose(HTP_RUN + ["model.r3=true", "model.recompose_hadamard=false"]))
    assert abs(result.metrics["ppl_deployed_vs_qdq"]) < 0.02


@pytest.mark.parametrize("scheme", ["8a8w", "16a8w"])
def test_r3_as_hadamard_transform_is_refused_clearly(compose, scheme):
    """R3 recomposed into QNN's HadamardTransform: HTP cannot build it in the prefill graph (`could not create op`),
    rejects it at 8 bits, and its graphs differ between AR lengths. One clear error naming the fix, before any work."""
    from qexp.core.errors import ConfigError
    from qexp.pipeline import validate

    with pytest.raises(ConfigError, match="recompose_hadamard=false"):
        validate(compose(HTP_RUN + [f"quant={scheme}", "model.r3=true", "model.recompose_hadamard=true"]))


def test_lpbq_block_sizes_the_emulator_cannot_run_are_refused_before_compiling(compose):
    """Block 64 segfaults QNN's x86 HTP emulator (seen on SmolLM2 with AWQ + 16a4w_block/64): one line, no compile."""
    from qexp.core.errors import ConfigError
    from qexp.pipeline import validate

    with pytest.raises(ConfigError, match="LPBQ block_size=64"):
        validate(compose(TINY + ["quant=16a4w_block", "quant.block_size=64", "backend=htp"]))
    validate(compose(TINY + ["quant=16a4w_block", "quant.block_size=32", "backend=htp"]))


V_AT_8_BITS = ["quant=16a8w", "quant.overrides=[{pattern: 'layers\\.\\d+\\.attention\\.wv_conv', scheme: 8a8w}]"]


def test_kv_caches_of_mixed_bit_widths_are_refused_before_any_work(compose):
    """An 8-bit-activation override on the v projection makes the v cache 8-bit beside 16-bit k caches; HTP programs
    take one cache type (measured: that program compiled and returned garbage, top-1 agreement with QDQ 0.000; the
    opposite mix aborted the emulator). One line naming both fixes; each fix passes."""
    from qexp.core.errors import ConfigError
    from qexp.pipeline import validate

    with pytest.raises(ConfigError, match="v cache would be 8-bit beside 16-bit k caches"):
        validate(compose(TINY + V_AT_8_BITS + ["backend=htp"]))
    with pytest.raises(ConfigError, match="v cache would be 16-bit beside 8-bit k caches"):
        validate(compose(TINY + ["quant=8a8w", "backend=htp",
                                 "quant.overrides=[{pattern: 'layers\\.1\\.attention\\.wv_conv', scheme: 16a8w}]"]))
    validate(compose(TINY + V_AT_8_BITS + ["backend=htp", "quant.custom_annotations=[annotate_kv_8bit]"]))
    validate(compose(TINY + ["quant=16a8w", "backend=htp",
                             "quant.overrides=[{pattern: 'layers\\.\\d+\\.attention\\.wv_conv', scheme: 16a4w}]"]))


def test_the_lowering_checks_the_cache_widths_in_the_graph_itself(compose):
    """What validation predicts, the deploy graph confirms: the same mixed program (built here without the HTP
    backend's validation) is refused by the lowering's own check, and a uniform one passes it."""
    from qexp.backends.htp.graph import check_one_kv_cache_width, quantized_graph
    from qexp.core.errors import ConfigError
    from qexp.pipeline import prepare

    all_8_bit = V_AT_8_BITS + ["quant.custom_annotations=[annotate_kv_8bit]"]
    for overrides, mixed in ((V_AT_8_BITS, True), (all_8_bit, False)):
        state = prepare(compose(TINY + overrides), through="qdq")
        cfg, stats = state.cfg, torch.load(state.qdq.program.stats_path, weights_only=True)
        converted, static = quantized_graph(state.deploy_model, 64, 1, state.deploy_static.r3, cfg.quant, cfg.observer,
                                            stats, cfg.model.recompose_hadamard, "SM8650")
        if mixed:
            with pytest.raises(ConfigError, match=r"KV caches mix bit widths \(k 16-bit, v 8/16-bit"):
                check_one_kv_cache_width(converted, static.n_layers)
        else:
            check_one_kv_cache_width(converted, static.n_layers)
