"""Running statistics of a watched value (a gradient norm, a loss): a
warm-up mean, then an EMA (ZClip's update order) or a rolling window, the
variance kept at a scale that cannot overflow or flush, streaks and
saturating counters. :func:`clip_zscore` and :func:`guard` share them.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip import _norms

_INT32_MAX = np.iinfo(np.int32).max


# A variance is kept with the exponent of spread_exponent: as the variance
# itself while 2**-41 <= |mean| < 2**40 (about 4.5e-13 to 1.1e12) in float32
# (2**-489 to 2**488 in float64), beyond that as var * 4**-e, so that
# spreads from 2**-24 to 2**24 times the mean stay in range. Kept as the
# variance itself, it saturated at the dtype's largest value once the norms
# passed about 1e19 (float32), where ordinary steps then read as spikes, and
# it flushed to 0 below about 1e-19, where every move read as a new level.
# A spread larger than that beside a mean near 0 (losses around 0, a restart
# at 0, EMAs of a stream of zeros) would saturate too: the kept mean is held
# at least 2**-_NUDGE standard deviations from 0 (see kept_moments).
_HEADROOM = 24
_NUDGE = _HEADROOM - 2


def _spread_offset(dtype: Any) -> int:
  return int(jnp.finfo(dtype).maxexp) // 2 - _HEADROOM


def spread_exponent(mean: jax.Array) -> jax.Array:
  """The int32 ``e`` with which a variance beside ``mean`` is kept, as
  ``var * 4**-e``: 0 while ``2**-41 <= |mean| < 2**40`` (float32;
  ``2**-489`` to ``2**488`` in float64), beyond that the mean's binary
  exponent less (plus) 40 (488). ``|e|`` is at most 89 (537), so that
  ``2**e`` and ``2**-e`` are normal: ``ldexp`` by it takes one piece.
  """
  offset = np.int32(_spread_offset(mean.dtype))
  e = _norms.exponent(mean)
  zero = jnp.zeros_like(offset)
  above = jax.lax.max(jax.lax.sub(e, offset), zero)
  below = jax.lax.min(jax.lax.add(e, offset), zero)
  return jax.lax.add(above, below)


def spread_exponent_of(mean: float, dtype: Any) -> int:
  """:func:`spread_exponent` of a Python number (for reports)."""
  info = jnp.finfo(dtype)
  if not math.isfinite(mean):
    e = int(info.maxexp) + 1
  elif mean == 0:  # 0 and subnormals as the smallest normal, as exponent()
    e = int(info.minexp) + 1
  else:
    e = max(math.frexp(mean)[1], int(info.minexp) + 1)
  offset = _spread_offset(dtype)
  return max(e - offset, 0) + min(e + offset, 0)


def spread(mean: jax.Array, var: jax.Array) -> jax.Array:
  """The standard deviation of a statistic kept as ``(mean, var)``, ``var``
  with :func:`spread_exponent`'s scale (+inf beyond the dtype's range).
  """
  return _norms.ldexp(jnp.sqrt(var), spread_exponent(mean), pieces=1)


def safe_exponent(*values: jax.Array) -> jax.Array:
  """A variance exponent at which squares of differences of ``values`` (and
  a variance kept beside any of them) stay in range: :func:`spread_exponent`
  of the largest magnitude (``spread_exponent`` grows with it).
  """
  largest = jnp.abs(values[0])
  for v in values[1:]:
    largest = jnp.maximum(largest, jnp.abs(v))
  return spread_exponent(largest)


def kept_moments(mean: jax.Array, var: Any, e: jax.Array):
  """The ``(mean, var)`` to keep for a mean and a variance held as ``var *
  4**-e`` (``e`` from :func:`safe_exponent`, so that nothing saturated).

  The variance is re-expressed with :func:`spread_exponent` of the kept
  mean, which is ``mean`` itself unless it lies within ``2**-22`` standard
  deviations of 0 (in float32 a spread above ``2**22`` times the mean, e.g.
  losses averaging 0, saturated there): then it is moved away from 0, to
  the power of two ``2**(E - 22)`` with the spread's exponent ``E`` (its
  sign kept). A z-score against the kept mean moves by less than ``2**-21``,
  and only when the mean is that close to 0 (decisions are unchanged beyond
  rounding); a variance of 0 leaves the mean as it is.
  """
  dtype = mean.dtype
  var = jnp.minimum(var, jnp.finfo(dtype).max)
  spread_e = jax.lax.add(_norms.exponent(jnp.sqrt(var)), e)
  floor = _norms.pow2(jax.lax.sub(spread_e, np.int32(_NUDGE)), dtype)
  near = (var > 0) & (jnp.abs(mean) < floor)
  kept = jnp.where(near, jnp.where(jnp.signbit(mean), -floor, floor), mean)
  return kept, rescaled(var, e, spread_exponent(kept))


def rescaled(var: jax.Array, e_from: jax.Array, e_to: jax.Array):
  """A variance kept with exponent ``e_from``, kept with ``e_to`` (capped at
  the dtype's largest value: a spread beyond the range saturates).
  """
  moved = _norms.ldexp(var, 2 * (e_from - e_to))
  return jnp.minimum(moved, jnp.finfo(var.dtype).max)


def welford(count, mean, var, x, e):
  """Adds ``x`` to a running mean and population variance of ``count`` values.

  Returns the mean and variance of the ``count + 1`` values, equal up to
  rounding to ``sum(xs) / n`` and ``sum((xs - mean)**2) / n``; ``var`` in
  and out held as ``var * 4**-e`` (``e`` from :func:`safe_exponent` of
  ``x``, ``mean`` and ``x - mean``: nothing saturates; see
  :func:`kept_moments`).
  """
  k = (count + 1).astype(mean.dtype)
  delta = x - mean
  new_mean = mean + delta / k
  step = _norms.ldexp(delta, -e, 1) * _norms.ldexp(x - new_mean, -e, 1)
  new_var = var + (step - var) / k
  return new_mean, new_var


def ema_mean_var(alpha, mean, var, x, e):
  """EMA update of mean and variance; the variance uses the *new* mean.

  This is the order of the ZClip reference implementation:
  ``mean = a*mean + (1-a)*x`` first, then ``var = a*var + (1-a)*(x-mean)**2``.
  The mean is computed as ``mean + (1-a)*(x-mean)``, equal up to rounding:
  a value equal to the mean leaves it exactly as it was (ZClip's form
  drifts by an ulp a step on a constant stream, and the variance that the
  drift builds up makes the constant value itself a spike). ``var`` in and
  out held with exponent ``e``, as :func:`welford`'s.
  """
  new_mean = mean + (1 - alpha) * (x - mean)
  new_var = alpha * var + (1 - alpha) * _norms.ldexp(x - new_mean, -e, 1) ** 2
  return new_mean, new_var


def running_moments(
  count, mean, var, x, *, alpha, warmup_steps, finite, take, restart
):
  """One step of the norm statistics that :func:`clip_zscore` and
  :func:`guard` share: a warm-up, then an EMA, and restarts.

  While ``count < warmup_steps`` the plain mean and variance of the values
  so far (:func:`welford`); then the EMA (:func:`ema_mean_var`). A unit that
  ``restart``-s has its mean moved to ``x`` and its variance take in the
  jump ``(x - mean)**2`` as one EMA step would.

  Args:
    count: int32 scalar, values gathered for the warm-up.
    mean: the running mean, a scalar or one per unit.
    var: the running variance, likewise, kept with
      :func:`spread_exponent`'s scale.
    x: the value to take in, shaped like ``mean``.
    alpha: the EMA's smoothing.
    warmup_steps: values that start the statistics.
    finite: bool scalar; when false nothing changes (a NaN/Inf step).
    take: per unit, whether to take ``x`` in (false: the unit's statistics
      stay, as for ZClip's ``skip_update_on_spike``).
    restart: per unit, whether the statistics restart at ``x``.

  Returns:
    The new ``(count, mean, var)``, as :func:`kept_moments` keeps them.
  """
  warming = count < warmup_steps
  # One exponent for the three updates: each new mean lies between mean
  # and x, each new deviation within |x - mean|.
  e = safe_exponent(x, mean, x - mean)
  old = rescaled(var, spread_exponent(mean), e)
  warm_mean, warm_var = welford(count, mean, old, x, e)
  ema_mean, ema_var = ema_mean_var(alpha, mean, old, x, e)
  restart_var = alpha * old + (1 - alpha) * (_norms.ldexp(x - mean, -e, 1) ** 2)
  new_mean, new_var = kept_moments(
    jnp.where(restart, x, jnp.where(warming, warm_mean, ema_mean)),
    jnp.where(restart, restart_var, jnp.where(warming, warm_var, ema_var)),
    e,
  )
  take = finite & (take | restart)
  new_count = jnp.where(finite, jnp.minimum(count + 1, warmup_steps), count)
  return (
    new_count.astype(jnp.int32),
    jnp.where(take, new_mean, mean).astype(mean.dtype),
    jnp.where(take, new_var, var).astype(var.dtype),
  )


class Window(NamedTuple):
  """A ring buffer of the last values of a statistic, per unit.

  Attributes:
    values: ``(size,)`` or ``(size, n_units)``; the first ``filled`` rows of
      a unit's column hold its values (the order is irrelevant).
    filled: how many rows hold a value, per unit (int32, at most ``size``).
    index: the row the next value goes to, per unit (int32).
  """

  values: jax.Array
  filled: jax.Array
  index: jax.Array  # pyright: ignore[reportIncompatibleMethodOverride]


def window_init(size: int, unit_shape: tuple[int, ...], dtype: Any) -> Window:
  """An empty :class:`Window` of ``size`` rows per unit."""
  return Window(
    values=jnp.zeros((size, *unit_shape), dtype),
    filled=jnp.zeros(unit_shape, jnp.int32),
    index=jnp.zeros(unit_shape, jnp.int32),
  )


def rolling_moments(count, window: Window, x, *, warmup_steps, take, restart):
  """One step of exact rolling statistics: the mean and sample variance of
  the last ``size`` values taken in, per unit.

  The values sit in a ring buffer and both moments are recomputed over it at
  every step (two passes over ``size`` scalars per unit: exact, no running
  sums to drift, and cheap next to one pass over the gradients). A unit that
  ``restart``-s empties its window and starts it again at ``x``, warm-up
  included (``count`` back to 1).

  Args:
    count: int32, values gathered for the warm-up (per unit), at most
      ``warmup_steps``.
    window: the :class:`Window` so far.
    x: the value to take in, per unit.
    warmup_steps: values needed before the statistics judge anything.
    take: per unit, whether ``x`` enters (it must be finite).
    restart: per unit, whether the window starts again at ``x``.

  Returns:
    The new ``(count, window, mean, var)``: ``mean`` and ``var`` are those
    of the values in the window, ``var`` with Bessel's correction (0 with
    fewer than two values), as :func:`kept_moments` keeps them (the kept
    mean may sit a little away from 0: see there).
  """
  size = window.values.shape[0]
  rows = jnp.arange(size, dtype=jnp.int32).reshape((size,) + (1,) * x.ndim)
  enter = take | restart
  index = jnp.where(restart, 0, window.index)
  values = jnp.where((rows == index) & enter, x, window.values)
  filled = jnp.where(
    restart,
    1,
    jnp.where(take, jnp.minimum(window.filled + 1, size), window.filled),
  )
  index = jnp.where(enter, (index + 1) % size, window.index)
  count = jnp.where(
    restart, 1, jnp.where(take, jnp.minimum(count + 1, warmup_steps), count)
  )
  valid = rows < filled
  n = filled.astype(values.dtype)
  # Summed at the scale of the largest magnitude (a power of two: the same
  # roundings), so that values near the dtype's largest do not overflow.
  largest = jnp.max(jnp.where(valid, jnp.abs(values), 0), axis=0)
  top = _norms.scale_exponent(largest)
  scaled = jnp.where(valid, _norms.ldexp(values, -top, 1), 0)
  mean = _norms.ldexp(jnp.sum(scaled, axis=0) / jnp.maximum(n, 1), top, 1)
  e = safe_exponent(mean, largest)
  squares = jnp.where(valid, _norms.ldexp(values - mean, -e, 1) ** 2, 0)
  var = jnp.sum(squares, axis=0) / jnp.maximum(n - 1, 1)
  mean, var = kept_moments(mean, jnp.where(filled < 2, 0, var), e)
  return (
    count.astype(jnp.int32),
    Window(values, filled.astype(jnp.int32), index.astype(jnp.int32)),
    mean.astype(values.dtype),
    var.astype(values.dtype),
  )


def streak(run: jax.Array, hit: jax.Array, finite: jax.Array) -> jax.Array:
  """Steps in a row with ``hit``: ``run + 1`` on a hit, else 0 (int32,
  saturating); unchanged on a non-finite step.
  """
  grown = jnp.where(hit, jnp.minimum(run, _INT32_MAX - 1) + 1, 0)
  return jnp.where(finite, grown, run).astype(jnp.int32)


def add_count(total: jax.Array, n: jax.Array) -> jax.Array:
  """``total + n`` for int32 counters, saturating at the int32 maximum."""
  n = jnp.sum(jnp.asarray(n, jnp.int32))
  return (total + jnp.minimum(n, _INT32_MAX - total)).astype(jnp.int32)
