"""qexp.offload.on_disk: inside the block the chosen storages hold no memory, kept and small ones are untouched;
afterwards every tensor, view and tie is back bit for bit, after an error too. (Nothing reads an offloaded tensor
inside the block: torch does not check a storage's size on every read, so that would crash the process; the QDQ
phase keeps every tensor its program holds, tests/test_pipeline.py runs it.)"""

from __future__ import annotations

import pytest
import torch


def test_weights_leave_memory_and_come_back_bit_for_bit(tmp_path):
    from qexp.offload import on_disk

    torch.manual_seed(0)
    big = torch.randn(1024, 1024)  # 4 MiB
    view = big.view(1024, 1024, 1, 1)  # as the static llama's conv weight views the loaded model's linear
    kept = torch.randn(512, 1024)
    small = torch.randn(16)
    before = {name: t.clone() for name, t in (("big", big), ("kept", kept), ("small", small))}
    with on_disk([big, view, kept, small], tmp_path, keep=[kept]):
        assert big.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
        assert torch.equal(kept, before["kept"]) and torch.equal(small, before["small"])
    assert torch.equal(big, before["big"]) and view.data_ptr() == big.data_ptr()
    assert torch.equal(view.reshape(1024, 1024), before["big"])
    assert list(tmp_path.iterdir()) == []  # the file was never linked


def test_an_error_inside_still_brings_the_weights_back(tmp_path):
    from qexp.offload import on_disk

    weight = torch.randn(2048, 512)
    copy = weight.clone()
    with pytest.raises(ValueError, match="inside"):
        with on_disk([weight], tmp_path):
            raise ValueError("inside")
    assert torch.equal(weight, copy)


def test_weights_mapped_from_a_safetensors_file_are_handed_back_and_read_again(tmp_path):
    """A loaded model's weights are read-only maps of its safetensors file: their pages leave the process (its
    resident set falls by their size) and come back from the file when read, inside the block too."""
    import psutil
    from safetensors.torch import load_file, save_file

    from qexp.offload import on_disk

    save_file({"embedding": torch.randn(4096, 4096)}, str(tmp_path / "model.safetensors"))  # 64 MiB
    weight = load_file(str(tmp_path / "model.safetensors"))["embedding"]
    total = float(weight.double().sum())  # every page read in
    process = psutil.Process()
    before = process.memory_info().rss
    with on_disk([weight], tmp_path / "offload"):
        assert before - process.memory_info().rss > 48 * 2**20
        assert float(weight.double().sum()) == total  # read again from the file
    assert float(weight.double().sum()) == total


@pytest.mark.parametrize("algorithm", ["[]", "[rotation,gptq]"])
def test_the_qdq_phase_scores_the_same_with_the_float_weights_out_of_memory(compose, monkeypatch, algorithm):
    """The QDQ phase with every float tensor of the run out of memory (no size floor): the tiny model's weights are
    file-mapped (its cached HF folder) and the transformed ones are plain tensors written to disk; the evaluation
    reads none of them (it would crash or differ) and the later stages get them back."""
    from qexp import offload
    from qexp.pipeline import run_experiment

    overrides = ["model=tiny", "eval.seq_len=256", "eval.limit=2", "calibration.limit=3", "quant=16a4w",
                 f"algorithm={algorithm}", "eval.tasks=[qexp_lastword_wikitext]", "eval.task_limit=4"]
    reference = run_experiment(compose(overrides)).metrics
    monkeypatch.setattr(offload, "SMALLEST", 0)
    seen = []
    monkeypatch.setattr(offload.log, "info", lambda message, *args: seen.append(message % args))
    offloaded = run_experiment(compose(overrides)).metrics
    assert any("float weights out of memory" in line and " 0 tensors" not in line for line in seen), seen
    for name in ("ppl_qdq", "ppl_fp", "ppl_fp_transformed"):
        assert offloaded.get(name) == reference.get(name), name
    tasks = {k: v for k, v in reference.items() if k.startswith("task") or "acc" in k}
    assert tasks and {k: offloaded.get(k) for k in tasks} == tasks
