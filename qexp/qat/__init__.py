"""Quantization-aware training with distillation from the float model (the `qat` algorithm,
qexp/transforms/qat.py): training data from the calibration half (data.py), the weight grid as a straight-through
fake quantizer (fake_quant.py), and the training loop with validation, early stopping and resumable checkpoints
(loop.py)."""
