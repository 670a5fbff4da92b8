"""The numerics every clipper shares, as the rest of the package names them.

The names defined in :mod:`optaxclip._numerics` (its docstring maps the
modules and states the rules every norm follows) are re-exported here;
the concepts defined here still: maxima, norms.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
import math
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip._numerics.collectives import axis_size as axis_size
from optaxclip._numerics.collectives import may_span_devices as may_span_devices
from optaxclip._numerics.collectives import nan_pmax
from optaxclip._numerics.collectives import on_every_device
from optaxclip._numerics.collectives import psum_sharded as psum_sharded
from optaxclip._numerics.collectives import sharded_flags
from optaxclip._numerics.collectives import varying as varying
from optaxclip._numerics.floats import Scaled as Scaled
from optaxclip._numerics.floats import accumulation_dtype as accumulation_dtype
from optaxclip._numerics.floats import as_scaled as as_scaled
from optaxclip._numerics.floats import exponent as exponent
from optaxclip._numerics.floats import ldexp as ldexp
from optaxclip._numerics.floats import magnitude as magnitude
from optaxclip._numerics.floats import normalize as normalize
from optaxclip._numerics.floats import pow2 as pow2
from optaxclip._numerics.floats import product as product
from optaxclip._numerics.floats import promote_types as promote_types
from optaxclip._numerics.floats import pth_power
from optaxclip._numerics.floats import safe_root as safe_root
from optaxclip._numerics.floats import scale_exponent as scale_exponent
from optaxclip._numerics.floats import scale_parts
from optaxclip._numerics.floats import scaled_product as scaled_product
from optaxclip._numerics.floats import select as select
from optaxclip._numerics.floats import (
  tree_accumulation_dtype as tree_accumulation_dtype,
)
from optaxclip._numerics.layouts import PACKED_SCALE_SIZE as PACKED_SCALE_SIZE
from optaxclip._numerics.layouts import UnitLayout as UnitLayout
from optaxclip._numerics.layouts import handed_run as handed_run
from optaxclip._numerics.layouts import handing_over as handing_over
from optaxclip._numerics.layouts import take_leaf as take_leaf
from optaxclip._numerics.layouts import take_leaves as take_leaves
from optaxclip._numerics.packing import CHUNK_SIZE as CHUNK_SIZE
from optaxclip._numerics.packing import SMALL_LEAF_SIZE as SMALL_LEAF_SIZE
from optaxclip._numerics.packing import blocked_concat as blocked_concat
from optaxclip._numerics.packing import chunked as chunked
from optaxclip._numerics.packing import concat_parts as concat_parts
from optaxclip._numerics.packing import concatenable as concatenable
from optaxclip._numerics.packing import flat_concat
from optaxclip._numerics.packing import packed_pieces
from optaxclip._numerics.packing import part_groups as part_groups
from optaxclip._numerics.packing import split_parts as split_parts
from optaxclip._numerics.packing import take_each as take_each
from optaxclip._numerics.reductions import all_true as all_true
from optaxclip._numerics.reductions import count as count
from optaxclip._numerics.reductions import drops_nan
from optaxclip._numerics.reductions import extremes_plain
from optaxclip._numerics.reductions import max_sum_all as max_sum_all
from optaxclip._numerics.reductions import nan_extremes as nan_extremes
from optaxclip._numerics.reductions import nan_max as nan_max
from optaxclip._numerics.reductions import reduce_axes
from optaxclip._numerics.reductions import with_plain_derivative
from optaxclip._numerics.scaling import clip_factor as clip_factor
from optaxclip._numerics.scaling import clip_scale as clip_scale
from optaxclip._numerics.scaling import clip_scale_parts as clip_scale_parts
from optaxclip._numerics.scaling import is_scaled_down as is_scaled_down
from optaxclip._numerics.scaling import materialized as materialized
from optaxclip._numerics.scaling import materialized_rows as materialized_rows
from optaxclip._numerics.scaling import (
  materialized_scaled as materialized_scaled,
)
from optaxclip._numerics.scaling import ratio as ratio
from optaxclip._numerics.scaling import scale_all as scale_all
from optaxclip._numerics.scaling import scale_each as scale_each
from optaxclip._numerics.scaling import scale_leaf as scale_leaf
from optaxclip._numerics.scaling import (
  smallest_clip_factor as smallest_clip_factor,
)
from optaxclip._numerics.sums import across_devices
from optaxclip._numerics.sums import direct_sums
from optaxclip._numerics.sums import exact_rows as exact_rows
from optaxclip._numerics.sums import merge_scaled
from optaxclip._numerics.sums import scaled_norm as scaled_norm
from optaxclip._numerics.sums import scaled_sum as scaled_sum
from optaxclip._numerics.sums import trusted_max as trusted_max
from optaxclip._numerics.sums import trusted_min as trusted_min
from optaxclip._numerics.sums import trusted_sum as trusted_sum
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


def largest_and_count_above(x: jax.Array, limit: Any):
  """``(max |x|, number of elements with |x| > limit)``, in one pass.

  Both float32 scalars (the count as a float, exact up to 2**24; a NaN is
  the max and counts; 0 and 0 for an empty ``x``): the statistics
  clip_value takes of a leaf of its own (see largest_and_count_parts). One
  two-output integer reduction on one device (see
  ``_largest_and_count_reduce``), plain reductions for a leaf that may span
  devices.
  """
  dtype = accumulation_dtype(x.dtype)
  limit = jnp.asarray(limit, dtype)
  a = magnitude(x, dtype) if jnp.iscomplexobj(x) else x
  if _counts_in_one_pass(x):
    biggest, n_over = _largest_and_count(a, limit)
  else:
    biggest, n_over = largest_magnitude(x), _count_over_plain(a, limit)
  return biggest.astype(jnp.float32), n_over


# Leaves above this size have their statistics estimated from a sample
# (clip_value's stats="sampled", count_above).
EXACT_COUNT_SIZE = 1 << 16
# The sample: every SAMPLE_STRIDE-th element (a prime, so that it does not
# line up with the rows of a matrix of any usual width).
SAMPLE_STRIDE = 257


def largest_magnitude(
  x: jax.Array,
  axis: Optional[tuple[int, ...]] = None,
  *,
  keepdims: bool = False,
) -> jax.Array:
  """``max |x|`` over ``axis`` (all axes by default) in the accumulation
  dtype (0 over no elements; NaN where x holds a NaN, else inf where it
  holds an inf).

  On one device, the largest of the magnitudes' bits as integers
  (``_largest_and_count_reduce``: XLA:CPU vectorises it, where it did not
  vectorise a NaN-keeping max of floats); on leaves that may span devices,
  from ``max(x)`` and ``min(x)`` (:func:`nan_extremes`), reductions the
  partitioner splits. A complex leaf's moduli are reduced as a real leaf.
  """
  dtype = accumulation_dtype(x.dtype)
  axes = reduce_axes(x, axis)
  if any(x.shape[d] == 0 for d in axes):
    shape = [1 if d in axes else n for d, n in enumerate(x.shape)]
    if not keepdims:
      shape = [n for d, n in enumerate(x.shape) if d not in axes]
    return jnp.zeros(shape, dtype)
  if jnp.iscomplexobj(x):
    x = magnitude(x, dtype)  # the moduli, then as a real leaf
  if drops_nan(x) and not may_span_devices(x):
    return _largest_magnitude_custom(x, axes, keepdims).astype(dtype)
  top, bottom = nan_extremes(x, axes, keepdims=keepdims)
  return jnp.maximum(top, -bottom).astype(dtype)


def _largest_magnitude_fast(x, axes, keepdims):
  # With the count of NaN elements (those above an inf limit) as the second
  # output, used: XLA drops an unused output, and hands a single-output
  # integer max to its reduction fusion, which writes the bits out in full
  # (2.4x Adam's step on 64 x 400k float32 values for chain(clip_global(1,
  # ord=inf), adam), against 1.2x so).
  top, n_nan = _largest_and_count_reduce(x, jnp.inf, axes)
  top = jnp.where(n_nan > 0, jnp.asarray(jnp.nan, x.dtype), top)
  return jnp.expand_dims(top, axes) if keepdims else top


def _largest_magnitude_plain(x, axes, keepdims):
  top, bottom = extremes_plain(x, axes, keepdims)
  return jnp.maximum(top, -bottom)


_largest_magnitude_custom = with_plain_derivative(
  _largest_magnitude_fast, _largest_magnitude_plain, n_args=3, n_static=2
)


def largest_modulus(
  x: jax.Array,
  axes: Optional[tuple[int, ...]] = None,
  names: tuple[str, ...] = (),
  *,
  keepdims: bool = False,
) -> Scaled:
  """:func:`largest_magnitude` over ``axes`` (all by default), ``pmax``-ed
  over the mapped axes ``names``, as :class:`Scaled`.

  A complex modulus may exceed the range while both parts are finite
  (-2.7e37 + 3.4e38j): a complex ``x`` is scaled by the power of two of
  its units' largest part first (the same on every device), as
  :func:`modulus` does element by element, so that the largest modulus of
  finite values is finite. NaN and inf stay as largest_magnitude gives
  them.
  """
  if not jnp.iscomplexobj(x):
    return as_scaled(
      nan_pmax(largest_magnitude(x, axes, keepdims=keepdims), names)
    )
  part = nan_pmax(largest_part(x, axes, keepdims=True), names)
  e = scale_exponent(part)
  top = nan_pmax(
    largest_magnitude(
      scale_parts(x, pow2(-e, part.dtype)), axes, keepdims=True
    ),
    names,
  )
  if not keepdims:
    dims = reduce_axes(x, axes)
    top, e = jnp.squeeze(top, dims), jnp.squeeze(e, dims)
  return Scaled(top, e)


def largest_scaled(maxima: Sequence[Scaled], dtype) -> Scaled:
  """The largest of scalar :class:`Scaled` numbers, in ``dtype`` (NaN if one
  is NaN): each rescaled to the largest exponent by a power of two.
  """
  top = functools.reduce(jnp.maximum, [m.exponent for m in maxima])
  value = functools.reduce(
    jnp.maximum,
    [ldexp(m.value.astype(dtype), m.exponent - top) for m in maxima],
  )
  return Scaled(value, top)


def largest_part(
  x: jax.Array,
  axes: Optional[tuple[int, ...]] = None,
  *,
  keepdims: bool = False,
) -> jax.Array:
  """:func:`largest_magnitude` of a real leaf over ``axes`` (all by
  default); of a complex one, the largest magnitude of its real and
  imaginary parts. Finite exactly when every element is, where a complex
  modulus may exceed the range (3e38 + 3e38j).
  """
  if not jnp.iscomplexobj(x):
    return largest_magnitude(x, axes, keepdims=keepdims)
  return jnp.maximum(
    largest_magnitude(x.real, axes, keepdims=keepdims),
    largest_magnitude(x.imag, axes, keepdims=keepdims),
  )


def modulus(x: jax.Array) -> Scaled:
  """``|x|`` element-wise as :class:`Scaled`, in the accumulation dtype: a
  complex modulus beyond the range (both parts finite) is exact, taken
  after scaling by the power of two of the larger part.
  """
  dtype = accumulation_dtype(x.dtype)
  if not jnp.iscomplexobj(x):
    return as_scaled(magnitude(x, dtype))
  part = jnp.maximum(magnitude(x.real, dtype), magnitude(x.imag, dtype))
  e = scale_exponent(part)
  return Scaled(magnitude(scale_parts(x, pow2(-e, dtype)), dtype), e)


def count_above(x: jax.Array, limit: Any) -> jax.Array:
  """The number of elements with ``|x| > limit``, a float32 scalar.

  Exact for leaves of at most ``EXACT_COUNT_SIZE`` elements and for leaves
  that may span devices; for larger ones, estimated from every
  ``SAMPLE_STRIDE``-th element (scaled to the leaf's size). clip_value
  calls it only for the leaves that its one-pass count does not take (see
  ``_counts_in_one_pass``): leaves that may span devices, and leaves of
  2**31 elements or more, whose exact count is not one int32 reduction.
  """
  dtype = accumulation_dtype(x.dtype)
  sample, weight = sample_elements(x)
  a = magnitude(sample, dtype)
  return count_over(a, jnp.asarray(limit, dtype)) * weight


def sample_elements(x: jax.Array) -> tuple[jax.Array, float]:
  """The elements statistics are estimated from, and how many each stands for.

  A leaf of at most ``EXACT_COUNT_SIZE`` elements, or one that may span
  devices (no reshape: no all-gather), is its own sample (weight 1); a
  larger one is sampled at every ``SAMPLE_STRIDE``-th element.
  """
  if x.size <= EXACT_COUNT_SIZE or may_span_devices(x):
    return x, 1.0
  flat = jnp.ravel(x)
  sample = flat[::SAMPLE_STRIDE]
  return sample, flat.size / sample.size


def largest_and_count_parts(
  layout: UnitLayout,
  leaves: Sequence[jax.Array],
  limit: Any,
  *,
  sampled: bool = False,
) -> list[tuple[jax.Array, jax.Array, int, jax.Array]]:
  """Per part of ``layout`` (whole leaves as units): the largest magnitude
  of each leaf, the number of its elements not within ``|x| <= limit``
  (float32; NaN counts), the leaf's size, and whether the leaf is finite (a
  complex modulus may exceed the range while both parts are finite: see
  :func:`largest_part`).

  Small leaves stacked as rows are reduced at once, along the rows (exact
  counts); other leaves as :func:`largest_magnitude` and
  :func:`count_above` do, or, with ``sampled``, every statistic of such a
  leaf from :func:`sample_elements` (no pass over a large leaf). Values are
  per unit, keepdims, as the layout's parts' unit values (see
  :meth:`UnitLayout.unpack`).
  """
  out = []
  parts = layout.pack(list(leaves), together=True)
  for (kind, _, _), part in zip(layout.parts, parts):
    if kind == "leaf" and sampled:
      if part.size == 0:
        zero = jnp.zeros((), jnp.float32)
        out.append((largest_magnitude(part), zero, 0, jnp.array(True)))
        continue
      sample, weight = sample_elements(part)
      if not _counts_in_one_pass(sample):
        a = magnitude(sample)
        n_over = count_over(a, jnp.asarray(limit, a.dtype)) * weight
        finite = largest_part(sample) < jnp.inf
        out.append((nan_max(a), n_over, int(part.size), finite))
        continue
      # One reduction of the sample for all three statistics: three of
      # them read the strided sample three times (a cache line an element).
      biggest, n_over, finite = _one_pass_stats(sample, limit)
      out.append((biggest, n_over * weight, int(part.size), finite))
      continue
    if kind == "leaf" and _counts_in_one_pass(part):
      biggest, n_over, finite = _one_pass_stats(part, limit)
      out.append((biggest, n_over, int(part.size), finite))
      continue
    if kind == "leaf":
      biggest = largest_magnitude(part)
      finite = (
        largest_part(part) if jnp.iscomplexobj(part) else biggest
      ) < jnp.inf
      out.append((biggest, count_above(part, limit), int(part.size), finite))
      continue
    m = jax.lax.optimization_barrier(part)  # read once, as _power_sum_fast
    biggest, n_over = _row_largest_and_count(m, jnp.asarray(limit, m.dtype))
    out.append((biggest, n_over, int(m.shape[1]), biggest < jnp.inf))
  return out


def _one_pass_stats(x: jax.Array, limit: Any):
  """``(largest magnitude, count above limit, finite)`` of a leaf (or a
  sample of one) that :func:`_counts_in_one_pass` takes, in one reduction:
  the largest in the accumulation dtype, a complex leaf by its moduli.
  """
  dtype = accumulation_dtype(x.dtype)
  complex_ = jnp.iscomplexobj(x)
  biggest, n_over = _largest_and_count(
    magnitude(x) if complex_ else x, jnp.asarray(limit, dtype)
  )
  biggest = biggest.astype(dtype)
  return biggest, n_over, (largest_part(x) if complex_ else biggest) < jnp.inf


def _counts_in_one_pass(x: jax.Array) -> bool:
  """Whether :func:`_largest_and_count` takes leaf ``x`` (a complex one as
  its modulus): not empty, on one device (a reduction the partitioner would
  not split: see :func:`nan_extremes`), its count exact in int32.
  """
  return (
    x.size > 0
    and jnp.issubdtype(x.dtype, jnp.inexact)
    and x.size < 2**31
    and not may_span_devices(x)
  )


_SIGNED_INT = {2: np.int16, 4: np.int32, 8: np.int64}


def magnitude_bits(x: jax.Array) -> jax.Array:
  """The bits of ``|x|`` (a real float array) as a signed integer of its
  width: ordered as the magnitudes are, exactly (subnormals apart from 0,
  which XLA:CPU's float comparisons are not), with every NaN above inf.
  """
  int_dtype = _SIGNED_INT[np.dtype(x.dtype).itemsize]
  return jax.lax.bitwise_and(
    jax.lax.bitcast_convert_type(x, int_dtype),
    int_dtype(np.iinfo(int_dtype).max),
  )


def limit_bits(limit: Any, dtype: Any) -> jax.Array:
  """The integer ``b`` with ``|x| > limit`` exactly when ``magnitude_bits(x)
  > b``, for every ``x`` of the real float ``dtype`` (a NaN ``x`` above any
  limit): the bits of the largest value of ``dtype`` not above ``limit``
  (a float scalar of any width), -1 when none is (``limit`` negative or
  NaN: every element counts).
  """
  limit = jnp.asarray(limit)
  size = magnitude_bits(limit)  # the limit's own magnitude, as bits
  near = limit.astype(dtype)
  narrow, wide = jnp.finfo(limit.dtype), jnp.finfo(dtype)
  if float(narrow.smallest_subnormal) >= float(wide.smallest_normal):
    # Widened from a dtype whose subnormals are normal in ``dtype``: a
    # subnormal limit widened as its count of smallest subnormals, exactly
    # (XLA:CPU's conversion flushes it to 0).
    subnormal = size.astype(dtype) * jnp.asarray(
      narrow.smallest_subnormal, dtype
    )
    is_subnormal = size < magnitude_bits(jnp.asarray(narrow.tiny, limit.dtype))
    near = jnp.where(is_subnormal, subnormal, near)
  bits = magnitude_bits(near)
  # As integers: XLA:CPU compares subnormals as zeros.
  rounded_up = magnitude_bits(near.astype(limit.dtype)) > size
  bits = jax.lax.sub(bits, rounded_up.astype(bits.dtype))
  # Negative and NaN read from the bits: XLA:CPU compares a negative
  # subnormal limit as 0.
  own = jax.lax.bitcast_convert_type(
    limit, _SIGNED_INT[np.dtype(limit.dtype).itemsize]
  )
  within = ((own >= 0) | (size == 0)) & (
    size <= magnitude_bits(jnp.asarray(jnp.inf, limit.dtype))
  )
  return jnp.where(within, bits, -1).astype(bits.dtype)


def _above(x: jax.Array, limit: Any) -> jax.Array:
  """``|x| > limit`` element-wise for the real float ``x`` (NaN is above),
  compared as integers (:func:`magnitude_bits`, :func:`limit_bits`): exact
  for subnormals.
  """
  return magnitude_bits(x) > limit_bits(limit, x.dtype)


def count_over(x: jax.Array, limit: Any) -> jax.Array:
  """The number of elements of the real float ``x`` with ``|x| > limit`` (a
  NaN counts), a float32 scalar (:func:`count`), compared exactly
  (:func:`_above`).
  """
  return count(_above(x, limit))


def _largest_and_count_reduce(x, limit, axes):
  """``(max |x|, number of elements with |x| > limit)`` over ``axes`` (a NaN
  counts, and is the max) in one two-output ``lax.reduce`` of integers:
  the max of :func:`magnitude_bits` (which keeps NaN with no select) and
  the sum of their comparison with :func:`limit_bits`. XLA:CPU vectorises
  it, where the same reduction of floats with NaN-keeping merges is a
  scalar loop (clip_value's step on 64 float32 leaves of 400k: 1.25x
  Adam's against 2.2x-2.5x; float16 1.3x against 4.0x).

  The max in ``x``'s dtype, the count in int32.
  """
  top, n_over = jax.lax.reduce(
    (magnitude_bits(x), _above(x, limit).astype(jnp.int32)),
    (
      jnp.zeros((), _SIGNED_INT[np.dtype(x.dtype).itemsize]),
      jnp.zeros((), jnp.int32),
    ),
    lambda u, v: (jax.lax.max(u[0], v[0]), jax.lax.add(u[1], v[1])),
    axes,
  )
  return jax.lax.bitcast_convert_type(top, x.dtype), n_over


def _count_over_plain(x, limit, axes=None, keepdims=False):
  return jnp.sum(
    _above(x, limit), axis=axes, keepdims=keepdims, dtype=jnp.float32
  )


def _largest_and_count_fast(x, limit):
  top, n_over = _largest_and_count_reduce(x, limit, tuple(range(x.ndim)))
  return top, n_over.astype(jnp.float32)


def _largest_and_count_plain(x, limit):
  top, bottom = nan_extremes(x)
  return jnp.maximum(top, -bottom), _count_over_plain(x, limit)


# A whole leaf's largest magnitude (NaN if it holds one) and number of
# elements with |x| > limit (a NaN counts), in one pass: the count (int32,
# returned as float32: exact up to 2**24, then to float32's precision) comes
# with the read that the max needs anyway, where a count of its own was a
# second pass. Derivatives from the plain formulas.
_largest_and_count = with_plain_derivative(
  _largest_and_count_fast,
  _largest_and_count_plain,
  n_args=2,
  n_static=0,
)


def _row_largest_and_count_plain(m, limit):
  top, bottom = nan_extremes(m, (1,), keepdims=True)
  return (
    jnp.maximum(top, -bottom),
    _count_over_plain(m, limit, (1,), keepdims=True),
  )


def _row_largest_and_count_fast(m, limit):
  top, n_over = _largest_and_count_reduce(m, limit, (1,))
  return top[:, None], n_over[:, None].astype(jnp.float32)


# Per row of a matrix: the largest magnitude and the number of elements with
# |x| > limit (float32; a NaN counts, as an element not kept as it was), in
# one two-output reduction. XLA:CPU compiles it as one kernel with the
# comparison, where single-output reductions (split into reduce-window and
# reduce above 32 elements a row) and their operands were some three
# kernels a part shape: clip_value's statistics on many small leaves.
# Derivatives from the plain formulas.
_row_largest_and_count = with_plain_derivative(
  _row_largest_and_count_fast,
  _row_largest_and_count_plain,
  n_args=2,
  n_static=0,
)


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
