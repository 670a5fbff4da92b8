"""Norms per unit, per part and over a tree, and their combinations.

Owns p-norms per unit, per part and over the tree; combining norms; power-
of-two buckets of sums of squares.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
import math
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip._numerics.collectives import may_span_devices
from optaxclip._numerics.collectives import nan_pmax
from optaxclip._numerics.collectives import on_every_device
from optaxclip._numerics.collectives import psum_sharded
from optaxclip._numerics.collectives import sharded_flags
from optaxclip._numerics.floats import Scaled
from optaxclip._numerics.floats import accumulation_dtype
from optaxclip._numerics.floats import as_scaled
from optaxclip._numerics.floats import ldexp
from optaxclip._numerics.floats import magnitude
from optaxclip._numerics.floats import normalize
from optaxclip._numerics.floats import pow2
from optaxclip._numerics.floats import pth_power
from optaxclip._numerics.floats import safe_root
from optaxclip._numerics.floats import scale_exponent
from optaxclip._numerics.floats import tree_accumulation_dtype
from optaxclip._numerics.layouts import UnitLayout
from optaxclip._numerics.maxima import largest_magnitude
from optaxclip._numerics.maxima import largest_modulus
from optaxclip._numerics.maxima import largest_scaled
from optaxclip._numerics.packing import flat_concat
from optaxclip._numerics.packing import packed_pieces
from optaxclip._numerics.packing import part_groups
from optaxclip._numerics.packing import split_parts
from optaxclip._numerics.reductions import all_true
from optaxclip._numerics.reductions import nan_max
from optaxclip._numerics.reductions import with_plain_derivative
from optaxclip._numerics.scaling import materialized
from optaxclip._numerics.scaling import materialized_scaled
from optaxclip._numerics.sums import across_devices
from optaxclip._numerics.sums import direct_sums
from optaxclip._numerics.sums import exact_rows
from optaxclip._numerics.sums import merge_scaled
from optaxclip._numerics.sums import scaled_norm
from optaxclip._numerics.sums import scaled_sum
from optaxclip._numerics.sums import trusted_max
from optaxclip._numerics.sums import trusted_min
from optaxclip._numerics.sums import trusted_sum
from optaxclip._typing import AxisName


def unit_norms(
  leaves: Sequence[jax.Array],
  ord: float = 2.0,
  axes: Optional[Sequence[Optional[tuple[int, ...]]]] = None,
  *,
  axis_name: AxisName = None,
  sharded: Optional[Sequence[Union[bool, tuple[str, ...]]]] = None,
) -> list[jax.Array]:
  """The p-norm of each unit of each leaf, with reduced axes kept as size 1.

  As :func:`unit_norms_scaled`, as plain arrays in the accumulation dtype
  (``inf`` where a norm of finite values exceeds its range).
  """
  return [
    n.as_float()
    for n in unit_norms_scaled(
      leaves, ord, axes, axis_name=axis_name, sharded=sharded
    )
  ]


def unit_norms_scaled(
  leaves: Sequence[jax.Array],
  ord: float = 2.0,  # pylint: disable=redefined-builtin
  axes: Optional[Sequence[Optional[tuple[int, ...]]]] = None,
  *,
  axis_name: AxisName = None,
  sharded: Optional[Sequence[Union[bool, tuple[str, ...]]]] = None,
) -> list[Scaled]:
  """The p-norm of each unit of each leaf, with reduced axes kept as size 1.

  The fast path is one reduction pass over the leaves, small leaves stacked
  by unit size (see :class:`UnitLayout`). A unit whose power sum is not
  finite, or too small to trust, sends the call to the exact recompute. A
  unit whose sum is exactly zero (all zeros, or every square
  underflowed) is settled first by the largest magnitude of each unit, a
  cheaper pass, so that trees with zero units (dead ReLUs, unused
  parameters) pay that pass only, not the recompute.

  Args:
    leaves: float or complex arrays.
    ord: the norm's order p >= 1, or ``math.inf``.
    axes: per leaf, the axes a unit spans (``None``: the whole leaf).
    axis_name: mapped axis name(s) over which sharded leaves are summed.
    sharded: per leaf, the names of ``axis_name`` it is split over (a tuple;
      partial sums are summed over exactly those), or a bool: all or none.

  Returns:
    One :class:`Scaled` per leaf, of the leaf's rank, holding each unit's
    norm in the accumulation dtype (exact even where it exceeds the dtype's
    range).
  """
  leaves = list(leaves)
  if not leaves:
    return []
  layout, norms = unit_norms_packed(
    leaves, ord, axes, axis_name=axis_name, sharded=sharded
  )
  return layout.unpack(norms)


def unit_norms_packed(
  leaves: Sequence[jax.Array],
  ord: float = 2.0,
  axes: Optional[Sequence[Optional[tuple[int, ...]]]] = None,
  *,
  axis_name: AxisName = None,
  sharded: Optional[Sequence[Union[bool, tuple[str, ...]]]] = None,
  keys: Optional[Sequence[Any]] = None,
  several_units: bool = False,
) -> tuple[UnitLayout, list[Scaled]]:
  """:func:`unit_norms_scaled` as ``(layout, norms per part)`` (see UnitLayout).

  ``keys``: per leaf, a hashable that leaves stacked together must share
  (beyond their unit size, dtype and ``sharded`` entry).
  ``several_units``: stack leaves of several units too (see UnitLayout).
  """
  leaves = list(leaves)
  axes = [None] * len(leaves) if axes is None else list(axes)
  flags = sharded_flags(leaves, sharded, axis_name)
  keys = [None] * len(leaves) if keys is None else list(keys)
  layout = UnitLayout(leaves, axes, list(zip(flags, keys)), several_units)
  return layout, _part_norms(
    layout.pack(leaves),
    ord,
    layout.part_axes,
    [f for f, _ in layout.keys],
    axis_name,
  )


def part_norms(
  layout: UnitLayout,
  leaves: Sequence[jax.Array],
  ord: float = 2.0,
  *,
  axis_name: AxisName = None,
) -> list[Scaled]:
  """Unit norms of other leaves of the same shapes (e.g. the parameters),
  per part of ``layout`` (from :func:`unit_norms_packed`).
  """
  return _part_norms(
    layout.pack(list(leaves)),
    ord,
    layout.part_axes,
    [f for f, _ in layout.keys],
    axis_name,
  )


def _part_norms(parts, p, axes, flags, axis_name) -> list[Scaled]:
  """Unit norms of each part (keepdims); the body of unit_norms."""

  def maxima(parts_) -> list[Scaled]:
    return [
      largest_modulus(x, ax, f, keepdims=True)
      for x, ax, f in zip(parts_, axes, flags)
    ]

  if not parts:
    return []
  if math.isinf(p):
    return maxima(parts)

  powered = direct_sums(
    parts, p, axes, [accumulation_dtype(x.dtype) for x in parts]
  )
  sums = [psum_sharded(s, f, axis_name) for s, f in zip(powered, flags)]
  # The sums of parts that do not span devices are concatenated, per dtype
  # and shard_map typing, into one vector (a group): the checks, the roots
  # and the exact recompute's results are computed on it and sliced back
  # per part, so that the compiled program grows with neither the number of
  # parts nor of leaves. Consumers that concatenate the parts' norms again
  # (clip_scale_parts, UnitLayout.scale) get the vector back: XLA folds a
  # concatenation of consecutive slices. (Fused into kernels of the parts'
  # shapes, the concatenations were half the statistics' compile time.)
  groups = part_groups(sums, flags)
  members = [m for m in groups if not may_span_devices(sums[m[0]])]
  own = [m[0] for m in groups if may_span_devices(sums[m[0]])]

  def grouped(values, in_memory=True):
    # One vector per group, then the values that may span devices as they
    # are. In memory: fused into each of its consumers, a concatenation
    # would be compiled again in each (XLA unrolls it, a long kernel each).
    out = []
    for m in members:
      v = flat_concat([values[i] for i in m])
      out.append(materialized(v) if in_memory and len(m) > 1 else v)
    return out + [values[i] for i in own]

  flat = grouped(sums)
  # The bound of the narrowest accumulation dtype serves all: a stricter
  # bound only sends more sums to the exact recompute.
  safe_min = max(trusted_min(s.dtype) for s in sums)
  safe_max = min(trusted_max(s.dtype) for s in sums)

  def good(v):  # NaN and inf fail both comparisons
    return (v >= safe_min) & (v <= safe_max)

  def zero(v):  # all zeros, or all squares underflowed
    return v == 0

  def direct(parts_):
    del parts_
    return [as_scaled(safe_root(s, p)) for s in flat]

  def exact(parts_):
    out: list[Any] = [None] * len(parts_)
    for m in members:
      for i, n in exact_rows(parts_, axes, flags, m, p).items():
        out[i] = n
    for i, (x, ax, f) in enumerate(zip(parts_, axes, flags)):
      if out[i] is None:
        q, e = scaled_sum(x, p, ax, accumulation_dtype(x.dtype))
        out[i] = scaled_norm(*across_devices(q, e, p, f, axis_name), p)
    # Value and exponent of a group in one kernel (materialized_scaled).
    return [
      materialized_scaled(n) if len(m) > 1 else n
      for n, m in zip(
        (
          trusted_or(s, Scaled(v, e))
          for s, v, e in zip(
            flat,
            grouped([n.value for n in out], in_memory=False),
            grouped([n.exponent for n in out], in_memory=False),
          )
        ),
        members + [[i] for i in own],
      )
    ]

  def trusted_or(s, exact_norm: Scaled) -> Scaled:
    # Units whose sum is trusted keep the direct root: a unit's norm does
    # not depend, in its last bit, on whether another unit of the tree sent
    # the step to the recompute. Both operands masked: the root of an
    # untrusted (inf) sum would meet 0 * inf in the second derivative.
    ok = good(s)
    return Scaled(
      jnp.where(ok, safe_root(jnp.where(ok, s, 1), p), exact_norm.value),
      jnp.where(ok, 0, exact_norm.exponent),
    )

  def tops(parts_):
    # Plain maxima (vectorized by XLA:CPU, where the NaN-keeping ones of
    # largest_magnitude are not): read only where a sum is 0, which a NaN
    # would have made NaN.
    return [
      nan_pmax(
        jnp.max(magnitude(x), axis=ax, keepdims=True, initial=0),
        f,
      )
      for x, ax, f in zip(parts_, axes, flags)
    ]

  def fallback(parts_):
    # Zero sums are zero norms when their units' largest magnitude is 0 and
    # every other sum is trusted (one max pass); otherwise recompute.
    settled = all_true(
      [
        good(v) | (zero(v) & (m == 0))
        for v, m in zip(flat, grouped(tops(parts_)))
      ]
    )
    return jax.lax.cond(
      on_every_device(settled, axis_name), direct, exact, parts_
    )

  # The checks are computed where they are used (inside the branch too):
  # fused into their reductions (all_true), not kept in memory. Units split
  # across devices may differ (another device's NaN): every device takes
  # the branch one of them needs.
  norms = jax.lax.cond(
    on_every_device(all_true([good(v) for v in flat]), axis_name),
    direct,
    fallback,
    parts,
  )
  out: list[Any] = [None] * len(parts)
  for m, n in zip(members, norms):
    for i, piece in zip(m, split_parts(n, [sums[i] for i in m])):
      out[i] = piece
  for i, n in zip(own, norms[len(members) :]):
    out[i] = n
  return out


def global_norm(
  leaves: Sequence[jax.Array],
  ord: float = 2.0,
  *,
  axis_name: AxisName = None,
  sharded: Optional[Sequence[Union[bool, tuple[str, ...]]]] = None,
) -> jax.Array:
  """The p-norm of all leaves taken together, as one vector.

  As :func:`global_norm_scaled`, as a plain scalar in the accumulation dtype
  (``inf`` where a norm of finite values exceeds its range).
  """
  return global_norm_scaled(
    leaves, ord, axis_name=axis_name, sharded=sharded
  ).as_float()


def global_norm_scaled(
  leaves: Sequence[jax.Array],
  ord: float = 2.0,  # pylint: disable=redefined-builtin
  *,
  axis_name: AxisName = None,
  sharded: Optional[Sequence[Union[bool, tuple[str, ...]]]] = None,
) -> Scaled:
  """The p-norm of all leaves taken together, as one vector.

  The fast path is one reduction pass over the leaves (small ones
  concatenated); only when its sum is not finite, or too small to trust (or
  zero), is the norm recomputed exactly, from the same buffers.

  Args:
    leaves: float or complex arrays.
    ord: the norm's order p >= 1, or ``math.inf``.
    axis_name: mapped axis name(s) over which sharded leaves are summed.
    sharded: per leaf, the names of ``axis_name`` it is split over (a tuple;
      partial sums are summed over exactly those), or a bool: all or none.

  Returns:
    A scalar :class:`Scaled` in the accumulation dtype (float32 unless a
    leaf is wider).
  """
  leaves = list(leaves)
  dtype = tree_accumulation_dtype(leaves)
  flags = sharded_flags(leaves, sharded, axis_name)
  pieces = packed_pieces(leaves, flags)
  if not pieces:
    return as_scaled(jnp.zeros((), dtype))
  p = ord
  arrays = [a for a, _ in pieces]
  groups = {}
  for i, (_, f) in enumerate(pieces):
    groups.setdefault(f, []).append(i)

  if math.isinf(p):
    if any(jnp.iscomplexobj(a) for a in arrays):
      # A complex modulus may exceed the range: see largest_modulus.
      return largest_scaled(
        [as_scaled(jnp.zeros((), dtype))]
        + [
          largest_modulus(arrays[i], None, f)
          for f, idx in groups.items()
          for i in idx
        ],
        dtype,
      )
    biggest = jnp.zeros((), dtype)
    for f, idx in groups.items():
      if idx:
        local = functools.reduce(
          jnp.maximum,
          [largest_magnitude(arrays[i]).astype(dtype) for i in idx],
        )
        biggest = jnp.maximum(biggest, nan_pmax(local, f))
    return as_scaled(biggest)

  total = jnp.zeros((), dtype)
  powered = direct_sums(arrays, p, [None] * len(arrays), [dtype] * len(arrays))
  for f, idx in groups.items():
    if idx:
      local = sum(powered[i].reshape(()) for i in idx)
      total = total + psum_sharded(local, f, axis_name)
  # Below the trusted range, lost (underflowed) terms may matter; above it,
  # the sum or its derivatives may overflow: recompute exactly.
  trusted = trusted_sum(total)

  def direct(arrays_):
    del arrays_
    return as_scaled(safe_root(total, p))

  def exact(arrays_):
    parts = []
    for f, idx in groups.items():
      if idx:
        q, e = merge_scaled(
          [
            tuple(v.reshape(()) for v in scaled_sum(arrays_[i], p, None, dtype))
            for i in idx
          ],
          p,
        )
        parts.append(across_devices(q, e, p, f, axis_name))
    return scaled_norm(*merge_scaled(parts, p), p)

  return jax.lax.cond(trusted, direct, exact, arrays)


def _flat_scaled(norms: Sequence[Scaled]) -> list[Scaled]:
  """The norms as 1-D parts: those on one device concatenated into one, the
  others (that may be split across devices: no all-gather, no
  ``ShardingTypeError``) raveled on their own.
  """
  local = [n for n in norms if not may_span_devices(n.value)]
  parts = [
    Scaled(jnp.ravel(n.value), jnp.ravel(n.exponent))
    for n in norms
    if may_span_devices(n.value)
  ]
  if local:
    parts.append(
      Scaled(
        flat_concat([n.value for n in local]),
        flat_concat([n.exponent for n in local]),
      )
    )
  return parts


def combine_norms(
  norms: Sequence[Union[jax.Array, Scaled]],
  ord: float = 2.0,  # pylint: disable=redefined-builtin
  *,
  across: Optional[Sequence[tuple[str, ...]]] = None,
) -> jax.Array:
  """The p-norm of a set of unit norms: the norm of the whole they partition.

  Used for statistics: it costs a pass over the (small) norm arrays only.
  Norms may be plain arrays or :class:`Scaled`; the result is a plain
  scalar (``inf`` if it exceeds the dtype's range or a unit norm is
  infinite, NaN if one is NaN). ``across`` gives, per norm array, the
  mapped axes over which the devices hold different units of it (inside
  ``shard_map``/``pmap``): those parts are summed across them. By default
  every array is the same everywhere.
  """
  if not norms:
    return jnp.zeros((), jnp.float32)
  across = [()] * len(norms) if across is None else list(across)
  names = tuple(tuple(a) for a in across)
  scaled = [as_scaled(n) for n in norms]
  if math.isinf(ord) or any(may_span_devices(n.value) for n in scaled):
    return _combine_norms_plain(scaled, ord, names)
  return _combine_norms_custom(scaled, ord, names)


def _combine_norms_plain(norms, ord, across):  # pylint: disable=redefined-builtin
  """combine_norms in differentiable operations, reductions one at a time."""
  groups = {}
  for n, names in zip(norms, across):
    groups.setdefault(tuple(names), []).append(as_scaled(n))
  parts = {names: _flat_scaled(members) for names, members in groups.items()}

  def over_devices(reduce_local, combine, collective):
    return functools.reduce(
      combine,
      [
        collective(
          functools.reduce(combine, [reduce_local(v) for v in own]), names
        )
        if names
        else functools.reduce(combine, [reduce_local(v) for v in own])
        for names, own in parts.items()
      ],
    )

  if math.isinf(ord):
    return over_devices(
      lambda n: nan_max(n.as_float(), initial=0), jnp.maximum, nan_pmax
    )
  # Each unit norm as m * 2**E (0.5 <= m < 1), all rescaled to the largest
  # E: exact powers of two, no division. Non-finite norms are added at the
  # end (inf or NaN), so that no inf * 0 appears.
  floor = jnp.iinfo(jnp.int32).min // 2

  def normalized(n):
    ok = jnp.isfinite(n.value)
    return normalize(Scaled(jnp.where(ok, n.value, 0), n.exponent))

  def top_exponent(n):
    m, e = normalized(n)
    return jnp.max(jnp.where(m > 0, e, floor), initial=floor)

  top = over_devices(top_exponent, jnp.maximum, jax.lax.pmax)

  def power_sum(n):
    m, e = normalized(n)
    return jnp.sum(pth_power(ldexp(m, e - top), ord))

  total = over_devices(power_sum, jnp.add, jax.lax.psum)
  bad = over_devices(
    lambda n: jnp.sum(jnp.where(jnp.isfinite(n.value), 0, n.value)),
    jnp.add,
    jax.lax.psum,
  )
  top = jnp.where(total > 0, top, 0)
  return Scaled(safe_root(total, ord), top).as_float() + bad


def _combine_norms_fast(norms, ord, across):  # pylint: disable=redefined-builtin
  """combine_norms with the norms of each group (one device's, one vector)
  reduced in one multi-output pass (:func:`_power_sums`).
  """
  groups = {}
  for n, names in zip(norms, across):
    groups.setdefault(names, []).append(n)
  sums = []
  for names, members in groups.items():
    (flat,) = _flat_scaled(members)
    ((q, e, bad),), _ = _power_sums([flat], [], ord)
    if names:
      top = jax.lax.pmax(e, names)
      q = jax.lax.psum(q * _power_scale(e - top, ord, q.dtype), names)
      e, bad = top, jax.lax.psum(bad, names)
    sums.append((q, e, bad))
  return _finish(sums, ord)


def _finish(sums, ord) -> jax.Array:  # pylint: disable=redefined-builtin
  """The norm from ``(q, E, bad)`` sums of disjoint sets (_power_sums)."""
  top = functools.reduce(jnp.maximum, [e for _, e, _ in sums])
  if len(sums) == 1:
    total, _, bad = sums[0]
  else:
    total = functools.reduce(
      jnp.add, [q * _power_scale(e - top, ord, q.dtype) for q, e, _ in sums]
    )
    bad = functools.reduce(jnp.add, [b for _, _, b in sums])
  top = jnp.where(total > 0, top, 0)
  return Scaled(safe_root(total, ord), top).as_float() + bad


_combine_norms_custom = with_plain_derivative(
  _combine_norms_fast, _combine_norms_plain, n_args=3, n_static=2
)


def combine_norms_each(
  norms: Sequence[Union[jax.Array, Scaled]],
  ord: float = 2.0,  # pylint: disable=redefined-builtin
  *,
  counts: Sequence[jax.Array] = (),
) -> tuple[list[jax.Array], list[jax.Array]]:
  """``[combine_norms([n], ord) for n in norms]``, and the number of True
  entries of each boolean array of ``counts`` (float32, exact below
  2**24), for arrays of unit norms of one shape and dtype on one device: in
  one pass (see :func:`_power_sums`), so that a clipper's statistics over
  the units of many leaves are one kernel to compile.
  """
  scaled = [as_scaled(n) for n in norms]
  flags = list(counts)
  shapes = {jnp.shape(n.value) for n in scaled} | {jnp.shape(c) for c in flags}
  if (
    math.isinf(ord)
    or not scaled
    or len(shapes) > 1
    or len({np.dtype(n.value.dtype) for n in scaled}) > 1
    or any(may_span_devices(n.value) for n in scaled)
  ):
    return (
      [combine_norms([n], ord) for n in scaled],
      [_count_plain(c) for c in flags],
    )
  return _combine_each_custom(scaled, flags, ord)


def _count_plain(mask: jax.Array) -> jax.Array:
  return jnp.sum(mask, dtype=jnp.float32)


def _combine_each_fast(norms, flags, ord):  # pylint: disable=redefined-builtin
  flat = [Scaled(jnp.ravel(n.value), jnp.ravel(n.exponent)) for n in norms]
  sums, counts = _power_sums(flat, [jnp.ravel(f) for f in flags], ord)
  return [_finish([s], ord) for s in sums], counts


def _combine_each_plain(norms, flags, ord):  # pylint: disable=redefined-builtin
  return (
    [_combine_norms_plain([n], ord, ((),)) for n in norms],
    [_count_plain(f) for f in flags],
  )


_combine_each_custom = with_plain_derivative(
  _combine_each_fast, _combine_each_plain, n_args=3, n_static=1
)


def _power_scale(d: jax.Array, p: float, dtype) -> jax.Array:
  """``(2**d)**p`` for int32 ``d <= 0`` (0 once ``2**d`` is below the
  dtype's normal range).
  """
  return pth_power(pow2(jnp.maximum(d, -(1 << 16)), dtype), p)


def _power_sums(norms: Sequence[Scaled], flags: Sequence[jax.Array], p):
  """Per vector of unit norms (all of one shape and dtype), ``(q, E,
  bad)``: the sum of the p-th powers of its finite norms is ``q * 2**(p *
  E)`` (``q`` at most the number of norms, ``E`` the largest exponent of a
  nonzero one),
  ``bad`` the sum of the non-finite ones (inf or NaN; 0 if none); and per
  boolean vector of ``flags``, its number of True entries (float32). All
  in one pass.

  One multi-output reduction, each partial result carrying its own largest
  exponent (two partials are merged by rescaling the smaller by an exact
  power of two): XLA:CPU compiles it into one kernel with the arithmetic
  that produces its operands, and leaves it whole, where it splits a
  single-output reduction of more than 32 elements into a reduce-window
  and a reduce, its operands a kernel of their own: three separate
  reductions (largest exponent, power sum, non-finite sum) were some ten
  kernels to compile for each statistic of a clipper on many leaves.
  Summed in the order of the vector, the terms are those of
  ``sum((m * 2**(e - E))**p)`` for integer p.
  """
  floor = jnp.iinfo(jnp.int32).min // 2
  operands, inits, kinds = [], [], []
  for n in norms:
    ok = jnp.isfinite(n.value)
    m, e = normalize(Scaled(jnp.where(ok, n.value, 0), n.exponent))
    operands += [pth_power(m, p), jnp.where(m > 0, e, floor)]
    operands.append(jnp.where(ok, 0, n.value))
    inits += [jnp.zeros((), m.dtype), jnp.asarray(floor, jnp.int32)]
    inits.append(jnp.zeros((), n.value.dtype))
    kinds.append(m.dtype)
  # Counted in the norms' dtype (one float type in a reduction).
  wide = kinds[0] if kinds else jnp.float32
  for f in flags:
    operands.append(f.astype(wide))
    inits.append(jnp.zeros((), wide))

  def merge(u, v):
    out = []
    for k, dtype in enumerate(kinds):
      (q1, e1, b1), (q2, e2, b2) = u[3 * k : 3 * k + 3], v[3 * k : 3 * k + 3]
      top = jnp.maximum(e1, e2)
      q = q1 * _power_scale(e1 - top, p, dtype)
      out += [q + q2 * _power_scale(e2 - top, p, dtype), top, b1 + b2]
    return tuple(out) + tuple(
      a + b for a, b in zip(u[3 * len(kinds) :], v[3 * len(kinds) :])
    )

  axes = tuple(range(operands[0].ndim))
  out = jax.lax.reduce(tuple(operands), tuple(inits), merge, axes)
  sums = [tuple(out[3 * k : 3 * k + 3]) for k in range(len(kinds))]
  return sums, [c.astype(jnp.float32) for c in out[3 * len(kinds) :]]


def combine_norms_scaled(
  norms: Sequence[Scaled],
  ord: float = 2.0,  # pylint: disable=redefined-builtin
) -> Scaled:
  """The p-norm of a set of unit norms (:class:`Scaled`), as a Scaled scalar.

  As :func:`combine_norms` (on one device), but exact beyond the dtype's
  range: what a clip factor is computed from when a global norm is put
  together from per-leaf norms (``leaf_stats=True``).
  """
  if not norms:
    return as_scaled(jnp.zeros((), jnp.float32))
  flat = _flat_scaled([as_scaled(n) for n in norms])
  parts = [reduce_norms(n, ord) for n in flat]
  if len(parts) == 1:
    return parts[0]
  return reduce_norms(
    Scaled(
      jnp.stack([n.value for n in parts]),
      jnp.stack([n.exponent for n in parts]),
    ),
    ord,
  )


def reduce_norms(
  norms: Scaled,
  ord: float = 2.0,  # pylint: disable=redefined-builtin
  axes: Optional[tuple[int, ...]] = None,
  *,
  keepdims: bool = False,
  names: tuple[str, ...] = (),
) -> Scaled:
  """The p-norm over ``axes`` of an array of unit norms, exactly.

  ``norms`` are the p-norms of disjoint units; the result is the p-norm of
  their union along ``axes`` (all axes by default) and, inside
  ``shard_map``/``pmap``, across the devices along ``names`` (each holding
  other units). Mantissas are rescaled to the largest exponent by exact
  powers of two, so norms beyond the dtype's range combine exactly. A NaN
  unit gives NaN, an infinite one inf. A pass over the (small) norm arrays
  only; no derivative is meant to flow through it (statistics).
  """
  axes = tuple(range(norms.value.ndim)) if axes is None else tuple(axes)
  if math.isinf(ord):
    top = nan_max(norms.as_float(), axes, keepdims=keepdims, initial=0)
    return as_scaled(nan_pmax(top, names))
  ok = jnp.isfinite(norms.value)
  m, e = normalize(Scaled(jnp.where(ok, norms.value, 0), norms.exponent))
  floor = jnp.iinfo(jnp.int32).min // 2
  top = nan_pmax(
    jnp.max(
      jnp.where(m > 0, e, floor), axis=axes, keepdims=True, initial=floor
    ),
    names,
  )
  total = jnp.sum(
    pth_power(ldexp(m, e - top), ord), axis=axes, keepdims=keepdims
  )
  bad = jnp.sum(jnp.where(ok, 0, norms.value), axis=axes, keepdims=keepdims)
  if names:
    total, bad = jax.lax.psum((total, bad), names)
  if not keepdims:
    top = jnp.squeeze(top, axes)
  top = jnp.where(total > 0, top, 0)
  return Scaled(safe_root(total, ord) + bad, top)


# Ghost norms (optaxclip/_ghost.py) leave the backward pass as the cotangent
# of a probe array, which automatic differentiation sums over the layers
# and the steps of an ``nn.scan``: addition is all they go through. A
# squared norm beyond float32's range (an example's gradient norm above
# about 1.8e19) cannot be one float32 number there, so each one is written,
# as ``m * 2**(E - BUCKET_BITS * j)`` with ``E`` its exponent, into row
# ``j = E // BUCKET_BITS`` of a stack of rows: rows add up as the numbers
# they stand for, and :func:`bucket_norms` turns the sums back into exact
# :class:`Scaled` norms.

BUCKET_BITS = 64
# Rows j = FIRST_BUCKET, ..., FIRST_BUCKET + N_BUCKETS - 1: exponents -704 to
# 703, beyond every squared norm of finite float32 values (2**256 per
# element at most, times the element count).
FIRST_BUCKET = -11
N_BUCKETS = 22


def row_scales(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per row ``b`` of ``x`` (leading axis ``B``), the power of two
  ``2**-E_b`` that brings its largest magnitude near 1 (see
  ``scale_exponent``), in the accumulation dtype and shaped to broadcast
  against ``x`` (or any slice of its trailing axes), and the int32 ``(B,)``
  exponents ``E``.

  Products and squares of rows scaled by it (``x * scale``: exact) neither
  overflow nor underflow, whatever the rows' magnitudes; one reduction over
  ``x``, no scaled copy of it.
  """
  dtype = accumulation_dtype(x.dtype)
  axes = tuple(range(1, x.ndim))
  m = jax.lax.stop_gradient(jnp.max(magnitude(x, dtype), axis=axes, initial=0))
  e = scale_exponent(m)
  return pow2(-e, dtype).reshape((-1,) + (1,) * len(axes)), e


def to_buckets(squares: Scaled) -> jax.Array:
  """Non-negative numbers (a :class:`Scaled` of any shape ``S``, in any
  range) as ``(N_BUCKETS,) + S`` rows: each number in the row of its
  exponent, scaled into ``[0.5, 2**BUCKET_BITS)`` there, 0 elsewhere.

  Sums of such rows go back with :func:`bucket_norms`. Inf and NaN stay as
  they are (in row 0 unless their exponent says otherwise); numbers below
  the first row's range are lost (below 2**-704).
  """
  m, e = normalize(squares)
  last = FIRST_BUCKET + N_BUCKETS - 1
  j = jnp.clip(jnp.floor_divide(e, BUCKET_BITS), FIRST_BUCKET, last)
  value = ldexp(m, e - BUCKET_BITS * j)
  rows = np.arange(FIRST_BUCKET, last + 1, dtype=np.int32)
  rows = rows.reshape((-1,) + (1,) * m.ndim)
  return jnp.where(j[None] == rows, value[None], jnp.zeros((), m.dtype))


def bucket_norms(rows: jax.Array) -> Scaled:
  """The square roots, exact, of the numbers that ``rows`` (sums of
  :func:`to_buckets` rows, shape ``(N_BUCKETS,) + S``) stand for: the L2
  norms whose squares were written, as a :class:`Scaled` of shape ``S``.
  """
  if BUCKET_BITS % 2:  # pragma: no cover
    raise AssertionError("BUCKET_BITS must be even")
  half = np.arange(FIRST_BUCKET, FIRST_BUCKET + N_BUCKETS) * (BUCKET_BITS // 2)
  exponents = jnp.broadcast_to(
    jnp.asarray(half, jnp.int32).reshape((-1,) + (1,) * (rows.ndim - 1)),
    rows.shape,
  )
  return reduce_norms(Scaled(safe_root(rows, 2.0), exponents), 2.0, (0,))
