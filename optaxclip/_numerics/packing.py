"""Packing: many small arrays as one vector, and back.

Owns small leaves and per-part values packed into one vector and cut back
(the id-keyed cache of cut pieces).
"""

from __future__ import annotations

from collections.abc import Sequence
import math
from typing import Any, Optional, Union
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip._numerics.collectives import may_span_devices
from optaxclip._numerics.collectives import varying
from optaxclip._numerics.floats import Scaled
from optaxclip._numerics.floats import scaled_value

# Leaves with at most this many elements are concatenated into one buffer for
# a tree-wide reduction: one reduction instead of one per leaf keeps compile
# time flat in the number of leaves, and copying small leaves is cheap.
SMALL_LEAF_SIZE = 1 << 16
# The largest concatenated buffer (elements): a bound on the temporary memory
# that concatenation costs, whatever the number of small leaves.
CHUNK_SIZE = 1 << 20


def concatenable(x: jax.Array) -> bool:
  return x.size <= SMALL_LEAF_SIZE and not may_span_devices(x)


def flat_concat(xs: Sequence[jax.Array]) -> jax.Array:
  whole = _whole_of(xs)
  if whole is not None:
    return whole
  flat = [jnp.ravel(x) for x in xs]
  return jnp.concatenate(flat) if len(flat) > 1 else flat[0]


# The pieces that split_parts cut, by id: (a weak reference to the piece,
# the vector it was cut from, its offset there). Per-part values are cut
# from one vector and concatenated again by their consumers (the norms,
# the factors, their statistics); XLA folds a concatenation of slices only
# where it sees them as such, and left a kernel per such concatenation.
# Keyed by the id of the piece, which is only unique while the piece lives:
# an entry is dropped when its piece is collected (the weak reference's
# callback), and a lookup also checks that the weak reference still gives
# the very array asked about, so an id reused by a later array (of this
# trace or another) misses. A retrace builds new pieces, so no entry of one
# trace answers for another; the vector an entry holds is of the piece's own
# trace.
_PIECES: dict[int, tuple[Any, jax.Array, int]] = {}


def _remember_piece(piece: jax.Array, flat: jax.Array, start: int) -> None:
  key = id(piece)

  def forget(_, key=key):
    _PIECES.pop(key, None)

  _PIECES[key] = (weakref.ref(piece, forget), flat, start)


def _whole_of(xs: Sequence[jax.Array]) -> Optional[jax.Array]:
  """The vector that ``xs`` were cut from by :func:`split_parts`, when they
  are all of it in order, else None.
  """
  whole, at = None, 0
  for x in xs:
    entry = _PIECES.get(id(x))
    if entry is None or entry[0]() is not x:
      return None
    _, flat, start = entry
    if (whole is not None and flat is not whole) or start != at:
      return None
    whole, at = flat, at + math.prod(jnp.shape(x))
  if whole is None or at != whole.size:
    return None
  return whole


# XLA:CPU unrolls the copy of each operand of a concatenation with at most
# this many elements into the kernel: many operands just under this size
# compile several times slower than as many just over it (tiny ones are
# cheap again), so blocked_concat packs such operands into larger blocks.
UNROLLED_COPY_SIZE = 64


def blocked_pieces(xs: Sequence[jax.Array]) -> list[jax.Array]:
  """The 1-D operands of :func:`blocked_concat`'s concatenation."""
  flat = [jnp.ravel(x) for x in xs]
  size = flat[0].size if flat else 0
  k = UNROLLED_COPY_SIZE // max(size, 1) + 1
  unrolled = UNROLLED_COPY_SIZE // 2 < size <= UNROLLED_COPY_SIZE
  if not unrolled or len(flat) <= k:
    return flat
  return [
    jnp.stack(flat[i : i + k]).reshape(-1) for i in range(0, len(flat), k)
  ]


def blocked_concat(xs: Sequence[jax.Array]) -> jax.Array:
  """``flat_concat(xs)`` for arrays of one size, cheap to compile.

  Operands of more than half ``UNROLLED_COPY_SIZE`` elements and at most
  that many (where the unrolled copies cost the most) are first stacked in
  blocks of just more than that many elements (one kernel shared by all
  blocks of a size; stacks, not concatenations, which XLA would merge into
  the outer one): the outer concatenation then copies each block in a
  loop. The elements and their order are those of the plain concatenation.
  """
  return flat_concat(blocked_pieces(xs))


def take_each(v: jax.Array) -> list[jax.Array]:
  """``[v[0], v[1], ...]`` for an array ``v``, as separate arrays.

  Not as ``v[i]``: XLA fuses a static slice into its consumer with the
  offset as a constant, so that scaling many leaves of one shape by their
  own entries of ``v`` compiles one kernel per leaf (XLA:CPU compiles each
  distinct kernel with LLVM: seconds for hundreds of leaves). Here ``v`` is
  laid out as a ``B x B`` grid of its rows (``B = ceil(sqrt(len(v)))``) and
  row ``(r, c)`` is selected by two masked sums with constant one-hot
  masks, which XLA keeps as operands: kernels are shared by all leaves of a
  shape. Selection, not multiplication: a NaN or inf entry stays in its own
  row.
  """
  n = v.shape[0]
  if n <= 1:
    return [v[0]] if n else []
  b = math.isqrt(n - 1) + 1
  rest = v.shape[1:]
  grid = jnp.pad(v, [(0, b * b - n)] + [(0, 0)] * len(rest)).reshape(
    (b, b) + rest
  )
  eye = np.eye(b, dtype=bool)
  ones = (1,) * len(rest)
  zero = np.zeros((), v.dtype)
  # lax, not jnp: a call per leaf, and each jnp call is a nested jit to
  # trace (a third of the tracing time on a tree of hundreds of leaves).
  grid_zeros = jax.lax.full(grid.shape, zero, v.dtype)
  row_zeros = jax.lax.full(grid.shape[1:], zero, v.dtype)

  def pick(x, mask, zeros):  # the one row of x that mask keeps
    mask = np.broadcast_to(mask, x.shape)
    return jax.lax.reduce(
      jax.lax.select(mask, x, zeros), zero, jax.lax.add, (0,)
    )

  rows, out = {}, []
  for i in range(n):
    r, c = divmod(i, b)
    if r not in rows:
      rows[r] = pick(grid, eye[r].reshape((b, 1) + ones), grid_zeros)
    out.append(pick(rows[r], eye[c].reshape((b,) + ones), row_zeros))
  return out


def chunked(members: Sequence[Any], sizes: Sequence[int]) -> list[list[Any]]:
  """``members`` in order, cut into runs whose ``sizes`` (elements) add up
  to at most ``CHUNK_SIZE`` (a member larger than that is a run alone): the
  parts that :class:`UnitLayout`, ``_packed.Packing`` and the global norm's
  pieces concatenate.
  """
  runs: list[list[Any]] = []
  total = 0
  for member, size in zip(members, sizes):
    if not runs or total + size > CHUNK_SIZE:
      runs.append([])
      total = 0
    runs[-1].append(member)
    total += size
  return runs


def packed_pieces(leaves, flags) -> list[tuple[jax.Array, bool]]:
  """The leaves as ``(array, sharded)`` pieces for a tree-wide reduction.

  Large leaves stay as they are. Small ones are concatenated, per dtype and
  sharded flag, into chunks of at most ``CHUNK_SIZE`` elements: one
  reduction (and one fusion to compile) per chunk, not per leaf. Empty
  leaves are dropped.
  """
  pieces, small = [], {}
  for x, f in zip(leaves, flags):
    if x.size == 0:
      continue
    if concatenable(x):
      small.setdefault((f, jnp.dtype(x.dtype)), []).append(x)
    else:
      pieces.append((x, f))
  for (f, _), xs in small.items():
    for chunk in chunked(xs, [x.size for x in xs]):
      pieces.append((flat_concat(chunk), f))
  return pieces


def part_groups(
  values: Sequence[Union[jax.Array, Scaled]],
  keys: Optional[Sequence[Any]] = None,
) -> list[list[int]]:
  """Indices of per-part values computed on one concatenation: those of one
  dtype, key and shard_map typing (as :func:`clip_scale_parts` groups
  them); a value that may span devices is a group of its own.

  Element-wise work on per-part norms or factors is best done on such a
  concatenation (:func:`concat_parts`) and sliced back
  (:func:`split_parts`): the parts' norms are slices of one vector
  (_part_norms), so XLA folds the concatenation away and compiles one
  kernel, where per part it would compile one per part's shape and again
  a concatenation of their results, unrolled, in each consumer.
  """
  keys = [None] * len(values) if keys is None else list(keys)
  groups, out = {}, []
  for i, v in enumerate(values):
    value = v.value if isinstance(v, Scaled) else v
    if may_span_devices(value):
      out.append([i])
    else:
      key = (np.dtype(value.dtype), keys[i], varying(v))
      groups.setdefault(key, []).append(i)
  return list(groups.values()) + out


def concat_parts(values: Sequence[Any]) -> Any:
  """Per-part arrays (or :class:`Scaled`) raveled into one."""
  if isinstance(values[0], Scaled):
    return Scaled(
      flat_concat([v.value for v in values]),
      flat_concat([v.exponent for v in values]),
    )
  return flat_concat(values)


def split_parts(flat: Any, like: Sequence[Any]) -> list[Any]:
  """:func:`concat_parts` undone: ``flat`` cut into the shapes of ``like``."""
  if isinstance(flat, Scaled):
    values = split_parts(flat.value, [scaled_value(v) for v in like])
    exponents = split_parts(flat.exponent, [scaled_value(v) for v in like])
    return [Scaled(v, e) for v, e in zip(values, exponents)]
  out, start = [], 0
  for v in like:
    size = math.prod(jnp.shape(v))
    piece = jax.lax.slice_in_dim(flat, start, start + size)
    piece = piece.reshape(jnp.shape(v))
    if jnp.ndim(flat) == 1:
      _remember_piece(piece, flat, start)
    out.append(piece)
    start += size
  return out
