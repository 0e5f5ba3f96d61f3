"""The built-in tiny model's weights as a state dict (tests that push weights to real vLLM)."""

from __future__ import annotations

import glob


def tiny_state_dict() -> dict:
    from safetensors.torch import load_file

    from rollfleet.models import get_model_path

    state = {}
    for f in glob.glob(f"{get_model_path('tiny')}/*.safetensors"):
        state.update(load_file(f))
    return state
