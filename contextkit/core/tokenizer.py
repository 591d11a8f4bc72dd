"""The model's tokenizer and chat template, loaded from a prepared model directory."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path


class Tokenizer:
    """Thin wrapper over the Hugging Face tokenizer saved beside the weights."""

    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        tok_file = model_dir / "tokenizer.json"
        self.fingerprint = hashlib.sha256(tok_file.read_bytes()).hexdigest() if tok_file.is_file() else ""

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``."""
        return len(self._tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """``messages`` rendered with the model's template as text, ready for the assistant turn."""
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
