"""The built-in verifiable rewards: exact match, numeric answer match, answer format.

Each returns 1.0 or 0.0 (``format`` takes a ``reward`` scale), so the reward of a GRPO group is
the fraction of correct samples. Partial credit is deliberately not built in: a shaped reward is a
modelling choice the user should write and register by name.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any, Optional

from rollfleet.reward.answers import extract_answer, extract_boxed, extract_gsm8k, parse_number


def _normalise(text: str) -> str:
    return " ".join(str(text).strip().lower().split()).rstrip(".")


def exact_match(solution_str: str, ground_truth: Any, *, extract: bool = False, **_: Any) -> float:
    """1.0 when the response (or, with ``extract=True``, its final answer) equals the ground truth
    up to case, surrounding blanks, runs of white space and a final full stop."""
    candidate = extract_answer(solution_str) if extract else solution_str
    if candidate is None:
        return 0.0
    truths = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    # no ground truth matches nothing (read as text, None would reward the answer "None")
    return float(any(t is not None and _normalise(candidate) == _normalise(t) for t in truths))


def numeric_match(solution_str: str, ground_truth: Any, **_: Any) -> dict[str, Any]:
    """1.0 when the final answer (``\\boxed{}``, ``#### ``, else the last number) equals the ground
    truth as a number (each read by :func:`~rollfleet.reward.answers.parse_number`: one number,
    LaTeX fractions included). The extracted answer is reported for debugging reward hacking."""
    answer = extract_answer(solution_str)
    truth = _truth_number(ground_truth)
    got = parse_number(answer) if answer is not None else None
    score = float(got is not None and truth is not None and got == truth)
    return {"score": score, "extracted_answer": answer}


def _truth_number(ground_truth: Any) -> Optional[Fraction]:
    """A ground truth as an exact number: a float by its shortest decimal (``str(1e-05)`` reads as
    two numbers, and ``Fraction(0.1)`` is not 1/10), an int as itself, text as an answer is read."""
    if isinstance(ground_truth, bool):
        return None
    if isinstance(ground_truth, int):
        return Fraction(ground_truth)
    if isinstance(ground_truth, float):
        return Fraction(repr(ground_truth)) if math.isfinite(ground_truth) else None
    return parse_number(str(ground_truth))


def answer_format(
    solution_str: str, ground_truth: Any = None, *, pattern: Optional[str] = None, reward: float = 1.0, **_: Any
) -> float:
    """``reward`` when the response states its final answer in the expected form: ``pattern`` (a
    regex, searched) when given, else a ``\\boxed{}`` or ``#### `` answer; 0.0 otherwise."""
    if pattern is not None:
        return reward if re.search(pattern, solution_str, flags=re.DOTALL) else 0.0
    ok = extract_boxed(solution_str) is not None or extract_gsm8k(solution_str) is not None
    return reward if ok else 0.0


__all__ = ["exact_match", "numeric_match", "answer_format"]
