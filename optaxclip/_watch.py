"""``watch()``: the update's norm, the parameters' norm and their ratio, the
signals large-model trainers watch for instability, as an identity
transformation at the end of a chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from optaxclip import _checks
from optaxclip import _compiled
from optaxclip import _functional
from optaxclip import _norms
from optaxclip import _sharding
from optaxclip import _stats
from optaxclip import _telemetry
from optaxclip._typing import AxisName

_FIELDS = ("update_norm", "param_norm", "update_to_param")


@_stats.register("watch", _FIELDS)
class WatchState(NamedTuple):
  """State of :func:`watch`: this step's norms.

  Attributes:
    update_norm: the global L2 norm of the update (what the chain returns).
    param_norm: the global L2 norm of the parameters the update applies to
      (before it is applied).
    update_to_param: ``update_norm / param_norm`` (``inf`` for a nonzero
      update of all-zero parameters, 0 when both are zero).
    leaf_norms: with ``leaf_stats=True``, each leaf's update norm (per
      layer for a leaf with a ``layer_axis``), a :class:`LeafNorms`
      (:func:`optaxclip.stats` reports ``watch/leaf_norm/<path>``); else
      ``None``.
    top_leaf_share: with ``leaf_stats=True``, the largest leaf's (or
      layer's) share of ``update_norm**2``; else ``None``.
    top_leaf: with ``leaf_stats=True``, that leaf's index in
      ``leaf_norms``; else ``None``.
    leaf_update_to_param: with ``leaf_stats=True``, each leaf's (or
      layer's) update norm over its parameters' norm, a :class:`LeafNorms`
      (``watch/update_to_param/<path>``); else ``None``.
  """

  update_norm: jax.Array  # float32 scalar
  param_norm: jax.Array  # float32 scalar
  update_to_param: jax.Array  # float32 scalar
  leaf_norms: Any = None  # LeafNorms: float32 (entries,), static structure
  top_leaf_share: Optional[jax.Array] = None  # float32 scalar in [0, 1]
  top_leaf: Optional[jax.Array] = None  # int32 scalar
  leaf_update_to_param: Any = None  # LeafNorms, as leaf_norms

  def stats_items(self, key: str) -> list[tuple[str, jax.Array]]:
    """``(key, value)`` of each leaf's ratio, for :func:`optaxclip.stats`."""
    ratios = self.leaf_update_to_param
    if not isinstance(ratios, _telemetry.LeafNorms):
      return []
    base = f"{key}/update_to_param"
    return [
      (f"{base}/{name}" if name else base, ratios.values[..., i])
      for i, name in enumerate(ratios.names())
    ]


def _ratio(a: _norms.Scaled, b: _norms.Scaled) -> jax.Array:
  """``a / b`` of non-negative norms, float32: exact powers of two for
  finite ones (no overflow, no flushed reciprocal), ``inf`` for ``a > 0 =
  b``, 0 for ``0 / 0``, IEEE division for non-finite ones.
  """
  quotient = _norms.ratio(a, b)
  zero = b.value == 0
  quotient = jnp.where(zero, jnp.where(a.value > 0, jnp.inf, 0), quotient)
  finite = jnp.isfinite(a.value) & jnp.isfinite(b.value)
  quotient = jnp.where(finite, quotient, a.value / b.value)
  return jax.lax.stop_gradient(quotient).astype(jnp.float32)


def _after(updates: Any, norm: _norms.Scaled) -> Any:
  """``updates`` times an exact 1 computed from ``norm``: the same values,
  which XLA cannot have before the parameters' norm. Applying them then
  waits for that read of the parameters, so a step that donates the
  parameters updates them in place; without the order, XLA copies every
  donated parameter first (the read and the in-place write being unordered).
  """
  v = jax.lax.stop_gradient(norm.value)
  one = jnp.where(jnp.isnan(v), 1, jnp.minimum(1, jnp.abs(v) + 1))
  return jax.tree.map(lambda x: x * one.astype(x.dtype), updates)


def _leaf_vector(
  who: str,
  leaves: Sequence[jax.Array],
  layers: Sequence[Optional[int]],
  splits: Sequence[_sharding.LeafSharding],
  axis_name: AxisName,
) -> tuple[_norms.Scaled, list[int]]:
  """Each leaf's (or layer's) L2 norm as one flat vector, from one packed
  pass (the pass of the clippers' ``leaf_stats``), and each leaf's entries.
  """
  _telemetry.check_unsplit(who, splits, layers)
  fine = _telemetry.fine_axes(leaves, [None] * len(leaves), layers)
  layout, norms = _norms.unit_norms_packed(
    leaves,
    2.0,
    fine,
    axis_name=axis_name,
    sharded=[_sharding.axes_of(s, a) for s, a in zip(splits, fine)],
  )
  return _telemetry.leaf_vector(layout, norms, layers, 2.0)


@_compiled.compiled_once
def watch(
  *,
  leaf_stats: bool = False,
  layer_axis: _telemetry.LayerAxis = None,
  axis_name: AxisName = None,
  sharded: Any = True,
) -> optax.GradientTransformation:
  """Records the update's norm, the parameters' norm and their ratio.

  An identity transformation for the end of a chain: the update passes
  through unchanged (bit for bit), and the state keeps the global L2 norm
  of the update (what the chain before it produced: the step the
  parameters will take), the global L2 norm of the parameters it applies
  to, and their ratio --
  the signals of Levanter's ``WatchConfig`` and OLMo-core's stability
  monitor. :func:`optaxclip.stats` reports them as ``watch/update_norm``,
  ``watch/param_norm`` and ``watch/update_to_param``. Norms accumulate in
  float32 and are overflow-safe, as the clippers' are; they are read in
  one pass over each tree, inside ``jit``.

  Args:
    leaf_stats: also keep each leaf's update norm (``watch/leaf_norm/<path>``)
      and its update-to-parameter ratio (``watch/update_to_param/<path>``),
      from the same pass.
    layer_axis: with ``leaf_stats``, the stacking axis of stacked layers
      (``nn.scan``): such a leaf reports one norm and one ratio per layer
      (``.../<path>/<layer>``). An int, a pytree prefix of ints/``None`` or
      a callable ``(path, leaf) -> int | None``.
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split: their partial sums are summed.
    sharded: per leaf, which axes of ``axis_name`` split it (as for
      :func:`clip_global`); the parameters are split as the updates are.

  Returns:
    An ``optax.GradientTransformation`` (``update`` needs ``params``) whose
    state is a :class:`WatchState`.

  References:
    Levanter, ``src/levanter/callbacks/watch.py`` (update and parameter
    norms); Wortsman et al., `Small-scale proxies for large-scale
    Transformer training instabilities <https://arxiv.org/abs/2309.14322>`_,
    2023 (the update-to-parameter ratio).

  Example:
    >>> import jax.numpy as jnp, optax, optaxclip
    >>> tx = optax.chain(
    ...     optaxclip.clip_global(1.0), optax.sgd(0.1), optaxclip.watch())
    >>> params = {"w": jnp.full(4, 2.0)}
    >>> updates, state = tx.update({"w": jnp.full(4, 3.0)}, tx.init(params),
    ...                            params)
    >>> logs = optaxclip.stats(state)
    >>> [round(float(logs[f"watch/{k}"]), 3) for k in (
    ...     "update_norm", "param_norm", "update_to_param")]
    [0.1, 4.0, 0.025]
  """
  who = "watch"
  leaf_stats = _telemetry.check(who, leaf_stats, layer_axis)
  axis_name = _checks.check_sharding(who, axis_name, sharded)

  def init_fn(params):
    _checks.check_float_width(params, f"{who}: params")
    if not leaf_stats:
      return WatchState(*_stats.zeros(len(_FIELDS)))
    layers = _telemetry.layer_axes(who, params, layer_axis)
    telemetry = _telemetry.init(params, True, layers)
    ratios = telemetry.leaf_norms
    return WatchState(*_stats.zeros(len(_FIELDS)), *telemetry, ratios)

  def update_fn(updates, state, params=None):
    _checks.check_same_structure(
      updates, params, who, why="it reports their norm"
    )
    leaves, treedef = _functional.flatten(updates, who)
    p_leaves = _functional.flatten(params, f"{who}: params")[0]
    del treedef
    if not leaf_stats:
      flags = _functional.sharded_flags(updates, sharded, who, axis_name)
      u_norm = _norms.global_norm_scaled(
        leaves, 2.0, axis_name=axis_name, sharded=flags
      )
      p_norm = _norms.global_norm_scaled(
        p_leaves, 2.0, axis_name=axis_name, sharded=flags
      )
      return _after(updates, p_norm), WatchState(
        _stats.as_stat(u_norm.as_float()),
        _stats.as_stat(p_norm.as_float()),
        _stats.as_stat(_ratio(u_norm, p_norm)),
      )
    layers = _telemetry.layer_axes(who, updates, layer_axis)
    splits = _sharding.resolve(updates, sharded, axis_name, who)
    u_vector, sizes = _leaf_vector(who, leaves, layers, splits, axis_name)
    p_vector, _ = _leaf_vector(who, p_leaves, layers, splits, axis_name)
    u_norm = _norms.reduce_norms(u_vector, 2.0)
    p_norm = _norms.reduce_norms(p_vector, 2.0)
    telemetry = _telemetry.finish(
      state.leaf_norms, u_vector, sizes, u_norm, 2.0
    )
    old = state.leaf_update_to_param
    return _after(updates, p_norm), WatchState(
      _stats.as_stat(u_norm.as_float()),
      _stats.as_stat(p_norm.as_float()),
      _stats.as_stat(_ratio(u_norm, p_norm)),
      *telemetry,
      _telemetry.LeafNorms(_ratio(u_vector, p_vector), old.treedef, old.layers),
    )

  return optax.GradientTransformation(init_fn, _compiled.jit_update(update_fn))
