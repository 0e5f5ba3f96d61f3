"""In-process pieces of the gateway: tokenizer codec, sampling translation, error mapping, sim fit."""

from __future__ import annotations

import random
from typing import Any

import pytest
from gateway_support import load_codec, stack_config

from rollfleet.errors import InvalidRequest, NoServerAvailable, RetriesExhausted
from rollfleet.gateway import TextCodec, fit_sim_to_tokenizer, protocol
from rollfleet.gateway.codec import IncrementalDecoder
from rollfleet.gateway.errors import GatewayError, from_exception
from rollfleet.gateway.protocol import ChatCompletionRequest, CompletionRequest
from rollfleet.gateway.sampling import choice_params, field_mapper, sampling_params, token_budget

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return load_codec()


def test_codec_matches_the_tokenizer(codec):
    tok = codec.tokenizer
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(codec.vocab_size) for _ in range(rng.randrange(1, 60))]
        text = tok.decode(ids, skip_special_tokens=True)
        assert codec.decode(ids) == text
        assert codec.encode(text) == tok.encode(text)
        pieces = list(codec.pieces(ids, 3))
        assert "".join(p for p, _, _ in pieces) == text
        assert pieces[0][1] == 0 and pieces[-1][2] == len(ids)
        assert all(a[2] == b[1] for a, b in zip(pieces, pieces[1:]))  # contiguous token ranges
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    expected = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert codec.render_chat(messages, tools=tools) == tok.encode(expected, add_special_tokens=False)


def test_incremental_decoder_adds_up_holds_split_characters_and_decodes_a_window_per_step(codec):
    rng = random.Random(1)
    text = "Grüße, 世界! 🤖 emoji and ünïcödé: " * 40
    samples = [codec.encode(text, add_special_tokens=False)]
    samples += [[rng.randrange(codec.vocab_size) for _ in range(rng.randrange(1, 300))] for _ in range(100)]
    decoded = [0]  # ids decoded, all calls together

    def counting(window):
        decoded[0] += len(window)
        return codec.decode(window)

    for ids in samples:
        decoded[0] = 0
        decoder = IncrementalDecoder(codec)
        decoder._decode = counting
        pieces, i = [], 0
        while i < len(ids):
            step = rng.randrange(1, 4)
            pieces.append(decoder.push(ids[i : i + step]))
            i += step
        streamed = decoded[0]  # before the one whole decode of finish()
        pieces.append(decoder.finish())
        assert "".join(pieces) == codec.decode(ids)
        if ids is samples[0]:
            assert "".join(pieces) == text
            assert not any(p.endswith("\ufffd") for p in pieces)  # a split character waits, whole
        assert streamed <= 8 * len(ids)  # a window per step; decoding every prefix costs ~n^2/2


def test_incremental_decoder_streams_bytes_that_never_make_a_character(codec):
    """An untrained model may repeat one lone byte token (CI saw 400 of them held to the end): each
    is U+FFFD for good, so the text goes out three writing tokens behind, and still adds up; mixed
    with real characters split into their bytes, nothing is sent that a later byte would change."""
    lone = next(i for i in range(codec.vocab_size) if codec.decode([i]) == "\ufffd")
    decoder = IncrementalDecoder(codec)
    pieces = [decoder.push([lone]) for _ in range(50)]
    assert "".join(pieces) == "\ufffd" * 47 and all(pieces[3:])
    assert decoder.finish() == "\ufffd" * 3
    rng = random.Random(2)
    chars = codec.encode("é世🤖a", add_special_tokens=False) + [lone] * 4
    for _ in range(200):
        ids = [rng.choice(chars) for _ in range(rng.randrange(1, 80))]
        decoder = IncrementalDecoder(codec)
        sent = [decoder.push([i]) for i in ids]
        assert all(codec.decode(ids).startswith("".join(sent[: k + 1])) for k in range(len(ids)))
        assert "".join(sent) + decoder.finish() == codec.decode(ids)


def test_tool_call_stream_shows_text_up_to_the_marker_even_split_across_pieces():
    from rollfleet.gateway.toolcalls import ToolCallFormatter

    stream = ToolCallFormatter("hermes").stream()
    assert stream is not None
    shown = [
        stream.push(p) for p in ["Sure", ", <to", "ol", "_c", 'all>\n{"name": "f", ', '"arguments": {}}\n</tool_call>']
    ]
    assert shown == ["Sure", ", ", "", "", "", ""]  # "<to..." waits: it may open a call, and it does
    rest, message, calls = stream.finish()
    assert (rest, calls, message["tool_calls"][0]["function"]["name"]) == ("", True, "f")
    plain = ToolCallFormatter("hermes").stream()
    assert plain is not None
    assert [plain.push(p) for p in ["a <", "b> c <tool", "box"]] == ["a ", "<b> c ", "<toolbox"]
    broken = ToolCallFormatter("hermes").stream()
    assert broken is not None
    assert broken.push("x <tool_call>{not json</tool_call>") == "x "
    assert broken.finish()[:2] == ("<tool_call>{not json</tool_call>", {"role": "assistant", "content": "x <tool_call>{not json</tool_call>"})  # fmt: skip
    # Text after the calls is shown at the end, and the message says exactly what was shown:
    # the caller's next turn, built from what it saw, must match the recorded reply.
    text = 'Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> I will wait.'
    tail = ToolCallFormatter("hermes").stream()
    assert tail is not None
    shown_text = "".join(tail.push(ch) for ch in text)
    rest, message, calls = tail.finish()
    assert (shown_text, rest, calls) == ("Sure.", " I will wait.", True)
    assert (
        message["content"] == shown_text + rest == ToolCallFormatter("hermes").message(text, parse=True)[0]["content"]
    )
    # a reply that begins with whitespace: the text after its call was lost (the parsed content is stripped)
    spaced = ToolCallFormatter("hermes").stream()
    assert spaced is not None
    shown_text = "".join(
        spaced.push(ch) for ch in '\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\nI called a.'
    )
    rest, message, calls = spaced.finish()
    assert calls and (shown_text + rest).endswith("I called a.") and message["content"] == shown_text + rest


def test_codec_stop_strings(codec):
    assert codec.stop_token_ids(["<|im_end|>"]) == [codec.eos_token_id]
    with pytest.raises(GatewayError) as err:
        codec.stop_token_ids(["<|im_end|>", "two separate words"])
    assert err.value.param == "stop[1]"


def test_json_null_means_the_default_as_openai_marks_those_fields_nullable():
    # what the openai client sends for a parameter given as None (n=None, stream=None, ...)
    chat = ChatCompletionRequest.model_validate_json(
        '{"model": "m", "messages": [{"role": "user", "content": "hi", "name": null}], "n": null, "stream": null,'
        ' "logprobs": null, "add_generation_prompt": null, "ignore_eos": null, "stream_options": null}'
    )
    assert (chat.n, chat.stream, chat.logprobs, chat.add_generation_prompt, chat.ignore_eos) == (
        1,
        False,
        False,
        True,
        False,
    )
    done = CompletionRequest.model_validate_json(
        '{"model": "m", "prompt": "x", "echo": null, "return_token_ids": null}'
    )
    assert (done.echo, done.return_token_ids, done.n) == (False, False, 1)
    with pytest.raises(ValueError, match="prompt"):  # a required field given null is still missing
        CompletionRequest.model_validate_json('{"model": "m", "prompt": null}')


def test_a_body_field_the_gateway_ignores_is_logged_once_by_name(caplog, monkeypatch):
    # as vLLM's server: unknown fields are ignored (frameworks send their own), but a misspelled
    # `temprature` must show up somewhere, and once, not on every request
    monkeypatch.setattr(protocol, "_IGNORED_LOGGED", set())
    body = '{"model": "m", "prompt": "x", "temprature": 0.5, "echo": false}'
    with caplog.at_level("WARNING", logger="rollfleet.gateway.protocol"):
        for _ in range(3):
            assert CompletionRequest.model_validate_json(body).temperature is None
    said = [r.getMessage() for r in caplog.records if "temprature" in r.getMessage()]
    assert len(said) == 1 and "CompletionRequest" in said[0]
    assert not any("echo" in r.getMessage() for r in caplog.records)
    from rollfleet.gateway.protocol import ProfileRequest

    ProfileRequest.model_validate({"trace_dir": "/tmp/t"})  # takes any field: none is ignored, none logged
    assert not any("trace_dir" in r.getMessage() for r in caplog.records)


def test_budget_and_sampling_params(codec):
    assert token_budget(None, 10, max_model_len=512, default=64, prompt_param="prompt", budget_param="max_tokens") == 64
    assert (
        token_budget(None, 480, max_model_len=512, default=64, prompt_param="prompt", budget_param="max_tokens") == 32
    )
    with pytest.raises(GatewayError) as err:
        token_budget(None, 512, max_model_len=512, default=64, prompt_param="messages", budget_param="max_tokens")
    assert err.value.param == "messages" and err.value.code == "context_length_exceeded"
    with pytest.raises(GatewayError) as err:
        token_budget(
            100, 480, max_model_len=512, default=64, prompt_param="prompt", budget_param="max_completion_tokens"
        )
    assert err.value.param == "max_completion_tokens"
    req = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "temperature": 0.5, "stop": "<|im_end|>", "seed": 3}
    )
    assert sampling_params(req, 7, codec) == {
        "max_tokens": 7,
        "temperature": 0.5,
        "seed": 3,
        "stop_token_ids": [codec.eos_token_id],
    }


def test_fields_that_change_sampling_are_taken_or_refused_never_dropped(codec):
    """``logit_bias`` was dropped without a word (a ban of -100 sampled unbiased); ``best_of`` other
    than ``n``, and ``top_logprobs`` without ``logprobs``, were taken as if not given."""

    def params(**fields: Any) -> dict[str, Any]:
        return sampling_params(CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields}), 7, codec)

    assert params(logit_bias={"5": -100, "7": 2.5})["logit_bias"] == {"5": -100.0, "7": 2.5}
    for bias, param in (({"x": 1}, "logit_bias.x"), ({"5": 101}, "logit_bias.5"), ({"999999": 1}, "logit_bias.999999")):
        with pytest.raises(GatewayError) as err:
            params(logit_bias=bias)
        assert err.value.param == param, bias
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "best_of": 2, "n": 2}).best_of == 2
    with pytest.raises(ValueError, match="best_of"):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "best_of": 5})
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    with pytest.raises(ValueError, match="top_logprobs"):
        ChatCompletionRequest.model_validate(chat)
    assert ChatCompletionRequest.model_validate({**chat, "logprobs": True}).top_logprobs == 2
    # the seed of choice i is seed + i, inside what torch.Generator.manual_seed takes
    assert choice_params({"seed": 2**64 - 1}, 1)["seed"] == 0 and choice_params({"seed": 5}, 2)["seed"] == 7


def test_output_constraints_become_structured_outputs_and_bad_ones_name_the_field(codec):
    def params(**fields):
        return sampling_params(CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields}), 7, codec)

    assert "structured_outputs" not in params(response_format={"type": "text"})
    assert params(structured_outputs={"regex": "[ab]+", "disable_any_whitespace": True})["structured_outputs"] == {
        "regex": "[ab]+",
        "disable_any_whitespace": True,
    }
    assert params(response_format={"type": "json_object"})["structured_outputs"] == {"json_object": True}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    assert params(response_format=fmt)["structured_outputs"] == {"json": schema}
    bad = [
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {}}, "structured_outputs", "given: none"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", "one of json"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format", "not both"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}}, "response_format.json_schema.schema", "required"),
    ]  # fmt: skip
    for fields, param, words in bad:
        with pytest.raises(GatewayError) as err:
            params(**fields)
        assert err.value.param == param and words in err.value.message, (fields, err.value.message)


def test_fleet_errors_map_to_status_and_caller_fields():
    fields = field_mapper("messages", "max_completion_tokens")
    err = from_exception(InvalidRequest("sampling_params.max_tokens", "max_tokens >= 1", 0), fields)
    assert (err.status, err.param) == (400, "max_completion_tokens")
    assert from_exception(InvalidRequest("prompt_ids[3]", "id < vocab", 10**6), fields).param == "messages"
    tokens = field_mapper("prompt_token_ids", keep_prompt_index=True)
    assert from_exception(InvalidRequest("prompt_ids[3]", "id < vocab", 10**6), tokens).param == "prompt_token_ids[3]"
    assert from_exception(InvalidRequest("sampling_params.top_k", "x", -5), tokens).param == "top_k"
    assert from_exception(NoServerAvailable()).status == 503
    assert from_exception(RetriesExhausted("r", 3, NoServerAvailable())).status == 503
    assert from_exception(RetriesExhausted("r", 3, TimeoutError())).status == 504
    assert from_exception(TimeoutError()).status == 504
    assert from_exception(RuntimeError("boom")).status == 500


def test_sim_vocabulary_follows_the_tokenizer(codec):
    config = stack_config()
    fitted = fit_sim_to_tokenizer(config, codec)
    assert fitted.rollout.sim.vocab_size == codec.vocab_size == len(codec.tokenizer)
    assert fitted.rollout.sim.eos_token_id == codec.eos_token_id
    assert config.rollout.sim.vocab_size == 32000  # the original is untouched
    vllm = config.model_copy(update={"rollout": config.rollout.model_copy(update={"name": "vllm"})})
    assert fit_sim_to_tokenizer(vllm, codec) is vllm


async def test_a_live_stream_records_its_turn_before_it_says_done(codec):
    """A caller that hangs up on [DONE], or sends its next turn the moment it reads it, must find
    this turn recorded: the record ran after [DONE] was sent."""
    from rollfleet.gateway.live import live_events
    from rollfleet.gateway.responses import SSE_DONE
    from rollfleet.types import TokenOutput

    async def no_more() -> Any:
        return
        yield

    recorded: list[int] = []
    events = live_events(
        "chat",
        "m",
        codec,
        [TokenOutput(token_ids=codec.encode("hi", add_special_tokens=False), stop_reason="stop")],
        [no_more()],
        [1, 2],
        logprobs=False,
        return_token_ids=False,
        include_usage=True,
        on_done=lambda outputs, replies: recorded.append(len(outputs)),
    )
    async for event in events:
        if event == SSE_DONE:
            assert recorded == [1]
            break
    else:
        raise AssertionError("no [DONE]")
    await events.aclose()  # type: ignore[attr-defined]


def test_a_gateway_address_that_cannot_be_bound_names_the_setting():
    import socket

    from rollfleet.errors import CannotListen
    from rollfleet.gateway.server import check_can_listen

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CannotListen) as err:
            check_can_listen("127.0.0.1", port)
    assert err.value.field == "gateway.port" and f"127.0.0.1:{port}" in str(err.value)
    with pytest.raises(CannotListen) as err:
        check_can_listen("192.0.2.1", 8000)  # TEST-NET-1: no interface of this host has it
    assert err.value.field == "gateway.host"
    check_can_listen("127.0.0.1", 0)  # any free port: never refused


async def test_alternatives_the_fleet_does_not_return_are_refused_naming_the_field():
    """top_logprobs=5 answered ``[]`` for every token and completions' logprobs=5 ``null``: a
    caller reading alternatives (an entropy, a verifier) got none, and no error."""
    import httpx
    from gateway_support import in_process_gateway

    from rollfleet.config import GatewayConfig

    server, _, replica = await in_process_gateway(
        GatewayConfig(), response_length=16, time_scale=100.0, mean_response_tokens=8
    )
    http = httpx.AsyncClient(base_url=server.url, timeout=30)
    try:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True}
        bad = await http.post("/v1/chat/completions", json={**chat, "top_logprobs": 5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"
        assert (await http.post("/v1/chat/completions", json={**chat, "top_logprobs": 0})).status_code == 200
        done = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
        bad = await http.post("/v1/completions", json={**done, "logprobs": 5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"
        ok = await http.post("/v1/completions", json={**done, "logprobs": 0})
        assert ok.status_code == 200 and ok.json()["choices"][0]["logprobs"]["token_logprobs"]
    finally:
        await http.aclose()
        await server.stop()
        await replica.shutdown()


def test_a_replayed_chat_stream_that_calls_tools_carries_its_token_ids_and_logprobs(codec):
    """A replayed stream (a tool-call format without a call marker) sent the calls in one delta and
    no content chunks: those were the only ones with token ids and logprobs, so the stream had
    none of either, where the whole answer has every one."""
    from rollfleet.gateway import responses
    from rollfleet.types import TokenOutput

    ids = codec.encode('<tool_call>{"name":"f","arguments":{}}</tool_call>', add_special_tokens=False)
    out = TokenOutput(token_ids=ids, log_probs=[-0.1] * len(ids), stop_reason="stop", token_versions=[0] * len(ids))
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    reply = ({"role": "assistant", "content": None, "tool_calls": [call]}, True)
    events = list(responses.chat_chunks("m", codec, [out], [1, 2, 3], chunk_tokens=4, logprobs=True,
                                        return_token_ids=True, include_usage=False, replies=[reply]))  # fmt: skip
    choices = [c for e in events for c in e["choices"]]
    assert [t for c in choices for t in c.get("token_ids") or []] == ids
    assert sum(len(c["logprobs"]["content"]) for c in choices if c.get("logprobs")) == len(ids)
    assert not any(c["delta"].get("content") for c in choices if "token_ids" in c)  # the text is the calls'
