"""Token-level conversation building: the delta of tool messages matches the full rendering."""

from __future__ import annotations

import pytest

from rollfleet.agent_loop.chat import ChatRenderer

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("num_results", [1, 2])
def test_delta_equals_full_render(tokenizer, num_results):
    chat = ChatRenderer(tokenizer)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    prompt = chat.prompt_ids(messages, TOOLS)
    call = {"name": "add", "arguments": {"a": 2, "b": 3}}
    assistant_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    model = chat.encode(assistant_text) + [tokenizer.eos_token_id]  # what the model emits
    results = [{"role": "tool", "content": str(5 + i)} for i in range(num_results)]
    delta = chat.delta_ids(results, TOOLS, last_token_id=model[-1])
    history = messages + [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}]
    full = chat.encode(chat.render(history + results, TOOLS, add_generation_prompt=True))
    assert prompt + model + delta == full
    assert tokenizer.decode(delta).startswith("\n<|im_start|>user\n<tool_response>")
    assert tokenizer.decode(delta).endswith("<|im_start|>assistant\n")


def test_boundary_when_model_did_not_stop_on_eos(tokenizer):
    chat = ChatRenderer(tokenizer)
    delta = chat.delta_ids([{"role": "tool", "content": "5"}], TOOLS, last_token_id=17)
    assert tokenizer.decode(delta).startswith("<|im_end|>\n<|im_start|>user")
