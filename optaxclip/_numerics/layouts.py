"""Unit layouts: leaves stacked into parts by unit size.

Owns :class:`UnitLayout` (leaves stacked into parts by unit size) and the
thread-local hand-over of packed vectors between stages.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import contextlib
import math
import threading
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip._numerics.collectives import varying
from optaxclip._numerics.floats import Scaled
from optaxclip._numerics.floats import accumulation_dtype
from optaxclip._numerics.floats import tree_accumulation_dtype
from optaxclip._numerics.packing import blocked_concat
from optaxclip._numerics.packing import blocked_pieces
from optaxclip._numerics.packing import chunked
from optaxclip._numerics.packing import concatenable
from optaxclip._numerics.packing import flat_concat
from optaxclip._numerics.packing import split_parts
from optaxclip._numerics.packing import take_each
from optaxclip._numerics.reductions import reduce_axes
from optaxclip._numerics.scaling import apply_multipliers
from optaxclip._numerics.scaling import factor_multipliers
from optaxclip._numerics.scaling import holds_exponents
from optaxclip._numerics.scaling import materialized_rows
from optaxclip._numerics.scaling import scale_each
from optaxclip._numerics.scaling import scale_leaf

# Leaves of a stacked part with at most this many elements are scaled in
# their part (see UnitLayout.scale); each takes its elements back by a
# gather with a constant index array of its size (4 bytes an element).
PACKED_SCALE_SIZE = 1 << 12


class UnitLayout:
  """Where the units of many leaves lie: small leaves packed by unit size.

  Each unit of a leaf is a row of its elements (a leaf of several units,
  such as a kernel with one unit per output, is transposed so that the
  unit's axes come last). Small leaves (see ``concatenable``; real,
  non-empty) with the same unit size, number of units, accumulation dtype
  and grouping key (e.g. the mapped axes their sums are summed over) are
  stacked into one ``(units, unit size)`` matrix, in chunks of at most
  ``CHUNK_SIZE`` elements, and reduced along its rows at once: the compiled
  program then grows with the number of distinct leaf layouts, not of
  leaves (a model without ``scan`` has thousands of tiny leaves and pays its
  compile time at every restart). Other leaves (large or complex) are parts
  of their own, reduced as they are: their step time does not change.

  A *part* is either such a matrix (its unit values are a column, one row
  per unit) or one leaf (its unit values keep the leaf's rank, reduced axes
  of size 1). Values computed on the parts are handed back per leaf by
  :meth:`unpack` and :meth:`scale` with :func:`take_each`, so that each
  leaf is scaled by its own factors as a fusible element-wise operand (the
  leaves themselves are never sliced back out of a concatenation).
  """

  def __init__(self, leaves, axes, keys, several_units: bool = False):
    """``several_units``: pack leaves of several units too (otherwise they
    are parts of their own, as for callers that read parts' values as one
    per leaf; :meth:`unpack` and :meth:`scale` handle both).
    """
    self.shapes = [tuple(x.shape) for x in leaves]
    self.axes = [reduce_axes(x, ax) for x, ax in zip(leaves, axes)]
    # Per part: ("rows" or "stack", [(leaf, row offset, rows)], key) or
    # ("leaf", i, key).
    self.parts = []
    # Parts packed from the same leaves (the norms' pass and the scaling's)
    # are traced once: (the leaves, kept alive, and the part) by their ids.
    self._packed = {}
    groups = {}
    for i, (x, ax, key) in enumerate(zip(leaves, self.axes, keys)):
      if x.size == 0 or jnp.iscomplexobj(x) or not concatenable(x):
        self.parts.append(("leaf", i, key))
        continue
      unit = math.prod(x.shape[d] for d in ax)
      n = x.size // unit
      if n > 1 and not several_units:
        self.parts.append(("leaf", i, key))
        continue
      acc = accumulation_dtype(x.dtype)
      # Leaves of a part have the same number of units: each takes its
      # units' values back as one row of a (leaves, units) matrix.
      if n == 1 or ax == tuple(range(x.ndim - len(ax), x.ndim)):
        group = ("rows", unit, n, acc, key)
      else:
        # Units across leading axes (a Dense kernel's inputs): leaves of
        # one shape are stacked as they are, since making the units rows
        # would take a transpose (a kernel to compile) per leaf.
        group = ("stack", x.shape, ax, acc, key)
      groups.setdefault(group, []).append(i)
    for (kind, unit, *_, key), members in groups.items():
      if len(members) == 1:
        self.parts.append(("leaf", members[0], key))
        continue
      if kind == "stack":
        unit = math.prod(unit[d] for d in self.axes[members[0]])
      sizes = [math.prod(self.shapes[i]) for i in members]
      for chunk in chunked(members, sizes):
        rows, entries = 0, []
        for i in chunk:
          n = math.prod(self.shapes[i]) // unit
          entries.append((i, rows, n))
          rows += n
        self.parts.append((kind, entries, key))

  @property
  def keys(self) -> list[Any]:
    return [key for _, _, key in self.parts]

  @property
  def part_axes(self) -> list[tuple[int, ...]]:
    """Per part, the axes its units span."""
    out = []
    for kind, what, _ in self.parts:
      if kind == "rows":
        out.append((1,))
      elif kind == "stack":
        out.append(tuple(d + 1 for d in self.axes[what[0][0]]))
      else:
        out.append(self.axes[what])
    return out

  def pack(self, leaves, together: bool = False) -> list[jax.Array]:
    """The leaves (or arrays of their shapes, e.g. the params) as parts.

    Stacked parts are in the members' widest accumulation dtype.
    ``together``: the stacked parts of a dtype (and key) cut from one
    concatenation of their leaves (one kernel to compile, not one per part),
    for consumers into whose kernels XLA fuses the cuts (a reduction it
    emits itself, not one it hands to YNNPACK: there each cut would be a
    copy, a kernel of its own).
    """
    if together:
      self._pack_together(leaves)
    return [
      leaves[what] if kind == "leaf" else self._pack_part(kind, what, leaves)
      for kind, what, _ in self.parts
    ]

  def _pack_together(self, leaves) -> None:
    """Packs the stacked parts not packed yet as :meth:`pack` does with
    ``together``, into the cache of :meth:`_pack_part`. The cut is hidden
    from XLA's simplifier (which would turn the cuts of a concatenation
    back into one concatenation each) by an ``optimization_barrier``.
    """
    groups = {}
    for kind, what, part_key in self.parts:
      if kind == "leaf":
        continue
      members = [leaves[i] for i, _, _ in what]
      key = (kind, tuple(map(id, members)))
      if key in self._packed:
        continue
      dtype = tree_accumulation_dtype(members)
      group = (np.dtype(dtype), part_key, varying(*members))
      groups.setdefault(group, []).append((kind, what, key, members))
    for (dtype, *_), entries in groups.items():
      if len(entries) < 2:
        continue
      pieces = []
      for *_, members in entries:
        pieces += blocked_pieces(
          [jax.lax.convert_element_type(jnp.ravel(x), dtype) for x in members]
        )
      whole = jax.lax.optimization_barrier(jnp.concatenate(pieces))
      start = 0
      for kind, what, key, members in entries:
        size = sum(x.size for x in members)
        seg = jax.lax.slice_in_dim(whole, start, start + size)
        start += size
        if kind == "stack":
          part = seg.reshape((len(what),) + self.shapes[what[0][0]])
        else:
          first = what[0][0]
          unit = math.prod(self.shapes[first][d] for d in self.axes[first])
          part = seg.reshape(-1, unit)
        self._packed[key] = (members, part)

  def _pack_part(self, kind, what, leaves) -> jax.Array:
    members = [leaves[i] for i, _, _ in what]
    key = (kind, tuple(map(id, members)))
    if key not in self._packed:
      self._packed[key] = (members, self._pack_new(kind, what, leaves))
    return self._packed[key][1]

  def _pack_new(self, kind, what, leaves) -> jax.Array:
    dtype = tree_accumulation_dtype([leaves[i] for i, _, _ in what])
    if kind == "stack":
      return blocked_concat(
        [leaves[i].astype(dtype) for i, _, _ in what]
      ).reshape((len(what),) + self.shapes[what[0][0]])
    # Units are trailing (or whole leaves): the rows are the leaves'
    # raveled elements, concatenated as one vector and reshaped once (a
    # reshape per leaf is an instruction per leaf for XLA to process).
    unit = math.prod(self.shapes[what[0][0]][d] for d in self.axes[what[0][0]])
    run = handed_run([leaves[i] for i, _, _ in what])
    if run is not None:
      return jax.lax.convert_element_type(run, dtype).reshape(-1, unit)
    flat = [
      jax.lax.convert_element_type(jnp.ravel(leaves[i]), dtype)
      for i, _, _ in what
    ]
    return blocked_concat(flat).reshape(-1, unit)

  def pack_units(self, values) -> list[jax.Array]:
    """Per-leaf unit values (keepdims shapes) as per-part values."""
    out = []
    for kind, what, _ in self.parts:
      if kind == "leaf":
        out.append(values[what])
      elif kind == "stack":
        out.append(jnp.stack([values[i] for i, _, _ in what]))
      else:
        flat = [jnp.ravel(values[i]) for i, _, _ in what]
        out.append(jnp.concatenate(flat).reshape(-1, 1))
    return out

  def unit_shape(self, i) -> tuple[int, ...]:
    return tuple(
      1 if d in self.axes[i] else n for d, n in enumerate(self.shapes[i])
    )

  def pack_static(self, numbers) -> list[np.ndarray]:
    """Per-leaf numbers (one for all of a leaf's units) as per-part arrays
    of the parts' unit values' shapes.
    """
    out = []
    for kind, what, _ in self.parts:
      if kind == "leaf":
        out.append(np.asarray(numbers[what]))
      elif kind == "stack":
        out.append(
          np.stack(
            [np.full(self.unit_shape(i), numbers[i]) for i, _, _ in what]
          )
        )
      else:
        out.append(
          np.concatenate([np.full((n, 1), numbers[i]) for i, _, n in what])
        )
    return out

  def leaf_vector(self, values, dtype) -> jax.Array:
    """Per-part values (arrays) of whole-leaf units as one vector in leaf
    order.
    """
    vector = self.leaf_vector_unordered(values, dtype)
    order = self._leaf_order()
    if order is None:
      return vector
    return jnp.take(vector, order, axis=0)

  def leaf_vector_scaled(self, norms: Sequence[Scaled], dtype) -> Scaled:
    """:meth:`leaf_vector` of per-part :class:`Scaled` values, value and
    exponent put in leaf order by one gather (a kernel to compile, not
    two): the exponents, small integers, are exact as floats of ``dtype``.
    """
    if not holds_exponents(dtype):
      return Scaled(
        self.leaf_vector([n.value for n in norms], dtype),
        self.leaf_vector([n.exponent for n in norms], jnp.int32),
      )
    pairs = jnp.stack(
      [
        self.leaf_vector_unordered([n.value for n in norms], dtype),
        self.leaf_vector_unordered([n.exponent for n in norms], dtype),
      ]
    )
    order = self._leaf_order()
    if order is not None:
      pairs = jnp.take(pairs, order, axis=1)
    return Scaled(pairs[0], pairs[1].astype(jnp.int32))

  def leaf_vector_unordered(self, values, dtype) -> jax.Array:
    flat = [jnp.ravel(v).astype(dtype) for v in values]
    return jnp.concatenate(flat) if len(flat) > 1 else flat[0]

  def _leaf_order(self) -> Optional[np.ndarray]:
    """Where each leaf's entry lies in the parts' order (None: in place)."""
    order = []
    for kind, what, _ in self.parts:
      order.extend([what] if kind == "leaf" else [i for i, _, _ in what])
    if order == sorted(order):
      return None
    return np.argsort(np.asarray(order))

  def unpack_part(self, j, value) -> list[Any]:
    """:meth:`unpack` of part ``j``'s unit values alone: its leaves' values,
    in the order of its rows.
    """
    values: list[Any] = [None] * len(self.parts)
    values[j] = value
    out = self.unpack(values, only=j)
    kind, what, _ = self.parts[j]
    return [out[what]] if kind == "leaf" else [out[i] for i, _, _ in what]

  def unpack(self, values, only: Optional[int] = None):
    """Per-part unit values (arrays or :class:`Scaled`) as per-leaf ones
    (keepdims shapes). ``only``: of that part alone (the others' None).
    """
    out: list[Any] = [None] * len(self.shapes)
    for j, ((kind, what, _), v) in enumerate(zip(self.parts, values)):
      if only is not None and j != only:
        continue
      if kind == "leaf":
        out[what] = v
        continue
      # One row of a (leaves, units) matrix per leaf: all of a part's
      # leaves have the same number of units.
      grid = (len(what), what[0][2])
      if isinstance(v, Scaled):
        pairs = zip(
          take_each(v.value.reshape(grid)), take_each(v.exponent.reshape(grid))
        )
        for (i, _, _), (value, e) in zip(what, pairs):
          shape = self.unit_shape(i)
          out[i] = Scaled(value.reshape(shape), e.reshape(shape))
        continue
      for (i, _, _), value in zip(what, take_each(v.reshape(grid))):
        out[i] = value.reshape(self.unit_shape(i))
    return out

  def scale(self, leaves, factors, smallest: float = 0.0) -> list[jax.Array]:
    """Each leaf times its units' factors (per part, :class:`Scaled` or
    plain), as :func:`scale_leaf` computes it (``smallest``: a bound on
    the factors for the parts of one leaf, see :func:`scale_leaf`).

    Stacked parts of leaves of at most ``PACKED_SCALE_SIZE`` elements with
    Scaled factors are scaled as arrays: the multipliers of all their
    units are computed at once (one concatenation per dtype) and kept in
    memory (:func:`materialized_rows`), and each leaf takes its elements of
    its part times its rows of them with a gather whose constant indices
    XLA keeps as an operand: the multiplication is fused into the gather,
    one small kernel per leaf shape, shared by its leaves, in place of a
    row of multipliers (:func:`scale_each`) fused three times into each of
    its consumers, which made the scaling cost as much compile time as Adam
    on a tree of hundreds of tiny leaves. (A static slice would be a
    distinct kernel per leaf, compiled on its own; the product kept in
    memory first was one more kernel per part, 5 of some 56 on 300 leaves
    of 5 shapes.) Other parts:
    :func:`scale_each`, or :func:`scale_leaf` for a part of one leaf.
    """
    out: list[Any] = [None] * len(self.shapes)
    packed = []
    for j, ((kind, what, _), f) in enumerate(zip(self.parts, factors)):
      if kind == "leaf":
        out[what] = scale_leaf(leaves[what], f, smallest=smallest)
        continue
      members = [i for i, _, _ in what]
      if isinstance(f, Scaled) and (
        math.prod(self.shapes[members[0]]) <= PACKED_SCALE_SIZE
      ):
        packed.append(j)
        continue
      grid = (len(what), what[0][2])
      per_leaf = (
        Scaled(f.value.reshape(grid), f.exponent.reshape(grid))
        if isinstance(f, Scaled)
        else f.reshape(grid)
      )
      scaled = scale_each(
        [leaves[i] for i in members],
        per_leaf,
        [self.unit_shape(i) for i in members],
      )
      for i, y in zip(members, scaled):
        out[i] = y
    if packed:
      self._scale_packed(packed, leaves, factors, out)
    return out

  def scale_leafwise(self, leaves, factor) -> list[jax.Array]:
    """Each leaf times its own entry of ``factor`` (Scaled: one entry per
    leaf, in leaf order), for a layout of whole-leaf units: as
    :func:`scale_each`, with stacked parts scaled as :meth:`scale` does.
    The packed parts take their entries by one gather: a factor computed by
    arithmetic is best passed in memory (:func:`materialized_scaled`).
    """
    out: list[Any] = [None] * len(self.shapes)
    own, packed = [], []
    factors: list[Any] = [None] * len(self.parts)
    for j, (kind, what, _) in enumerate(self.parts):
      if kind == "leaf" or kind == "stack" or what[0][2] != 1:
        own.extend([what] if kind == "leaf" else [i for i, _, _ in what])
        continue
      # One unit a leaf: the part's factors are its leaves' entries.
      if math.prod(self.shapes[what[0][0]]) <= PACKED_SCALE_SIZE:
        packed.append(j)
      else:
        own.extend(i for i, _, _ in what)
    if packed:
      # The entries of all packed parts by one gather, sliced per part:
      # _scale_packed concatenates them again, which XLA then folds (a
      # concatenation of gathers would be a long kernel to compile).
      index = [np.asarray([i for i, _, _ in self.parts[j][1]]) for j in packed]
      picked = split_parts(
        Scaled(
          jnp.take(factor.value, np.concatenate(index), axis=0),
          jnp.take(factor.exponent, np.concatenate(index), axis=0),
        ),
        [np.zeros((len(i), 1)) for i in index],
      )
      for j, f in zip(packed, picked):
        factors[j] = f
    if own:
      own = sorted(own)
      index = np.asarray(own)
      scaled = scale_each(
        [leaves[i] for i in own],
        Scaled(
          jnp.take(factor.value, index, axis=0),
          jnp.take(factor.exponent, index, axis=0),
        ),
      )
      for i, y in zip(own, scaled):
        out[i] = y
    if packed:
      self._scale_packed(packed, leaves, factors, out)
    return out

  def _scale_packed(self, indices, leaves, factors, out) -> None:
    """Scales the leaves of the stacked parts ``indices`` in their parts
    (see :meth:`scale`), into ``out``.
    """
    parts = {
      j: self._pack_part(self.parts[j][0], self.parts[j][1], leaves)
      for j in indices
    }
    axes = self.part_axes
    shapes = {
      j: tuple(1 if d in axes[j] else n for d, n in enumerate(x.shape))
      for j, x in parts.items()
    }
    # Parts of one key only: inside shard_map, multipliers of units that
    # vary across devices are not mixed with those of replicated ones.
    by_dtype = {}
    for j in indices:
      group = (
        np.dtype(parts[j].dtype),
        self.parts[j][2],
        varying(parts[j], factors[j]),
      )
      by_dtype.setdefault(group, []).append(j)
    for (dtype, *_), members in by_dtype.items():
      factor = Scaled(
        flat_concat(
          [jnp.broadcast_to(factors[j].value, shapes[j]) for j in members]
        ),
        flat_concat(
          [jnp.broadcast_to(factors[j].exponent, shapes[j]) for j in members]
        ),
      )
      rows = materialized_rows(factor_multipliers(factor, dtype))
      start = 0
      for j in members:
        size = math.prod(shapes[j])
        multipliers = [
          jax.lax.slice_in_dim(r, start, start + size).reshape(shapes[j])
          for r in rows
        ]
        start += size
        flat = apply_multipliers(parts[j], multipliers).reshape(-1)
        members = [i for i, _, _ in self.parts[j][1]]
        for i, y in zip(
          members, take_leaves(flat, [leaves[i] for i in members])
        ):
          out[i] = y


def take_run(flat: jax.Array, start: int, shape: tuple[int, ...]) -> jax.Array:
  """``flat[start : start + prod(shape)]`` shaped ``shape``, taken by a
  gather with a constant index array (a leaf's elements of a packed vector).

  Not as a static slice: XLA folds the offset into the kernel as a constant,
  a distinct kernel per leaf that XLA:CPU compiles with LLVM on its own. The
  index array stays an operand, so the kernels of all leaves of one shape
  are one.
  """
  size = math.prod(shape)
  index = np.arange(start, start + size, dtype=np.int32)
  return jax.lax.gather(
    flat,
    index.reshape(tuple(shape) + (1,)),
    _TAKE_RUN_DIMS,
    (1,),
    mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
  )


_TAKE_RUN_DIMS = jax.lax.GatherDimensionNumbers(
  offset_dims=(), collapsed_slice_dims=(0,), start_index_map=(0,)
)


# Leaves taken from packed vectors while a transformation of several stages
# runs (see handing_over): ``runs``, id of the leaf -> (leaf, vector,
# start), or None outside handing_over. Each entry holds its leaf, so its id
# cannot be reused while the entry lives, and a lookup checks the leaf is the
# one asked about. The runs are this thread's (another thread tracing at the
# same time has its own) and last one ``with handing_over()`` block, which
# runs within one trace: a retrace starts with none, and the block gives the
# enclosing block's runs back when it ends.
_handed = threading.local()


@contextlib.contextmanager
def handing_over() -> Iterator[None]:
  """Within it, each leaf taken from a packed vector by :func:`take_leaf` is
  remembered, and packing such leaves again, in order, takes a slice of that
  vector (:func:`handed_run`) instead of concatenating them: a
  transformation built of stages that each pack the small leaves (Stable-
  SPAM's three) hands its packed vectors from one stage to the next, and the
  gathers between them are left unused (compile time on many-leaf trees).
  """
  outer = getattr(_handed, "runs", None)
  _handed.runs = {}
  try:
    yield
  finally:
    _handed.runs = outer


def take_leaf(
  flat: jax.Array, start: int, shape: tuple[int, ...], dtype: Any
) -> jax.Array:
  """:func:`take_run` as ``dtype`` (a leaf's own), remembered within
  :func:`handing_over`.
  """
  leaf = jax.lax.convert_element_type(take_run(flat, start, shape), dtype)
  runs = getattr(_handed, "runs", None)
  if runs is not None:
    runs[id(leaf)] = (leaf, flat, start)
  return leaf


def take_leaves(flat: jax.Array, like: Sequence[jax.Array]) -> list[jax.Array]:
  """Leaves of one size packed one after the other in ``flat``, each taken
  back shaped and typed like its entry of ``like`` (:func:`take_leaf`).
  """
  size = like[0].size if like else 0
  return [
    take_leaf(flat, k * size, x.shape, x.dtype) for k, x in enumerate(like)
  ]


def handed_run(members: Sequence[jax.Array]) -> Optional[jax.Array]:
  """The members' elements, concatenated, as a slice of the packed vector
  they were all taken from in this order by :func:`take_leaf` within
  :func:`handing_over` (rounded to their dtype); None otherwise.
  """
  runs = getattr(_handed, "runs", None)
  if not runs or not members:
    return None
  entries = [runs.get(id(x)) for x in members]
  if any(e is None or e[0] is not x for e, x in zip(entries, members)):
    return None
  vector, start = entries[0][1], entries[0][2]
  dtype = members[0].dtype
  end = start
  for x, (_, v, at) in zip(members, entries):
    if v is not vector or at != end or x.dtype != dtype:
      return None
    end += x.size
  run = jax.lax.slice_in_dim(vector, start, end)
  return jax.lax.convert_element_type(run, dtype)
