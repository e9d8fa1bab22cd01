"""Models: sources -> LoadedModel (sources.py, families.py, tiny.py, tokenizer.py) and the static llama every phase
runs (static_llama.py)."""

from qexp.models.loaded import LoadedModel
from qexp.models.sources import load_model

__all__ = ["LoadedModel", "load_model"]
