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


def test_a_template_that_renders_the_last_assistant_message_apart_extends_by_its_later_rendering(tokenizer):
    """Qwen3's template adds an empty think block to the last assistant message only: the base
    rendered alone (its assistant message last) was no prefix of the base followed by a tool
    message, and every tool round failed with ChatTemplateError."""
    import copy

    qwen3_like = copy.copy(tokenizer)
    qwen3_like.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
        "{% if m['role'] == 'tool' %}<tool_response>\n{{ m['content'] }}\n</tool_response>"
        "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = ChatRenderer(qwen3_like)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    prompt = chat.prompt_ids(messages)
    model = chat.encode("<think>\n\n</think>\n\ncall add") + [tokenizer.eos_token_id]
    result = [{"role": "tool", "content": "5"}]
    delta = chat.delta_ids(result, last_token_id=model[-1])
    history = [*messages, {"role": "assistant", "content": "call add"}, *result]
    rendered = chat.render(history, add_generation_prompt=True)
    assert tokenizer.decode(delta) == rendered[rendered.index("<|im_end|>", rendered.index("call add")) + 10 :]
    assert tokenizer.decode(prompt + model + delta).endswith("<|im_start|>assistant\n")
