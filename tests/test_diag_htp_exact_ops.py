"""diagnostics/diag_htp_exact_ops.py: the agreement measures against their definitions, and the attribution on the
tiny model on the x86 HTP emulator (every arithmetic scored on the same HTP logits; a model of an op the program does
not have scores as the fake-quant program, bit for bit)."""

from __future__ import annotations

import math
import sys

import torch

from helpers import REPO, TINY

sys.path.insert(0, str(REPO))


def test_agreement_measures():
    from diagnostics.diag_htp_exact_ops import agreement

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=generator)
    same = agreement(logits, logits)
    assert same["logits_sqnr_db"] == math.inf and abs(same["kl_nats"]) < 1e-12 and same["top1"] == 1
    noisy = logits + 0.1 * torch.randn(16, 50, generator=generator)
    row = agreement(logits, noisy)
    assert 18 < row["logits_sqnr_db"] < 22  # signal power 1, noise 0.01: 20 dB
    p, q = torch.softmax(logits.double(), -1), torch.softmax(noisy.double(), -1)
    assert math.isclose(row["kl_nats"], (p * (p / q).log()).sum(-1).mean().item(), rel_tol=1e-9)


def test_attribution_on_the_tiny_model(compose):
    from diagnostics.diag_htp_exact_ops import arithmetics, attribute

    cfg = compose(TINY + ["quant=16a8w", "backend=htp", "backend.prefill_ar_len=16"])
    rows, facts = attribute(cfg, 2)
    assert set(rows) == set(arithmetics()) and facts["positions"] == 2 * facts["tokens_per_window"]
    assert rows["only gelu_phi_table"] == rows["fake_quant"]  # the llama has no GELU
    assert all(row["kl_nats"] >= 0 and 0 < row["top1"] <= 1 for row in rows.values())
    assert rows["htp_exact"] != rows["fake_quant"] and "softmaxes with a 15-bit exp" in facts["modelled"]


def test_perplexity_attribution_scores_what_a_run_reports(compose):
    """Each arithmetic's QDQ perplexity on the run's windows against HTP's scores of the first windows; the
    fake-quant row is the QDQ phase a run of the config reports, and with eval.htp_exact=true the htp_exact row is."""
    from diagnostics.diag_htp_exact_ops import arithmetics, attribute_perplexity

    overrides = TINY + ["quant=16a8w", "backend=htp", "backend.prefill_ar_len=16", "backend.eval_tokens=128"]
    rows, facts = attribute_perplexity(compose(overrides))
    assert set(rows) == set(arithmetics()) and facts["windows"] == 3 and facts["htp_windows"] == 2
    assert rows["fake_quant"]["ppl_qdq"] == facts["ppl_qdq_phase"] and rows["fake_quant"]["ppl_shift"] == 0
    assert math.isclose(1 + rows["htp_exact"]["ppl_shift"], rows["htp_exact"]["ppl_qdq"] / facts["ppl_qdq_phase"])
    assert rows["only gelu_phi_table"] == rows["fake_quant"]  # the llama has no GELU
    assert rows["htp_exact"]["ppl_qdq"] != rows["fake_quant"]["ppl_qdq"]
    for row in rows.values():
        assert row["ppl_ci_units"] > 0 and 0 < row["top1_agreement"] <= 1
    exact_rows, exact_facts = attribute_perplexity(compose(overrides + ["eval.htp_exact=true"]))
    assert exact_rows["htp_exact"]["ppl_qdq"] == exact_facts["ppl_qdq_phase"]
    assert exact_rows == rows and exact_facts["ppl_deployed"] == facts["ppl_deployed"]
