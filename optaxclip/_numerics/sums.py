"""Power sums, trusted or recomputed exactly.

Owns power sums: the direct one, the trusted range, and the exact (scaled)
recompute.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip._numerics.collectives import may_span_devices
from optaxclip._numerics.collectives import split_axes
from optaxclip._numerics.floats import Scaled
from optaxclip._numerics.floats import accumulation_dtype
from optaxclip._numerics.floats import magnitude
from optaxclip._numerics.floats import pow2
from optaxclip._numerics.floats import pth_power
from optaxclip._numerics.floats import safe_root
from optaxclip._numerics.floats import scale_exponent
from optaxclip._numerics.floats import scale_parts
from optaxclip._numerics.packing import CHUNK_SIZE
from optaxclip._numerics.reductions import reduce_axes
from optaxclip._numerics.reductions import with_plain_derivative
from optaxclip._typing import AxisName


def trusted_min(dtype: Any) -> float:
  """Smallest power sum (of any order) for which the direct sum is trusted."""
  info = jnp.finfo(dtype)
  return float(info.tiny) / float(info.eps) ** 2


def trusted_max(dtype: Any) -> float:
  """Largest power sum for which the direct sum is trusted.

  Not the dtype's largest value: the sum's own derivatives (``p sum |x|**(p
  - 1) dx`` and the next order's) are of its size times the tangent's ratio
  to the values, and overflow where a sum near float32's largest value (four
  values of 1e19) is taken directly (clip_unitwise's Hessian-vector product
  would be NaN). The exact recompute differentiates the values scaled by a
  power of two. A factor ``1 / eps`` of headroom: float32 norms above about
  6e15 are recomputed.
  """
  info = jnp.finfo(dtype)
  return float(info.max) * float(info.eps)


def trusted_sum(v: jax.Array) -> jax.Array:
  """Whether a direct power sum is trusted: neither so small that lost
  (underflowed) terms may matter, nor so large that it or its derivatives
  overflow (NaN, inf: never).
  """
  return (v >= trusted_min(v.dtype)) & (v <= trusted_max(v.dtype))


def _summands(x, p, dtype):
  """What ``sum |x|**p`` raises to the power p: ``x`` in ``dtype`` for an
  even power of real values (no abs, nothing but x in the pass), else the
  magnitudes.
  """
  if p == 2 and not jnp.iscomplexobj(x):
    return x.astype(dtype)
  return magnitude(x, dtype)


def _power_sum_fast(x, p, axes, dtype):
  # The barrier keeps XLA from merging this pass's upcast and square with the
  # optimizer's own (Adam squares the same gradient): merged, they are written
  # out in full, a gradient-sized temporary, instead of fused into the sum.
  x = jax.lax.optimization_barrier(x)
  a = _summands(x, p, dtype)
  return jnp.sum(pth_power(a, p), axis=reduce_axes(x, axes), keepdims=True)


def _power_sum_plain(x, p, axes, dtype):
  # The values clamped just above the largest that a trusted sum holds (the
  # identity there): an untrusted sum's derivative is masked out, but its
  # intermediates, such as p (p - 1) |x|**(p - 2) dx at the second order,
  # must stay finite (inf * 0 is NaN).
  bound = trusted_max(dtype) ** (1.0 / p) * 1.0001
  a = jnp.clip(_summands(x, p, dtype), -bound, bound)
  return jnp.sum(pth_power(a, p), axis=reduce_axes(x, axes), keepdims=True)


def _direct_sums_fast(xs, p, axes, dtypes):
  return [_power_sum_fast(x, p, a, d) for x, a, d in zip(xs, axes, dtypes)]


def _direct_sums_plain(xs, p, axes, dtypes):
  return [_power_sum_plain(x, p, a, d) for x, a, d in zip(xs, axes, dtypes)]


# One custom rule for all of a call's sums. (Lowered, the rule leaves the
# program as it was: the same StableHLO, the same compile time on 300
# leaves, within the noise.)
_direct_sums_custom = with_plain_derivative(
  _direct_sums_fast, _direct_sums_plain, n_args=4, n_static=3
)


def direct_sums(
  xs: Sequence[jax.Array], p: float, axes: Sequence[Any], dtypes: Sequence[Any]
) -> list[jax.Array]:
  """``sum |x|**p`` of each array over its ``axes`` (keepdims) in its
  ``dtypes`` entry: the fast path.

  Their derivatives are finite for every finite ``x`` (where a sum is
  beyond :func:`trusted_max`, they are not the sum's: the caller recomputes
  such sums exactly, and masks this one out).
  """
  return list(
    _direct_sums_custom(
      list(xs), p, tuple(axes), tuple(np.dtype(d) for d in dtypes)
    )
  )


def scaled_sum(x: jax.Array, p: float, axes, dtype):
  """``(q, E)`` with ``q = sum (|x| * 2**-E)**p`` over ``axes`` (keepdims).

  ``2**E`` is the power of two of ``M = max |x|`` (int32 ``E``), so ``q`` is
  neither overflowed nor underflowed, and the norm is ``q**(1/p) * 2**E``.
  Two passes: ``M``, then the sum of the values scaled by ``2**-E``, exact
  powers of two. An infinite element gives ``q = inf``, a NaN ``q = NaN``.
  A complex leaf, whose modulus may exceed the range while both parts are
  finite, is scaled by the power of two of its largest part first.

  Not one pass with a two-output reduction whose merge rescales partial
  sums by the ratio of their maxima: XLA:CPU does not vectorize it, and it
  is several times slower than the two passes: with it, a step that takes
  the exact recompute costs far more (``docs/performance.md``); nor does
  XLA's partitioner split it.
  """
  axes = reduce_axes(x, axes)
  dtype = np.dtype(dtype)
  if jnp.iscomplexobj(x):
    # A modulus may exceed the range while both parts are finite
    # (3.4e38 - 8e37j): M is the largest part, and the modulus is taken
    # after scaling.
    m = jax.lax.stop_gradient(
      jnp.max(
        jnp.maximum(magnitude(x.real, dtype), magnitude(x.imag, dtype)),
        axis=axes,
        keepdims=True,
        initial=0,
      )
    )
    e = scale_exponent(m)
    a = magnitude(scale_parts(x, pow2(-e, dtype)), dtype)
    return jnp.sum(pth_power(a, p), axis=axes, keepdims=True), e
  # M only picks an exact power-of-two scale: it has no derivative, and a
  # NaN it misses (see nan_max) is in the sum. It is taken in x's own dtype
  # (exact), and the sum scales x itself: with |x| or a cast of x shared
  # by the two reductions (or with any select in the sum), XLA:CPU writes a
  # leaf-sized temporary, or reduces both in a loop of its own, several times
  # slower than the two passes it vectorizes.
  m = jax.lax.stop_gradient(
    jnp.max(jnp.abs(x), axis=axes, keepdims=True, initial=0)
  ).astype(dtype)
  e = scale_exponent(m)
  x = jax.lax.optimization_barrier(x)
  y = jax.lax.convert_element_type(x, dtype) * pow2(-e, dtype)
  powered = y * y if p == 2 else pth_power(jnp.abs(y), p)
  return jnp.sum(powered, axis=axes, keepdims=True), e


def exact_rows(parts, axes, flags, members, p) -> dict[int, Scaled]:
  """Exact norms (:func:`scaled_sum`) of the parts ``members`` whose units
  are rows (2-D, real, on one device, reduced along axis 1), by index:
  their rows padded with zeros to the widest and reduced as one matrix. A
  zero adds nothing to a unit's largest magnitude or scaled sum, so each
  unit's norm is what its part alone gives; its reductions are compiled
  once, not once per part's shape (they run only in the rare exact
  recompute). Parts are left out (computed on their own) when
  the padding would more than quadruple the elements or exceed
  ``CHUNK_SIZE``.
  """
  rows = [
    i
    for i in members
    if parts[i].ndim == 2
    and tuple(axes[i]) == (1,)
    and not flags[i]
    and not jnp.iscomplexobj(parts[i])
    and not may_span_devices(parts[i])
    and parts[i].shape[1] > 0
  ]
  dtypes = {np.dtype(parts[i].dtype) for i in rows}
  if len(rows) < 2 or len(dtypes) > 1:
    return {}
  width = max(parts[i].shape[1] for i in rows)
  units = sum(parts[i].shape[0] for i in rows)
  actual = sum(parts[i].size for i in rows)
  if units * width > min(4 * actual, CHUNK_SIZE):
    return {}
  matrix = jnp.concatenate(
    [
      jax.lax.pad(
        parts[i],
        jnp.zeros((), parts[i].dtype),
        [(0, 0, 0), (0, width - parts[i].shape[1], 0)],
      )
      for i in rows
    ]
  )
  q, e = scaled_sum(matrix, p, (1,), accumulation_dtype(matrix.dtype))
  out, start = {}, 0
  for i in rows:
    n = parts[i].shape[0]
    out[i] = scaled_norm(
      jax.lax.slice_in_dim(q, start, start + n),
      jax.lax.slice_in_dim(e, start, start + n),
      p,
    )
    start += n
  return out


def merge_scaled(parts, p: float):
  """Merges ``(q_i, E_i)`` of disjoint parts (same shapes) into one."""
  e = functools.reduce(jnp.maximum, [ei for _, ei in parts])
  # An infinite q has the largest E (it is never scaled by 0: no inf * 0).
  return sum(qi * pth_power(pow2(ei - e, qi.dtype), p) for qi, ei in parts), e


def across_devices(q, e, p, sharded, axis_name: AxisName):
  """``(q, E)`` of a leaf split over (some of) ``axis_name``, merged over the
  devices that hold its parts (``sharded``: see split_axes).
  """
  names = split_axes(sharded, axis_name)
  if not names:
    return q, e
  total_e = jax.lax.pmax(e, names)
  return jax.lax.psum(
    q * pth_power(pow2(e - total_e, q.dtype), p), names
  ), total_e


def scaled_norm(q, e, p) -> Scaled:
  """The norm ``q**(1/p) * 2**E``."""
  return Scaled(safe_root(q, p), e)
