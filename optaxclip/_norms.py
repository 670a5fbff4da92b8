"""The numerics every clipper shares: safe p-norms over leaves, units and trees.

Three rules hold for every norm computed here:

* Accumulation happens in float32, or wider when a leaf is wider, whatever the
  leaf dtype: a bfloat16 sum over millions of elements is useless.
* Norms are overflow- and underflow-safe. The fast path sums ``|x|**p``
  directly; when that sum is not finite (float32 overflows at elements near
  1e19 for p=2) or too small to be trusted, one ``lax.cond`` recomputes
  ``M * (sum (|x|/M)**p) ** (1/p)`` with ``M`` the largest magnitude, as BLAS
  ``nrm2`` does. Ordinary steps pay for the fast path alone.
* Derivatives are finite everywhere: at a zero gradient and exactly on a
  clipping threshold (meta-learning differentiates through ``update``).

``axis_name`` support: inside ``shard_map`` or ``pmap``, the partial sums of
leaves that are sharded over the named axis (or axes) are ``psum``-ed, and the
maxima ``pmax``-ed, so each device sees the norm of the whole array; leaves
replicated over the axis are counted once.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

AxisName = Union[None, str, tuple]

# Leaves with at most this many elements are concatenated into one buffer for
# a tree-wide reduction: one reduction instead of one per leaf keeps compile
# time flat in the number of leaves, and copying small leaves is cheap.
SMALL_LEAF_SIZE = 1 << 16


def accumulation_dtype(dtype: Any) -> np.dtype:
  """float32, or the leaf's real dtype when that is wider (float64)."""
  real = jnp.finfo(dtype).dtype
  return jnp.promote_types(real, jnp.float32)


def tree_accumulation_dtype(leaves: Sequence[jax.Array]) -> np.dtype:
  dtype = np.dtype(np.float32)
  for x in leaves:
    dtype = jnp.promote_types(dtype, accumulation_dtype(x.dtype))
  return dtype


def magnitude(x: jax.Array, dtype: Optional[Any] = None) -> jax.Array:
  """``|x|`` in the accumulation dtype (complex: the overflow-safe modulus)."""
  dtype = accumulation_dtype(x.dtype) if dtype is None else dtype
  if jnp.iscomplexobj(x):
    return jnp.abs(x).astype(dtype)
  return jnp.abs(x.astype(dtype))


def _power(a: jax.Array, p: float) -> jax.Array:
  """``a ** p`` for ``a >= 0``, with cheap forms for p = 1 and 2."""
  if p == 1:
    return a
  if p == 2:
    return a * a
  return a ** p


def safe_root(s: jax.Array, p: float) -> jax.Array:
  """``s ** (1/p)`` for ``s >= 0`` whose derivative is 0, not inf, at 0."""
  if p == 1:
    return s
  positive = s > 0
  s_safe = jnp.where(positive, s, 1)
  root = jnp.sqrt(s_safe) if p == 2 else s_safe ** (1.0 / p)
  return jnp.where(positive, root, 0)


def _safe_min(dtype: Any, p: float) -> float:
  """Smallest ``max|x| ** p`` for which the direct sum is trusted."""
  info = jnp.finfo(dtype)
  return float(info.tiny) / float(info.eps) ** 2


def _reduce_axes(x: jax.Array, axes: Optional[tuple[int, ...]]):
  return tuple(range(x.ndim)) if axes is None else axes


def _psum_sharded(value, sharded: bool, axis_name: AxisName):
  return jax.lax.psum(value, axis_name) if (sharded and axis_name) else value


def _pmax(value, axis_name: AxisName):
  return jax.lax.pmax(value, axis_name) if axis_name else value


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
  if mesh is None or mesh.empty:
    return False
  used = set()
  for entry in sharding.spec:
    used.update(entry if isinstance(entry, tuple) else (entry,))
  types = getattr(mesh, "axis_types", None) or (None,) * len(mesh.axis_names)
  for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, types):
    kind = getattr(kind, "name", str(kind))
    if size == 1 or kind == "Manual":
      continue
    if kind == "Explicit" and name not in used:
      continue
    return True
  return False


def _concatenable(x: jax.Array) -> bool:
  return x.size <= SMALL_LEAF_SIZE and not may_span_devices(x)


def _sharded_flags(leaves, sharded) -> list[bool]:
  if sharded is None:
    return [True] * len(leaves)
  if len(sharded) != len(leaves):
    raise ValueError("sharded flags do not match the leaves.")
  return [bool(s) for s in sharded]


def unit_norms(
    leaves: Sequence[jax.Array],
    ord: float = 2.0,  # pylint: disable=redefined-builtin
    axes: Optional[Sequence[Optional[tuple[int, ...]]]] = None,
    *,
    axis_name: AxisName = None,
    sharded: Optional[Sequence[bool]] = None,
) -> list[jax.Array]:
  """The p-norm of each unit of each leaf, with reduced axes kept as size 1.

  Args:
    leaves: float or complex arrays.
    ord: the norm's order p >= 1, or ``math.inf``.
    axes: per leaf, the axes a unit spans (``None``: the whole leaf).
    axis_name: mapped axis name(s) over which sharded leaves are summed.
    sharded: per leaf, whether it is sharded over ``axis_name``.

  Returns:
    One array per leaf, of the leaf's rank, holding each unit's norm in the
    accumulation dtype.
  """
  leaves = list(leaves)
  if not leaves:
    return []
  axes = [None] * len(leaves) if axes is None else list(axes)
  flags = _sharded_flags(leaves, sharded)
  mags = [magnitude(x) for x in leaves]
  maxima = [
      _pmax(jnp.max(a, axis=_reduce_axes(a, ax), keepdims=True, initial=0),
            axis_name if f else None)
      for a, ax, f in zip(mags, axes, flags)
  ]
  if math.isinf(ord):
    return maxima
  sums = [
      _psum_sharded(jnp.sum(_power(a, ord), axis=_reduce_axes(a, ax),
                            keepdims=True), f, axis_name)
      for a, ax, f in zip(mags, axes, flags)
  ]
  trusted = jnp.array(True)
  for s, m in zip(sums, maxima):
    ok = jnp.isfinite(s) & ((m == 0) | (_power(m, ord) >= _safe_min(m.dtype, ord)))
    trusted = trusted & jnp.all(ok)

  def direct(leaves_):
    del leaves_
    return [safe_root(s, ord) for s in sums]

  def rescaled(leaves_):
    out = []
    for x, m, ax, f in zip(leaves_, maxima, axes, flags):
      a = magnitude(x)
      m_safe = jnp.where(m > 0, m, 1)
      s = _psum_sharded(
          jnp.sum(_power(a / m_safe, ord), axis=_reduce_axes(a, ax),
                  keepdims=True), f, axis_name)
      out.append(m * safe_root(s, ord))
    return out

  return jax.lax.cond(trusted, direct, rescaled, leaves)


def _grouped_power_sums(leaves, flags, p, dtype, axis_name, scale=None):
  """Sum of ``(|x|/scale)**p`` over all leaves, small leaves concatenated."""
  total = jnp.zeros((), dtype)
  for is_sharded in (False, True):
    small = [x for x, f in zip(leaves, flags) if f == is_sharded
             and _concatenable(x)]
    large = [x for x, f in zip(leaves, flags) if f == is_sharded
             and not _concatenable(x)]
    parts = []
    if small:
      flat = jnp.concatenate([magnitude(x, dtype).ravel() for x in small])
      parts.append(flat)
    parts.extend(magnitude(x, dtype) for x in large)
    group = jnp.zeros((), dtype)
    for a in parts:
      if scale is not None:
        a = a / scale
      group = group + jnp.sum(_power(a, p))
    total = total + _psum_sharded(group, is_sharded, axis_name)
  return total


def _grouped_max(leaves, flags, dtype, axis_name):
  local = jnp.zeros((), dtype)
  small = [x for x in leaves if _concatenable(x)]
  large = [x for x in leaves if not _concatenable(x)]
  if small:
    local = jnp.maximum(local, jnp.max(jnp.concatenate(
        [magnitude(x, dtype).ravel() for x in small]), initial=0))
  for x in large:
    local = jnp.maximum(local, jnp.max(magnitude(x, dtype)))
  return _pmax(local, axis_name if any(flags) else None)


def global_norm(
    leaves: Sequence[jax.Array],
    ord: float = 2.0,  # pylint: disable=redefined-builtin
    *,
    axis_name: AxisName = None,
    sharded: Optional[Sequence[bool]] = None,
) -> jax.Array:
  """The p-norm of all leaves taken together, as one vector.

  The fast path is one reduction pass over the leaves; only when its sum is
  not finite, or too small to trust, is the norm recomputed with rescaling.

  Args:
    leaves: float or complex arrays.
    ord: the norm's order p >= 1, or ``math.inf``.
    axis_name: mapped axis name(s) over which sharded leaves are summed.
    sharded: per leaf, whether it is sharded over ``axis_name``.

  Returns:
    A scalar in the accumulation dtype (float32 unless a leaf is wider).
  """
  leaves = list(leaves)
  dtype = tree_accumulation_dtype(leaves)
  if not leaves:
    return jnp.zeros((), dtype)
  flags = _sharded_flags(leaves, sharded)
  if math.isinf(ord):
    return _grouped_max(leaves, flags, dtype, axis_name)
  total = _grouped_power_sums(leaves, flags, ord, dtype, axis_name)
  # A sum at or above this bound cannot hide lost (underflowed) terms that
  # matter; below it, or when it overflowed, rescale by the largest magnitude.
  trusted = jnp.isfinite(total) & (total >= _safe_min(dtype, ord))

  def direct(leaves_):
    del leaves_
    return safe_root(total, ord)

  def rescaled(leaves_):
    biggest = _grouped_max(leaves_, flags, dtype, axis_name)
    scale = jnp.where(biggest > 0, biggest, 1)
    s = _grouped_power_sums(leaves_, flags, ord, dtype, axis_name, scale)
    return biggest * safe_root(s, ord)

  return jax.lax.cond(trusted, direct, rescaled, leaves)


def combine_norms(norms: Sequence[jax.Array], ord: float = 2.0) -> jax.Array:  # pylint: disable=redefined-builtin
  """The p-norm of a set of unit norms: the norm of the whole they partition.

  Used for statistics: it costs a pass over the (small) norm arrays only.
  """
  if not norms:
    return jnp.zeros((), jnp.float32)
  # Norms that may be split across devices are reduced on their own (no
  # all-gather, no ShardingTypeError); the others are concatenated.
  local = [jnp.ravel(n) for n in norms if not may_span_devices(n)]
  parts = [n for n in norms if may_span_devices(n)]
  if local:
    parts.append(jnp.concatenate(local) if len(local) > 1 else local[0])
  biggest = parts[0].max(initial=0)
  for part in parts[1:]:
    biggest = jnp.maximum(biggest, part.max(initial=0))
  if math.isinf(ord):
    return biggest
  # An infinite unit norm makes the whole infinite (inf / inf would be NaN).
  scale = jnp.where((biggest > 0) & jnp.isfinite(biggest), biggest, 1)
  total = sum(jnp.sum(_power(part / scale, ord)) for part in parts)
  return jnp.where(jnp.isinf(biggest), biggest,
                   biggest * safe_root(total, ord))


def clip_factor(norm: jax.Array, limit: Any) -> jax.Array:
  """``min(1, limit / norm)`` with finite derivatives at 0 and on the limit.

  A NaN norm gives factor 1 (the NaN then shows in the update, as in PyTorch);
  an infinite norm gives factor 0.
  """
  limit = jnp.asarray(limit, norm.dtype)
  above = norm > limit
  return jnp.where(above, limit / jnp.where(above, norm, 1), 1).astype(norm.dtype)


def scale_leaf(x: jax.Array, factor: jax.Array) -> jax.Array:
  """``x * factor`` computed in the accumulation dtype, returned in x's dtype."""
  return (x * factor.astype(accumulation_dtype(x.dtype))).astype(x.dtype)


def count(mask: jax.Array) -> jax.Array:
  return jnp.sum(mask, dtype=jnp.float32)
