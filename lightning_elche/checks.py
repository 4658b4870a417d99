"""Validation helpers shared by every user-facing argument: one wording, one notion of a number.

A bad value fails with ``<subject> is invalid: <what is allowed>.``, where the subject names the
knob and shows the value (``ElCheConfig.anchor=0``, ``ElCheStrategy(chunk_batches=0)``). Integer
knobs accept any integer type (``numpy.int64`` from a config file or a sweep) but not ``bool``;
real knobs accept any real number type but not ``bool``.
"""

from __future__ import annotations

import math
import numbers
import operator
from datetime import timedelta
from typing import Any, Optional


def invalid(subject: str, allowed: str) -> ValueError:
    """The error for a bad value: ``subject`` names the knob and shows the value."""
    return ValueError(f"{subject} is invalid: {allowed}.")


def as_int(value: Any) -> Optional[int]:
    """``value`` as a Python int if it is an integer of any type (not bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_real(value: Any) -> Optional[float]:
    """``value`` as a finite float if it is a real number of any type (not bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def is_number(value: Any) -> bool:
    """A real number of any type (not bool), finite or not."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def require_int(subject: str, value: Any, minimum: int, allowed: Optional[str] = None) -> int:
    """``value`` as an int >= ``minimum``, or :func:`invalid`."""
    number = as_int(value)
    if number is None or number < minimum:
        raise invalid(subject, allowed or f"expected an integer >= {minimum}")
    return number


def require_real(subject: str, value: Any, allowed: str = "expected a finite number") -> float:
    """``value`` as a finite float, or :func:`invalid`."""
    number = as_real(value)
    if number is None:
        raise invalid(subject, allowed)
    return number


def require_bool(subject: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise invalid(subject, "expected true or false")
    return value


def require_timedelta(subject: str, value: Any, minimum_s: float = 0.0) -> timedelta:
    """``value`` as a timedelta longer than ``minimum_s`` seconds, or :func:`invalid`."""
    if not isinstance(value, timedelta) or value.total_seconds() <= minimum_s:
        raise invalid(subject, "expected a positive timedelta" if minimum_s == 0 else
                      f"expected a timedelta longer than {minimum_s:g} s")
    return value
