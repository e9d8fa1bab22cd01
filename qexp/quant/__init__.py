"""Quantization: config -> QnnQuantizer recipe (recipe.py), calibrate + convert (calibrate.py), what got quantized
(encodings.py)."""
