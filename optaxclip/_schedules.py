"""Thresholds given as a number or as a schedule (``step -> value``).

Every threshold of every clipper (``max_norm``, ``max_delta``,
``threshold``, ``clipping``, ``spike_z``, ``percentile``, ``factor``,
``warmup_max_norm``, guard's ``max_norm`` and ``spike_z``, ``l2_clip``)
takes either. A schedule is any callable of the step, such as an optax
schedule (``optax.linear_schedule(1.0, 0.1, 1000)``); it is evaluated inside
the update, at the clipper's own step count (0 on its first update), so it
adds no retrace and no host transfer.

Rules, the same for every clipper:

* A number is checked when the transformation is built; a schedule's values
  can only be known when it runs, so they are not checked but put in range:
  a value below the threshold's smallest (0 for a limit) counts as that
  smallest, one above its largest (100 for a percentile) as the largest. A
  limit that reaches 0 gives zero updates, never NaN.
* A NaN from a schedule follows the non-finite policy of
  ``optaxclip/_norms.py``: the update comes out NaN (:func:`guard` skips the
  step), visible rather than silently unclipped.
* A schedule is not a hyperparameter for ``optax.inject_hyperparams``:
  that wrapper evaluates callables at its own step and passes arrays, which
  are numbers here. To have the clipper evaluate a schedule at its own step
  under ``inject_hyperparams``, name the argument in ``static_args``.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from optaxclip import _checks


def is_schedule(value: Any) -> bool:
  """Whether ``value`` is a schedule (a callable), not a number or array."""
  return callable(value) and not isinstance(value, jax.Array)


def check(
  who: str,
  name: str,
  value: Any,
  **bounds: Any,
) -> None:
  """Checks a threshold argument: a number against ``bounds`` (the keywords
  of :func:`optaxclip._checks.check_number`), or a schedule.

  Raises:
    TypeError: for an optax ``StatefulSchedule``, which only
      ``optax.inject_hyperparams`` can run, and for what
      ``check_number`` refuses.
    ValueError: for a number out of range.
  """
  if isinstance(value, optax.schedules.StatefulSchedule):
    raise TypeError(
      f"{who}: {name} must be a number or a schedule (step -> value); got a "
      "stateful schedule, which needs optax.inject_hyperparams."
    )
  if is_schedule(value):
    return
  _checks.check_number(name, value, who=who, **bounds)


def value_at(
  value: Any,
  count: jax.Array,
  *,
  who: str = "",
  name: str = "",
  low: Optional[float] = 0.0,
  high: Optional[float] = None,
) -> Any:
  """The threshold at step ``count``.

  Args:
    value: a number (returned unchanged: a fixed threshold costs nothing) or
      a schedule.
    count: the clipper's step count, an int32 scalar.
    who: the transformation, for the error message.
    name: the argument, for the error message.
    low: a schedule's values below it count as it (None: no bound).
    high: a schedule's values above it count as it (None: no bound).

  Returns:
    ``value`` itself, or the schedule's value at ``count`` as a scalar of
    float32 or wider, put in ``[low, high]`` (NaN stays NaN).

  Raises:
    TypeError: when the schedule returns something other than one real
      number.
  """
  if not is_schedule(value):
    return value
  out = jnp.asarray(value(count))
  if out.size != 1 or not _checks.is_real_dtype(out.dtype):
    raise TypeError(
      f"{who}: the schedule {name} must return one real number; got an "
      f"array of shape {out.shape} and dtype {out.dtype}."
    )
  dtype = jnp.promote_types(out.dtype, jnp.float32)
  if not jnp.issubdtype(dtype, jnp.floating):  # int64 under x64
    dtype = jnp.float32
  out = out.reshape(()).astype(dtype)
  # jnp.where, not clip: NaN must stay NaN.
  if low is not None:
    below = out < low
    if low == 0:
      # XLA:CPU reads a subnormal as zero in a comparison, so a negative
      # subnormal is not "< 0" there; its sign bit says it is (and turns
      # -0.0 into 0.0). NaN keeps its value whatever its sign bit.
      below = below | (jnp.signbit(out) & ~jnp.isnan(out))
    out = jnp.where(below, jnp.asarray(low, dtype), out)
  if high is not None:
    out = jnp.where(out > high, jnp.asarray(high, dtype), out)
  return out


def first_value(value: Any, **bounds: Any) -> Any:
  """The threshold at step 0, for a state's ``init`` (:func:`value_at`)."""
  return value_at(value, jnp.zeros((), jnp.int32), **bounds)


def count_of(state: Any, field: str = "count") -> jax.Array:
  """The step count kept in ``state``: 0 for ``None`` (a fixed-threshold
  clipper also takes ``update(g, None)``, as a stateless one would).
  """
  if state is None:
    return jnp.zeros((), jnp.int32)
  return getattr(state, field)


def next_count(count: jax.Array) -> jax.Array:
  """``count + 1`` as int32, saturating at the int32 maximum."""
  return jnp.asarray(optax.safe_increment(count), jnp.int32)
