"""The model's tokenizer and chat template, loaded from a model directory.

Read straight from the files a Hugging Face model directory holds (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``) with ``tokenizers`` and ``jinja2``, not through
``transformers``: the proxy and the light installs tokenize without transformers' 120 MB, its numpy and its
second of import time. ``tests/core/test_tokenizer.py`` holds it equal to ``transformers.AutoTokenizer``
(ids, text, rendered chats) on every packaged model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from contextkit.core.errors import ModelError

# tokenizers and jinja2 are imported where used: the proxy loads its tokenizer on the first documents
# request, so starting it (and importing its modules) pays for neither

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """Encode, decode and render chats the way the model's Hugging Face tokenizer does."""

    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelError(f"{model_dir} has no tokenizer.json: point the model at a Hugging Face model "
                             "directory (one that holds tokenizer.json and tokenizer_config.json)")
        raw = tok_file.read_bytes()
        self.fingerprint = hashlib.sha256(raw).hexdigest()
        from tokenizers import Tokenizer as RustTokenizer

        self._tok = RustTokenizer.from_str(raw.decode())
        config = _read_json(model_dir / "tokenizer_config.json")
        self._cleanup = bool(config.get("clean_up_tokenization_spaces", False))
        self._specials = {k: _content(config[k]) for k in SPECIAL_TOKEN_KEYS if config.get(k) is not None}
        self.chat_template = _chat_template(model_dir, config)

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)`` (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        text = self._tok.decode(list(token_ids), skip_special_tokens=True)
        return _clean_up_spaces(text) if self._cleanup else text

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """``messages`` rendered with the model's template as text, ready for the assistant turn."""
        if not self.chat_template:
            raise ModelError("this model has no chat template: render the prompt as plain text instead")
        return _compile(self.chat_template).render(messages=messages, add_generation_prompt=True,
                                                    **self._specials)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _content(token: str | dict) -> str:
    """A special token as ``tokenizer_config.json`` writes it: a string, or an AddedToken's dict."""
    return token["content"] if isinstance(token, dict) else token


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: ``chat_template.jinja`` beside the tokenizer (newer exports), else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates)."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which chat templates do not expect
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@cache
def _compile(template: str) -> Any:
    """The environment chat templates are written for (the one transformers renders them in): sandboxed,
    trimmed blocks, loop controls, ``raise_exception``, ``strftime_now``, and ``{% generation %}`` blocks
    (assistant-mask markers some templates carry, which only matter to training masks) rendered as is."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}  # noqa: RUF012 - jinja reads the tag set off the class

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _clean_up_spaces(text: str) -> str:
    """transformers' ``clean_up_tokenization``, for tokenizers whose config turns it on."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
