"""Packing many small leaves into a few arrays of units, for compile time.

A per-unit clipper computes, per leaf, the units' power sums, the checks and
the exact recompute, the factors and the statistics: a program that grows by
some thirty operations (and three conditional branches) per leaf. On a model
of a thousand small leaves it compiled 15 to 20 times slower than adam.

Packing puts each small leaf's units in the rows of a 2-D array (the unit's
own axes last, ``(units, unit size)``) and concatenates the leaves that share
a dtype, a unit size and a sharding into one such array: the clipper then
runs on a few arrays, whatever the number of leaves, and the results are
sliced back into leaves. A unit's elements are the same, so are the norms
(up to the order of summation). Large leaves (whose copy would cost step
time) and leaves that may span devices (a concatenation would gather them)
are left as they are.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip import _norms


class _Part(NamedTuple):
  """Where one leaf lives in the packed arrays."""
  array: int  # index into Packing.arrays
  start: int  # first row (packed) or 0 (a leaf left as it is)
  units: int  # rows it takes
  perm: Optional[tuple[int, ...]]  # leaf axes -> (other axes, unit axes)
  shape: tuple[int, ...]  # the leaf's shape after ``perm``
  n_unit: int  # how many of its axes a unit spans (the last of ``perm``)


class Packing:
  """Leaves regrouped into arrays of units (see the module docstring).

  Attributes:
    arrays: the packed arrays (2-D, units in rows) and the leaves left as
      they are.
    axes: per array, the axes its units span: ``(1,)`` for a packed one.
    sharded, across: per array, the leaves' entries of the same name.
  """

  def __init__(self, leaves: Sequence[jax.Array],
               axes: Optional[Sequence[Optional[tuple[int, ...]]]] = None,
               sharded: Optional[Sequence[Any]] = None,
               across: Optional[Sequence[Any]] = None,
               limit: int = _norms.SMALL_LEAF_SIZE):
    n = len(leaves)
    axes = [None] * n if axes is None else list(axes)
    sharded = [None] * n if sharded is None else list(sharded)
    across = [()] * n if across is None else list(across)
    groups, alone = {}, []
    for i, x in enumerate(leaves):
      if 0 < x.size <= limit and not _norms.may_span_devices(x):
        unit = axes[i] if axes[i] is not None else tuple(range(x.ndim))
        size = math.prod(x.shape[a] for a in unit)
        key = (jnp.dtype(x.dtype), size, _key(sharded[i]), _key(across[i]))
        groups.setdefault(key, []).append(i)
      else:
        alone.append(i)
    self.arrays, self.axes, self.sharded, self.across = [], [], [], []
    self._packed: list[bool] = []
    self._parts: list[Optional[_Part]] = [None] * n
    for i in alone:
      self._add_alone(leaves[i], axes[i], sharded[i], across[i], i)
    for (_, size, _, _), members in groups.items():
      if len(members) == 1:
        i = members[0]
        self._add_alone(leaves[i], axes[i], sharded[i], across[i], i)
        continue
      # Chunks of at most CHUNK_SIZE elements bound the copy's memory.
      chunk, elements = [], 0
      for i in members:
        if chunk and elements + leaves[i].size > _norms.CHUNK_SIZE:
          self._add_packed(leaves, chunk, axes, size, sharded, across)
          chunk, elements = [], 0
        chunk.append(i)
        elements += leaves[i].size
      self._add_packed(leaves, chunk, axes, size, sharded, across)

  def pack_like(self, leaves: Sequence[jax.Array]) -> list[jax.Array]:
    """Other leaves of the same shapes (params), in this layout. A packed
    array of leaves of mixed dtypes takes their promoted dtype."""
    rows = [[] for _ in self.arrays]
    for x, part in sorted(zip(leaves, self._parts),
                          key=lambda xp: (xp[1].array, xp[1].start)):
      if part.perm is None:
        rows[part.array].append(x)
      else:
        y = jnp.transpose(x, part.perm) if part.perm != tuple(
            range(x.ndim)) else x
        rows[part.array].append(y.reshape(part.units, -1))
    return [r[0] if len(r) == 1 else jnp.concatenate(r) for r in rows]

  def _add_alone(self, x, axes, sharded, across, i):
    self._parts[i] = _Part(len(self.arrays), 0, 0, None, tuple(x.shape), 0)
    self.arrays.append(x)
    self._packed.append(False)
    self.axes.append(axes)
    self.sharded.append(sharded)
    self.across.append(across)

  def _add_packed(self, leaves, members, axes, size, sharded, across):
    rows, start = [], 0
    for i in members:
      x = leaves[i]
      unit = axes[i] if axes[i] is not None else tuple(range(x.ndim))
      perm = tuple(a for a in range(x.ndim) if a not in unit) + tuple(unit)
      y = jnp.transpose(x, perm) if perm != tuple(range(x.ndim)) else x
      units = x.size // size
      rows.append(y.reshape(units, size))
      self._parts[i] = _Part(len(self.arrays), start, units, perm, y.shape,
                             len(unit))
      start += units
    self.arrays.append(jnp.concatenate(rows) if len(rows) > 1 else rows[0])
    self._packed.append(True)
    self.axes.append((1,))
    self.sharded.append(sharded[members[0]])
    self.across.append(across[members[0]])

  def unpack(self, arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """Leaves from arrays shaped as :attr:`arrays` (e.g. the scaled ones)."""
    out = []
    for part in self._parts:
      a = arrays[part.array]
      if part.perm is None:
        out.append(a)
        continue
      y = a[part.start:part.start + part.units].reshape(part.shape)
      out.append(jnp.transpose(y, np.argsort(part.perm))
                 if part.perm != tuple(range(len(part.perm))) else y)
    return out

  def unit_values(self, arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """Per leaf, its units' values from per-unit arrays (one value per row
    of a packed array, keepdims-shaped for a leaf left alone), shaped to
    broadcast against the leaf (its unit axes of size 1).

    Scaling each leaf by a slice of small per-unit values keeps XLA from
    fusing a whole packed array into every leaf's output (which made the
    compile time grow with the square of the leaves).
    """
    out = []
    for part in self._parts:
      a = arrays[part.array]
      if part.perm is None:
        out.append(a)
        continue
      n_other = len(part.shape) - part.n_unit
      kept = [1] * len(part.shape)
      for k, axis in enumerate(part.perm[:n_other]):
        kept[axis] = part.shape[k]
      out.append(a[part.start:part.start + part.units].reshape(kept))
    return out

  def per_leaf(self, values: Sequence[jax.Array]) -> jax.Array:
    """For whole-leaf units: per array one value per unit (any shape with
    that many elements), as one vector in the leaves' order."""
    flat = jnp.concatenate([jnp.ravel(v) for v in values]) if values else (
        jnp.zeros((0,), jnp.float32))
    return flat[self._order()] if flat.shape[0] > 1 else flat

  def from_per_leaf(self, vector: jax.Array) -> list[jax.Array]:
    """For whole-leaf units: a vector in the leaves' order as per array
    values, shaped for broadcasting against :attr:`arrays`."""
    out = []
    for a, idx in enumerate(self._rows()):
      if self._packed[a]:
        out.append(vector[np.asarray(idx)].reshape(-1, 1))
      else:
        out.append(vector[idx[0]])
    return out

  def _rows(self) -> list[list[int]]:
    """Per array, the leaves in its rows (in order)."""
    rows = [[] for _ in self.arrays]
    for i, p in sorted(enumerate(self._parts),
                       key=lambda ip: (ip[1].array, ip[1].start)):
      rows[p.array].append(i)
    return rows

  def _order(self) -> np.ndarray:
    """Positions, in the concatenation of the arrays' rows, of each leaf."""
    flat = [i for rows in self._rows() for i in rows]
    order = np.empty(len(flat), np.int32)
    order[np.asarray(flat, np.int64)] = np.arange(len(flat), dtype=np.int32)
    return order


def _key(entry: Any) -> Any:
  """A hashable stand-in for a sharding entry (bools, tuples of names)."""
  if isinstance(entry, list):
    return tuple(entry)
  return entry
