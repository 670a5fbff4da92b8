"""Clip factors and scaling leaves by them.

Owns clip factors and applying them to leaves by exact powers of two.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
import math
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip._numerics.collectives import axis_size
from optaxclip._numerics.collectives import may_span_devices
from optaxclip._numerics.collectives import varying
from optaxclip._numerics.floats import Scaled
from optaxclip._numerics.floats import accumulation_dtype
from optaxclip._numerics.floats import as_scaled
from optaxclip._numerics.floats import exp_range
from optaxclip._numerics.floats import ldexp
from optaxclip._numerics.floats import normalize
from optaxclip._numerics.floats import pow2
from optaxclip._numerics.floats import promote_types
from optaxclip._numerics.floats import scaled_value
from optaxclip._numerics.packing import flat_concat
from optaxclip._numerics.packing import split_parts
from optaxclip._numerics.packing import take_each
from optaxclip._typing import AxisName


def scale_each(
  leaves: Sequence[jax.Array],
  factors: Union[jax.Array, Scaled],
  shapes: Optional[Sequence[tuple[int, ...]]] = None,
) -> list[jax.Array]:
  """``[scale_leaf(x_i, factors[i])]`` for an array of factors, row i for
  leaf i.

  ``factors`` is a vector (one factor a leaf) or a ``(leaves, units)``
  matrix whose row i, reshaped to ``shapes[i]`` (a shape that broadcasts
  against leaf i, e.g. its units' keepdims shape), scales leaf i. The
  multipliers that scale_leaf applies one after the other are computed on
  the factor array (per leaf dtype), and each leaf takes its row of them
  at once with :func:`take_each`: kernels shared by the leaves of one
  shape, not one per leaf.
  """
  leaves = list(leaves)
  shapes = [()] * len(leaves) if shapes is None else list(shapes)
  by_dtype = {}
  for i, x in enumerate(leaves):
    by_dtype.setdefault(np.dtype(x.dtype), []).append(i)
  out: list[Any] = [None] * len(leaves)
  for dtype, members in by_dtype.items():
    f = factors
    if len(members) < len(leaves):
      idx = np.asarray(members)
      f = (
        Scaled(
          jnp.take(f.value, idx, axis=0), jnp.take(f.exponent, idx, axis=0)
        )
        if isinstance(f, Scaled)
        else jnp.take(f, idx, axis=0)
      )
    columns = factor_multipliers(f, dtype)
    # Real multipliers (a complex leaf's last one is real-valued complex).
    real = jnp.finfo(columns[0].dtype).dtype
    grid = (len(members), -1)
    rows = take_each(
      jnp.stack(
        [jnp.real(m).astype(real).reshape(grid) for m in columns], axis=1
      )
    )
    for i, row in zip(members, rows):
      out[i] = apply_multipliers(
        leaves[i],
        [
          jax.lax.reshape(
            jax.lax.index_in_dim(row, k, keepdims=False), shapes[i]
          )
          for k in range(len(columns))
        ],
      )
  return out


def ratio(a: Scaled, b: Scaled) -> jax.Array:
  """``a / b`` as a plain array, for finite ``0 <= a <= b`` (0 when ``b``
  is 0): exact powers of two, so that numbers beyond the dtype's range
  divide without overflow. Non-finite entries give no meaningful value
  (callers mask them).
  """
  a_m, a_e = normalize(a)
  b_m, b_e = normalize(b)
  quotient = a_m / jnp.where(b_m > 0, b_m, 1)
  return jnp.where(b_m > 0, ldexp(quotient, a_e - b_e), 0)


def clip_scale(
  norm: Union[jax.Array, Scaled], limit: Union[Any, Scaled]
) -> Scaled:
  """``min(1, limit / norm)`` as a :class:`Scaled` factor, exact.

  Both may lie outside the dtype's range (``1e-3 / 1.4e37`` is below 2**-126
  in float32: a plain factor would be flushed to zero); the factor is
  computed from their mantissas and exponents, with no division by a large
  number. Finite derivatives at a zero norm and on the limit (the factor is
  1 there, as in ``norm <= limit``).

  Non-finite policy (see the module docstring): the factor is NaN when the
  norm is NaN or infinite, or the limit is NaN, so that every value it
  scales comes out NaN.
  """
  norm = as_scaled(norm)
  dtype = norm.value.dtype
  limit = as_scaled(limit)
  limit = Scaled(limit.value.astype(dtype), limit.exponent)
  n_m, n_e = normalize(norm)
  l_m, l_e = normalize(limit)
  finite_limit = limit.value < jnp.inf
  above = (
    (n_m > 0)
    & finite_limit
    & ((limit.value == 0) | (n_e > l_e) | ((n_e == l_e) & (n_m > l_m)))
  )
  # Both operands masked: no inf (an infinite limit) or 0 in the branch
  # not taken, whose derivative would be 0 * inf = NaN. A zero limit makes
  # the factor 0 whatever the norm: the norm's tangent is dropped there (it
  # would meet 0 * inf in the second derivative, the normalised norm's
  # tangent being 2**-E times the norm's, huge for a tiny norm); the
  # limit's is kept.
  n_m = jnp.where(above & (l_m > 0), n_m, jax.lax.stop_gradient(n_m))
  value = jnp.where(
    above, jnp.where(above, l_m, 1) / jnp.where(above, n_m, 1), 1
  )
  bad = ~jnp.isfinite(norm.value) | jnp.isnan(limit.value)
  value = jnp.where(bad, jnp.nan, value).astype(dtype)
  return Scaled(value, jnp.where(above, l_e - n_e, 0))


def clip_scale_parts(
  norms: Sequence[Scaled],
  limits: Sequence[Any],
  keys: Optional[Sequence[Any]] = None,
):
  """``[clip_scale(n, limit) for n, limit in zip(norms, limits)]``, computed
  on one concatenation of the norms of each dtype (those that may span
  devices on their own) and sliced back: the factor's arithmetic (exponent
  bits, comparisons, a division: some fifty instructions) is compiled once,
  not once per part of a :class:`UnitLayout` (a distinct kernel per shape).
  ``limits``: per norm, anything that broadcasts to its shape, or Scaled.
  ``keys``: per norm, a hashable that norms concatenated together share
  (e.g. a UnitLayout's part keys: inside ``shard_map``, norms that vary
  across devices are not mixed with replicated ones).
  """
  out: list[Any] = [None] * len(norms)
  keys = [None] * len(norms) if keys is None else list(keys)
  groups = {}
  for i, n in enumerate(norms):
    if may_span_devices(n.value):
      out[i] = clip_scale(n, limits[i])
    else:
      group = (np.dtype(n.value.dtype), keys[i], varying(n, limits[i]))
      groups.setdefault(group, []).append(i)
  for (dtype, *_), members in groups.items():
    if len(members) == 1:
      out[members[0]] = clip_scale(norms[members[0]], limits[members[0]])
      continue
    shapes = [norms[i].value.shape for i in members]
    limit = [as_scaled(limits[i]) for i in members]
    factor = clip_scale(
      Scaled(
        flat_concat([norms[i].value for i in members]),
        flat_concat([norms[i].exponent for i in members]),
      ),
      Scaled(
        flat_concat(
          [
            jnp.broadcast_to(lim.value.astype(dtype), shape)
            for lim, shape in zip(limit, shapes)
          ]
        ),
        flat_concat(
          [
            jnp.broadcast_to(lim.exponent, shape)
            for lim, shape in zip(limit, shapes)
          ]
        ),
      ),
    )
    # In memory: each part's slice would otherwise recompute the factors'
    # arithmetic in its own consumers' kernels.
    factor = materialized_scaled(factor)
    for i, piece in zip(
      members, split_parts(factor, [norms[i] for i in members])
    ):
      out[i] = piece
  return out


def is_scaled_down(factor: Scaled) -> jax.Array:
  """Whether a factor from :func:`clip_scale` changes what it scales (NaN
  factors included).
  """
  return (factor.value != 1) | (factor.exponent != 0)


def clip_factor(norm: Union[jax.Array, Scaled], limit: Any) -> jax.Array:
  """``min(1, limit / norm)`` as a plain array (see :func:`clip_scale`).

  A factor below the dtype's smallest normal number is flushed to zero here;
  scale by :func:`clip_scale`'s result to keep it exact. NaN for a NaN or
  infinite norm (the non-finite policy).
  """
  return clip_scale(norm, limit).as_float()


def scale_leaf(
  x: jax.Array, factor: Union[jax.Array, Scaled], *, smallest: float = 0.0
) -> jax.Array:
  """``x * factor`` computed in the accumulation dtype, returned in x's dtype.

  A :class:`Scaled` factor is applied exactly whatever its exponent: its
  value times the part of ``2**exponent`` that keeps it normal, then the
  rest as further exact powers of two (each 1 for an ordinary factor).
  ``smallest``: a bound known when tracing below which the factor (at most
  1) does not fall; where it allows, two multipliers, not three (see
  :func:`scale_all`): one multiplication fewer per element in each kernel
  that reads the scaled leaf (clip_unitwise's step on a transformer's
  kernels, where Adam's two element-wise kernels each apply them).

  Per-unit factors (an array, one per unit) reach the leaf's kernel as
  multipliers kept in memory (see :func:`materialized`): otherwise XLA
  fuses their arithmetic (about a hundred instructions: the factor from the
  norms and limits, exponent bits, clamps) into every consumer of the
  scaled leaf, where it runs once per element, not once per unit: on a
  transformer's kernels, a step far slower than with them in memory
  (``docs/performance.md``). A scalar factor's arithmetic is hoisted out of
  the loop anyway.
  """
  # Not element-wise factors (clip_value's complex modulus): their
  # arithmetic runs once per element anyway.
  per_unit = 1 < math.prod(jnp.shape(scaled_value(factor))) < x.size
  if per_unit and isinstance(factor, Scaled):
    factor = materialized_scaled(factor)
  multipliers = factor_multipliers(
    factor, x.dtype, count=_multiplier_count(x.dtype, smallest)
  )
  if per_unit:
    multipliers = materialized_rows(multipliers)
  return apply_multipliers(x, multipliers)


def scale_all(
  leaves: Sequence[jax.Array],
  factor: Union[jax.Array, Scaled],
  *,
  smallest: float = 0.0,
) -> list[jax.Array]:
  """``[scale_leaf(x, factor) for x in leaves]`` for one scalar factor.

  ``smallest`` is a bound known when tracing (a number, see
  :func:`smallest_clip_factor`) below which a :class:`Scaled` factor of at
  most 1 does not fall. Each multiplier of a leaf is an instruction per
  element in every kernel that reads the scaled leaf (two per leaf when
  Adam follows), and on a tree of many small leaves their count sets the
  compile time: ``chain(clip_global(1.0), adam)`` on 1000 leaves compiles
  markedly faster with two multipliers than with three
  (``docs/performance.md``). Where ``smallest``
  is at least ``2**(2 * minexp)`` (``2**-252`` in float32), two suffice: a
  normal power of two, then the factor's mantissa times the rest, also
  normal. With the flush to zero of XLA:CPU that is bit for bit what three
  give (a result that is normal had a normal, exact first product; one that
  is not is zero either way); elsewhere it rounds a subnormal result once
  fewer. Otherwise the factor is applied in three steps, as scale_leaf does.

  The multipliers are computed once per leaf dtype, each into memory as a
  scalar of its own (see :func:`materialized`): otherwise XLA fuses the
  scalar arithmetic that builds them (exponent bits, clamps, powers of two:
  some ninety instructions) into every leaf's kernel, and stacked in one
  vector each kernel would slice its entries out again.
  """
  leaves = list(leaves)
  by_dtype = {}
  out = []
  for x in leaves:
    dtype = np.dtype(x.dtype)
    if dtype not in by_dtype:
      columns = factor_multipliers(
        factor, dtype, count=_multiplier_count(dtype, smallest)
      )
      wide = columns[0].dtype
      by_dtype[dtype] = [
        # Real numbers (a complex leaf's last one is stored as complex).
        materialized(jnp.real(jnp.asarray(m)).astype(wide).reshape(()))
        for m in columns
      ]
    out.append(apply_multipliers(x, by_dtype[dtype]))
  return out


def _multiplier_count(dtype: Any, smallest: float) -> int:
  """2 where ``smallest`` (see :func:`scale_all`) is at least
  ``2**(2 * minexp)`` of x's wide dtype, else 3.
  """
  wide = promote_types(dtype, accumulation_dtype(dtype))
  lo, _ = exp_range(jnp.finfo(wide).dtype)
  return 2 if smallest > 0 and smallest >= math.ldexp(1.0, 2 * lo) else 3


def smallest_clip_factor(
  leaves: Sequence[jax.Array], limit: Any, axis_name: AxisName = None
) -> float:
  """A bound below which ``min(1, limit / norm)`` cannot fall, for any
  p-norm (p >= 1) of the leaves (over the devices of ``axis_name`` too), or
  of a number in their accumulation dtype: ``limit / (n * 2**(maxexp + 1))``
  for n elements whose magnitudes are below ``2**maxexp`` (a complex
  element's below twice that). 0 when ``limit`` is not a positive number
  known when tracing (an array, a schedule's value).
  """
  if isinstance(limit, (bool, np.bool_)) or not isinstance(
    limit, (int, float, np.integer, np.floating)
  ):
    return 0.0
  limit = float(limit)
  if not (0 < limit < math.inf) or not leaves:
    return 0.0
  n = sum(math.prod(jnp.shape(x)) for x in leaves) * axis_size(axis_name)
  dtypes = [accumulation_dtype(x.dtype) for x in leaves]
  dtypes += [jnp.finfo(x.dtype).dtype for x in leaves]
  maxexp = max(int(jnp.finfo(d).maxexp) for d in dtypes)
  return math.ldexp(limit, -(maxexp + 1 + math.ceil(math.log2(max(n, 1)))))


def materialized(v: jax.Array) -> jax.Array:
  """``v``, computed once into memory by XLA, bit for bit (small arrays
  mostly; a clipped leaf in :mod:`optaxclip._spam`).

  XLA:CPU fuses cheap element-wise producers into each of their consumers
  (and drops ``optimization_barrier``), but never a reduction: ``v`` is
  returned as the product of the rows of ``[v; 1]`` (the padding row, so
  that ``v`` is not computed twice). Times 1 every value stays as it is,
  a zero's sign and NaN included. Not a sum of ``[v; 0]``: XLA:CPU hands
  float sums (and max, min) to YNNPACK, whose call costs orders of
  magnitude more than XLA's own loop over so few values: over a
  transformer's per-unit multipliers and packed parts, a noticeable share
  of its step (``docs/performance.md``); and -0.0 + 0 is +0.
  """
  v = jnp.asarray(v)
  if jnp.issubdtype(v.dtype, jnp.floating):
    return _multiplied_rows(v)
  if jnp.issubdtype(v.dtype, jnp.integer):
    return _multiplied_rows.fun(v)  # no derivative
  # Complex (times 1 + 0j, inf would become NaN), bool: not on a hot path.
  return _summed_rows(v)


def _summed_rows(v: jax.Array) -> jax.Array:
  """``v`` as the sum of the rows of ``[v; 0]``: linear."""
  padded = jax.lax.pad(
    v[None], jnp.zeros((), v.dtype), [(0, 1, 0)] + [(0, 0, 0)] * v.ndim
  )
  return jnp.sum(padded, axis=0)


@jax.custom_jvp
def _multiplied_rows(v: jax.Array) -> jax.Array:
  """``v`` as the product of the rows of ``[v; 1]`` (:func:`materialized`)."""
  one = np.ones((), v.dtype)
  padded = jax.lax.pad(v[None], one, [(0, 1, 0)] + [(0, 0, 0)] * v.ndim)
  return jax.lax.reduce(padded, one, jax.lax.mul, (0,))


@_multiplied_rows.defjvp
def _multiplied_rows_jvp(primals, tangents):
  # The identity. Its tangent in memory as a sum (linear, so that reverse
  # mode transposes it; derivative programs are not the hot path).
  (v,), (dv,) = primals, tangents
  return _multiplied_rows(v), _summed_rows(dv)


def materialized_rows(arrays: Sequence[jax.Array]) -> list[jax.Array]:
  """Arrays of one shape, computed once into memory (:func:`materialized`
  on their stack) and handed back as they were.
  """
  # The multipliers are real numbers (a complex leaf's last one is stored
  # as complex): one real dtype for the stack.
  real = [a.real if jnp.iscomplexobj(a) else a for a in arrays]
  dtype = functools.reduce(promote_types, [a.dtype for a in real])
  rows = materialized(
    jnp.stack([a.astype(dtype) for a in jnp.broadcast_arrays(*real)])
  )
  return [
    jax.lax.index_in_dim(rows, k, keepdims=False) for k in range(len(arrays))
  ]


def holds_exponents(dtype) -> bool:
  """Whether a :class:`Scaled` exponent (a small int32) is exact as a float
  of ``dtype``, so that value and exponent can share one array (one kernel).
  """
  return np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.float64))


def materialized_scaled(factor: Scaled) -> Scaled:
  """A per-unit factor computed once into memory, value and exponent in one
  kernel (:func:`materialized` on their stack; the exponent, a small
  integer, is exact as a float). Without it each multiplier row that
  :func:`scale_leaf` keeps in memory computes the factor again from the
  norms and limits (about a hundred instructions per unit and row); from
  memory, a row is a few bit operations.
  """
  if not holds_exponents(factor.value.dtype):
    return factor
  value, e = jnp.broadcast_arrays(factor.value, factor.exponent)
  stacked = materialized(
    jnp.stack([value, jax.lax.stop_gradient(e).astype(value.dtype)])
  )
  return Scaled(stacked[0], stacked[1].astype(factor.exponent.dtype))


def factor_multipliers(
  factor: Union[jax.Array, Scaled], dtype, count: int = 3
) -> list[jax.Array]:
  """The numbers that a value of ``dtype`` is multiplied by, one after the
  other, in the wide dtype, to scale it by ``factor`` (see scale_leaf).

  ``count`` (2 or 3) multipliers for a :class:`Scaled` factor: with 3, every
  one is exact; with 2, the last one (the mantissa times what is left of the
  power of two after one normal step) is rounded where it is subnormal.
  """
  wide = promote_types(dtype, accumulation_dtype(dtype))
  if not isinstance(factor, Scaled):
    return [factor.astype(wide)]
  acc = accumulation_dtype(dtype)
  # factor = m * 2**k with m in [0.5, 1) for a factor below 1 and in [1, 2)
  # otherwise: x * 2**k then lies between the result and twice it (a factor
  # below 1) or half of it (above), so it neither overflows nor is flushed
  # where the result does not.
  m, k = normalize(Scaled(factor.value.astype(acc), factor.exponent))
  up = (k >= 1) & (m > 0)
  m = jnp.where(up, 2 * m, m)
  k = k - up.astype(k.dtype)
  # The powers of two first, m last: the only multiplier with a derivative
  # then has the cotangent sum(ct * x * 2**k), whose size is that of the
  # result's, not sum(ct * x) (which overflows for leaves near the dtype's
  # largest value while the derivative with respect to x is finite).
  real = jnp.finfo(wide).dtype
  lo, hi = exp_range(real)
  if count == 2:
    step = jnp.clip(k, lo, hi)
    # m times the rest (0 unless the total exceeds one normal power), with
    # gradual underflow (pow2 alone would flush it to zero).
    return [pow2(step, real), ldexp(m, k - step, pieces=2).astype(wide)]
  steps = []
  for _ in range(3):
    step = jnp.clip(k, lo, hi)
    steps.append(pow2(step, real))
    k = k - step
  # The last step is 1 unless the total exceeds two normal powers.
  return [steps[0], steps[1], (m * steps[2].astype(acc)).astype(wide)]


def apply_multipliers(x: jax.Array, multipliers) -> jax.Array:
  """``x`` times each multiplier in turn (scalars, or of x's rank with size
  1 where they broadcast), in the wide dtype.

  In lax, not jnp: this runs once per leaf, and each jnp call is a nested
  jit to trace.
  """
  wide = promote_types(x.dtype, accumulation_dtype(x.dtype))
  y = jax.lax.convert_element_type(x, wide)
  for m in multipliers:
    m = jax.lax.convert_element_type(jnp.asarray(m), wide)
    if m.shape != y.shape:
      dims = tuple(range(m.ndim)) if m.ndim else ()
      m = jax.lax.broadcast_in_dim(m, y.shape, dims)
    y = jax.lax.mul(y, m)  # exact: real powers of two
  return jax.lax.convert_element_type(y, x.dtype)
