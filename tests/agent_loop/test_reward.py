"""Verifiable rewards: answer extraction, matching, the registry."""

from __future__ import annotations

import pytest

from rollfleet.reward import (
    compute_reward,
    extract_answer,
    get_reward_fn,
    list_rewards,
    numeric_match,
    register_reward,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so the result is \\boxed{\\frac{1}{2}} and 7", "\\frac{1}{2}"),
        ("first 3 then \\boxed{42}", "42"),
        ("work...\n#### 1,234", "1,234"),
        ("the answer is 12, not 13.", "13"),
        ("no numbers here", None),
        ("-3.5 degrees", "-3.5"),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    "text, truth, score",
    [
        ("The answer is 5.", "5", 1.0),
        ("\\boxed{0.50}", "1/2", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("I think 4, wait, 6", "4", 0.0),
        ("nothing", "4", 0.0),
        ("3,4", "34", 0.0),  # a list of numbers is not a thousands separator
        # LaTeX answers: the last number inside one is not its value (each of these scored wrongly)
        ("so \\boxed{\\frac{3}{4}}", "4", 0.0),
        ("\\boxed{2^{10}}", "10", 0.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "1/2", 1.0),
        ("\\boxed{-\\tfrac{14}{3}}", "\\frac{-14}{3}", 1.0),
        ("\\boxed{1\\frac{1}{2}}", "11/2", 0.0),  # a mixed number is no number we read
        ("\\boxed{5\\text{ cm}}", "$5", 1.0),
        # a ground truth stored as a number: str(1e-05) read as two numbers, and matched nothing
        ("\\boxed{0.00001}", 1e-5, 1.0),
        ("\\boxed{10000000000000000}", 1e16, 1.0),
        ("\\boxed{0.1}", 0.1, 1.0),
        ("\\boxed{12}", 12, 1.0),
        ("\\boxed{1}", True, 0.0),
    ],
)
def test_numeric_match(text, truth, score):
    assert numeric_match(text, truth)["score"] == score


def test_builtins_and_spec():
    assert {"exact_match", "numeric_match", "math", "format"} <= set(list_rewards())
    assert compute_reward("  Paris. ", {"name": "exact_match", "ground_truth": "paris"}).score == 1.0
    assert compute_reward("The capital is Paris", {"name": "exact_match", "ground_truth": "paris"}).score == 0.0
    assert compute_reward("None", {"name": "exact_match"}).score == 0.0  # no ground truth: no match
    assert compute_reward("x \\boxed{3}", {"name": "format"}).score == 1.0
    assert compute_reward("x 3", {"name": "format"}).score == 0.0
    assert compute_reward("ANSWER: yes", {"name": "format", "pattern": r"ANSWER: \w+", "reward": 0.5}).score == 0.5
    assert compute_reward("7", {"ground_truth": "7"}, default="math").score == 1.0
    assert compute_reward("7", {"ground_truth": "7"}) is None  # no name, no default: no score
    assert compute_reward("7", None) is None
    info = compute_reward("so 7", {"name": "math", "ground_truth": "7"}).info
    assert info == {"extracted_answer": "7"}


def test_registry_error_lists_names_and_custom_rewards():
    with pytest.raises(KeyError, match="numeric_match"):
        get_reward_fn("nope")

    @register_reward("length_penalty_test")
    def length_penalty(solution_str, ground_truth, *, per_char=0.1, **_):
        return -per_char * len(solution_str)

    assert compute_reward("abc", {"name": "length_penalty_test", "per_char": 1.0}).score == -3.0
    assert get_reward_fn("rollfleet.reward.rules:exact_match") is not None
