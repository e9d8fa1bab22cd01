"""diagnostics/diag_htp_ops.py on the tiny model (x86 HTP emulator): the program it dumps computes what the deployed
program computes (the same logits on the same tokens), and every decoder layer's ops are compared."""

from __future__ import annotations

import math
import sys

import torch

from helpers import REPO, TINY

sys.path.insert(0, str(REPO))


def test_op_by_op_diagnosis_of_the_deployed_program(compose):
    from diagnostics.diag_htp_ops import diagnose

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

    # each op on HTP's own inputs: copies are exact, and the 16-bit RMSNorms floor (every other output one step low,
    # a -1/2 step mean), as eval.htp_exact models them
    local = table.dropna(subset=["local_lsb_rms"])
    copies = local[local.kind.isin(["view_copy", "permute_copy", "unsqueeze_copy"])]
    assert len(copies) > 10 and (copies.local_lsb_rms == 0).all()
    norms = local[local.kind == "rms_norm"]
    assert len(norms) == 2 * n_layers + 1 and norms.local_lsb_mean.between(-0.55, -0.45).all(), norms
    assert summary["local_ops"] == len(local) and summary["local_lsb_rms_max"] < 10


def test_per_position_sqnr_is_not_the_massive_position_s():
    """A position 1000x the others' rms with a small error, the others with 1% errors: the whole tensor's SQNR is the
    big position's (~60 dB), the per-position median the others' (40 dB)."""
    from diagnostics.sqnr import per_position_sqnr_db

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


def test_local_departure_is_the_ops_own_not_what_it_inherits():
    """A device whose first op departs by +1 step at one value and whose second op computes exactly from what the
    first gave it: the second op's cumulative error is the first's, its local departure nothing; the first's local
    departure is its own (one value in eight changed by one step, a +1/8 step bias)."""
    from diagnostics.diag_htp_ops import local_departures

    class TwoOps(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x * 2.0) + 1.0

    x = torch.arange(8, dtype=torch.float32).reshape(1, 8, 1)  # 8 positions of 1 channel
    reference = torch.export.export(TwoOps(), (x,))
    mul, relu, add = [node.name for node in reference.graph.nodes if node.op == "call_function"]
    step = 0.5
    device_mul = x * 2.0
    device_mul[0, 3, 0] += step  # the device's mul is one step off at one value
    outputs = {mul: device_mul, add: torch.relu(device_mul) + 1.0}  # the add exact on what the device computed
    table = local_departures(reference.module(), outputs, {mul: (mul, step), add: (add, step)}, (x,), tokens=8)
    rows = table.set_index("op")
    assert rows.loc[mul, "local_changed"] == 1 / 8 and rows.loc[mul, "local_lsb_mean"] == 1 / 8
    assert rows.loc[mul, "local_lsb_max"] == 1.0 and rows.loc[mul, "local_lsb_rms"] == (1 / 8) ** 0.5
    assert rows.loc[add, "local_changed"] == 0 and rows.loc[add, "local_lsb_rms"] == 0
    assert rows.loc[add, "local_sqnr_db"] == math.inf and rows.loc[mul, "local_sqnr_db"] == math.inf  # median of 8
    with __import__("pytest").raises(RuntimeError, match="not found"):  # a dumped op the graph lacks is no silent gap
        local_departures(reference.module(), {**outputs, "nonexistent": x}, {}, (x,), tokens=8)


def test_noise_yardstick_matches_its_definition():
    """Rounding noise of σ LSB: no change at σ 0; for wide noise the difference round(u + e) - round(u), u the
    fraction, has variance σ² + 1/6 (the uniform fraction's 1/12 plus Sheppard's 1/12 for the rounding); the share
    changed grows with σ."""
    from diagnostics.diag_htp_ops import noise_lsb

    assert noise_lsb(0.0) == (0.0, 0.0)
    for sigma in (1.0, 2.0):
        assert abs(noise_lsb(sigma)[1] - (sigma ** 2 + 1 / 6) ** 0.5) < 0.005
    changed = [noise_lsb(sigma)[0] for sigma in (0.125, 0.25, 0.5, 1.0)]
    assert changed == sorted(changed) and 0.03 < changed[0] < 0.15 and changed[-1] > 0.6
