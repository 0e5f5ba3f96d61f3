"""The built-in ``tiny`` model: a ~0.6M-parameter random Llama with a locally trained BPE tokenizer.

It exists so that everything (vLLM on CPU, transformers, RL training loops) can run with no model
hub: the whole model is generated from code and a seed. Layout:

* architecture ``LlamaForCausalLM``: hidden 128, 4 heads of dim 32 (vLLM's CPU attention supports
  head dims 32/64/80/96/112/128...; 16 kills the engine), 2 layers, MLP 256, untied lm_head,
  random-initialised from ``seed``;
* a byte-level BPE tokenizer (vocab 1024) trained with the ``tokenizers`` library on a built-in
  corpus of arithmetic, copy tasks, short English and chat/tool-call text. Digits are split one
  per token, so ``"12+345=357"`` tokenises digit by digit. Special tokens: ``<|endoftext|>``,
  ``<|im_start|>``, ``<|im_end|>``, ``<|pad|>``; added (non-special) tokens ``<tool_call>``,
  ``</tool_call>``, ``<tool_response>``, ``</tool_response>``;
* a ChatML chat template that supports ``tools`` and ``tool`` messages (Qwen2.5/Hermes style).

The same seed gives byte-identical files.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from rollfleet.models.chat_template import CHAT_TEMPLATE

#: Bump when anything that changes the built files changes (it is part of the cache key).
RECIPE_VERSION = "tiny-v1"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VOCAB_SIZE = 1024  # BPE vocab (specials included); added tokens come on top

MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}

_WORDS = (
    "the a an of to and in is it that for on with as was at by be this from or are have not "
    "but what all were when we there can one which their said if do will each about how up out "
    "them then she many some so these would other into has more her two like him see time could "
    "no make than first been its who now people my made over did down only way find use may water "
    "long little very after words called just where most know get through back much before go good "
    "new write our used me man too any day same right look think also around another came come work "
    "three word must because does part even place well such here take why things help put years "
    "different away again off went old number great tell men say small every found still between "
    "name should home big give air line set own under read last never us left end along while might "
    "next sound below saw something thought both few those always looked show large often together "
    "asked house world going want school important until form food keep children feet land side "
    "without boy once animals life enough took sometimes four head above kind began almost live page "
    "got earth need far hand high year mother light parts country father let night following picture "
    "being study second eyes soon times story boys since white days ever paper hard near sentence "
    "better best across during today others however sure means knew try told young miles sun ways "
    "thing whole hear example heard several change answer room sea against top turned learn point "
    "city play toward five using himself usually add sum plus minus times equals copy repeat reverse "
    "compute result question assistant user system tool function call calculator weather search"
).split()

_TOOLS = ("calculator", "get_weather", "search", "lookup", "python")


def _corpus(seed: int = 1234) -> list[str]:
    """A small deterministic training corpus for the tokenizer (independent of the model seed)."""
    rng = random.Random(seed)
    lines: list[str] = []
    ops = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)]
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        sym, fn = rng.choice(ops)
        style = rng.randrange(4)
        if style == 0:
            lines.append(f"{a}{sym}{b}={fn(a, b)}")
        elif style == 1:
            lines.append(f"{a} {sym} {b} = {fn(a, b)}")
        elif style == 2:
            lines.append(f"What is {a} {sym} {b}? The answer is {fn(a, b)}.")
        else:
            lines.append(f"Compute {a}{sym}{b}. Answer: {fn(a, b)}")
    for _ in range(1500):
        n = rng.randint(3, 12)
        words = [rng.choice(_WORDS) for _ in range(n)]
        text = " ".join(words)
        style = rng.randrange(3)
        if style == 0:
            lines.append(f"Copy: {text}\n{text}")
        elif style == 1:
            lines.append(text.capitalize() + rng.choice([".", "!", "?", ","]))
        else:
            letters = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 10)))
            lines.append(f"Repeat {letters}: {letters}. Reverse: {letters[::-1]}")
    for _ in range(400):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        tool = rng.choice(_TOOLS)
        args = json.dumps({"expression": f"{a}+{b}"} if tool == "calculator" else {"query": rng.choice(_WORDS)})
        lines.append(
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            f"<|im_start|>user\nWhat is {a} plus {b}?<|im_end|>\n"
            f'<|im_start|>assistant\n<tool_call>\n{{"name": "{tool}", "arguments": {args}}}\n</tool_call><|im_end|>\n'
            f"<|im_start|>user\n<tool_response>\n{a + b}\n</tool_response><|im_end|>\n"
            f"<|im_start|>assistant\nThe answer is {a + b}.<|im_end|>\n<|endoftext|>"
        )
    lines.append(" ".join(str(i) for i in range(0, 1000)))
    lines.append('{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}')
    return lines


def build_tokenizer():
    """Train the byte-level BPE tokenizer (deterministic); returns a ``tokenizers.Tokenizer``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tok


def build_tiny_model(out_dir: str | os.PathLike, seed: int = 0) -> str:
    """Write the ``tiny`` model (HF format: config, safetensors, tokenizer, chat template) to ``out_dir``.

    Deterministic: the same ``seed`` gives byte-identical files. Returns ``out_dir`` as a string.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}

    added_decoder = {}
    for t in SPECIAL_TOKENS + ADDED_TOKENS:
        added_decoder[str(tok.token_to_id(t))] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_decoder,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(
        out / "special_tokens_map.json",
        {
            "eos_token": "<|im_end|>",
            "pad_token": "<|pad|>",
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        },
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|pad|>"],
        dtype="float32",  # config.json below gets both spellings, for every transformers version
        **MODEL_CONFIG,
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    # Initialise explicitly from our own generator: independent of transformers' init order.
    std = MODEL_CONFIG["initializer_range"]
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}

    from safetensors.torch import save_file

    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_diff_dict()
    cfg.pop("transformers_version", None)  # keep the files independent of the installed version
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    cfg["dtype"] = cfg["torch_dtype"] = "float32"
    cfg["rope_theta"] = MODEL_CONFIG["rope_theta"]  # legacy key, for transformers < 5
    _write_json(out / "config.json", cfg)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|pad|>"],
        },
    )
    return str(out)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def recipe() -> dict[str, Any]:
    """Everything that determines the built files (hashed into the cache folder name)."""
    import hashlib

    return {
        "recipe": RECIPE_VERSION,
        # Any edit of this module gives a new cache folder: a stale build is never reused.
        "source": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "config": MODEL_CONFIG,
        "vocab": VOCAB_SIZE,
        "special": SPECIAL_TOKENS,
        "added": ADDED_TOKENS,
        "template": CHAT_TEMPLATE,
    }


__all__ = ["build_tiny_model", "build_tokenizer", "recipe", "RECIPE_VERSION", "MODEL_CONFIG"]
