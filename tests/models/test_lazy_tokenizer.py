"""LazyTokenizer: the special ids a plan reads, without transformers; everything else from the
real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rollfleet.models import build_tiny_model
from rollfleet.models.lazy_tokenizer import SPECIAL_TOKENS, LazyTokenizer, read_special_tokens

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return Path(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0))


def test_special_tokens_match_the_real_tokenizer_without_loading_it(tiny_dir):
    real = AutoTokenizer.from_pretrained(tiny_dir)
    lazy = LazyTokenizer(str(tiny_dir))
    for name in SPECIAL_TOKENS:
        assert getattr(lazy, name) == getattr(real, name), name
        assert getattr(lazy, f"{name}_id") == getattr(real, f"{name}_id"), name
    assert lazy.pad_token_id is not None and lazy.eos_token_id is not None
    assert not lazy.loaded
    # anything else loads the real one and behaves as it does
    assert lazy.encode("hello world", add_special_tokens=False) == real.encode("hello world", add_special_tokens=False)
    assert lazy.loaded and len(lazy) == len(real)


def test_a_special_the_config_cannot_resolve_comes_from_the_tokenizer(tiny_dir, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    for f in tiny_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["pad_token"]  # left out of the config: special_tokens_map.json may still set it
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert "pad_token" not in read_special_tokens(folder)
    lazy = LazyTokenizer(str(folder))
    assert lazy.pad_token_id == AutoTokenizer.from_pretrained(folder).pad_token_id
    assert lazy.loaded
    assert read_special_tokens(tmp_path / "missing") == {}
    # older configs write a token as an AddedToken dict; a text the added tokens lack is left out
    config.update(eos_token={"__type": "AddedToken", "content": "<|im_end|>"}, unk_token="<not-added>")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    specials = read_special_tokens(folder)
    assert specials["eos_token"] == "<|im_end|>" and "unk_token" not in specials
