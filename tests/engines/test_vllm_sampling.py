"""The fleet's sampling keys reach vLLM under vLLM's names. Its ``SamplingParams`` ignores a key it
does not know, so SGLang's names (which the replica accepts, and the SGLang engine maps) were
dropped on vLLM without a word: a seed, a minimum length, a JSON constraint."""

from __future__ import annotations

import pytest

from rollfleet.engines.vllm.wire import completion_body, generate_body
from rollfleet.errors import InvalidRequest

pytestmark = pytest.mark.unit

SGLANG_NAMES = {"max_new_tokens": 8, "min_new_tokens": 2, "sampling_seed": 7, "temperature": 0.5}


@pytest.mark.parametrize("build", ["generate", "completion"])
def test_sglang_names_arrive_as_vllms(build):
    params = {**SGLANG_NAMES, "json_schema": '{"type": "object"}'}
    if build == "generate":
        sent = generate_body([1, 2, 3], params, 64)[0]["sampling_params"]
    else:
        sent = completion_body("tiny", [1, 2, 3], params, 64)[0]
    assert sent["min_tokens"] == 2 and sent["seed"] == 7 and sent["max_tokens"] == 8
    assert sent["structured_outputs"] == {"json": '{"type": "object"}'}
    assert not {"min_new_tokens", "sampling_seed", "json_schema", "max_new_tokens"} & set(sent)


@pytest.mark.parametrize(
    "params, field",
    [
        ({"stop_regex": ["x+"]}, "sampling_params.stop_regex"),  # SGLang's alone
        ({"custom_params": {"a": 1}}, "sampling_params.custom_params"),
        ({"seed": 1, "sampling_seed": 2}, "sampling_params.sampling_seed"),  # two seeds that differ
        ({"regex": "a+", "ebnf": "root ::= 'a'"}, "sampling_params.ebnf"),  # two constraints
    ],
)
def test_what_vllm_cannot_honour_is_refused_naming_it(params, field):
    with pytest.raises(InvalidRequest) as err:
        generate_body([1, 2, 3], {"max_tokens": 4, **params}, 64)
    assert err.value.field == field


def test_vllm_names_pass_as_they_are():
    params = {"max_tokens": 4, "min_tokens": 1, "seed": 3, "structured_outputs": {"regex": "a+"}, "top_k": 5}
    sent = generate_body([1], params, 64)[0]["sampling_params"]
    assert {k: sent[k] for k in ("min_tokens", "seed", "structured_outputs", "top_k")} == {
        "min_tokens": 1,
        "seed": 3,
        "structured_outputs": {"regex": "a+"},
        "top_k": 5,
    }


@pytest.mark.parametrize("build", ["generate", "completion"])
def test_a_structural_tag_constrains_through_structured_outputs(build):
    """vLLM's SamplingParams has no structural_tag of its own: sent as it was, it was dropped."""
    params = {"max_tokens": 4, "structural_tag": '{"type": "structural_tag"}'}
    if build == "generate":
        sent = generate_body([1, 2, 3], params, 64)[0]["sampling_params"]
    else:
        sent = completion_body("tiny", [1, 2, 3], params, 64)[0]
    assert sent["structured_outputs"] == {"structural_tag": '{"type": "structural_tag"}'}
    assert "structural_tag" not in sent


def test_prompt_truncation_is_refused_on_the_generate_route_which_would_ignore_it():
    with pytest.raises(InvalidRequest) as err:
        generate_body([1, 2, 3], {"max_tokens": 4, "truncate_prompt_tokens": 2}, 64)
    assert err.value.field == "sampling_params.truncate_prompt_tokens"
    # /v1/completions takes it as a request field
    assert (
        completion_body("tiny", [1, 2, 3], {"max_tokens": 4, "truncate_prompt_tokens": 2}, 64)[0][
            "truncate_prompt_tokens"
        ]
        == 2
    )
