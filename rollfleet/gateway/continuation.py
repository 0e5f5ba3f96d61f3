"""The next turn's prompt ids, built from the ids of the last turn instead of re-rendered text.

Rendering a whole conversation again and tokenizing it gives ids that differ from what the engine
saw: the model's reply is re-encoded from its decoded text (BPE merges across boundaries, special
tokens, a tool call's JSON re-serialised by the template), so the logprobs a trainer holds belong
to ids that are no longer there ("retokenisation drift"). A turn whose messages extend the last
turn's messages with the reply the gateway returned is therefore built as::

    last prompt ids + the sampled ids of that reply + encode(the template's text after the reply)

The chat template still writes everything that is not the model's (turn markers, tool results,
the next generation prompt): it is rendered for the old and the new messages, and only the text
past the reply is tokenized. Whatever does not line up (an edited history, a reply this gateway
did not return, a template that rewrites earlier turns) is rendered from scratch as a new branch,
with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # pragma: no cover
    from rollfleet.gateway.codec import TextCodec
    from rollfleet.gateway.trajectories import SessionSnapshot, Turn


@dataclass
class Plan:
    """The prompt of a turn: ``reused`` ids carried over; ``new_branch`` says why not, if not."""

    prompt_ids: list[int]
    reused: int = 0
    chosen: Optional[int] = None
    new_branch: Optional[str] = None
    #: The session's last turn when this one was planned: the record forks there if another turn
    #: of the session was recorded meanwhile, and drops the turn if the session ended meanwhile.
    base: Optional["Turn"] = None


def plan_prompt(
    codec: "TextCodec",
    session: Optional["SessionSnapshot"],
    messages: list[dict[str, Any]],
    *,
    tools: Optional[list[dict[str, Any]]],
    template_kwargs: Optional[dict[str, Any]],
) -> Plan:
    """The prompt ids for ``messages`` (called off the event loop: it renders and tokenizes, so
    it reads a snapshot of the session taken on the loop, never the live session)."""

    def render(msgs: list[dict[str, Any]], generation_prompt: bool) -> str:
        return codec.render_chat_text(
            msgs, tools=tools, add_generation_prompt=generation_prompt, template_kwargs=template_kwargs
        )

    last = session.last_turn if session is not None else None

    def fresh(why: str) -> Plan:
        return Plan(codec.encode(render(messages, True), add_special_tokens=False), new_branch=why, base=last)

    if session is None or last is None:
        return fresh("first turn")
    previous = session.messages
    k = len(previous)
    for i, (was, now) in enumerate(zip(previous, messages)):
        if _canonical(was) != _canonical(now):
            return fresh(f"history edited: messages[{i}] differs from the session's earlier turn")
    if len(messages) <= k or messages[k].get("role") != "assistant":
        return fresh(f"messages[{k}] is not the assistant reply to the session's last turn")
    if _canonical(tools) != _canonical(session.tools):
        return fresh("the tools changed")
    if _canonical(template_kwargs or None) != _canonical(session.template_kwargs or None):
        return fresh("the chat template kwargs changed")  # the history was rendered with the old ones
    chosen = next((j for j, c in enumerate(last.choices) if same_reply(messages[k], c.message)), None)
    if chosen is None:
        return fresh(f"messages[{k}] is not a reply this gateway returned for the session's last turn")
    before, head, full = render(previous, True), render(messages[: k + 1], False), render(messages, True)
    eos = codec.eos_text
    if eos is None or not head.startswith(before) or not full.startswith(head):
        return fresh("the chat template rewrites earlier turns")
    reply = head[len(before) :]  # the reply as the template writes it, up to the next turn
    if reply.count(eos) > 1:  # which one the template wrote after it cannot be told
        return fresh(f"messages[{k}] holds the end-of-turn marker's text ({eos!r})")
    at = reply.find(eos)
    if at < 0:
        return fresh("the chat template does not end the reply with the end-of-turn token")
    sampled = last.choices[chosen].token_ids
    ended = bool(sampled) and sampled[-1] == codec.eos_token_id
    tail = reply[at + len(eos) :] if ended else reply[at:]  # the end-of-turn token, unless sampled
    new = codec.encode(tail + full[len(head) :], add_special_tokens=False)
    carried = last.prompt_ids + sampled
    return Plan(carried + new, reused=len(carried), chosen=chosen, base=last)


def same_reply(sent: dict[str, Any], returned: dict[str, Any]) -> bool:
    """Whether the caller's assistant message is the reply the gateway returned: same text and
    the same calls (names and arguments as JSON values; call ids and key order do not matter)."""
    if (sent.get("content") or "").strip() != (returned.get("content") or "").strip():
        return False
    return _calls(sent.get("tool_calls")) == _calls(returned.get("tool_calls"))


def _calls(calls: Any) -> list[tuple[Any, str]]:
    out = []
    for call in calls or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        args = function.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append((function.get("name"), json.dumps(args, sort_keys=True)))
    return out


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


__all__ = ["Plan", "plan_prompt", "same_reply"]
