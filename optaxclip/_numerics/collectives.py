"""Collectives: reductions across the devices of mapped axes.

Owns which mapped axes an array spans, and the psum and pmax over them.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from optaxclip._typing import AxisName


def _names(axis_name: AxisName) -> tuple[str, ...]:
  if not axis_name:
    return ()
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def on_every_device(pred: jax.Array, axis_name: AxisName) -> jax.Array:
  """Whether the scalar ``pred`` holds on every device of the mapped axes
  ``axis_name`` (``pred`` itself outside them).

  The predicate of a ``lax.cond`` whose branches hold collectives must be
  the same on every device: a device that skips a branch leaves the others
  waiting in its all-reduce until XLA aborts the process (the predicate
  differs where a NaN lies in one device's units of ``clip_norm(axis=0)`` on
  a 2-D mesh, whose units differ across one of the axes).
  """
  names = _names(axis_name)
  if not names:
    return pred
  return jax.lax.pmin(pred.astype(jnp.int32), names) > 0


def split_axes(sharded, axis_name: AxisName) -> tuple[str, ...]:
  """One leaf's ``sharded`` entry as the names of ``axis_name`` it is split
  over: ``True`` all of them, ``False`` none, a tuple of names those.
  """
  names = _names(axis_name)
  if isinstance(sharded, (tuple, list)):
    return tuple(n for n in names if n in sharded)
  return names if sharded else ()


def psum_sharded(value, sharded, axis_name: AxisName):
  """``value`` summed over the axes a leaf is split over (see split_axes)."""
  names = split_axes(sharded, axis_name)
  return jax.lax.psum(value, names) if names else value


def nan_pmax(value, names: tuple[str, ...]):
  """``lax.pmax`` over the mapped axes ``names``, NaN wherever a device's
  value is NaN: XLA:CPU's all-reduce max drops a NaN, as its max reductions
  do (see "Maxima that keep NaN"). The NaN flags go in the same all-reduce.
  """
  if not names:
    return value
  value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    return jax.lax.pmax(value, names)
  top, nan = jax.lax.pmax(
    jnp.stack([value, jnp.isnan(value).astype(value.dtype)]), names
  )
  return jnp.where(nan > 0, jnp.nan, top).astype(value.dtype)


def axis_size(axis_name: AxisName) -> int:
  """The number of devices along the mapped axis (or axes); 1 for ``None``."""
  if not axis_name:
    return 1
  size = getattr(jax.lax, "axis_size", None)
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if size is None:  # older jax: psum of a Python constant is concrete.
    return int(jax.lax.psum(1, names))
  return math.prod(int(size(n)) for n in names)


def may_span_devices(x: jax.Array) -> bool:
  """Whether ``x`` may be split across devices, as far as its type tells.

  True when its mesh has an ``Auto`` axis of more than one device (the
  partitioner decides later, so it may be split) or an ``Explicit`` axis that
  its spec uses. Such leaves are reduced on their own: concatenating them
  with others would make XLA all-gather them (``Auto``) or fail with a
  ``ShardingTypeError`` (``Explicit``). Leaves on one device, replicated on an
  ``Explicit`` mesh, or local shards inside ``shard_map``/``pmap`` (``Manual``
  axes) are safe to concatenate.
  """
  typeof = getattr(jax, "typeof", None)
  if typeof is None:  # an older jax: no mesh in the type, jit sees one device.
    return False
  sharding = getattr(typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if sharding is None or mesh is None or mesh.empty:
    return False
  used = set()
  for entry in sharding.spec:
    used.update(entry if isinstance(entry, tuple) else (entry,))
  types = getattr(mesh, "axis_types", None) or (None,) * len(mesh.axis_names)
  for name, size, axis_type in zip(mesh.axis_names, mesh.axis_sizes, types):
    kind = getattr(axis_type, "name", str(axis_type))
    if size == 1 or kind == "Manual":
      continue
    if kind == "Explicit" and name not in used:
      continue
    return True
  return False


def varying(*values) -> tuple[Any, ...]:
  """How each array of ``values`` (Scaled or not) is typed across the
  mapped axes inside ``shard_map`` (varying along which): arrays
  concatenated with others must agree, or a replicated result would come out
  varying.
  """
  typeof = getattr(jax, "typeof", None)
  out = []
  for v in jax.tree.leaves(values):
    aval = typeof(v) if typeof is not None else None
    # jax 0.10: manual_axis_type (varying, unreduced, reduced); older: vma.
    kind = getattr(aval, "manual_axis_type", None)
    if kind is None:
      kind = getattr(aval, "vma", None)
    out.append(None if kind is None else repr(kind))
  return tuple(out)


def sharded_flags(
  leaves, sharded, axis_name: AxisName = None
) -> list[tuple[str, ...]]:
  """Per leaf, the names of ``axis_name`` it is split over (``sharded=None``:
  all of them, for every leaf).
  """
  if sharded is None:
    return [_names(axis_name)] * len(leaves)
  if len(sharded) != len(leaves):
    raise ValueError("sharded flags do not match the leaves.")
  return [split_axes(s, axis_name) for s in sharded]
