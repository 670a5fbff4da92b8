"""What an adaptive clipper or :func:`guard` measures of a step's gradients:
the norm of each unit (the whole tree, or each leaf) in one pass, in the
statistics' dtype, with the per-leaf telemetry when asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip import _checks
from optaxclip import _norms
from optaxclip import _sharding
from optaxclip import _telemetry
from optaxclip._typing import AxisName

_F32 = jnp.float32


def stats_dtype(params: Any, who: str) -> np.dtype:
  """The dtype of an adaptive state's statistics, fixed at ``init``.

  The accumulation dtype of the parameters' float leaves: float32, or
  float64 when one is float64 (so float64 trees keep float64 decisions).
  A float leaf narrower than 16 bits is ``who``'s TypeError.
  """
  _checks.check_float_width(params, f"{who}: params")
  leaves = [
    x
    for x in jax.tree.leaves(params)
    if jnp.issubdtype(getattr(x, "dtype", np.int32), jnp.inexact)
  ]
  return np.dtype(_norms.tree_accumulation_dtype(leaves))


def unit_shape(params: Any, scope: str) -> tuple[int, ...]:
  """Shape of the per-unit statistics: () for the tree, (n_leaves,) per leaf."""
  return () if scope == "global" else (len(jax.tree.leaves(params)),)


def as_scalar(x: Any, dtype: Any) -> jax.Array:
  return jnp.asarray(x).astype(dtype).reshape(())


def total(values: jax.Array, dtype: Any) -> jax.Array:
  """A scalar: the value itself, or the L2 norm of per-leaf values."""
  if values.ndim == 0:
    return as_scalar(values, dtype)
  return as_scalar(_norms.combine_norms([values]), dtype)


class Measured:
  """The updates' leaves and their norm(s), one pass over the tree.

  Norms are taken in the wider of the state's dtype and the tree's
  accumulation dtype; with ``axis_name``, of the whole (sharded) arrays.
  """

  def __init__(
    self,
    updates: Any,
    scope: str,
    who: str,
    state_dtype: Any,
    unit_shape: Optional[tuple[int, ...]] = None,
    *,
    axis_name: AxisName = None,
    sharded: Any = True,
    leaf_stats: bool = False,
    layer_axis: Any = None,
    state_norms: Any = None,
  ):
    _checks.check_float_leaves(updates, f"{who}: updates")
    self.leaves, self.treedef = jax.tree.flatten(updates)
    self.scope = scope
    # Per-leaf scope: the packing of the leaves (see _norms.UnitLayout).
    self.layout = None
    self.state_dtype = state_dtype
    self.telemetry = _telemetry.LeafStats()
    # Per leaf, how it is split (with the dimensions a PartitionSpec
    # declares: the per-layer telemetry refuses a split layer axis).
    splits = (
      _sharding.resolve(updates, sharded, axis_name, who) if axis_name else None
    )
    flags = None if splits is None else [s.axes for s in splits]
    self.dtype = _norms.promote_types(
      state_dtype, _norms.tree_accumulation_dtype(self.leaves)
    )
    acc = _norms.tree_accumulation_dtype(self.leaves)
    if scope == "global" and leaf_stats:
      scaled, self.telemetry = _telemetry.global_norm_with_leaves(
        who,
        updates,
        self.leaves,
        2.0,
        state_norms,
        layer_axis,
        axis_name=axis_name,
        splits=splits,
      )
    elif scope == "global":
      scaled = _norms.global_norm_scaled(
        self.leaves, axis_name=axis_name, sharded=flags
      )
    else:
      if unit_shape is not None and unit_shape != (len(self.leaves),):
        raise ValueError(
          f"{who}: the state was built for {unit_shape[0]} leaves but the "
          f"updates have {len(self.leaves)}; call init with parameters of "
          "the same structure as the updates."
        )
      # Packed: the leaves' norms come as one vector from a few reductions,
      # whatever the number of leaves (compile time on many tiny leaves).
      layout, per_part, self.telemetry = _telemetry.unit_norms(
        who,
        updates,
        self.leaves,
        2.0,
        [None] * len(self.leaves),
        on=leaf_stats,
        state_norms=state_norms,
        layer_axis=layer_axis,
        axis_name=axis_name,
        splits=splits,
      )
      self.layout = layout
      scaled = (
        layout.leaf_vector_scaled(per_part, acc)
        if per_part
        else _norms.Scaled(jnp.zeros((0,), acc), jnp.zeros((0,), jnp.int32))
      )
    # The norm exactly (value * 2**exponent, even beyond the dtype's range)
    # for the scaling; as a plain float for the statistics and decisions.
    self.scaled = scaled
    # Statistics are not differentiated through (as in every reference,
    # where they are Python floats): only the scaling carries gradients.
    self.stat_norm = jax.lax.stop_gradient(scaled.as_float()).astype(self.dtype)
    # NaN/Inf in the input (a norm of finite values beyond the dtype's
    # range is finite here, and inf as a statistic: it is not recorded).
    self.unit_finite = jnp.isfinite(jax.lax.stop_gradient(scaled.value))
    if self.stat_norm.ndim and self.stat_norm.size:
      # The total (a statistic) and whether every unit is finite in one
      # pass: one kernel to compile (see _norms.combine_norms_each).
      (self.total,), (n_bad,) = _norms.combine_norms_each(
        [self.stat_norm], counts=[~jnp.isfinite(self.stat_norm)]
      )
      self.finite = n_bad == 0
    else:
      self.total = total(self.stat_norm, self.dtype)
      self.finite = jnp.all(jnp.isfinite(self.stat_norm))

  def clip(self, limit: jax.Array, counts: Sequence[jax.Array] = ()):
    """Scales each clipping unit to ``limit``; returns updates, stats and
    the number of True entries (float32) of each per-unit boolean array of
    ``counts``, counted in the statistics' pass.
    """
    limit = jax.lax.stop_gradient(jnp.asarray(limit, self.dtype))
    g = self.stat_norm
    # Exact, and NaN for a unit with a NaN or infinite norm: the non-finite
    # policy (see the module's docstring), from _norms.clip_scale.
    factor = _norms.clip_scale(self.scaled, limit)
    if self.layout is not None:
      # In memory: the scaling's parts and the statistics below would each
      # compile the factor's arithmetic into their own kernels.
      factor = _norms.materialized_scaled(factor)
    if self.scope == "global":
      out = _norms.scale_all(self.leaves, factor)
    elif self.layout is not None:
      # Small leaves scaled in their packed parts (compile time).
      out = self.layout.scale_leafwise(self.leaves, factor)
    else:
      # scale_each, not factor[i]: kernels shared by leaves of one shape.
      out = _norms.scale_each(self.leaves, factor)
    scaled = _norms.is_scaled_down(jax.lax.stop_gradient(factor))
    # Exactly min(norm, limit), without inf * 0; NaN for a non-finite unit,
    # whose output holds NaN.
    clipped = jnp.where(self.unit_finite, jnp.where(scaled, limit, g), jnp.nan)
    dtype = self.state_dtype
    updates = jax.tree.unflatten(self.treedef, out)
    if g.ndim == 0 or not g.size:
      stats = (
        as_scalar(self.total, dtype),
        total(clipped, dtype),
        as_scalar(jnp.mean(scaled, dtype=_F32) if scaled.size else 0.0, dtype),
        total(limit, dtype),
      )
      return updates, stats, [jnp.sum(c, dtype=_F32) for c in counts]
    # Per-unit statistics in one pass (one kernel to compile, not several
    # per statistic: see _norms.combine_norms_each).
    per_unit = [clipped] + ([limit] if limit.shape == g.shape else [])
    totals, numbers = _norms.combine_norms_each(
      per_unit, counts=[scaled, *counts]
    )
    stats = (
      as_scalar(self.total, dtype),
      as_scalar(totals[0], dtype),
      as_scalar(numbers[0] / scaled.size, dtype),
      as_scalar(totals[1], dtype) if len(totals) > 1 else total(limit, dtype),
    )
    return updates, stats, numbers[1:]
