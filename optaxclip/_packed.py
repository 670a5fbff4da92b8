"""Element-wise work on many small leaves at once.

A transformation that keeps per-element state (a second moment, Adam's
moments) does a few element-wise operations per leaf. On a model written
without ``scan`` (hundreds of tiny leaves) that is a few dozen instructions
per leaf for XLA to optimize, on top of the optimizer's own: stepped leaf
by leaf, SPAM's clipping before Adam takes several times Adam's compile
time on a few hundred leaves (``docs/performance.md``). Here
small leaves of one size and the same dtypes are concatenated into one
vector per state slot, the element-wise step runs once on each vector, and
each leaf takes its elements back by a gather whose constant indices XLA
keeps as an operand: one kernel per leaf shape, shared by its leaves (a
static slice would be a distinct kernel per leaf, each compiled with LLVM).
Large leaves keep their own kernels: their step time does not change.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from optaxclip import _norms

# Leaves of at most this many elements are packed: each takes its elements
# back with a constant index array of its size (4 bytes an element).
PACKED_SIZE = _norms.PACKED_SCALE_SIZE


class Packing:
  """Which leaves are packed together, and the packing itself.

  ``slots`` holds, per state slot (the gradient, each moment), the leaves of
  that slot; leaf ``i`` is ``[slot[i] for slot in slots]``. Leaves that are
  small (``PACKED_SIZE``), real, non-empty and never split across devices,
  with the same size, the same dtype in every slot and the same typing
  across ``shard_map``'s axes, form a *part* (at most ``_norms.CHUNK_SIZE``
  elements); the others, and a leaf alone in its group, are in ``own``.
  """

  def __init__(self, slots: Sequence[Sequence[jax.Array]]):
    n = len(slots[0])
    groups: dict[tuple, list[int]] = {}
    own = []
    for i in range(n):
      arrays = [slot[i] for slot in slots]
      x = arrays[0]
      if not all(_packable(a) for a in arrays) or x.size > PACKED_SIZE:
        own.append(i)
        continue
      key = (
        x.size,
        tuple(np.dtype(a.dtype) for a in arrays),
        _norms.varying(*arrays),
      )
      groups.setdefault(key, []).append(i)
    self.parts: list[list[int]] = []
    for (size, *_), members in groups.items():
      for chunk in _norms.chunked(members, [size] * len(members)):
        if len(chunk) > 1:
          self.parts.append(chunk)
        else:
          own.extend(chunk)
    self.own = sorted(own)

  def pack(self, leaves: Sequence[jax.Array]) -> list[jax.Array]:
    """Per part, its members of ``leaves`` concatenated into one vector."""
    out = []
    for part in self.parts:
      members = [leaves[i] for i in part]
      run = _norms.handed_run(members)
      out.append(run if run is not None else _norms.blocked_concat(members))
    return out

  def unpack(
    self, vectors: Sequence[jax.Array], like: Sequence[jax.Array]
  ) -> dict[int, jax.Array]:
    """Per member of each part, its elements of the part's vector, shaped
    (and typed) like its leaf of ``like``.
    """
    out = {}
    for part, vector in zip(self.parts, vectors):
      out.update(zip(part, _norms.take_leaves(vector, [like[i] for i in part])))
    return out


def _packable(x: jax.Array) -> bool:
  return (
    x.size > 0
    and not np.issubdtype(np.dtype(x.dtype), np.complexfloating)
    and _norms.concatenable(x)
  )
