"""Answer extraction for math-style prompts: ``\\boxed{...}``, GSM8K ``#### N``, or the last number.

Kept apart from the reward functions so a custom reward can reuse the extraction. Numbers are
compared as exact fractions (``0.5 == 1/2 == 0.50``), so float formatting never flips a reward;
thousands separators (``1,000``) are accepted.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_GSM8K = re.compile(r"####\s*([^\n]+)")


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def extract_gsm8k(text: str) -> Optional[str]:
    """The answer after the last ``#### ``, or None."""
    found = _GSM8K.findall(text)
    return found[-1].strip() if found else None


def extract_last_number(text: str) -> Optional[str]:
    """The last number in ``text`` (integer, decimal or simple fraction), or None."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def extract_answer(text: str) -> Optional[str]:
    """The final answer: ``\\boxed{}`` wins, then ``#### ``, then the last number."""
    for extract in (extract_boxed, extract_gsm8k, extract_last_number):
        answer = extract(text)
        if answer is not None:
            return answer
    return None


def parse_number(text: str) -> Optional[Fraction]:
    """An exact number from an answer string (``"1,000"``, ``"-2.50"``, ``"3/4"``, ``"$5"``), or None."""
    found = _NUMBER.findall(str(text))
    if not found:
        return None
    raw = found[-1].replace(",", "")
    try:
        return Fraction(raw)
    except (ValueError, ZeroDivisionError):
        return None


__all__ = ["extract_boxed", "extract_gsm8k", "extract_last_number", "extract_answer", "parse_number"]
