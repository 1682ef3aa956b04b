"""Shamir t-out-of-n secret sharing (Shamir 1979) over the prime field GF(2^521 - 1).

Used to share each client's 32-byte self-mask seed and its 32-byte X25519 mask key, so the server can remove the
masks of clients that drop out once at least ``threshold`` share holders answer, and learns nothing from fewer.
Coefficients come from ``secrets``; the x-coordinate of a holder is its (positive integer) client id.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping

__all__ = ["PRIME", "SHARE_BYTES", "split", "combine", "bytes_to_int", "int_to_bytes"]

PRIME = 2 ** 521 - 1  # a Mersenne prime, larger than any 32-byte secret
SHARE_BYTES = (PRIME.bit_length() + 7) // 8  # 66


def bytes_to_int(secret: bytes) -> int:
    value = int.from_bytes(secret, "big")
    if value >= PRIME:
        raise ValueError("secret does not fit in the field")
    return value


def int_to_bytes(value: int, length: int) -> bytes:
    if not 0 <= value < 256 ** length:
        raise ValueError(f"reconstructed value does not fit in {length} bytes: the shares are inconsistent")
    return value.to_bytes(length, "big")


def _check_x(x: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not 0 < x < PRIME:
        raise ValueError(f"share x-coordinates must be integers in [1, p), got {x!r}")
    return x


def split(secret: int | bytes, threshold: int, holders: Iterable[int]) -> dict[int, int]:
    """Shares ``{x: f(x)}`` of a random polynomial f of degree threshold - 1 with f(0) = secret."""
    if isinstance(secret, (bytes, bytearray)):
        secret = bytes_to_int(bytes(secret))
    if isinstance(secret, bool) or not isinstance(secret, int) or not 0 <= secret < PRIME:
        raise ValueError("secret must be bytes or an integer in [0, p)")
    xs = [_check_x(x) for x in holders]
    if len(set(xs)) != len(xs):
        raise ValueError("share holders must be distinct")
    if isinstance(threshold, bool) or not isinstance(threshold, int) or not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold must be an integer in [1, {len(xs)}] (the number of holders), got {threshold!r}")
    coefficients = [secret] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for x in xs:
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % PRIME
        shares[x] = y
    return shares


def _lagrange_at(points: list[tuple[int, int]], at: int) -> int:
    total = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                num = num * (at - xj) % PRIME
                den = den * (xi - xj) % PRIME
        total = (total + yi * num * pow(den, -1, PRIME)) % PRIME
    return total


def combine(shares: Mapping[int, int] | Iterable[tuple[int, int]], threshold: int) -> int:
    """Reconstruct f(0) from at least ``threshold`` shares.

    The polynomial is interpolated through ``threshold`` shares; every extra share must lie on it, otherwise a share was
    corrupted and ``ValueError`` is raised instead of returning a wrong secret.
    """
    items = list(shares.items()) if isinstance(shares, Mapping) else [tuple(s) for s in shares]
    points: dict[int, int] = {}
    for x, y in items:
        _check_x(x)
        if isinstance(y, bool) or not isinstance(y, int) or not 0 <= y < PRIME:
            raise ValueError("share values must be integers in [0, p)")
        if x in points and points[x] != y:
            raise ValueError(f"two different shares for x={x}")
        points[x] = y
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise ValueError(f"threshold must be a positive integer, got {threshold!r}")
    if len(points) < threshold:
        raise ValueError(f"need {threshold} distinct shares to reconstruct, got {len(points)}")
    ordered = sorted(points.items())
    base, extra = ordered[:threshold], ordered[threshold:]
    for x, y in extra:
        if _lagrange_at(base, x) != y:
            raise ValueError("shares are inconsistent: at least one was corrupted")
    return _lagrange_at(base, 0)
