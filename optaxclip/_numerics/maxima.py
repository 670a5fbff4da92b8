"""Largest magnitudes and counts above a limit, as integer bits.

Owns the largest ``|x|`` of a leaf, a row or a part (as a value, or as a
:class:`Scaled` beyond the dtype's range) and the number of elements whose
``|x|`` exceeds a limit; the fast paths compare the magnitudes' bits as
integers in one multi-output reduction.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip._numerics.collectives import may_span_devices
from optaxclip._numerics.collectives import nan_pmax
from optaxclip._numerics.floats import Scaled
from optaxclip._numerics.floats import accumulation_dtype
from optaxclip._numerics.floats import as_scaled
from optaxclip._numerics.floats import ldexp
from optaxclip._numerics.floats import magnitude
from optaxclip._numerics.floats import pow2
from optaxclip._numerics.floats import scale_exponent
from optaxclip._numerics.floats import scale_parts
from optaxclip._numerics.layouts import UnitLayout
from optaxclip._numerics.reductions import count
from optaxclip._numerics.reductions import drops_nan
from optaxclip._numerics.reductions import extremes_plain
from optaxclip._numerics.reductions import nan_extremes
from optaxclip._numerics.reductions import nan_max
from optaxclip._numerics.reductions import reduce_axes
from optaxclip._numerics.reductions import with_plain_derivative


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
  # integer max to its reduction fusion, which writes the bits out in full:
  # a leaf-sized temporary and a second pass, which make an ord=inf
  # clipper's step far slower (docs/performance.md).
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
  scalar loop, several times slower, in float16 even more so
  (``docs/performance.md``).

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
