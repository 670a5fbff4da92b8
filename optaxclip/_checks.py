"""Validation of hyperparameters (at construction) and of trees (at trace time).

Concrete hyperparameters (Python or NumPy numbers) are checked when a
transformation is built. JAX arrays -- traced values under ``jit`` or the
arrays that :func:`optax.inject_hyperparams` passes in -- are accepted
unchecked: reading their value would need a host transfer.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence

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
  if isinstance(value, (bool, np.bool_)) or not is_concrete_number(value):
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


def check_ord(name: str, ord: Any) -> float:  # pylint: disable=redefined-builtin
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
    raise TypeError(f"{name} must be None, an int or a tuple of ints; got {axis!r}.")
  if isinstance(axis, (numbers.Integral, np.integer)):
    return (int(axis),)
  if isinstance(axis, Sequence) and all(
      isinstance(a, (numbers.Integral, np.integer))
      and not isinstance(a, (bool, np.bool_)) for a in axis):
    if len(set(int(a) for a in axis)) != len(axis):
      raise ValueError(f"{name} has repeated axes: {axis!r}.")
    return tuple(int(a) for a in axis)
  raise TypeError(f"{name} must be None, an int or a tuple of ints; got {axis!r}.")


def check_probability(name: str, value: Any, *, open_low=True, open_high=True):
  """Checks a value in (0, 1) (bounds open by default)."""
  check_number(name, value, low=0.0, high=1.0, low_open=open_low,
               high_open=open_high)


def leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
  """Leaves of ``tree`` with readable paths (``None`` leaves are dropped)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path) or "<root>", leaf) for path, leaf in flat]


def check_float_leaves(tree: Any, what: str = "updates") -> None:
  """Raises TypeError naming the first leaf that is not a float or complex array."""
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
  """Raises ValueError naming the leaf where ``params`` differs from ``updates``."""
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


def axis_names(axis_name: Any) -> tuple[str, ...]:
  """The names in ``axis_name`` (a name, a tuple of names or ``None``)."""
  if axis_name is None:
    return ()
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def check_axis_name(who: str, axis_name: Any) -> Any:
  """Checks ``axis_name``: ``None``, a non-empty string or a non-empty tuple
  of distinct non-empty strings. Returns it unchanged."""
  if axis_name is None:
    return None
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if not names or not all(isinstance(n, str) for n in names):
    raise TypeError(f"{who}: axis_name must be a string or a tuple of strings;"
                    f" got {axis_name!r}.")
  if not all(names):
    raise ValueError(f"{who}: axis_name must not be or contain an empty "
                     f"name; got {axis_name!r}.")
  if len(set(names)) != len(names):
    raise ValueError(f"{who}: axis_name must name each axis once; got "
                     f"{axis_name!r}.")
  return axis_name


def is_shard_spec(value: Any) -> bool:
  """Whether ``value`` is one leaf's entry of ``sharded`` rather than a node
  of a pytree prefix: a bool, ``None``, a ``PartitionSpec``, a string (an
  error, caught by :func:`shard_spec`) or a tuple/list of strings."""
  if isinstance(value, (bool, np.bool_, str, jax.sharding.PartitionSpec)):
    return True
  if value is None:
    return True
  return (isinstance(value, (tuple, list)) and bool(value)
          and all(isinstance(v, str) for v in value))


def shard_spec(who: str, spec: Any, axis_name: Any, where: str = "",
               ndim: Optional[int] = None):
  """One leaf's ``sharded`` entry, checked and normalised.

  Args:
    who: the clipper, for messages.
    spec: ``True`` (split over every axis of ``axis_name``), ``False`` or
      ``None`` (not split), a tuple of axis names, or a
      ``jax.sharding.PartitionSpec`` (which array dimension each name splits).
    axis_name: the clipper's ``axis_name``.
    where: the leaf's path, for messages.
    ndim: the leaf's rank, when known (a PartitionSpec must fit it).

  Returns:
    ``(axes, dims)``: the names the leaf is split over, in ``axis_name``'s
    order, and for a PartitionSpec the names splitting each dimension (one
    tuple per dimension, ``ndim`` of them when known), else ``None``.
  """
  names = axis_names(axis_name)
  at = f" for the leaf {where}" if where else ""
  if isinstance(spec, (bool, np.bool_)):
    return (names if spec else ()), None
  if spec is None:
    return (), None
  if isinstance(spec, str):
    raise TypeError(
        f"{who}: sharded must be a bool, a tuple of axis names or a "
        f"PartitionSpec{at}; got the string {spec!r} (write ({spec!r},) for "
        "one axis).")
  if isinstance(spec, jax.sharding.PartitionSpec):
    dims = []
    for entry in spec:
      if entry is None:
        dims.append(())
      elif isinstance(entry, str):
        dims.append((entry,))
      elif isinstance(entry, tuple) and all(isinstance(e, str) for e in entry):
        dims.append(entry)
      else:
        raise TypeError(f"{who}: sharded{at} must be a PartitionSpec of axis "
                        f"names; got {spec!r}.")
    if ndim is not None:
      if len(dims) > ndim:
        raise ValueError(f"{who}: sharded{at} must have at most the leaf's "
                         f"rank ({ndim}) entries; got {spec!r}.")
      dims += [()] * (ndim - len(dims))
    used = [n for d in dims for n in d]
  elif (isinstance(spec, (tuple, list))
        and all(isinstance(s, str) for s in spec)):
    dims, used = None, list(spec)
  else:
    raise TypeError(f"{who}: sharded{at} must be a bool, a tuple of axis "
                    f"names or a PartitionSpec; got {spec!r}.")
  if len(set(used)) != len(used):
    raise ValueError(f"{who}: sharded{at} must name each axis once; got "
                     f"{spec!r}.")
  unknown = [n for n in used if n not in names]
  if unknown:
    raise ValueError(f"{who}: sharded{at} must name axes of axis_name "
                     f"{axis_name!r}; got {spec!r}.")
  axes = tuple(n for n in names if n in used)
  return axes, (None if dims is None else tuple(dims))


def check_sharded(who: str, sharded: Any, axis_name: Any) -> None:
  """Checks what can be checked of ``sharded`` before the updates are seen:
  every entry of a pytree prefix (a callable is checked per leaf later)."""
  if callable(sharded) and not is_shard_spec(sharded):
    return
  entries = jax.tree_util.tree_leaves(sharded, is_leaf=is_shard_spec)
  if not entries and not is_shard_spec(sharded):
    return  # an empty prefix: fits an empty tree.
  for entry in ([sharded] if is_shard_spec(sharded) else entries):
    if not is_shard_spec(entry):
      raise TypeError(f"{who}: sharded must be a bool, a tuple of axis names, "
                      "a PartitionSpec, a pytree prefix of those or a "
                      f"callable; got an entry {entry!r}.")
    shard_spec(who, entry, axis_name)
