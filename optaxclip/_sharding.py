"""Which leaves are split over which mapped axes, inside shard_map or pmap.

Inside ``shard_map``/``pmap`` each device holds a local shard of a leaf, and
a clipper with ``axis_name`` must sum a norm's partial sums over exactly the
axes that split what the norm spans: the others hold copies (counted once)
or other units. ``sharded`` says so per leaf, as

* ``True``: split over every axis of ``axis_name`` (the default),
* ``False`` or ``None``: not split (replicated on every device),
* a tuple of axis names: split over those axes (dimension unknown),
* a ``jax.sharding.PartitionSpec``: the names splitting each dimension, as
  given to ``shard_map``'s ``in_specs``. It gives the leaf's global shape (so
  ``clip_unitwise`` picks units from it) and tells a unit's axes from the
  others (so per-unit statistics are exact).

``sharded`` is one such entry for all leaves, a pytree prefix of the updates
with such entries (matched by key path, so a ``dict`` prefix fits
``FrozenDict`` updates and subtrees that ``optax.masked`` replaced by
``MaskedNode`` need no entry), or a callable ``(path, leaf) -> entry``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax

from optaxclip import _checks
from optaxclip import _norms


class LeafSharding(NamedTuple):
  """How one leaf is split across the mapped axes.

  Attributes:
    axes: the names of ``axis_name`` the leaf is split over (in its order).
    dims: per dimension, the names splitting it (from a PartitionSpec), or
      ``None`` when only ``axes`` is known.
  """

  axes: tuple[str, ...]
  dims: Optional[tuple[tuple[str, ...], ...]]


def _entry(who, spec, axis_name, path, leaf) -> LeafSharding:
  ndim = getattr(leaf, "ndim", None)
  return LeafSharding(
    *_checks.shard_spec(
      who, spec, axis_name, jax.tree_util.keystr(path) or "<root>", ndim
    )
  )


def per_leaf(
  tree: Any,
  spec: Any,
  *,
  is_entry: Callable[[Any], bool],
  who: str,
  name: str,
) -> list[tuple[tuple, Any, Any]]:
  """``(path, leaf, entry)`` per leaf of ``tree`` (``jax.tree.leaves`` order)
  for a per-leaf argument given as one entry, a pytree prefix of entries
  (matched by key path) or a callable ``(path, leaf) -> entry``.

  ``is_entry`` tells an entry from a node of the prefix. Shared by
  ``sharded`` and ``layer_axis``.

  Raises:
    ValueError naming the leaf when a prefix has no entry for it.
  """
  with_path = jax.tree_util.tree_flatten_with_path(tree)[0]
  if is_entry(spec):
    return [(tuple(path), leaf, spec) for path, leaf in with_path]
  if callable(spec):
    return [(tuple(path), leaf, spec(path, leaf)) for path, leaf in with_path]
  entries = {
    tuple(path): entry
    for path, entry in jax.tree_util.tree_flatten_with_path(
      spec, is_leaf=is_entry
    )[0]
  }
  out = []
  for path, leaf in with_path:
    path = tuple(path)
    for depth in range(len(path) + 1):
      if path[:depth] in entries:
        out.append((path, leaf, entries[path[:depth]]))
        break
    else:
      raise ValueError(
        f"{who}: {name} must be a pytree prefix of the updates (an entry "
        f"for every leaf); got none for the leaf "
        f"{jax.tree_util.keystr(path) or '<root>'}."
      )
  return out


def resolve(
  updates: Any, sharded: Any, axis_name: Any, who: str
) -> list[LeafSharding]:
  """Per leaf of ``updates`` (in ``jax.tree.leaves`` order), its sharding.

  Raises:
    ValueError or TypeError naming the leaf when ``sharded`` has no entry
    for it, or a bad one.
  """
  return [
    _entry(who, spec, axis_name, path, leaf)
    for path, leaf, spec in per_leaf(
      updates, sharded, is_entry=_checks.is_shard_spec, who=who, name="sharded"
    )
  ]


def axes_of(
  sharding: LeafSharding, unit_axes: Optional[tuple[int, ...]]
) -> tuple[str, ...]:
  """The names over which the partial sums of a unit must be summed.

  Without dimensions (a bool or a tuple of names), every axis the leaf is
  split over: ``sharded`` then means "split along what a unit spans".
  """
  if sharding.dims is None:
    return sharding.axes
  spanned = range(len(sharding.dims)) if unit_axes is None else unit_axes
  names = {n for d in spanned for n in sharding.dims[d]}
  return tuple(n for n in sharding.axes if n in names)


def other_axes(
  sharding: LeafSharding, unit_axes: Optional[tuple[int, ...]]
) -> tuple[str, ...]:
  """The names that split a leaf across units (each device: other units)."""
  summed = axes_of(sharding, unit_axes)
  if sharding.dims is None:
    return ()
  return tuple(n for n in sharding.axes if n not in summed)


def global_shape(x: Any, sharding: LeafSharding) -> Optional[tuple[int, ...]]:
  """The leaf's global shape, or ``None`` when its dimensions are unknown
  (split, with no PartitionSpec).
  """
  shape = tuple(getattr(x, "shape", ()))
  if not sharding.axes:
    return shape
  if sharding.dims is None:
    return None
  return tuple(
    d * _norms.axis_size(names) for d, names in zip(shape, sharding.dims)
  )
