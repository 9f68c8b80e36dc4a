"""Shape bucketing: round sizes up to a few distinct values, so each compiled shape is reused."""

from __future__ import annotations


def next_pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two that is ``>= n`` and ``>= minimum``."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers."""
    return -(-a // b)
