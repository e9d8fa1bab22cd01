"""One tokenizer interface over Hugging Face tokenizers and the llama2c/tiktoken ones Meta checkpoints ship."""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence

from qexp.core.errors import InputError

log = logging.getLogger("qexp")


class Tokenizer:
    """encode() never adds BOS/EOS itself: callers decide (windows, calibration samples), per model."""

    def __init__(self, impl, kind: str, path: str):
        self._impl = impl
        self.kind = kind  # "hf" | "llama2c" | "tiktoken"
        self.path = path

    # ---- construction
    @classmethod
    def from_hf_dir(cls, path: str) -> "Tokenizer":
        from transformers import AutoTokenizer

        try:
            return cls(AutoTokenizer.from_pretrained(path), "hf", path)
        except Exception as exc:  # noqa: BLE001 - any failure means the folder is unusable
            raise InputError(
                f"cannot load the tokenizer in {path}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                "the folder needs tokenizer.json / tokenizer_config.json",
            ) from exc

    @classmethod
    def from_file(cls, path: str) -> "Tokenizer":
        """tokenizer.model (sentencepiece or tiktoken, as Meta ships) or tokenizer.json."""
        if path.endswith(".json"):
            import os

            return cls.from_hf_dir(os.path.dirname(path) or ".")
        from pytorch_tokenizers.llama2c import Llama2cTokenizer
        from pytorch_tokenizers.tiktoken import TiktokenTokenizer

        try:
            return cls(Llama2cTokenizer(model_path=path), "llama2c", path)
        except Exception:  # noqa: BLE001 - not sentencepiece: try tiktoken
            pass
        try:
            return cls(TiktokenTokenizer(model_path=path), "tiktoken", path)
        except Exception as exc:  # noqa: BLE001
            raise InputError(
                f"cannot read tokenizer {path} as sentencepiece or tiktoken ({type(exc).__name__})",
                "pass the tokenizer.model that came with the checkpoint",
            ) from exc

    # ---- properties
    @property
    def bos_id(self) -> Optional[int]:
        if self.kind == "hf":
            return self._impl.bos_token_id
        return self._impl.bos_id

    @property
    def eos_id(self) -> Optional[int]:
        if self.kind == "hf":
            return self._impl.eos_token_id
        return self._impl.eos_id

    @property
    def vocab_size(self) -> int:
        return len(self._impl) if self.kind == "hf" else self._impl.n_words

    @property
    def chat_template(self) -> Optional[str]:
        return getattr(self._impl, "chat_template", None) if self.kind == "hf" else None

    # ---- use
    def encode(self, text: str) -> List[int]:
        """Token ids of `text`; special-token strings in it (e.g. <|eot_id|>) become special tokens."""
        if self.kind == "hf":
            return self._impl.encode(text, add_special_tokens=False)
        if self.kind == "tiktoken":
            return self._impl.encode(text, bos=False, eos=False, allowed_special="all")
        return self._impl.encode(text, bos=False, eos=False)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "hf":
            return self._impl.decode(ids)
        return self._impl.decode(ids)

    def render_chat(self, messages: list, template: Optional[str] = None) -> str:
        """Conversation -> prompt text with the tokenizer's chat template (or `template`, a Jinja string)."""
        template = template or self.chat_template
        if not template:
            raise InputError(
                f"the tokenizer {self.path} has no chat template",
                "set calibration.chat_template to a Jinja template, or use calibration=prompt",
            )
        if self.kind == "hf":
            return self._impl.apply_chat_template(messages, chat_template=template, tokenize=False)
        import jinja2

        return jinja2.Template(template).render(messages=messages, add_generation_prompt=False)
