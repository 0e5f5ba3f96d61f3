"""Hermes/Qwen tool-call parsing: valid, malformed, several calls; never evaluated."""

from __future__ import annotations

import pytest

from rollfleet.tool_parser import get_tool_parser

pytestmark = pytest.mark.unit


def test_two_calls_and_content():
    parser = get_tool_parser("hermes")
    text = (
        'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'
    )
    parsed = parser.parse(text)
    assert parsed.content == "Let me check."
    assert [(c.name, c.arguments, c.id, c.error) for c in parsed.tool_calls] == [
        ("add", {"a": 1, "b": 2}, "call_0", None),
        ("search", {"q": "x"}, "call_1", None),
    ]


@pytest.mark.parametrize(
    "body, error",
    [
        ("{not json}", "not valid JSON"),
        ('{"arguments": {}}', '"name"'),
        ('{"name": "f", "arguments": [1, 2]}', "JSON object"),
        ('{"name": "f", "arguments": "{bad"}', "arguments are not valid JSON"),
        ('__import__("os").system("echo pwned")', "not valid JSON"),  # never evaluated
    ],
)
def test_malformed_calls_are_reported_not_dropped(body, error):
    parsed = get_tool_parser("qwen").parse(f"<tool_call>{body}</tool_call>")
    assert len(parsed.tool_calls) == 1
    assert error in parsed.tool_calls[0].error


def test_unclosed_call_is_not_a_call_and_unknown_format_lists_valid():
    assert get_tool_parser("hermes").parse('<tool_call>{"name": "f", "argu').tool_calls == []
    with pytest.raises(KeyError, match="hermes"):
        get_tool_parser("nope")


def test_a_call_whose_arguments_quote_the_closing_tag_is_one_valid_call():
    """The call ended at the tag inside its own string: a valid call answered as invalid JSON."""
    parser = get_tool_parser("hermes")
    code = '<tool_call>{"name": "py", "arguments": {"code": "print(\'</tool_call>\')"}}</tool_call>'
    parsed = parser.parse(f'Running it.\n{code}\n<tool_call>{{"name": "ls", "arguments": {{}}}}</tool_call> done')
    assert [(c.name, c.arguments, c.error) for c in parsed.tool_calls] == [
        ("py", {"code": "print('</tool_call>')"}, None),
        ("ls", {}, None),
    ]
    assert parsed.content == "Running it.\n\n done"
    # a malformed call still ends at its first closing tag, and the next call is its own
    bad = parser.parse('<tool_call>{oops</tool_call> then <tool_call>{"name": "ls", "arguments": {}}</tool_call>')
    assert [(c.name, c.error is None) for c in bad.tool_calls] == [("", False), ("ls", True)]
    assert bad.content == "then"


@pytest.fixture
def decoded(monkeypatch) -> list[int]:
    """Where the hermes parser starts each JSON decode, in order."""
    import json

    from rollfleet.tool_parser import hermes

    starts: list[int] = []

    class Counting(json.JSONDecoder):
        def raw_decode(self, s, idx=0):
            starts.append(idx)
            return super().raw_decode(s, idx)

    monkeypatch.setattr(hermes, "_DECODER", Counting())
    return starts


def test_each_call_is_decoded_once_however_many_closing_tags_follow(decoded):
    """Retrying the JSON at every later closing tag made malformed calls cost the rest of the text
    each: 800 of them, 1.7 s on the gateway's event loop."""
    text = "<tool_call>{oops</tool_call> " * 800
    parsed = get_tool_parser("hermes").parse(text)
    assert len(parsed.tool_calls) == 800 and all(c.error for c in parsed.tool_calls)
    assert len(decoded) == 800


def test_a_stray_opening_tag_before_a_call_does_not_swallow_it():
    """The model mentions the tag while it thinks: the body ran from that unclosed tag to the real
    call's closing one, invalid JSON, so the call was a bad call (tool_agent) or no call at all
    (the gateway answered plain text)."""
    text = (
        "<think>I should wrap the call in a <tool_call> tag.</think>\n\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    parsed = get_tool_parser("qwen3").parse(text)
    assert [(c.name, c.arguments, c.error) for c in parsed.tool_calls] == [("add", {"a": 1, "b": 2}, None)]
    assert "<tool_call> tag" in parsed.content  # the stray tag stays in the text
    two = get_tool_parser("hermes").parse('<tool_call> <tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert [c.name for c in two.tool_calls] == ["a"]
    quoting = (  # the call's own JSON quotes the tag: the next opening tag, not the last, starts it
        'Let me use <tool_call> now.\n<tool_call>\n{"name": "echo", "arguments": {"s": "say <tool_call> literally"}}\n'
        "</tool_call>"
    )
    parsed = get_tool_parser("hermes").parse(quoting)
    assert [(c.name, c.arguments, c.error) for c in parsed.tool_calls] == [
        ("echo", {"s": "say <tool_call> literally"}, None)
    ]


def test_a_run_of_stray_tags_is_tried_a_few_at_a_time_not_each(decoded):
    """Trying every stray tag as a call's start cost the text's length each (a failed decode works
    out its line and column): a reply of 32,000 repeated tags took 5.6 s on the gateway's loop."""
    from rollfleet.tool_parser import hermes

    text = "<tool_call>{" * 5000 + '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    parsed = get_tool_parser("hermes").parse(text)
    assert [c.name for c in parsed.tool_calls] == ["a"]  # the last tag starts it
    assert len(decoded) <= hermes._MAX_STRAY_TAGS + 2
