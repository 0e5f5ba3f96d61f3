"""Answer extraction for math-style prompts: ``\\boxed{...}``, GSM8K ``#### N``, or the last number.

Kept apart from the reward functions so a custom reward can reuse the extraction. Numbers are
compared as exact fractions (``0.5 == 1/2 == 0.50 == \\frac{1}{2}``), so float formatting never
flips a reward; thousands separators (``1,000``) are accepted. An answer that states more than one
number (``2^{10}``, ``3 or 4``) matches nothing: no rule here evaluates expressions.
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


_FRAC = re.compile(r"(\d?)\\[dt]?frac\{\s*(-?[\d.,]+)\s*\}\{\s*(-?[\d.,]+)\s*\}")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\{([^{}]*)\}")
_LATEX_SPACING = re.compile(r"\\[,;:! ]|\\left|\\right|\$")


def _plain(text: str) -> str:
    """LaTeX a final answer is written in, as plain text: ``\\frac{a}{b}`` (``\\dfrac``,
    ``\\tfrac``) as ``a/b``, ``\\text{...}`` as its words, spacing and ``$`` dropped. A fraction
    right after a digit (``1\\frac{1}{2}``) stays apart from it: two numbers, not ``11/2``."""
    text = _TEXT.sub(r" \1 ", text)
    text = _FRAC.sub(lambda m: f"{m[1]} {m[2]}/{m[3]}" if m[1] else f"{m[2]}/{m[3]}", text)
    return _LATEX_SPACING.sub(" ", text).replace("\\%", "%")


def parse_number(text: str) -> Optional[Fraction]:
    """The exact number an answer string states (``"1,000"``, ``"-2.50"``, ``"3/4"``, ``"$5"``,
    ``"\\frac{3}{4}"``, ``"18 apples"``), or None when it states none or more than one
    (``"2^{10}"``, ``"3 or 4"``): the last of several numbers is not the answer (``\\frac{3}{4}``
    read as 4 matched a ground truth of 4)."""
    found = _NUMBER.findall(_plain(str(text)))
    if len(found) != 1:
        return None
    try:
        return Fraction(found[0].replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


__all__ = ["extract_boxed", "extract_gsm8k", "extract_last_number", "extract_answer", "parse_number"]
