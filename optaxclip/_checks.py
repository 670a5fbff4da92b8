"""Validation of hyperparameters (at construction) and of trees (at trace time).

Concrete hyperparameters (Python or NumPy numbers) are checked when a
transformation is built. JAX arrays -- traced values under ``jit`` or the
arrays that :func:`optax.inject_hyperparams` passes in -- are accepted
unchecked: reading their value would need a host transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
import numbers
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete_number(value: Any) -> bool:
  """True for a Python or NumPy scalar whose value can be checked now."""
  if isinstance(value, jax.Array):
    return False
  if isinstance(value, np.ndarray):
    return value.ndim == 0
  return isinstance(value, (numbers.Number, np.generic))


def check_number(
    name: str,
    value: Any,
    *,
    low: Optional[float] = None,
    high: Optional[float] = None,
    low_open: bool = False,
    high_open: bool = False,
    allow_inf: bool = False,
    integer: bool = False,
    allow_none: bool = False,
) -> None:
  """Raises a clear error when a concrete hyperparameter is out of range.

  Args:
    name: the argument's name, used in the message.
    value: the value to check. JAX arrays pass unchecked.
    low: smallest allowed value (or None for no bound).
    high: largest allowed value (or None for no bound).
    low_open: whether ``low`` itself is excluded.
    high_open: whether ``high`` itself is excluded.
    allow_inf: whether +inf is a valid value.
    integer: whether the value must be a whole number.
    allow_none: whether ``None`` is a valid value.

  Raises:
    TypeError: for a value that is not a real number (a string, a bool, a
      complex number, an array of several elements).
    ValueError: for NaN, an infinity that is not allowed, a non-integer where
      one is required, or a value outside the range.
  """
  if value is None and allow_none:
    return
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value.item()  # a 0-d bool, complex or str array is checked as such.
  if isinstance(value, jax.Array):
    if value.ndim != 0 or not (
        jnp.issubdtype(value.dtype, jnp.floating)
        or jnp.issubdtype(value.dtype, jnp.integer)
    ):
      raise TypeError(
          f"{name} must be a real scalar; got an array of shape {value.shape}"
          f" and dtype {value.dtype}."
      )
    return  # traced or injected: accepted as is.
  if (value is None or isinstance(value, (bool, np.bool_))
      or not is_concrete_number(value)):
    raise TypeError(f"{name} must be a real number; got {value!r}.")
  if isinstance(value, (complex, np.complexfloating)):
    raise TypeError(f"{name} must be a real number; got complex {value!r}.")
  v = float(value)
  if math.isnan(v):
    raise ValueError(f"{name} must not be NaN.")
  if math.isinf(v) and not (allow_inf and v > 0):
    raise ValueError(f"{name} must be finite; got {v}.")
  if integer and not (isinstance(value, (numbers.Integral, np.integer))
                      or v.is_integer()):
    raise ValueError(f"{name} must be a whole number; got {value!r}.")
  if low is not None and (v < low or (low_open and v == low)):
    bound = f"> {low}" if low_open else f">= {low}"
    raise ValueError(f"{name} must be {bound}; got {value!r}.")
  if high is not None and (v > high or (high_open and v == high)):
    bound = f"< {high}" if high_open else f"<= {high}"
    raise ValueError(f"{name} must be {bound}; got {value!r}.")


# Structural arguments (a norm's order, reduction axes) shape the computation,
# so they cannot be traced. optax.inject_hyperparams turns every numeric
# argument -- defaults included -- into an array unless it is named in
# static_args; this hint says so.
_STATIC_HINT = ("it shapes the computation and cannot be traced; under "
                "optax.inject_hyperparams, name it in static_args")


def check_ord(name: str, ord: Any) -> float:
  """Checks a norm order: any real p >= 1, or inf ('inf' accepted too).

  ``None`` stands for 2 (the Euclidean norm), as in ``numpy.linalg.norm``.
  """
  if ord is None:
    return 2.0
  if isinstance(ord, str) and ord.lower() in ("inf", "infinity"):
    return math.inf
  if isinstance(ord, jax.Array):
    raise TypeError(f"{name} must be a Python number, not an array: "
                    f"{_STATIC_HINT}=({name!r},).")
  check_number(name, ord, low=1.0, allow_inf=True)
  return float(ord)


def check_axis(name: str, axis: Any) -> Optional[tuple[int, ...]]:
  """Normalises ``axis`` (None, an int or a sequence of ints) to a tuple."""
  if axis is None:
    return None
  if isinstance(axis, jax.Array):
    raise TypeError(f"{name} must be None, an int or a tuple of ints, not an "
                    f"array: {_STATIC_HINT}=({name!r},).")
  if isinstance(axis, (bool, np.bool_)):
    raise TypeError(
        f"{name} must be None, an int or a tuple of ints; got {axis!r}.")
  if isinstance(axis, (numbers.Integral, np.integer)):
    return (int(axis),)
  if isinstance(axis, Sequence) and all(
      isinstance(a, (numbers.Integral, np.integer))
      and not isinstance(a, (bool, np.bool_)) for a in axis):
    if len({int(a) for a in axis}) != len(axis):
      raise ValueError(f"{name} has repeated axes: {axis!r}.")
    return tuple(int(a) for a in axis)
  raise TypeError(
      f"{name} must be None, an int or a tuple of ints; got {axis!r}.")


def check_probability(name: str, value: Any, *, open_low=True, open_high=True):
  """Checks a value in (0, 1) (bounds open by default)."""
  check_number(name, value, low=0.0, high=1.0, low_open=open_low,
               high_open=open_high)


def leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
  """Leaves of ``tree`` with readable paths (``None`` leaves are dropped)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path) or "<root>", leaf) for path, leaf in flat]


def check_float_leaves(tree: Any, what: str = "updates") -> None:
  """Raises TypeError naming the first leaf that is not a float or complex."""
  for path, leaf in leaves_with_paths(tree):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
      dtype = np.asarray(leaf).dtype
    if not jnp.issubdtype(dtype, jnp.inexact):
      raise TypeError(
          f"{what} leaf {path} has dtype {dtype}; gradient clipping needs "
          "float or complex leaves (integer parameters have no gradient -- "
          "mask them out with optax.masked)."
      )


def check_same_structure(updates: Any, params: Any, who: str) -> None:
  """Raises ValueError naming the leaf where params and updates differ."""
  if params is None:
    raise ValueError(
        f"{who} needs the parameters: call update(updates, state, params).")
  u = dict(leaves_with_paths(updates))
  p = dict(leaves_with_paths(params))
  for path in u:
    if path not in p:
      raise ValueError(f"{who}: params have no leaf at {path}, which the "
                       "updates have.")
    if np.shape(u[path]) != np.shape(p[path]):
      raise ValueError(
          f"{who}: params leaf {path} has shape {np.shape(p[path])} but the "
          f"update there has shape {np.shape(u[path])}.")
  for path in p:
    if path not in u:
      raise ValueError(f"{who}: updates have no leaf at {path}, which the "
                       "params have.")
