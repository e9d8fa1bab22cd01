"""Task accuracy beside perplexity: qexp's programs as lm-eval models, qexp's offline tasks, tasks in a run."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import REPO, TINY

TASKS = ["qexp_lastword_wikitext", "qexp_choice_wikitext"]
SEQ = ["eval.seq_len=256"]  # the tiny tokenizer (512 tokens) spends ~3 per word: a task item is up to ~250
DEPLOYED = ["quant=fp32", "backend=xnnpack", "backend.qmode=fp32", "backend.bench.repeats=1", "backend.bench.warmup=0",
            "backend.bench.new_tokens=4"]


@pytest.fixture(scope="module")
def tiny_state(compose):
    from qexp.pipeline import prepare

    return prepare(compose(TINY + SEQ, tracked=False), through="qdq")


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory, corpus):
    from qexp.tasks.offline import write_task

    root = tmp_path_factory.mktemp("tasks")
    built = {k: write_task(k, "wikitext", list(corpus.test["text"]), corpus.source, corpus.sha256, root)
             for k in ("lastword", "choice")}
    return root, built


def _lone_logprob(module, static, request) -> float:
    from qexp.models.static_llama import window_logits

    logits = window_logits(module, static, list(request.inputs)).double()
    k = len(request.targets)
    lp = torch.log_softmax(logits[-k:], -1).gather(1, torch.tensor(request.targets)[:, None])[:, 0]
    return float(lp.sum())


@pytest.mark.parametrize("phase", ["fp", "qdq"])
def test_packed_requests_score_as_if_alone(tiny_state, phase):
    """Several requests per call, choices sharing their context: each scores as it does alone in the graph."""
    from qexp.tasks.packing import ScoreRequest
    from qexp.tasks.programs import program_of

    program = program_of(tiny_state, phase)
    rng = np.random.default_rng(0)
    vocab = tiny_state.deploy_static.vocab_size
    requests = []
    for _ in range(5):
        context = rng.integers(0, vocab, rng.integers(3, 50)).tolist()
        for _ in range(4):  # a multiple-choice item: one context, four continuations
            continuation = rng.integers(0, vocab, rng.integers(1, 12)).tolist()
            requests.append(ScoreRequest(tuple((context + continuation)[:-1]), tuple(continuation)))
    scored = program.scorer.score(requests)
    assert len({s.logprob for s in scored}) == len(requests)
    module, static = program.scorer.module, program.scorer.static
    diffs = np.array([abs(s.logprob - _lone_logprob(module, static, r)) for r, s in zip(requests, scored)])
    if phase == "fp":
        assert diffs.max() < 1e-4
    else:  # float summation order can flip a fake-quant rounding step now and then: rare and one step small
        assert np.median(diffs) < 1e-5 and diffs.max() < 2e-3


def test_fp_phase_matches_lm_evals_hf_model(tiny_state, task_folder):
    """The adapter's log-likelihoods equal lm-eval's own `hf` model on the same HF folder, item by item, on the
    shipped tasks (and rolling log-likelihoods and greedy generation agree too)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from qexp.tasks.lm import QexpLM
    from qexp.tasks.programs import fp_program

    program = fp_program(tiny_state)
    ours = QexpLM(program.scorer, program.tokenizer, program.add_bos)
    model = tiny_state.model
    hf = HFLM(pretrained=model.hf_dir, dtype="float32", max_length=ours.max_length, add_bos_token=model.add_bos,
              batch_size=8, device="cpu")
    root, _ = task_folder
    loaded = TaskManager(include_path=str(root), include_defaults=False).load(TASKS)["tasks"]
    requests = []
    for task in loaded.values():
        task.build_all_requests(limit=12, rank=0, world_size=1)
        requests += [r for r in task.instances]
    assert len(requests) == 12 + 12 * 4
    a, b = ours.loglikelihood(requests), hf.loglikelihood(requests)
    assert max(abs(x[0] - y[0]) for x, y in zip(a, b)) < 1e-4
    assert [x[1] for x in a] == [y[1] for y in b]
    text = " ".join(tiny_state.corpus.test["text"][0].split()[:400])
    rolling = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    assert ours.loglikelihood_rolling(rolling)[0] == pytest.approx(hf.loglikelihood_rolling(rolling)[0], abs=1e-3)
    prompt = [Instance("generate_until", {}, ("The government said", {"until": ["\n"], "max_gen_toks": 8}), 0)]
    assert ours.generate_until(prompt) == hf.generate_until(prompt)


def test_offline_tasks_are_deterministic_and_held_out(corpus, task_folder, tmp_path):
    from qexp.tasks.offline import write_task

    root, built = task_folder
    again = write_task("lastword", "wikitext", list(corpus.test["text"]), corpus.source, corpus.sha256, tmp_path)
    assert again.sha256 == built["lastword"].sha256
    calibration = corpus.joined("calibration")
    for kind, task in built.items():
        items = [json.loads(line) for line in task.data.read_text().splitlines()]
        assert len(items) == task.n_items >= 300
        for item in items[::25]:  # the passages come from the test half, never the calibration half
            assert item["context"][:80] not in calibration
        if kind == "lastword":
            assert all(item["target"].isalpha() and item["target"].lower() in item["context"].lower()
                       for item in items)
        else:
            assert all(len(item["choices"]) == 4 and 0 <= item["gold"] < 4 for item in items)
            golds = np.bincount([item["gold"] for item in items], minlength=4)
            assert golds.min() > 0.15 * len(items)  # the true continuation is not always in one place


def test_a_run_scores_tasks_on_each_phase(compose, tmp_path):
    """eval.tasks in a run: per-phase metrics with stderr, per-item artifacts, the QDQ phase paired with FP, a
    user's local task folder unchanged; a rerun takes the FP phase from the cache and logs the same numbers."""
    import mlflow

    from qexp.pipeline import run_experiment

    folder = tmp_path / "my_tasks"
    folder.mkdir()
    (folder / "items.jsonl").write_text("".join(json.dumps({"q": f"Item {i} says", "a": " the"}) + "\n"
                                                for i in range(6)))
    (folder / "my_task.yaml").write_text(
        f"task: my_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'items.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        "target_delimiter: ''\nmetric_list:\n  - metric: acc\n")
    overrides = TINY + SEQ + [f"eval.tasks=[{','.join(TASKS)},my_task]", f"eval.task_paths=[{folder}]",
                              "eval.task_limit=20"]
    first = run_experiment(compose(overrides))
    second = run_experiment(compose(overrides + ["tracking.force=true"]))
    m = first.metrics
    for phase in ("fp", "qdq"):
        assert 0 <= m[f"task.qexp_lastword_wikitext.acc_{phase}"] <= 1
        assert m[f"task.qexp_lastword_wikitext.perplexity_{phase}"] > 1
        assert f"task.qexp_choice_wikitext.acc_norm_stderr_{phase}" in m
        assert f"task.my_task.acc_{phase}" in m
    assert m["task.qexp_choice_wikitext.items"] == 20 and m["task.my_task.items"] == 6
    delta = "task.qexp_choice_wikitext.acc_qdq_vs_fp"
    assert m[f"{delta}_ci_low"] <= m[delta] <= m[f"{delta}_ci_high"]
    assert "task.qexp_lastword_wikitext.perplexity_qdq_vs_fp_ci_low" in m
    client = mlflow.tracking.MlflowClient(mlflow.get_tracking_uri())
    tags = client.get_run(second.run_id).data.tags
    assert tags["fp_tasks_cache_hit"] == "true" and len(tags["task.qexp_lastword_wikitext.sha256"]) == 16
    assert {k: v for k, v in second.metrics.items() if k.startswith("task.")} == {
        k: v for k, v in m.items() if k.startswith("task.")}
    items = client.download_artifacts(first.run_id, "tasks/items_qdq.csv")
    assert sum(1 for _ in open(items)) == 1 + 20 + 20 + 6

    # two runs paired item by item: --compare gives task metrics a paired interval
    from qexp.report.compare_runs import compare_runs

    other = run_experiment(compose([*overrides, "quant=8a8w"]))
    comparison = compare_runs(first.run_id, other.run_id, mlflow.get_tracking_uri())
    rows = {row.name: row for row in comparison.metrics}
    low, high = rows["task.qexp_lastword_wikitext.perplexity_qdq"].paired
    assert low < high
    assert any("items both runs scored" in note for note in comparison.notes)


def test_the_deployed_program_scores_tasks_on_a_budget(compose):
    """eval.deployed_task_limit: XNNPACK's fp32 .pte scores the first items of each task one request at a time, and
    its per-item log-likelihoods are FP's (the same function, as its window perplexity is), paired with FP."""
    import mlflow
    import pandas as pd

    from qexp.pipeline import run_experiment

    overrides = TINY + SEQ + DEPLOYED + [f"eval.tasks=[{','.join(TASKS)}]", "eval.task_limit=8",
                                         "eval.deployed_task_limit=3"]
    result = run_experiment(compose(overrides))
    m = result.metrics
    assert 0 <= m["task.qexp_lastword_wikitext.acc_deployed"] <= 1
    assert "task.qexp_choice_wikitext.acc_norm_deployed_vs_fp_ci_low" in m
    client = mlflow.tracking.MlflowClient(mlflow.get_tracking_uri())
    items = {phase: pd.read_csv(client.download_artifacts(result.run_id, f"tasks/items_{phase}.csv"))
             for phase in ("fp", "deployed")}
    assert len(items["deployed"]) == 3 + 3 and len(items["fp"]) == 8 + 8
    both = items["deployed"].merge(items["fp"], on=["task", "doc_id"], suffixes=("_xnn", "_fp"))
    lastword = both[both.task == "qexp_lastword_wikitext"]
    assert len(lastword) == 3
    assert np.allclose(lastword["perplexity_xnn"], lastword["perplexity_fp"], atol=1e-3, rtol=0)
    choice = both[both.task == "qexp_choice_wikitext"]
    assert (choice["acc_xnn"] == choice["acc_fp"]).all()


def test_agreement_counts_identical_prompts_and_the_first_divergence():
    from qexp.tasks.generation import agreement

    fp = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    qdq = [[1, 2, 3, 4], [5, 0, 7, 8], [0, 9, 9, 9]]
    m = agreement(qdq, fp, "qdq")
    assert m["gen_identical_qdq"] == pytest.approx(1 / 3)
    assert m["gen_first_divergence_qdq"] == pytest.approx((4 + 1 + 0) / 3)
    assert m["gen_token_agreement_qdq"] == pytest.approx(10 / 12)


def test_the_generation_check_compares_each_phase_with_fp(compose, tiny_state):
    """Greedy continuations of held-out prompts by FP and QDQ; FP's own continuation is what packed generation of the
    static llama gives one token at a time."""
    import mlflow
    import pandas as pd

    from qexp.pipeline import run_experiment
    from qexp.tasks.generation import greedy, prompts_of
    from qexp.tasks.programs import fp_program

    result = run_experiment(compose(TINY + SEQ + ["eval.generation_check=2", "eval.generation_tokens=6"]))
    m = result.metrics
    assert 0 <= m["gen_identical_qdq"] <= 1 and 0 <= m["gen_first_divergence_qdq"] <= 6
    assert 0 <= m["gen_token_agreement_qdq"] <= 1 and m["gen_prompts"] == 2
    client = mlflow.tracking.MlflowClient(mlflow.get_tracking_uri())
    table = pd.read_csv(client.download_artifacts(result.run_id, "tasks/generation.csv"))
    assert list(table.columns) == ["prompt", "prompt_text", "fp", "qdq"] and len(table) == 2
    program = fp_program(tiny_state)
    prompts = prompts_of(tiny_state.windows, 2)
    together = greedy(program.scorer, prompts, 6)
    alone = [greedy(program.scorer, [p], 6)[0] for p in prompts]
    assert together == alone


@pytest.mark.parametrize("override,message", [
    (["eval.generation_check=5"], "eval.generation_check=5: the prompts are the first tokens"),
    (["eval.generation_check=2", "eval.generation_tokens=600"], "eval.generation_tokens=600"),
    (["eval.deployed_task_limit=3"], "eval.deployed_task_limit without eval.tasks"),
    (["eval.tasks=[qexp_choice_news]", "eval.deployed_task_limit=3"], "backend=none has no deployed program"),
    (["eval.tasks=[qexp_choice_news]", "eval.deployed_task_limit=-1"], "eval.deployed_task_limit=-1"),
    (["eval.tasks=[qexp_choice_news]", "eval.deployed_task_limit=3", "backend=htp", "backend.target=android",
      "backend.serial=x"], "on a phone scores perplexity windows only"),
    (["eval.tasks=[qexp_lastword_wikitxt]"], "unknown task 'qexp_lastword_wikitxt'.*mean qexp_lastword_wikitext"),
    (["eval.tasks=[no_such_task_anywhere]"], "unknown task 'no_such_task_anywhere'"),
    (["eval.tasks=[qexp_choice_news]", "eval.task_limit=0"], "eval.task_limit=0"),
    (["eval.task_paths=[/tmp]"], "eval.task_paths without eval.tasks"),
])
def test_bad_task_settings_fail_before_any_work(compose, override, message):
    from qexp.core.errors import ConfigError
    from qexp.pipeline import validate

    with pytest.raises(ConfigError, match=message):
        validate(compose(TINY + override, tracked=False))


def test_a_task_folder_that_does_not_parse_is_named(compose, tmp_path):
    from qexp.core.errors import ConfigError
    from qexp.pipeline import validate

    (tmp_path / "broken.yaml").write_text("task: broken\ndataset_path: json\n  bad: [\n")
    with pytest.raises(ConfigError, match="broken.yaml does not parse"):
        validate(compose(TINY + ["eval.tasks=[broken]", f"eval.task_paths=[{tmp_path}]"], tracked=False))


def test_lm_evals_command_line_runs_qexp_programs(cache_dir, tmp_path):
    """lm-eval's own CLI, with --model qexp registered, on a qexp task folder; a phase the config does not have
    fails in one line."""
    import os

    env = {**os.environ, "QEXP_CACHE_DIR": str(cache_dir)}
    tasks = tmp_path / "tasks"
    build = subprocess.run([sys.executable, "-m", "qexp.tasks", "build", "--out", str(tasks), "--texts", "news"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    assert "qexp_lastword_news" in build.stdout
    overrides = " ".join(TINY + SEQ)
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "qexp.tasks", "lm_eval", "run", "--model", "qexp", "--model_args",
                          f"overrides={overrides},phase=qdq", "--tasks", "qexp_choice_news", "--include_path",
                          str(tasks), "--limit", "8", "--output_path", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "qexp_choice_news" in run.stdout and "acc_norm" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "qexp.tasks", "lm_eval", "run", "--model", "qexp", "--model_args",
                          f"overrides={overrides} quant=fp32,phase=qdq", "--tasks", "qexp_choice_news",
                          "--include_path", str(tasks), "--limit", "2"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0
    assert "phase=qdq: this run does not quantize" in bad.stderr.strip().splitlines()[-1]
    xnnpack = " ".join([*DEPLOYED, "eval.deployed_task_limit=0"])
    deployed = subprocess.run([sys.executable, "-m", "qexp.tasks", "lm_eval", "run", "--model", "qexp",
                               "--model_args", f"overrides={overrides} {xnnpack},phase=deployed", "--tasks",
                               "qexp_lastword_news", "--include_path", str(tasks), "--limit", "3"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    assert "qexp_lastword_news" in deployed.stdout and "XNNPACK tasks" in deployed.stderr


def test_the_report_shows_task_deltas_with_their_intervals():
    import pandas as pd

    from qexp.report.columns import resolve_columns
    from qexp.report.table import formatted

    chosen = resolve_columns(["task.t.acc_qdq_vs_fp", "task.t.perplexity_qdq_vs_fp"])
    assert chosen["task.t.acc_qdq_vs_fp"] == ("metrics.task.t.acc_qdq_vs_fp", "Δ t.acc_qdq_vs_fp")
    table = pd.DataFrame({"Δ t.acc_qdq_vs_fp": [-0.139, 0.01], "Δ t.perplexity_qdq_vs_fp": [0.15, 0.02]})
    table.attrs["ci"] = {"Δ t.acc_qdq_vs_fp": ([-0.172, -0.02], [-0.106, 0.03]),
                         "Δ t.perplexity_qdq_vs_fp": ([0.10, -0.01], [0.20, 0.05])}
    shown = formatted(table)
    assert list(shown["Δ t.acc_qdq_vs_fp"]) == ["-13.9 pt [-17.2, -10.6]", "+1.0 pt [-2.0, +3.0] ~"]
    assert list(shown["Δ t.perplexity_qdq_vs_fp"]) == ["+15.0% [+10.0, +20.0]", "+2.0% [-1.0, +5.0] ~"]


@pytest.mark.parametrize("phase", ["fp", "qdq"])
def test_the_head_run_on_the_scored_rows_gives_the_full_heads_scores(tiny_state, phase):
    """Each call runs the output head on the positions it scores only: the scores are those of the full head."""
    from qexp.quant.fold import with_weights_dequantized
    from qexp.quant.w4_lowering import htp_exact_lowering
    from qexp.tasks.packing import PackedScorer, ScoreRequest
    from qexp.tasks.programs import program_of

    program = program_of(tiny_state, phase)
    assert program.scorer.head_rows is not None, "the static llama's head was not found"
    static = program.scorer.static
    module = static.module if phase == "fp" else with_weights_dequantized(tiny_state.qdq.program.module,
                                                                          htp_exact_lowering(tiny_state.cfg))
    full = PackedScorer(module, static, "full head")
    rng = np.random.default_rng(1)
    vocab = static.vocab_size
    requests = []
    for _ in range(12):
        inputs = rng.integers(0, vocab, rng.integers(2, 90)).tolist()
        targets = rng.integers(0, vocab, rng.integers(1, 4)).tolist()
        requests.append(ScoreRequest(tuple(inputs[:-1] + targets[:-1]), tuple(targets)))
    ours, reference = program.scorer.score(requests), full.score(requests)
    diffs = [abs(a.logprob - b.logprob) for a, b in zip(ours, reference)]
    assert max(diffs) < 1e-5, diffs
    assert [a.greedy for a in ours] == [b.greedy for b in reference]
    seqs = [r.inputs for r in requests[:3]]
    for a, b in zip(program.scorer.next_logits(seqs), full.next_logits(seqs)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
