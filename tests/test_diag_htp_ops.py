"""benchmarks/diag_htp_ops.py on the tiny model (x86 HTP emulator): the program it dumps computes what the deployed
program computes (the same logits on the same tokens), and every decoder layer's ops are compared."""

from __future__ import annotations

import math
import sys

import torch

from helpers import REPO, TINY

sys.path.insert(0, str(REPO))


def test_op_by_op_diagnosis_of_the_deployed_program(compose):
    from benchmarks.diag_htp_ops import diagnose

    cfg = compose(TINY + ["quant=16a4w", "backend=htp", "backend.prefill_ar_len=16"])
    result = diagnose(cfg)
    table, summary = result.table, result.summary
    # on this model the dump, one method named `forward` and one context change nothing the device computes (on
    # Gemma-3-270M at 16a8w they do, a little: QNN fuses ops it need not dump; the script prints both programs')
    assert torch.equal(result.htp_logits, result.deployed_logits)
    assert summary["dumped_vs_deployed_logits_sqnr_db"] == math.inf

    # the reference is the QDQ program (activations requantized after QNN's passes), not float activations: its
    # logits are the converted QDQ graph's to within the passes' rewrites, and HTP agrees with it far better than
    # with float activations (38 dB here before the reference was requantized)
    assert summary["activations_requantized"] > 100 and summary["reference_vs_qdq_program_logits_sqnr_db"] > 60
    assert summary["tokens"] == 16 and summary["top1_htp_vs_qdq"] > 0.9 and summary["logits_sqnr_db"] > 45
    n_layers = 2  # model=tiny
    assert set(table.layer.dropna().astype(int)) == set(range(n_layers))
    for layer in range(n_layers):  # the o, gate, up and down projections run whole (q/k/v are split per head)
        convs = table[(table.layer == layer) & (table.kind == "convolution")]
        assert len(convs) >= 4 and convs.sqnr_db.between(30, 120).all(), convs
    assert result.left_out["split_per_head"] > 0 and table.kind.str.endswith("+heads").any()
    finite = table[table.drop_db.map(math.isfinite)]
    assert (finite.input_sqnr_db - finite.sqnr_db - finite.drop_db).abs().max() < 1e-9


def test_per_position_sqnr_is_not_the_massive_position_s():
    """A position 1000x the others' rms with a small error, the others with 1% errors: the whole tensor's SQNR is the
    big position's (~60 dB), the per-position median the others' (40 dB)."""
    from qexp.eval.compare import per_position_sqnr_db

    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(1, 8, 64, generator=generator)  # [batch, tokens, channels]
    reference[0, 0] *= 1000
    test = reference + 0.01 * reference.abs().mean(-1, keepdim=True) * torch.randn(1, 8, 64, generator=generator)
    test[0, 0] = reference[0, 0] * 1.00001
    whole = 10 * math.log10(reference.pow(2).sum() / (reference - test).pow(2).sum())
    assert whole > 55
    assert 35 < per_position_sqnr_db(reference, test, tokens=8) < 45
    assert per_position_sqnr_db(reference, reference, tokens=8) == math.inf
    assert per_position_sqnr_db(reference.transpose(1, 2), test.transpose(1, 2), tokens=8) == \
        per_position_sqnr_db(reference, test, tokens=8)  # the token axis is found wherever it is
