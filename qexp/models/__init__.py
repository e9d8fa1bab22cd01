"""Models: sources -> LoadedModel (sources.py, families.py, tiny.py, tokenizer.py) and the static llama every phase
runs (static_llama.py)."""

from qexp.models.loaded import LoadedModel
from qexp.models.sources import load_model
from qexp.models import gemma, qwen  # noqa: F401 - registers the gemma3, qwen2 and qwen3 families

__all__ = ["LoadedModel", "load_model"]
