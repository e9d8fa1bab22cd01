"""qexp: experiment tracking for LLM quantization on Qualcomm HTP with ExecuTorch."""

import os

# qexp runs offline by design: models and text come from installed packages and user paths. Without these, the
# Hugging Face libraries try the network first and wait for time-outs. Set them to 0 to allow downloads.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__version__ = "0.1.0"
