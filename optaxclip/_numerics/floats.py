"""Floating point: exact powers of two and scaled values.

Owns powers of two, exponents and :class:`Scaled` values (``value *
2**exponent``); dtypes of accumulation; the root of a power sum.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np


def promote_types(a: Any, b: Any) -> np.dtype:
  """``jnp.promote_types`` on JAX's standard lattice, whatever the config.

  Every dtype change in the package is written out with this: it also holds
  under ``jax_numpy_dtype_promotion="strict"``, which refuses to promote
  (bfloat16, float32) implicitly.
  """
  with jax.numpy_dtype_promotion("standard"):
    return np.dtype(jnp.promote_types(a, b))


def accumulation_dtype(dtype: Any) -> np.dtype:
  """float32, or the leaf's real dtype when that is wider (float64)."""
  return promote_types(jnp.finfo(dtype).dtype, jnp.float32)


def tree_accumulation_dtype(leaves: Sequence[jax.Array]) -> np.dtype:
  dtype = np.dtype(np.float32)
  for x in leaves:
    dtype = promote_types(dtype, accumulation_dtype(x.dtype))
  return dtype


def magnitude(x: jax.Array, dtype: Optional[Any] = None) -> jax.Array:
  """``|x|`` in the accumulation dtype (complex: the overflow-safe modulus)."""
  dtype = accumulation_dtype(x.dtype) if dtype is None else dtype
  if jnp.iscomplexobj(x):
    # The modulus in the accumulation's precision: a complex64 leaf beside a
    # float64 one is measured in float64, as its parts are.
    wide = np.promote_types(x.dtype, np.result_type(dtype, np.complex64))
    return jnp.abs(x.astype(wide)).astype(dtype)
  return jnp.abs(x.astype(dtype))


def pth_power(a: jax.Array, p: float) -> jax.Array:
  """``a ** p`` for ``a >= 0``, with cheap forms for p = 1 and 2."""
  if p == 1:
    return a
  if p == 2:
    return a * a
  return a**p


def safe_root(s: jax.Array, p: float) -> jax.Array:
  """``s ** (1/p)`` for ``s >= 0`` whose derivative is 0, not inf, at 0.

  NaN stays NaN (a NaN norm must not read as 0).
  """
  if p == 1:
    return s
  positive = s > 0
  s_safe = jnp.where(positive, s, 1)
  root = _root(s_safe, p)
  return jnp.where(positive, root, jnp.where(jnp.isnan(s), s, 0))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _root(s: jax.Array, p: float) -> jax.Array:
  """``s ** (1/p)`` for normal ``s > 0``, differentiated as
  ``root * (ds * 2**-E) / (p * m)`` with ``s = m * 2**E``, ``m`` in [0.5, 1).

  JAX differentiates a power into ``(1/p) * s**(1/p - 1)``, and the next
  order into ``s**(1/p - 2)``: flushed to zero for a float32 power sum above
  about 1e23 (p = 3 on values of 1e8) and overflowed below about 1e-23, so
  that Hessian-vector products through a clipped p-norm came out wrong or
  NaN. Here ``s`` enters every order's derivative only through its mantissa
  and an exact power of two, and the root (whose derivative is this rule
  again): each intermediate stays of the size of the result. For p = 2,
  too: JAX's rule for ``sqrt``, ``ds * 0.5 / root``, meets ``ds * d(root)``
  at the next order, which overflows for a float32 sum of squares near
  1e38 (clip_block_rms' Hessian-vector products there were NaN or off by
  15%).
  """
  return jnp.sqrt(s) if p == 2 else s ** (1.0 / p)


@_root.defjvp
def _root_jvp(p, primals, tangents):
  (s,), (ds,) = primals, tangents
  root = _root(s, p)
  e = exponent(s)  # no derivative
  mantissa = ldexp(s, -e, pieces=2)
  return root, root * ldexp(ds / (p * mantissa), -e)


# XLA compiles ``x / s`` (s a scalar broadcast over x) as ``x * (1 / s)``, and
# for s above 2**126 the reciprocal is subnormal, which CPUs (and GPUs) flush
# to zero. A factor below 2**-126 (``1e-3 / 1.4e37``) is flushed the same way,
# and a norm of finite values may exceed the dtype's largest value. So no
# data-dependent scale is ever divided by here: values are scaled by exact
# powers of two built from the exponent bits (multiplication by a normal
# power of two is exact), and norms and factors that may leave the dtype's
# range are carried as ``value * 2**exponent`` (:class:`Scaled`).


@functools.cache
def _bits_of(dtype: np.dtype) -> tuple[Any, int, int]:
  """:func:`_bits` of a ``np.dtype``, cached by that dtype: the answer is a
  fact of the dtype alone (no array, no tracer, no config enters it), so an
  entry holds in every trace, and ``_bits`` turns every spelling of a dtype
  into one key.
  """
  info = jnp.finfo(dtype)
  ints = {4: np.int32, 8: np.int64}
  if dtype.itemsize not in ints:
    raise TypeError(
      f"power-of-two scaling needs float32 or float64; got {dtype}"
    )
  return ints[dtype.itemsize], int(info.nmant), int(info.maxexp) - 1


def _bits(dtype) -> tuple[Any, int, int]:
  """(unsigned-size int dtype, mantissa bits, exponent bias) of a float."""
  return _bits_of(np.dtype(dtype))


# The helpers below run once or more per leaf while tracing: they bind lax
# primitives on operands of known, equal dtypes (with numpy constants of that
# dtype) rather than going through jnp's promotion and nested jits, which made
# them a large part of the Python time spent tracing a clipper.


def exponent(v: jax.Array) -> jax.Array:
  """The int32 ``E`` with ``v = m * 2**E``, ``0.5 <= |m| < 1``, for normal v.

  Read from the exponent bits (no derivative): 0 and subnormals give the
  smallest normal exponent, ``inf`` and NaN one above the largest.
  """
  v = jax.lax.stop_gradient(v)
  int_dtype, nmant, bias = _bits(v.dtype)
  bits = jax.lax.bitcast_convert_type(v, int_dtype)
  field = jax.lax.bitwise_and(
    jax.lax.shift_right_arithmetic(bits, int_dtype(nmant)),
    int_dtype(2 * bias + 1),
  )
  field = jax.lax.max(field, int_dtype(1))  # subnormals: as the smallest normal
  return jax.lax.convert_element_type(
    jax.lax.sub(field, int_dtype(bias - 1)), np.int32
  )


def pow2(k: jax.Array, dtype: Any) -> jax.Array:
  """Exactly ``2.0**k`` in ``dtype`` for integer k in its normal range; 0
  below it, the largest normal power above it.
  """
  int_dtype, nmant, bias = _bits(dtype)
  k = jax.lax.convert_element_type(k, int_dtype)
  field = jax.lax.clamp(
    int_dtype(0), jax.lax.add(k, int_dtype(bias)), int_dtype(2 * bias)
  )
  return jax.lax.bitcast_convert_type(
    jax.lax.shift_left(field, int_dtype(nmant)), dtype
  )


@functools.cache
def _exp_range_of(dtype: np.dtype) -> tuple[int, int]:
  """:func:`exp_range` of a ``np.dtype``, cached by that dtype, as
  :func:`_bits_of` is (a fact of the dtype alone, the same in every trace).
  """
  info = jnp.finfo(dtype)
  return int(info.minexp), -int(info.minexp)


def exp_range(dtype) -> tuple[int, int]:
  """The exponents k for which ``2**k`` and ``2**-k`` are both normal."""
  return _exp_range_of(np.dtype(dtype))


def ldexp(v: jax.Array, k: jax.Array, pieces: int = 3) -> jax.Array:
  """``v * 2**k`` with integer k, exact unless the result is subnormal.

  ``2**k`` may lie beyond the dtype's range (``k = -200`` in float32) while
  the product does not; the power is applied in up to ``pieces`` normal
  steps.
  """
  v = jnp.asarray(v)
  real = jnp.finfo(v.dtype).dtype
  lo, hi = exp_range(real)
  k = jax.lax.convert_element_type(k, np.int32)
  # lax.mul broadcasts only a rank-0 operand; other shapes as jnp does.
  same = np.shape(v) == np.shape(k) or not np.ndim(v) or not np.ndim(k)
  for _ in range(pieces):
    step = jax.lax.clamp(np.int32(lo), k, np.int32(hi))
    power = pow2(step, real)
    if power.dtype != v.dtype:  # complex v: explicit
      power = jax.lax.convert_element_type(power, v.dtype)
    # v * power; the result strong-typed as jnp's (power is strong).
    v = jax.lax.mul(v, power) if same else v * power
    k = jax.lax.sub(k, step)
  return v


class Scaled(NamedTuple):
  """The number ``value * 2**exponent``: a norm or factor that may lie
  outside its dtype's range (a norm of finite float32 values above 3.4e38, a
  clip factor below 2**-126). ``exponent`` is int32, of ``value``'s shape.
  """

  value: jax.Array
  exponent: jax.Array

  def as_float(self) -> jax.Array:
    """The number in ``value``'s dtype (inf on overflow, 0 on underflow)."""
    return ldexp(self.value, self.exponent)

  def __mul__(self, other: Scaled) -> Scaled:  # type: ignore[override]
    return Scaled(self.value * other.value, self.exponent + other.exponent)


def as_scaled(x: Union[jax.Array, Scaled]) -> Scaled:
  """A plain array as :class:`Scaled` (exponent 0); a Scaled unchanged."""
  if isinstance(x, Scaled):
    return x
  x = jnp.asarray(x)
  # zeros_like: the same varying axes as x inside shard_map (lax.cond).
  return Scaled(x, jnp.zeros_like(x, dtype=jnp.int32))


def normalize(x: Scaled) -> tuple[jax.Array, jax.Array]:
  """``(m, E)`` with ``x = m * 2**E`` and ``0.5 <= m < 1`` for ``x > 0``
  (``m = 0`` for 0; ``inf`` and NaN values stay as they are).
  """
  e = exponent(x.value)
  maxexp = np.int32(jnp.finfo(x.value.dtype).maxexp)
  e = jax.lax.select(jax.lax.gt(e, maxexp), jax.lax.full_like(e, 0), e)
  return ldexp(x.value, jax.lax.neg(e), pieces=2), x.exponent + e


def scaled_product(x: jax.Array, m: Any, e: Any) -> Scaled:
  """``x * m * 2**e`` as a :class:`Scaled` whose value is neither subnormal
  nor beyond the dtype's range for a normal ``x``.

  ``m`` in ``[0.5, 1)`` and the integer ``e`` are known when tracing
  (numbers or NumPy arrays: ``np.frexp`` of static numbers). ``x``'s power
  of two goes to the exponent first, and the value is ``m`` times a
  mantissa in ``[0.5, 1)``, one rounding as ``x * m`` has. ``x * m``
  itself is subnormal, and flushed to 0 by XLA:CPU, for ``x`` below twice
  the smallest normal (clip_block_rms's threshold of 1.5e-38 on a
  one-element leaf was a limit of 0).
  """
  v, k = normalize(as_scaled(x))
  return Scaled(v * jnp.asarray(m, v.dtype), k + np.asarray(e, np.int32))


def product(a: Union[jax.Array, Scaled], b: Union[jax.Array, Scaled]) -> Scaled:
  """``a * b`` as a :class:`Scaled` of the two normalised mantissas, whose
  value is neither subnormal nor beyond the dtype's range for finite
  nonzero operands (the same rounding as ``a * b`` where that is normal).
  A plain product flushes: clip_unitwise's limit, a clipping of 1.2e-38
  times a params' norm of 5.7e20 carried as ``0.97 * 2**69``, was 0.
  """
  a_m, a_e = normalize(as_scaled(a))
  b = as_scaled(b)
  b_m, b_e = normalize(Scaled(b.value.astype(a_m.dtype), b.exponent))
  return Scaled(a_m * b_m, a_e + b_e)


def scale_exponent(m: jax.Array) -> jax.Array:
  """``E`` such that ``m * 2**-E`` is in [0.5, 4) (smaller for tiny m) and
  ``2**-E`` is a normal number: the scale for values whose largest magnitude
  is ``m``. Non-finite ``m``: the largest such E.
  """
  lo, hi = exp_range(m.dtype)
  return jax.lax.clamp(np.int32(lo), exponent(m), np.int32(hi))


def select(k: Any, a: jax.Array, b: jax.Array) -> jax.Array:
  """``a`` where the scalar ``k`` holds, else ``b``. By lax, not
  ``jnp.where``, which is a nested jit for each call: to trace and lower
  for each of a tree's leaves and state slots (compile time on many-leaf
  trees, such as guard(scope="leaf")'s: ``docs/performance.md``).
  """
  k = jnp.asarray(k)
  if k.shape or k.dtype != bool or a.dtype != b.dtype or a.shape != b.shape:
    return jnp.where(k, a, b)
  # The scalar itself, not broadcast: a broadcast has no sharding, and on an
  # Explicit mesh it cannot select between sharded arrays.
  return jax.lax.select(k, a, b)


def scale_parts(x: jax.Array, scale: jax.Array) -> jax.Array:
  """A complex ``x`` with its real and imaginary parts each times the real
  ``scale``: no complex product (whose ``inf * 0`` would turn an inf part
  into NaN) and no implicit mixed-dtype promotion.

  The parts are widened to ``scale``'s dtype when it is the wider one, never
  the scale narrowed: a power of two of float64's range (``2**1021``, the
  scale of a zero or tiny complex64 leaf in a tree with a float64 leaf) is
  inf in float32, and ``0 * inf`` made the whole tree's norm NaN.
  """
  real = promote_types(x.real.dtype, scale.dtype)
  scale = scale.astype(real)
  return jax.lax.complex(
    x.real.astype(real) * scale, x.imag.astype(real) * scale
  )


def scaled_value(factor: Union[jax.Array, Scaled]) -> jax.Array:
  return factor.value if isinstance(factor, Scaled) else factor
