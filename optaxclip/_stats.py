"""Clipper states that carry their statistics, and ``stats()`` to read them.

Every clipper's state is a NamedTuple declared next to its transformation and
registered with :func:`register`, so that :func:`stats` can find it anywhere
in a nested optimizer state.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import optax

# The fields every clipper state starts with.
CLIP_FIELDS = ("norm", "clipped_norm", "clip_fraction")

# State class name -> (class, short name used in stats keys, stat field names).
_REGISTRY: dict[str, tuple[type, str, tuple[str, ...]]] = {}


def register(short: str, stat_fields: tuple[str, ...] = CLIP_FIELDS):
  """Class decorator: registers a clipper's state class for :func:`stats`.

  Args:
    short: the name used in stats keys, the transformation's name
      (``"clip_global"``).
    stat_fields: the fields :func:`stats` reports (scalars).

  Returns:
    The decorator, which returns the class unchanged (but for its
    ``__module__``, set to ``optaxclip``, where the class is public).
  """
  def decorate(cls: type) -> type:
    missing = [f for f in stat_fields if f not in cls._fields]
    if missing:
      raise TypeError(f"{cls.__name__} lacks the stat fields {missing}.")
    cls.__module__ = "optaxclip"
    _REGISTRY[cls.__name__] = (cls, short, tuple(stat_fields))
    return cls
  return decorate


def zeros(n: int = len(CLIP_FIELDS)) -> tuple[jax.Array, ...]:
  """``n`` float32 zero scalars, the initial value of the statistics."""
  return tuple(jnp.zeros((), jnp.float32) for _ in range(n))


def as_stat(x: Any) -> jax.Array:
  """A statistic as a float32 scalar (stable dtype: no retrace)."""
  return jnp.asarray(x, jnp.float32).reshape(())


def _path_part(entry: Any) -> str:
  for attr in ("name", "key", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _unwrap(value: Any) -> Any:
  """The array inside an ``nnx`` Variable, or the value itself."""
  if isinstance(value, jax.Array):
    return value
  get_value = getattr(value, "get_value", None)  # flax >= 0.12: .value is
  if callable(get_value):                         # deprecated.
    return get_value()
  return getattr(value, "value", value)


def stats(opt_state: Any) -> dict[str, jax.Array]:
  """One flat dict of every clipper's statistics found in an optimizer state.

  Walks any nesting of optax states -- ``optax.chain``, ``optax.masked``,
  ``optax.inject_hyperparams``, a Flax ``TrainState`` (pass the TrainState or
  its ``opt_state``) or the state of an ``nnx.Optimizer`` -- and returns
  ``{"<clipper>/<field>": value}``, e.g. ``"clip_global/norm"``. When one state
  holds the same clipper more than once, each key is prefixed by its path in
  the state (``"0/clip_global/norm"``, ``"2/clip_global/norm"``). It reads
  values already in the state: calling it inside a jitted step adds no pass
  over the gradients.

  Args:
    opt_state: any pytree holding optaxclip states.

  Returns:
    A dict from names to float32 scalars, in the order the states appear.

  Example:
    >>> import jax.numpy as jnp, optax, optaxclip
    >>> tx = optax.chain(optaxclip.clip_global(1.0), optax.sgd(0.1))
    >>> params = {"w": jnp.ones(4)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({"w": jnp.full(4, 2.0)}, state, params)
    >>> {k: round(float(v), 3) for k, v in optaxclip.stats(state).items()}
    {'clip_global/norm': 4.0, 'clip_global/clipped_norm': 1.0,
     'clip_global/clip_fraction': 1.0}
  """
  found = []
  for class_name, (_, short, fields) in _REGISTRY.items():
    for path, state in optax.tree_utils.tree_get_all_with_path(
        opt_state, class_name):
      parts = tuple(_path_part(e) for e in path)
      found.append((jax.tree_util.keystr(path), parts, short, fields, state))
  found.sort(key=lambda item: _natural_key(item[0]))
  counts: dict[str, int] = {}
  for _, _, short, _, _ in found:
    counts[short] = counts.get(short, 0) + 1
  out: dict[str, jax.Array] = {}
  for _, parts, short, fields, state in found:
    prefix = short if counts[short] == 1 else "/".join((*parts, short))
    for field in fields:
      out[f"{prefix}/{field}"] = _unwrap(getattr(state, field))
  return out


def _natural_key(text: str) -> list:
  return [(0, int(t), "") if t.isdigit() else (1, 0, t)
          for t in re.split(r"(\d+)", text)]
