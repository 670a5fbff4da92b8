"""Clippers whose threshold follows the gradient norms seen so far: ZClip
(z-score of an EMA), AutoClip (a percentile of recent norms) and AdaGC (per
leaf, relative to an EMA of its own clipped norms).

All their memory lives in the optax state (float32 statistics, int32
counters), so they run inside ``jit`` without host transfers, never retrace,
and survive a checkpoint round trip. A step whose gradient norm is NaN or
infinite leaves that memory untouched: one bad step must not poison the
statistics for the rest of training (use :func:`guard` to skip such steps).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from optaxclip import _checks
from optaxclip import _compiled
from optaxclip import _norms
from optaxclip import _stats

_F32 = jnp.float32
ADAPTIVE_FIELDS = (*_stats.CLIP_FIELDS, "threshold")
SCOPES = ("global", "leaf")

@_stats.register("clip_zscore", ADAPTIVE_FIELDS)
class ClipZscoreState(NamedTuple):
  """State of :func:`clip_zscore`.

  Attributes:
    norm: the global L2 norm before clipping.
    clipped_norm: the global L2 norm after clipping.
    clip_fraction: the share of clipping units (the tree, or each leaf)
      scaled down.
    threshold: the norm above which a step counts as a spike, capped by
      ``max_norm`` (during warm-up: ``max_norm``, or +inf without one; with
      ``scope='leaf'``: the L2 norm of the per-leaf thresholds).
    count: warm-up norms gathered, at most ``warmup_steps``.
    mean: the mean of the norm: the warm-up's plain mean until it ends, then
      an EMA.
    var: the variance of the norm, likewise.
  """
  norm: jax.Array  # float32 scalar
  clipped_norm: jax.Array  # float32 scalar
  clip_fraction: jax.Array  # float32 scalar
  threshold: jax.Array  # float32 scalar
  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  mean: jax.Array  # float32: scalar, or (n_leaves,) with scope="leaf"
  var: jax.Array  # float32: as mean


@_stats.register("clip_percentile", ADAPTIVE_FIELDS)
class ClipPercentileState(NamedTuple):
  """State of :func:`clip_percentile`.

  Attributes:
    norm: the global L2 norm before clipping.
    clipped_norm: the global L2 norm after clipping.
    clip_fraction: the share of clipping units scaled down.
    threshold: the percentile of the recent norms (with ``scope='leaf'``,
      the L2 norm of the per-leaf thresholds).
    filled: how many entries of ``history`` hold a norm.
    index: the slot the next norm goes to.
    history: a ring buffer of the last norms.
  """
  norm: jax.Array  # float32 scalar
  clipped_norm: jax.Array  # float32 scalar
  clip_fraction: jax.Array  # float32 scalar
  threshold: jax.Array  # float32 scalar
  filled: jax.Array  # int32 scalar
  index: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  history: jax.Array  # float32, (history,) or (history, n_leaves)


@_stats.register("clip_relative", ADAPTIVE_FIELDS)
class ClipRelativeState(NamedTuple):
  """State of :func:`clip_relative`.

  Attributes:
    norm: the global L2 norm before clipping.
    clipped_norm: the global L2 norm after clipping.
    clip_fraction: the share of leaves scaled down.
    threshold: ``warmup_max_norm`` during warm-up, then the L2 norm of the
      per-leaf limits ``factor * gamma_i``.
    count: steps with a finite norm, at most ``warmup_steps``.
    gamma: the EMA of each leaf's clipped norm (+inf before the first step).
  """
  norm: jax.Array  # float32 scalar
  clipped_norm: jax.Array  # float32 scalar
  clip_fraction: jax.Array  # float32 scalar
  threshold: jax.Array  # float32 scalar
  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  gamma: jax.Array  # float32, (n_leaves,)


# --- Shared pieces ------------------------------------------------------------


def _unit_shape(params: Any, scope: str) -> tuple[int, ...]:
  """Shape of the per-unit statistics: () for the tree, (n_leaves,) per leaf."""
  return () if scope == "global" else (len(jax.tree.leaves(params)),)


class _Measured:
  """The updates' leaves and their norm(s), one pass over the tree."""

  def __init__(self, updates: Any, scope: str, who: str,
               unit_shape: Optional[tuple[int, ...]] = None):
    _checks.check_float_leaves(updates, f"{who}: updates")
    self.leaves, self.treedef = jax.tree.flatten(updates)
    self.scope = scope
    if scope == "global":
      self.norm = _norms.global_norm(self.leaves)
    else:
      if unit_shape is not None and unit_shape != (len(self.leaves),):
        raise ValueError(
            f"{who}: the state was built for {unit_shape[0]} leaves but the "
            f"updates have {len(self.leaves)}; call init with parameters of "
            "the same structure as the updates.")
      dtype = _norms.tree_accumulation_dtype(self.leaves)
      per_leaf = _norms.unit_norms(self.leaves)
      self.norm = (jnp.stack([n.reshape(()).astype(dtype) for n in per_leaf])
                   if per_leaf else jnp.zeros((0,), dtype))
    # Statistics are not differentiated through (as in every reference,
    # where they are Python floats): only the scaling carries gradients.
    self.stat_norm = jax.lax.stop_gradient(self.norm).astype(_F32)
    self.finite = jnp.all(jnp.isfinite(self.stat_norm))

  def clip(self, limit: jax.Array):
    """Scales each clipping unit to ``limit``; returns updates and stats."""
    limit = jax.lax.stop_gradient(jnp.asarray(limit, _F32))
    factor = _norms.clip_factor(self.norm, limit)
    if self.scope == "global":
      out = [_norms.scale_leaf(x, factor) for x in self.leaves]
    else:
      out = [_norms.scale_leaf(x, factor[i]) for i, x in enumerate(self.leaves)]
    scaled = jax.lax.stop_gradient(factor) < 1
    # Exactly min(norm, limit), without inf * 0 for an infinite norm.
    clipped = jnp.where(scaled, limit, self.stat_norm)
    stats = (_total(self.stat_norm), _total(clipped),
             _stats.as_stat(jnp.mean(scaled, dtype=_F32) if scaled.size
                            else 0.0),
             _total(limit))
    return jax.tree.unflatten(self.treedef, out), stats


def _total(values: jax.Array) -> jax.Array:
  """A float32 scalar: the value itself, or the L2 norm of per-leaf values."""
  if values.ndim == 0:
    return _stats.as_stat(values)
  return _stats.as_stat(_norms.combine_norms([values]))


def _keep_if(finite: jax.Array, new, old):
  """``new`` where the step's norm was finite, else ``old`` (leaf by leaf)."""
  return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def _no_limit(max_norm: Any) -> Any:
  return math.inf if max_norm is None else max_norm


def welford(count, mean, var, x):
  """Adds ``x`` to a running mean and population variance of ``count`` values.

  Returns the mean and variance of the ``count + 1`` values, equal up to
  rounding to ``sum(xs) / n`` and ``sum((xs - mean)**2) / n``.
  """
  k = (count + 1).astype(mean.dtype)
  delta = x - mean
  new_mean = mean + delta / k
  new_var = var + (delta * (x - new_mean) - var) / k
  return new_mean, new_var


def ema_mean_var(alpha, mean, var, x):
  """EMA update of mean and variance; the variance uses the *new* mean.

  This is the order of the ZClip reference implementation:
  ``mean = a*mean + (1-a)*x`` first, then ``var = a*var + (1-a)*(x-mean)**2``.
  """
  new_mean = alpha * mean + (1 - alpha) * x
  new_var = alpha * var + (1 - alpha) * (x - new_mean) ** 2
  return new_mean, new_var


# --- ZClip -------------------------------------------------------------------


@_compiled.compiled_once
def clip_zscore(
    *,
    alpha: float = 0.97,
    z_thresh: float = 2.5,
    max_norm: Optional[float] = None,
    eps: float = 1e-6,
    warmup_steps: int = 25,
    mode: str = "zscore",
    clip_option: str = "adaptive_scaling",
    clip_factor: float = 1.0,
    skip_update_on_spike: bool = False,
    scope: str = "global",
) -> optax.GradientTransformation:
  r"""ZClip: clips gradient-norm spikes detected by the z-score of an EMA.

  Warm-up: the first ``warmup_steps`` steps only gather the gradient norm
  (and clip to ``max_norm`` if given); their mean and (population) variance
  start the statistics. Afterwards, with ``m`` and ``s`` the EMA mean and
  standard deviation of the norm and ``g`` this step's norm:

  * ``mode="zscore"``: ``z = (g - m) / (s + eps)``. When ``z > z_thresh`` the
    step is a spike and its norm is clipped to
    ``(m + z_thresh * s / (z / z_thresh)) * clip_factor``
    (``clip_option="adaptive_scaling"``: the larger the outlier, the harder
    it is clipped) or to ``m`` (``clip_option="mean"``).
  * ``mode="percentile"``: a norm above ``m + z_thresh * s`` is a spike,
    clipped to that value (``clip_option`` and ``clip_factor`` unused).

  ``max_norm`` (if given) caps the limit in every step. The EMAs are then
  updated with the clipped value on a spike and with ``g`` otherwise --
  ``m <- alpha m + (1 - alpha) x`` first, then
  ``v <- alpha v + (1 - alpha) (x - m)^2`` with the new ``m`` -- unless
  ``skip_update_on_spike`` and the step was a spike. This is step for step
  the clipping of the authors' reference implementation
  (``bluorion-com/ZClip``, ``zclip/zclip.py``), with these differences:

  * the update is scaled by ``min(1, limit / g)`` exactly (the reference, as
    ``torch.nn.utils.clip_grad_norm_``, divides by ``g + 1e-6``);
  * the warm-up's mean and variance are accumulated step by step in float32
    (Welford) instead of from a list of Python floats: the same values up
    to rounding;
  * a NaN or infinite norm leaves the statistics untouched (in the
    reference it enters them: a NaN would disable clipping for good);
  * ``max_norm`` defaults to ``None`` (no fixed cap; the reference uses 1.0)
    and ``warmup_steps`` must be at least 1 (the reference treats 0 as 1);
  * ``scope="leaf"`` (not in the reference) keeps statistics per leaf and
    clips each leaf on its own.

  Args:
    alpha: EMA smoothing of the norm's mean and variance, in (0, 1).
    z_thresh: the z-score above which a norm is a spike (> 0).
    max_norm: a fixed cap on the norm (on each leaf's with
      ``scope="leaf"``), applied during warm-up too; ``None`` for none.
    eps: added to the standard deviation in the z-score (>= 0).
    warmup_steps: steps whose norms start the statistics (>= 1).
    mode: ``"zscore"`` or ``"percentile"`` (see above).
    clip_option: ``"adaptive_scaling"`` or ``"mean"``, for ``mode="zscore"``.
    clip_factor: multiplies the adaptive-scaling limit (> 0); values below 1
      clip harder.
    skip_update_on_spike: leave the statistics unchanged on a spike step.
    scope: ``"global"`` (one norm for the whole tree) or ``"leaf"`` (each
      leaf its own norm, statistics and clipping).

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`ClipZscoreState`.

  References:
    Kumar et al., `ZClip: Adaptive Spike Mitigation for LLM Pre-Training
    <https://arxiv.org/abs/2504.02507>`_, 2025; reference implementation
    https://github.com/bluorion-com/ZClip

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> tx = optaxclip.clip_zscore(warmup_steps=3)
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> for norm in [1.0, 1.2, 0.8, 1.1]:  # warm-up, then an ordinary step
    ...   _, state = tx.update({"w": jnp.array([norm, 0.0])}, state)
    >>> spike = {"w": jnp.array([0.0, 10.0])}
    >>> clipped, state = tx.update(spike, state)
    >>> round(float(state.norm), 3), round(float(state.clipped_norm), 3)
    (10.0, 1.021)
    >>> round(float(state.threshold), 3)  # norms above it count as spikes
    1.407
  """
  who = "clip_zscore"
  _checks.check_probability("alpha", alpha, who=who)
  _checks.check_number("z_thresh", z_thresh, who=who, low=0.0, low_open=True)
  _checks.check_number("max_norm", max_norm, who=who, low=0.0, allow_inf=True,
                       allow_none=True)
  _checks.check_number("eps", eps, who=who, low=0.0)
  _checks.check_steps(who, "warmup_steps", warmup_steps)
  _checks.check_choice(who, "mode", mode, ("zscore", "percentile"))
  _checks.check_choice(who, "clip_option", clip_option,
                       ("adaptive_scaling", "mean"))
  _checks.check_number("clip_factor", clip_factor, who=who, low=0.0,
                       low_open=True)
  _checks.check_bool(who, "skip_update_on_spike", skip_update_on_spike)
  scope = _checks.check_choice(who, "scope", scope, SCOPES)
  cap = _no_limit(max_norm)

  def init_fn(params):
    shape = _unit_shape(params, scope)
    return ClipZscoreState(
        *_stats.zeros(len(ADAPTIVE_FIELDS)),
        count=jnp.zeros((), jnp.int32),
        mean=jnp.zeros(shape, _F32), var=jnp.zeros(shape, _F32))

  def spike_rule(g, mean, var):
    """Returns (spike?, value to clip to on a spike, spike boundary)."""
    std = jnp.sqrt(var)
    if mode == "percentile":
      boundary = mean + z_thresh * std
      return g > boundary, boundary, boundary
    z = (g - mean) / (std + eps)
    spike = z > z_thresh
    if clip_option == "mean":
      value = mean
    else:
      eta = jnp.where(spike, z, z_thresh) / z_thresh
      value = (mean + z_thresh * std / eta) * clip_factor
    return spike, value, mean + z_thresh * (std + eps)

  def update_fn(updates, state, params=None):
    del params
    measured = _Measured(updates, scope, who, state.mean.shape)
    g = measured.stat_norm
    warming = state.count < warmup_steps

    # Warm-up: gather the norm; clip only to max_norm.
    warm_mean, warm_var = welford(state.count, state.mean, state.var, g)
    # After warm-up: detect a spike against the statistics so far.
    spike, value, boundary = spike_rule(g, state.mean, state.var)
    spike = spike & ~warming
    seen = jnp.where(spike, value, g)
    ema_mean, ema_var = ema_mean_var(alpha, state.mean, state.var, seen)
    if skip_update_on_spike:
      ema_mean = jnp.where(spike, state.mean, ema_mean)
      ema_var = jnp.where(spike, state.var, ema_var)

    limit = jnp.minimum(jnp.where(spike, value, jnp.inf), cap)
    new_updates, stats = measured.clip(limit)
    threshold = jnp.minimum(jnp.where(warming, jnp.inf, boundary), cap)
    stats = (*stats[:3], _total(threshold))
    memory = _keep_if(
        measured.finite,
        (jnp.minimum(state.count + 1, warmup_steps).astype(jnp.int32),
         jnp.where(warming, warm_mean, ema_mean).astype(_F32),
         jnp.where(warming, warm_var, ema_var).astype(_F32)),
        (state.count, state.mean, state.var))
    return new_updates, ClipZscoreState(*stats, *memory)

  return optax.GradientTransformation(
      init_fn, _compiled.jit_update(update_fn))


# --- AutoClip ----------------------------------------------------------------


def percentile_linear(values: jax.Array, n: jax.Array, q: Any) -> jax.Array:
  """``numpy.percentile(values[:n], q, axis=0)`` (method "linear").

  ``values`` holds at least ``n`` valid rows first in any order (along axis
  0); the rest is ignored. ``n`` may be traced. Returns +inf when ``n == 0``.
  """
  rows = values.shape[0]
  valid = (jnp.arange(rows) < n).reshape((rows,) + (1,) * (values.ndim - 1))
  ordered = jnp.sort(jnp.where(valid, values, jnp.inf), axis=0)
  last = jnp.maximum(n - 1, 0)
  rank = jnp.asarray(q, _F32) / 100 * last.astype(_F32)
  lo = jnp.clip(jnp.floor(rank).astype(jnp.int32), 0, last)
  hi = jnp.minimum(lo + 1, last)
  frac = rank - lo.astype(_F32)
  below, above = ordered[lo], ordered[hi]
  # numpy's lerp: from the nearer end, so that frac = 1 gives `above` exactly.
  value = jnp.where(frac < 0.5, below + (above - below) * frac,
                    above - (above - below) * (1 - frac))
  return jnp.where(n > 0, value, jnp.inf)


@_compiled.compiled_once
def clip_percentile(
    percentile: float = 10.0,
    *,
    history: int = 1024,
    scope: str = "global",
) -> optax.GradientTransformation:
  """AutoClip: clips to a percentile of the recent gradient norms.

  Each step records the gradient's norm, then takes as threshold the
  ``percentile``-th percentile (as ``numpy.percentile`` computes it, linear
  interpolation) of the last ``history`` norms, this step's included, and
  scales the update by ``min(1, threshold / norm)``. At first only the norms
  seen so far count, so the first step is never clipped.

  Differences from the paper: AutoClip keeps every norm since the start of
  training; this keeps the last ``history`` (a ring buffer in the state), so
  memory is fixed and the threshold follows the norm as training moves on. A
  NaN or infinite norm is not recorded (one would otherwise stay in the
  history), and ``scope="leaf"`` (not in the paper) keeps one history per
  leaf and clips each leaf on its own.

  Args:
    percentile: which percentile of the recent norms to clip to, in
      [0, 100]; the paper recommends 10.
    history: how many recent norms to keep (>= 1); the state holds this many
      float32 values (per leaf with ``scope="leaf"``).
    scope: ``"global"`` (one norm for the whole tree) or ``"leaf"``.

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`ClipPercentileState`.

  References:
    Seetharaman et al., `AutoClip: Adaptive Gradient Clipping for Source
    Separation Networks <https://arxiv.org/abs/2007.14469>`_, 2020

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> tx = optaxclip.clip_percentile(50.0, history=4)
    >>> state = tx.init({"w": jnp.zeros(1)})
    >>> for norm in [1.0, 2.0, 3.0, 100.0]:
    ...   clipped, state = tx.update({"w": jnp.array([norm])}, state)
    >>> float(state.threshold), clipped["w"]  # median of 1, 2, 3, 100
    (2.5, Array([2.5], dtype=float32))
  """
  who = "clip_percentile"
  _checks.check_number("percentile", percentile, who=who, low=0.0,
                       high=100.0)
  history = _checks.check_count(who, "history", history)
  scope = _checks.check_choice(who, "scope", scope, SCOPES)

  def init_fn(params):
    shape = _unit_shape(params, scope)
    return ClipPercentileState(
        *_stats.zeros(len(ADAPTIVE_FIELDS)),
        filled=jnp.zeros((), jnp.int32), index=jnp.zeros((), jnp.int32),
        history=jnp.zeros((history, *shape), _F32))

  def update_fn(updates, state, params=None):
    del params
    measured = _Measured(updates, scope, who, state.history.shape[1:])
    finite = measured.finite
    recorded = state.history.at[state.index].set(measured.stat_norm)
    filled = jnp.minimum(state.filled + 1, history)
    recorded, filled, index = _keep_if(
        finite, (recorded, filled, (state.index + 1) % history),
        (state.history, state.filled, state.index))
    threshold = percentile_linear(recorded, filled, percentile)
    new_updates, stats = measured.clip(threshold)
    return new_updates, ClipPercentileState(
        *stats, filled=filled.astype(jnp.int32), index=index.astype(jnp.int32),
        history=recorded)

  return optax.GradientTransformation(
      init_fn, _compiled.jit_update(update_fn))


# --- AdaGC -------------------------------------------------------------------


@_compiled.compiled_once
def clip_relative(
    factor: float = 1.05,
    *,
    beta: float = 0.98,
    warmup_steps: int = 100,
    warmup_max_norm: float = 1.0,
) -> optax.GradientTransformation:
  r"""AdaGC: clips each leaf relative to an EMA of its own clipped norms.

  Each leaf ``i`` keeps a threshold ``gamma_i``, +inf at first. During the
  first ``warmup_steps`` steps the whole tree is clipped to global norm
  ``warmup_max_norm``, ``g_hat = g min(1, warmup_max_norm / ||g||)``, and
  ``gamma_i = min(gamma_i, ||g_hat_i||)``. Afterwards each leaf is clipped
  on its own, ``g_hat_i = g_i min(1, factor gamma_i / ||g_i||)``, and
  ``gamma_i = beta gamma_i + (1 - beta) ||g_hat_i||``.

  Differences from the paper: AdaGC is written there as part of AdamW (and
  its divisions carry an epsilon); here it is a transformation to chain
  before any optimizer and the ratios are exact. A NaN or infinite norm
  leaves ``gamma`` and the step count untouched. As in the paper, a leaf
  whose gradient is zero during warm-up gets ``gamma_i = 0`` and stays
  clipped to zero: mask such leaves out (``optax.masked``) if they may wake
  up later.

  Args:
    factor: the relative threshold (``lambda_rel`` in the paper; >= 1:
      below 1 every leaf's limit, and so its update, decays to zero).
    beta: EMA smoothing of each ``gamma_i``, in (0, 1).
    warmup_steps: steps of global clipping that set the ``gamma_i`` (>= 1).
    warmup_max_norm: the global norm limit during warm-up (``lambda_abs``;
      >= 0).

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`ClipRelativeState`.

  References:
    Wang et al., `AdaGC: Improving Training Stability for Large Language
    Model Pretraining <https://arxiv.org/abs/2502.11034>`_, 2025

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> tx = optaxclip.clip_relative(2.0, warmup_steps=1)
    >>> g = {"a": jnp.array([0.6]), "b": jnp.array([0.8])}
    >>> state = tx.init(g)
    >>> _, state = tx.update(g, state)  # warm-up: gamma = leaf norms
    >>> spike = {"a": jnp.array([6.0]), "b": jnp.array([0.8])}
    >>> clipped, state = tx.update(spike, state)
    >>> clipped["a"], clipped["b"]  # only "a" exceeds 2 * its gamma
    (Array([1.2], dtype=float32), Array([0.8], dtype=float32))
  """
  who = "clip_relative"
  _checks.check_number(
      "factor", factor, who=who, low=1.0,
      why="below 1 each leaf's limit shrinks every step and its updates decay"
      " to zero")
  _checks.check_probability("beta", beta, who=who)
  _checks.check_steps(who, "warmup_steps", warmup_steps)
  _checks.check_number("warmup_max_norm", warmup_max_norm, who=who, low=0.0,
                       allow_inf=True)

  def init_fn(params):
    return ClipRelativeState(
        *_stats.zeros(len(ADAPTIVE_FIELDS)),
        count=jnp.zeros((), jnp.int32),
        gamma=jnp.full(_unit_shape(params, "leaf"), jnp.inf, _F32))

  def update_fn(updates, state, params=None):
    del params
    measured = _Measured(updates, "leaf", who, state.gamma.shape)
    norms = measured.stat_norm
    warming = state.count < warmup_steps
    total = _norms.combine_norms([norms])
    warm_limit = norms * _norms.clip_factor(total, warmup_max_norm)
    limit = jnp.where(warming, warm_limit, factor * state.gamma)
    new_updates, stats = measured.clip(limit)
    clipped = jnp.minimum(norms, limit)
    gamma = jnp.where(warming, jnp.minimum(state.gamma, clipped),
                      beta * state.gamma + (1 - beta) * clipped)
    threshold = jnp.where(warming, jnp.asarray(warmup_max_norm, _F32),
                          stats[3])
    count, gamma = _keep_if(
        measured.finite,
        (jnp.minimum(state.count + 1, warmup_steps).astype(jnp.int32),
         gamma.astype(_F32)),
        (state.count, state.gamma))
    return new_updates, ClipRelativeState(
        *stats[:3], _stats.as_stat(threshold), count=count, gamma=gamma)

  return optax.GradientTransformation(
      init_fn, _compiled.jit_update(update_fn))
