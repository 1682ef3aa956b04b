"""Clipping, and the L2 sensitivity that a clip guarantees.

A clip is what makes a declared sensitivity true. Each function returns what it clipped together with the
sensitivity of the statistic the caller will release, under an explicit adjacency:

- ``add_remove``: neighbouring data sets differ by adding or removing one unit (record or client);
- ``replace_one``: they differ by replacing one unit.

Clip to norm C, then:
- a sum of clipped units moves by C (add/remove) or 2C (replace one);
- a sum of squares ``g (.) g`` or of outer products ``phi phi^T`` moves by C^2 (add/remove) or sqrt(2) C^2 (replace
  one), since ||a (.) a||_2 <= ||a||_2^2 and, for non-negative a, b, ||a - b||^2 <= ||a||^2 + ||b||^2;
- a sum of products ``phi * y`` with ||phi|| <= B, |y| <= B_y moves by B B_y (add/remove) or 2 B B_y (replace one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .errors import InvalidRelease

ADJACENCIES = ("add_remove", "replace_one")


def check_adjacency(adjacency: str) -> str:
    if adjacency not in ADJACENCIES:
        raise InvalidRelease(f"adjacency must be one of {ADJACENCIES}, got {adjacency!r}")
    return adjacency


def check_bound(name: str, bound) -> float:
    try:
        bound = float(bound)
    except (TypeError, ValueError):
        raise InvalidRelease(f"{name} must be a number, got {bound!r}") from None
    if not math.isfinite(bound) or bound <= 0:
        raise InvalidRelease(f"{name} must be a finite number > 0, got {bound!r}")
    return bound


def check_finite(name: str, value) -> np.ndarray:
    """Convert to a float64 array and refuse NaN/Inf (nothing non-finite is ever clipped or released)."""
    arr = np.asarray(value, dtype=np.float64)
    # A finite sum has no NaN or infinite term (either would make it NaN or infinite): one pass, no temporary. Only a
    # non-finite sum (a bad entry, or finite entries whose sum overflows) needs the entry-by-entry look.
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.add.reduce(arr, axis=None)
    if not np.isfinite(total) and not np.all(np.isfinite(arr)):
        bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
        raise InvalidRelease(f"{name} has {bad} non-finite entries (NaN or Inf); fix the computation that produced it "
                             f"(e.g. lower the learning rate) — nothing was released")
    return arr


def sum_sensitivity(bound: float, adjacency: str = "add_remove") -> float:
    """L2 sensitivity of a sum of vectors each clipped to ``bound``."""
    bound = check_bound("clip bound", bound)
    return bound if check_adjacency(adjacency) == "add_remove" else 2.0 * bound


def squared_sum_sensitivity(bound: float, adjacency: str = "add_remove") -> float:
    """L2 (Frobenius) sensitivity of a sum of ``g (.) g`` or ``phi phi^T`` with ||g|| <= ``bound``."""
    bound = check_bound("clip bound", bound)
    return bound ** 2 if check_adjacency(adjacency) == "add_remove" else math.sqrt(2.0) * bound ** 2


def cross_sensitivity(bound: float, target_bound: float, adjacency: str = "add_remove") -> float:
    """L2 sensitivity of a sum of ``phi * y`` with ||phi|| <= ``bound`` and |y| <= ``target_bound``."""
    product = check_bound("clip bound", bound) * check_bound("target clip bound", target_bound)
    return product if check_adjacency(adjacency) == "add_remove" else 2.0 * product


@dataclass(frozen=True)
class ClipResult:
    """Clipped values, which units were clipped, their norms before clipping, and the sensitivity of their sum."""

    value: np.ndarray
    clipped: np.ndarray
    norms: np.ndarray
    bound: float
    sensitivity: float

    @property
    def fraction_clipped(self) -> float:
        return float(np.mean(self.clipped)) if self.clipped.size else 0.0


# Entries per BLAS dot in _squared_norms: below OpenBLAS's threshold of 10,000, under which its dot runs on the
# calling thread whatever the size of its pool.
_DOT_CHUNK = 8192
_vecdot = getattr(np, "vecdot", None)  # numpy >= 2.0


def _squared_norms(rows: np.ndarray) -> np.ndarray:
    """Each row's squared L2 norm. float64 rows go through BLAS dots over pieces of ``_DOT_CHUNK`` entries (numpy's
    ``vecdot``): about 5x faster than einsum's loop, and no piece is long enough for OpenBLAS to start threads (a
    threaded dot on a busy machine can take milliseconds). A NaN or Inf entry gives a NaN or Inf norm, as it must
    for the finiteness check of an owned upload."""
    if _vecdot is None or rows.dtype != np.float64:
        return np.einsum("ij,ij->i", rows, rows)  # one pass per row, no squared temporary
    n, d = rows.shape
    full = d // _DOT_CHUNK
    out = np.zeros(n)
    if full:
        s0, s1 = rows.strides
        blocks = as_strided(rows, shape=(n, full, _DOT_CHUNK), strides=(s0, _DOT_CHUNK * s1, s1), writeable=False)
        out += _vecdot(blocks, blocks).sum(axis=1)
    if d > full * _DOT_CHUNK:
        tail = rows[:, full * _DOT_CHUNK:]
        out += _vecdot(tail, tail)
    return out


def _scale_rows(rows: np.ndarray, bound: float, *, own: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows scaled to norm at most ``bound``; ``own``: ``rows`` is a fresh array the caller hands over, scaled in
    place and returned as it is when no row is over the bound (no new array of the upload's size)."""
    norms = np.sqrt(_squared_norms(rows))
    over = norms > bound
    if own and not over.any():
        return rows, over, norms
    scale = np.ones_like(norms)
    np.divide(bound, norms, out=scale, where=over)
    if own:
        with np.errstate(invalid="ignore"):  # an Inf entry times the zero scale is NaN: the owner's check sees it
            rows *= scale[:, None]
        return rows, over, norms
    return rows * scale[:, None], over, norms


def clip_per_client(value, bound: float, adjacency: str = "add_remove", *, owned: bool = False) -> ClipResult:
    """Clip a client's whole upload (any shape, flattened for the norm) to L2 norm ``bound`` (user-level DP). The
    result never shares memory with ``value``, unless ``owned``: the caller hands over a float64 array of its own
    (the release pipeline's validated copy), which is then scaled in place. An owned array is checked finite through
    its norm, the pass the clip makes anyway: a NaN or Inf entry makes the norm non-finite and survives the scaling
    (Inf times the zero scale is NaN), so a non-finite norm whose scaled result is not all finite raises
    :class:`InvalidRelease`; finite entries whose squares overflow scale to zero, as unowned uploads do."""
    if owned:
        if not (isinstance(value, np.ndarray) and value.dtype == np.float64):
            raise InvalidRelease("an owned client upload must be the caller's float64 array")
        arr = value
    else:
        arr = check_finite("client upload", value)
    bound = check_bound("clip bound", bound)
    if not owned and (arr is value or (isinstance(value, np.ndarray) and np.shares_memory(arr, value))):
        arr = arr.copy()  # the conversion made no copy: make the one the result owns
    flat, clipped, norms = _scale_rows(arr.reshape(1, -1), bound, own=True)
    if owned and not math.isfinite(float(norms[0])):
        check_finite("client upload", flat)
    return ClipResult(flat.reshape(arr.shape), clipped, norms, bound, sum_sensitivity(bound, adjacency))


def clip_per_example(per_example, bound: float, adjacency: str = "add_remove") -> ClipResult:
    """Clip each example's term (first axis indexes examples) to L2 norm ``bound``; sensitivity is for their sum."""
    arr = check_finite("per-example values", per_example)
    if arr.ndim < 1:
        raise InvalidRelease("per-example values need a leading axis of examples; got a scalar")
    bound = check_bound("clip bound", bound)
    rows, clipped, norms = _scale_rows(arr.reshape(arr.shape[0], -1), bound)
    return ClipResult(rows.reshape(arr.shape), clipped, norms, bound, sum_sensitivity(bound, adjacency))


def clip_rows(matrix, bound: float, adjacency: str = "add_remove") -> ClipResult:
    """Clip each row of a 2-D matrix (e.g. feature rows phi_i) to L2 norm ``bound``.

    The returned sensitivity is that of the row sum; for ``Phi^T Phi`` use :func:`squared_sum_sensitivity`.
    """
    arr = check_finite("matrix", matrix)
    if arr.ndim != 2:
        raise InvalidRelease(f"clip_rows needs a 2-D matrix (rows = records), got shape {arr.shape}")
    bound = check_bound("clip bound", bound)
    rows, clipped, norms = _scale_rows(arr, bound)
    return ClipResult(rows, clipped, norms, bound, sum_sensitivity(bound, adjacency))


def clip_values(values, bound: float, adjacency: str = "add_remove") -> ClipResult:
    """Clip scalars (e.g. regression targets) to [-bound, bound]; sensitivity is for their sum."""
    arr = check_finite("values", values)
    bound = check_bound("clip bound", bound)
    out = np.clip(arr, -bound, bound)
    return ClipResult(out, np.abs(arr) > bound, np.abs(arr), bound, sum_sensitivity(bound, adjacency))
