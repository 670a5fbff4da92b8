"""Reductions that keep NaN, and counts.

Owns reductions that keep NaN (maxima, extremes, all, counts), each with
derivatives from its plain formula.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from optaxclip._numerics.collectives import may_span_devices


def reduce_axes(x: jax.Array, axes: Optional[tuple[int, ...]]):
  return tuple(range(x.ndim)) if axes is None else axes


def with_plain_derivative(fast, plain, n_args: int, n_static: int):
  """A function with ``fast``'s values and ``plain``'s derivatives.

  ``plain`` is the same function written with differentiable ops; ``fast``
  uses a multi-output ``lax.reduce``, which JAX cannot differentiate. Of the
  ``n_args`` arguments, the last ``n_static`` are static (hashable).
  Derivatives of any order work: the rule's primal output is computed by
  the function itself, so differentiating the rule uses the rule again.
  """

  @functools.partial(
    jax.custom_jvp, nondiff_argnums=tuple(range(n_args - n_static, n_args))
  )
  def fn(*args):
    return fast(*args)

  @fn.defjvp
  def fn_jvp(*args):
    static, (primals, tangents) = args[:-2], args[-2:]
    return fn(*primals, *static), jax.jvp(
      lambda *xs: plain(*xs, *static), primals, tangents
    )[1]

  return fn


# XLA:CPU (jaxlib 0.10, its YNNPACK reduction fusion, on by default) drops a
# NaN from a max or min reduction of 4096 elements or more (float32 and
# float64, and float16's min): ``jnp.max`` of 5000 float32 values holding
# one NaN returns the largest of the others, or the reduction's initial
# value (-inf) when the NaN is the last element. Every non-finite check and
# every max-based norm here (clip_value's ``max |g|``, ``ord=inf``) reduces
# through these helpers, which that fusion does not take: on one device,
# the largest magnitude is an integer max of the magnitudes' bits (every
# NaN above inf; see largest_magnitude), which XLA:CPU vectorises; a max or
# a min of the values themselves is a reduction whose merge says that a
# NaN wins (vectorised as a single-output reduction; a reduction of max and
# min together is not, and takes several times as long). Maxima that only
# pick a power-of-two scale for a sum stay plain: the sum carries the NaN
# they miss.


def _nan_max_merge(u, v):
  return jax.lax.select(jnp.isnan(u) | (u > v), u, v)


def _nan_min_merge(u, v):
  return jax.lax.select(jnp.isnan(u) | (u < v), u, v)


def _extremes_fast(x, axes, keepdims):
  big = jnp.asarray(jnp.inf, x.dtype)
  top, bottom = jax.lax.reduce(
    (x, x),
    (-big, big),
    lambda u, v: (_nan_max_merge(u[0], v[0]), _nan_min_merge(u[1], v[1])),
    axes,
  )
  if keepdims:
    top, bottom = jnp.expand_dims(top, axes), jnp.expand_dims(bottom, axes)
  return top, bottom


def extremes_plain(x, axes, keepdims):
  return (
    jnp.max(x, axis=axes, keepdims=keepdims),
    jnp.min(x, axis=axes, keepdims=keepdims),
  )


_extremes_custom = with_plain_derivative(
  _extremes_fast, extremes_plain, n_args=3, n_static=2
)


def _nan_keeping_reduce(x, axes, keepdims, merge, start):
  """One single-output reduction of ``x`` over ``axes`` by ``merge`` (one of
  the NaN-keeping merges above), starting from ``start``.
  """
  out = jax.lax.reduce(x, jnp.asarray(start, x.dtype), merge, axes)
  return jnp.expand_dims(out, axes) if keepdims else out


def _max_fast(x, axes, keepdims):
  return _nan_keeping_reduce(x, axes, keepdims, _nan_max_merge, -jnp.inf)


def _max_plain(x, axes, keepdims):
  return jnp.max(x, axis=axes, keepdims=keepdims)


_max_custom = with_plain_derivative(_max_fast, _max_plain, n_args=3, n_static=2)


def drops_nan(x: jax.Array) -> bool:
  """Whether a plain max of ``x`` may drop a NaN: every float dtype.

  Not only float32 and float64: a float16 min of 4096 elements drops it
  too (tests/test_fuzz_reductions.py checks every float dtype).
  """
  return jnp.issubdtype(x.dtype, jnp.floating)


def _merge_dtype(x: jax.Array) -> jax.Array:
  """``x`` widened to float32 when narrower (exact): XLA:CPU computes each
  merge of float16 or bfloat16 values through float32 conversions, several
  times a plain max's time on a bfloat16 leaf; widened first, close to it.
  """
  if x.dtype.itemsize < 4:
    return x.astype(jnp.float32)
  return x


def _nan_flagged(x, axes, keepdims, *reduced):
  """``reduced`` (plain reductions of ``x``, which XLA's partitioner splits
  across devices) made NaN where a NaN was reduced, by a reduction of
  booleans (which the fusion keeps).
  """
  nan = jnp.any(jnp.isnan(x), axis=axes, keepdims=keepdims)
  return tuple(jnp.where(nan, jnp.nan, r) for r in reduced)


def nan_extremes(
  x: jax.Array, axis: Optional[tuple[int, ...]] = None, *, keepdims=False
) -> tuple[jax.Array, jax.Array]:
  """``(max(x), min(x))`` over ``axis`` (all axes by default), each NaN
  wherever a NaN was reduced, in one pass; derivatives as ``jnp.max`` and
  ``jnp.min`` have them. ``x`` real, the reduced axes not empty. See the
  section's comment for why not ``jnp.max``.
  """
  axes = reduce_axes(x, axis)
  if not drops_nan(x):
    return extremes_plain(x, axes, keepdims)
  if may_span_devices(x):
    top, bottom = _nan_flagged(
      x, axes, keepdims, *extremes_plain(x, axes, keepdims)
    )
    return top, bottom
  top, bottom = _extremes_custom(_merge_dtype(x), axes, keepdims)
  return top.astype(x.dtype), bottom.astype(x.dtype)


def nan_max(
  x: jax.Array,
  axis: Optional[tuple[int, ...]] = None,
  *,
  keepdims: bool = False,
  initial: Optional[Any] = None,
) -> jax.Array:
  """``jnp.max(x, axis, keepdims=..., initial=...)``, NaN wherever a NaN
  was reduced (see the section's comment); derivatives as ``jnp.max``'s.
  """
  axes = reduce_axes(x, axis)
  if not drops_nan(x) or any(x.shape[d] == 0 for d in axes):
    return jnp.max(x, axis=axes, keepdims=keepdims, initial=initial)
  if may_span_devices(x):
    (top,) = _nan_flagged(x, axes, keepdims, _max_plain(x, axes, keepdims))
  else:
    top = _max_custom(_merge_dtype(x), axes, keepdims).astype(x.dtype)
  if initial is not None:
    top = jnp.maximum(top, jnp.asarray(initial, top.dtype))  # NaN stays
  return top


def _all(parts) -> jax.Array:
  return functools.reduce(
    jnp.logical_and, [jnp.all(v) for v in parts], jnp.array(True)
  )


def _all_of_fast(mask):
  # As int32: the bitwise and of the entries and the number of False ones
  # (their sum), two outputs of one reduction that XLA:CPU keeps whole.
  every, misses = jax.lax.reduce(
    (mask.astype(jnp.int32), (~mask).astype(jnp.int32)),
    (jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32)),
    lambda u, v: (
      jax.lax.bitwise_and(u[0], v[0]),
      jax.lax.add(u[1], v[1]),
    ),
    tuple(range(mask.ndim)),
  )
  return (every > 0) & (misses == 0)


def all_true(masks) -> jax.Array:
  """Whether every entry of the boolean arrays ``masks`` is True.

  XLA:CPU splits a single-output reduction of more than 32 elements
  (``jnp.all``) into a reduce-window and a reduce, with its operand (the
  comparisons that make the mask) a kernel of its own in memory: three
  kernels to compile for each check of the norms. Here each array is
  reduced by a two-output reduction (both outputs say the same), which it
  keeps whole, in one kernel with its operand.
  """
  out = jnp.array(True)
  for m in masks:
    if m.size and not may_span_devices(m):
      out = out & _all_of_fast(m)
    else:
      out = out & jnp.all(m)
  return out


def _max_sum_all_plain(largest_of, summed, all_of):
  return nan_max(largest_of), jnp.sum(summed), jnp.all(all_of)


def _max_sum_all_fast(largest_of, summed, all_of):
  # The flags as int32 (a bitwise and): a reduction of booleans is split
  # like a single-output one.
  top, total, every = jax.lax.reduce(
    (largest_of, summed, all_of.astype(jnp.int32)),
    (
      jnp.asarray(-jnp.inf, largest_of.dtype),
      jnp.zeros((), summed.dtype),
      jnp.ones((), jnp.int32),
    ),
    lambda u, v: (
      _nan_max_merge(u[0], v[0]),
      jax.lax.add(u[1], v[1]),
      jax.lax.bitwise_and(u[2], v[2]),
    ),
    (0,),
  )
  return top, total, every > 0


_max_sum_all_custom = with_plain_derivative(
  _max_sum_all_fast, _max_sum_all_plain, n_args=3, n_static=0
)


def max_sum_all(
  largest_of: jax.Array, summed: jax.Array, all_of: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(max(largest_of), sum(summed), all(all_of))`` for three non-empty
  vectors of one length (floats, floats, booleans), in one three-output
  reduction: one kernel to compile, where XLA:CPU splits each
  single-output reduction of more than 32 elements into a reduce-window, a
  reduce and a kernel for its operand (see :func:`_power_sums`).
  Derivatives from the plain formulas.
  """
  if may_span_devices(largest_of):
    return _max_sum_all_plain(largest_of, summed, all_of)
  return _max_sum_all_custom(largest_of, summed, all_of)


def count(mask: jax.Array) -> jax.Array:
  """The number of true elements of the boolean ``mask``, a float32 scalar
  (counted in int32, then converted: exact up to 2**24).

  One reduction with two outputs, the count and whether any is true, both
  used: XLA:CPU computes the mask inside it, in the pass over its operands.
  A plain sum of the mask is split into a tree of reductions (or handed to
  its YNNPACK fusion) that first writes the mask out in full: a leaf-sized
  temporary and a second pass (for clip_spikes_adaptive's count, as much
  temporary memory as the float32 gradients). A mask that may span
  devices is summed plainly, a reduction the partitioner splits.
  """
  if mask.size == 0 or mask.size >= 2**31 or may_span_devices(mask):
    return jnp.sum(mask, dtype=jnp.float32)
  m = mask.astype(jnp.int32)
  zero = jnp.zeros((), jnp.int32)
  n, any_true = jax.lax.reduce(
    (m, m),
    (zero, zero),
    lambda u, v: (jax.lax.add(u[0], v[0]), jax.lax.max(u[1], v[1])),
    tuple(range(m.ndim)),
  )
  # n is 0 wherever no element is true: the select only keeps XLA from
  # dropping the second output, and with it the fusion of the mask.
  return jnp.where(any_true > 0, n, zero).astype(jnp.float32)
