"""Make the simulated engine speak a real model's vocabulary.

The sim engine draws token ids from ``rollout.sim.vocab_size``; when its outputs meet a real
tokenizer (a trainer decoding responses for rewards, the gateway returning text), the ids must be
ones the tokenizer can decode and the sim's EOS must be the model's. This reads both from the
model folder's ``config.json`` (no tokenizer or torch import) and returns an adjusted config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollfleet.config import RollfleetConfig, RolloutConfig, SimEngineConfig


def model_vocab(name_or_path: str) -> tuple[int, int | None]:
    """``(vocab_size, eos_token_id)`` of a built-in model name or a Hugging Face folder; a
    multimodal model's come from its ``text_config`` (Qwen2.5-VL, Gemma-3). What cannot be read
    is a ``ValueError`` naming ``rollout.model`` (a KeyError or FileNotFoundError was a traceback)."""
    from rollfleet.models import get_model_path

    path = Path(get_model_path(name_or_path)) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"rollout.model {name_or_path!r}: cannot read {path} ({exc})") from None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    vocab = cfg.get("vocab_size", text.get("vocab_size"))
    if not isinstance(vocab, int) or isinstance(vocab, bool):
        raise ValueError(f"rollout.model {name_or_path!r}: {path} gives no vocab_size (nor its text_config)")
    eos = cfg.get("eos_token_id", text.get("eos_token_id"))
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return vocab, eos


def fit_sim_to_model(config: RollfleetConfig) -> RollfleetConfig:
    """A copy of ``config`` whose sim engine uses ``rollout.model``'s vocabulary and EOS."""
    rollout = config.rollout
    if rollout.name != "sim":
        return config
    vocab, eos = model_vocab(rollout.model)
    update: dict[str, Any] = {"vocab_size": vocab}
    if eos is not None:
        update["eos_token_id"] = eos
    given = rollout.sim.model_fields_set
    differ = [
        f"rollout.sim.{k} ({getattr(rollout.sim, k)})"
        for k, v in update.items()
        if k in given and getattr(rollout.sim, k) != v
    ]
    if differ:
        raise ValueError(
            f"{', '.join(differ)} set, but the sim engine takes model {rollout.model!r}'s "
            f"({', '.join(f'{k} {v}' for k, v in update.items())}): leave them unset"
        )
    # validated as built (an EOS outside the vocabulary is refused), keeping what was set as set
    sim = SimEngineConfig.model_validate({**rollout.sim.model_dump(exclude_unset=True), **update})
    # the section validated again too: it keeps the sim engine's context equal to its own
    fitted = RolloutConfig.model_validate({**rollout.model_dump(exclude_unset=True), "sim": sim})
    return config.model_copy(update={"rollout": fitted})


__all__ = ["model_vocab", "fit_sim_to_model"]
