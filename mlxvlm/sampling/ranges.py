"""The valid range of every numeric option, defined once for the command lines (as argparse
types) and the server (as pydantic constraints), so that both refuse the same values.

A ``Range`` checks one value: its kind (an ``int`` is not a ``float`` with no fraction,
and a ``bool`` is not an ``int``), that it is finite, and its bounds.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

# Token counts and ids end up in MLX int32 arrays; larger values cannot be meant.
INT32_MAX = 2**31 - 1
# OpenAI's seed is a signed 64-bit integer; MLX's generator takes it modulo 2**64.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# OpenAI's limit on alternatives per position; also bounds the work per token.
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Range:
    kind: type  # int or float
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is outside the range
    high_open: bool = False
    # Values outside the bounds that still mean something (e.g. -1 for "all").
    also: tuple = ()

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a number"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"{what} in {left}{_num(self.low)}, {_num(self.high)}{right}"
        elif self.low is not None:
            text = f"{what} {'>' if self.low_open else '>='} {_num(self.low)}"
        elif self.high is not None:
            text = f"{what} {'<' if self.high_open else '<='} {_num(self.high)}"
        else:
            text = f"a finite {what[2:].lstrip()}" if self.kind is float else what
        if self.also:
            text += " or " + " or ".join(_num(v) for v in self.also)
        return text

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is invalid ("must be ..."), or None when it is valid."""
        must = f"must be {self.describe()}, got {value!r}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return must
        if self.kind is int and not isinstance(value, int):
            return must
        if value in self.also:
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return must
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return must
        if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
            return must
        return None

    def pydantic(self) -> dict[str, Any]:
        """The bounds as ``pydantic.Field`` keywords (without ``also``)."""
        bounds: dict[str, Any] = {}
        if self.low is not None:
            bounds["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            bounds["lt" if self.high_open else "le"] = self.high
        if self.kind is float:
            bounds["allow_inf_nan"] = False
        return bounds

    def argtype(self) -> "RangeType":
        return RangeType(self)


class RangeType:
    """An argparse ``type``: parses the string as the range's kind and checks it."""

    def __init__(self, valid: Range):
        self.range = valid
        self.__name__ = valid.kind.__name__  # argparse names the type in its messages

    def __call__(self, text: str):
        try:
            value = self.range.kind(text)
        except ValueError:
            # argparse's own wording for a value that does not parse
            raise argparse.ArgumentTypeError(
                f"invalid {self.range.kind.__name__} value: {text!r}"
            ) from None
        if self.range.problem(value) is not None:
            raise argparse.ArgumentTypeError(f"must be {self.range.describe()}, got {text}")
        return value


def _num(value: float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def at_least(low: int, high: int = INT32_MAX) -> Range:
    return Range(int, low, high)


POSITIVE = Range(float, 0, None, low_open=True)  # finite and > 0
NON_NEGATIVE = Range(float, 0)
PORT = Range(int, 0, 65535)  # 0: any free port

# The sampling options, as every entry point takes them.
SAMPLING = {
    "max_tokens": at_least(1),
    # OpenAI's range; above 2 the distribution is close to uniform noise.
    "temperature": Range(float, 0, 2),
    "top_p": Range(float, 0, 1, low_open=True),
    # 0: off; bounded so that it fits MLX's integers (values >= the vocabulary mean off).
    "top_k": at_least(0),
    "min_p": Range(float, 0, 1),
    "repetition_penalty": POSITIVE,
    "repetition_context_size": at_least(1),
    "presence_penalty": Range(float, -2, 2),
    "frequency_penalty": Range(float, -2, 2),
    "logit_bias_value": Range(float, -100, 100),
    "seed": Range(int, INT64_MIN, INT64_MAX),
    "top_logprobs": Range(int, 0, MAX_TOP_LOGPROBS),
}


def check(name: str, value: Any, valid: Range | None = None) -> str | None:
    """``"name must be ..."`` when ``value`` is outside its range, else None."""
    problem = (valid or SAMPLING[name]).problem(value)
    return None if problem is None else f"{name} {problem}"
