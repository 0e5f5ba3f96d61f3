"""A model's tokenizer that loads only when something needs more than its special tokens.

A plan (``rollfleet plan``, ``benchmarks/routing_quality.py``) runs the real agent loops on token
ids and decodes nothing: all they read of the tokenizer is its end-of-sequence and padding ids.
Importing transformers and loading the tokenizer took about 3 s in every plan process, most of a
small plan's wall time. :class:`LazyTokenizer` answers those ids from the model folder's
``tokenizer_config.json`` and loads the real tokenizer on the first access to anything else, so
nothing changes for a caller that does encode or render a chat.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from rollfleet.models import get_model_path

#: Special tokens answered without loading: ``<name>`` (the token's text) and ``<name>_id``.
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def read_special_tokens(folder: str | Path) -> dict[str, Any]:
    """``{"eos_token": "<|im_end|>", "eos_token_id": 2, ...}`` for the special tokens whose text and
    id ``tokenizer_config.json`` states (a token set to null: None for both). A token the file
    leaves out, or whose id is not among its added tokens, is left out: the real tokenizer knows."""
    path = Path(folder) / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    ids = {
        entry.get("content"): int(token_id)
        for token_id, entry in (config.get("added_tokens_decoder") or {}).items()
        if isinstance(entry, dict)
    }
    found: dict[str, Any] = {}
    for name in SPECIAL_TOKENS:
        if name not in config:
            continue
        value = config[name]
        text: Optional[str] = value.get("content") if isinstance(value, dict) else value
        if text is None:
            found[name], found[f"{name}_id"] = None, None
        elif isinstance(text, str) and text in ids:
            found[name], found[f"{name}_id"] = text, ids[text]
    return found


class LazyTokenizer:
    """Stands in for ``AutoTokenizer.from_pretrained(model)``: the special tokens come from the
    folder's config, anything else from the tokenizer, loaded on first use."""

    def __init__(self, model: str) -> None:
        self._folder = get_model_path(model)
        self._specials = read_special_tokens(self._folder)
        self._tokenizer: Any = None

    @property
    def loaded(self) -> bool:
        """Whether the real tokenizer has been loaded."""
        return self._tokenizer is not None

    def _load(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._folder)
        return self._tokenizer

    def __getattr__(self, name: str) -> Any:  # only for names not set on the instance
        if name.startswith("_"):
            raise AttributeError(name)
        specials = self.__dict__.get("_specials", {})
        if name in specials:
            return specials[name]
        return getattr(self._load(), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._load()(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._load())


__all__ = ["LazyTokenizer", "read_special_tokens", "SPECIAL_TOKENS"]
