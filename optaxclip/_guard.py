"""``guard``: skip a whole optimizer step on a NaN/Inf or spiking gradient."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from optaxclip import _adaptive
from optaxclip import _checks
from optaxclip import _compiled
from optaxclip import _norms
from optaxclip import _static
from optaxclip import _stats
from optaxclip._typing import AxisName
from optaxclip._typing import Scalar


@_stats.register(
  "guard",
  (
    "norm",
    "threshold",
    "skipped",
    "nonfinite",
    "consecutive_skips",
    "restarts",
    "skipped_nonfinite",
    "skipped_max_norm",
    "skipped_spike",
    "z_score",
  ),
)
class GuardState(NamedTuple):
  """State of :func:`guard`.

  Float fields are in the statistics dtype chosen at ``init`` (float32, or
  float64 for float64 parameters).

  Attributes:
    norm: this step's global L2 gradient norm.
    threshold: the largest norm that passed this step: ``max_norm`` and,
      after warm-up, the spike bound; +inf when neither applies.
    skipped: steps skipped so far, whatever the cause (the sum of the
      ``skipped_*`` counters, for a state that counted them from ``init``).
    nonfinite: steps with a NaN/Inf gradient so far, skipped or not (with
      ``skip_nonfinite=False`` they pass and are still counted here).
    consecutive_skips: skipped steps in a row, ending with this one (0 when
      this step went through).
    count: finite norms gathered for the warm-up, at most ``warmup_steps``.
    mean: the mean of the norm (the warm-up's plain mean, then an EMA).
    var: the variance of the norm, likewise.
    inner_state: the state of the guarded transformation.
    consecutive_spikes: spikes in a row skipped so far.
    restarts: how often the statistics restarted at a new level.
    skipped_nonfinite: steps skipped because the gradient held NaN/Inf.
    skipped_max_norm: steps skipped because the norm was above ``max_norm``
      (and the gradient finite).
    skipped_spike: steps skipped as a spike of the norm (and for no cause
      above); an infinite norm of finite values counts here when only the
      spike bound stops it.
    z_score: this step's norm in standard deviations above the mean of the
      statistics it was judged by, ``(norm - mean) / sqrt(var)``; 0 where
      that is undefined (during warm-up, for a NaN/Inf norm, or when the
      variance is 0).
  """

  norm: jax.Array  # float scalar
  threshold: jax.Array  # float scalar
  skipped: jax.Array  # int32 scalar
  nonfinite: jax.Array  # int32 scalar
  consecutive_skips: jax.Array  # int32 scalar
  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  mean: jax.Array  # float scalar
  var: jax.Array  # float scalar
  inner_state: Any
  consecutive_spikes: jax.Array  # int32 scalar
  restarts: jax.Array  # int32 scalar
  skipped_nonfinite: jax.Array  # int32 scalar
  skipped_max_norm: jax.Array  # int32 scalar
  skipped_spike: jax.Array  # int32 scalar
  z_score: jax.Array  # float scalar


def _varying_axes(x: Any) -> frozenset:
  """The mesh axes over which ``x`` (an array or a struct) varies inside
  ``shard_map``; empty elsewhere.
  """
  kind = getattr(x, "manual_axis_type", None)
  if kind is None and not isinstance(x, jax.ShapeDtypeStruct):
    kind = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(getattr(kind, "varying", ()) or ())


def _vary(x: jax.Array, axes: frozenset) -> jax.Array:
  """``x`` made to vary over ``axes`` too (both branches of a ``cond``
  inside ``shard_map`` must agree on it).
  """
  missing = tuple(sorted(axes - _varying_axes(x)))
  if not missing:
    return x
  return jax.lax.pcast(x, missing, to="varying")


def _zeros_like_struct(struct: jax.ShapeDtypeStruct) -> jax.Array:
  """Zeros of the struct's shape and dtype, and of its sharding when that is
  explicit (on an Explicit mesh both branches of a cond must agree).
  """
  sharding = getattr(struct, "sharding", None)
  spec = getattr(sharding, "spec", None) or ()
  if any(entry is not None for entry in spec):
    zeros = jnp.zeros(struct.shape, struct.dtype, out_sharding=sharding)
  else:
    zeros = jnp.zeros(struct.shape, struct.dtype)
  return _vary(zeros, _varying_axes(struct))


@_compiled.compiled_once
def guard(
  inner: optax.GradientTransformation,
  *,
  skip_nonfinite: bool = True,
  spike_z: Optional[Scalar] = None,
  max_norm: Optional[Scalar] = None,
  alpha: Scalar = 0.97,
  warmup_steps: Scalar = 25,
  patience: Scalar = 25,
  axis_name: AxisName = None,
  sharded: Any = True,
) -> optax.GradientTransformationExtraArgs:
  """Skips the whole ``inner`` update when the gradient is NaN/Inf or spikes.

  A skipped step returns zero updates and leaves ``inner``'s state exactly
  as it was (its step count included), as if the batch never happened. A
  step is skipped when its global L2 gradient norm ``g`` is

  * NaN or infinite (with ``skip_nonfinite``), or
  * above ``max_norm`` (if given), or
  * once ``warmup_steps`` finite norms have been seen, above
    ``m + spike_z * s`` (if ``spike_z`` is given), with ``m`` and ``s`` the
    EMA mean and standard deviation of the norm.

  The statistics start as the plain mean and variance of the first
  ``warmup_steps`` finite norms and then follow every finite norm ``x``,
  ``m <- alpha m + (1 - alpha) x`` then ``v <- alpha v + (1 - alpha)
  (x - m)^2`` (the update order of ZClip, :func:`clip_zscore`, and the same
  code), a spike entering at the spike bound ``m + spike_z s`` rather than
  at its own size (as in ZClip's "percentile" mode). So one spike barely
  moves the bound, while a lasting rise in the norm lifts it step by step
  (the standard deviation grows geometrically while such steps are skipped)
  until the new level passes. NaN/Inf norms never enter.

  No absorbing state: when the statistics cannot rise -- a warm-up of equal
  norms (variance 0: all zeros when a loss is switched on by a schedule, or
  masked batches) -- or rise too slowly, a spike that comes after
  ``patience`` skipped spikes in a row is taken as a new level instead: it
  passes (unless ``max_norm`` or a NaN/Inf stops it), the mean moves to its
  norm and the variance takes in the jump (``restarts`` counts these). So
  at most ``patience`` spikes in a row are skipped. Statistics with no
  spread (variance exactly 0: equal norms so far, zeros included) cannot
  judge a spike: the first norm above their mean restarts them at once. A
  level
  above ``max_norm`` is skipped for as long as it lasts: that is the fixed
  limit asked for.

  Unlike ``optax.apply_if_finite``, it also catches spikes, counts what it
  skipped, and never gives up and applies a non-finite update (watch
  ``consecutive_skips`` to detect a run that has diverged). It is the
  skip-the-batch remedy PaLM used for loss spikes, inside the optimizer.

  The norm and the statistics are in the accumulation dtype of the
  parameters given to ``init`` (float64 ones keep float64: a finite norm of
  1e200 is finite). With ``axis_name`` (inside ``shard_map`` or ``pmap``),
  every device computes the norm of the whole arrays and takes the same
  decision, so the inner states stay equal across devices.

  Args:
    inner: the transformation to guard (usually the whole optimizer chain).
    skip_nonfinite: skip steps whose gradient norm is NaN or infinite.
    spike_z: skip steps more than this many standard deviations above the
      EMA mean of the norm (> 0); ``None`` to skip no spikes.
    max_norm: skip steps whose norm is above it (>= 0); ``None`` for none.
    alpha: EMA smoothing of the norm's mean and variance, in (0, 1).
    warmup_steps: finite norms to gather before spikes are detected (>= 1).
    patience: spikes in a row skipped before a lasting new level is
      accepted (>= 1).
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split (as for :func:`clip_global`).
    sharded: which leaves are split over ``axis_name``: a bool, a pytree
      prefix of bools or a callable ``(path, leaf) -> bool``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`GuardState` holding ``inner``'s state.

  References:
    Chowdhery et al., `PaLM: Scaling Language Modeling with Pathways
    <https://arxiv.org/abs/2204.02311>`_, 2022 (skipping batches around
    loss spikes); ``optax.apply_if_finite``.

  Example:
    >>> import jax.numpy as jnp, optax, optaxclip
    >>> tx = optaxclip.guard(optax.sgd(1.0), max_norm=10.0)
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state)
    >>> updates["w"], int(state.skipped), int(state.nonfinite)
    (Array([0., 0.], dtype=float32), 1, 1)
    >>> updates, state = tx.update({"w": jnp.array([30.0, 40.0])}, state)
    >>> updates["w"], int(state.skipped)
    (Array([0., 0.], dtype=float32), 2)
    >>> updates, state = tx.update({"w": jnp.array([3.0, 4.0])}, state)
    >>> updates["w"], int(state.consecutive_skips)
    (Array([-3., -4.], dtype=float32), 0)
  """
  who = "guard"
  _checks.check_transformation(who, "inner", inner)
  skip_nonfinite = _checks.check_bool(who, "skip_nonfinite", skip_nonfinite)
  _checks.check_number(
    "spike_z", spike_z, who=who, low=0.0, low_open=True, allow_none=True
  )
  _checks.check_number(
    "max_norm", max_norm, who=who, low=0.0, allow_inf=True, allow_none=True
  )
  _checks.check_probability("alpha", alpha, who=who)
  _checks.check_steps(who, "warmup_steps", warmup_steps)
  _checks.check_steps(who, "patience", patience)
  axis_name = _checks.check_sharding(who, axis_name, sharded)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    # A fresh array per field: a donated state must not hold one buffer twice.
    def counter():
      return jnp.zeros((), jnp.int32)

    dtype = _adaptive.stats_dtype(params)
    return GuardState(
      norm=jnp.zeros((), dtype),
      threshold=jnp.full((), jnp.inf, dtype),
      skipped=counter(),
      nonfinite=counter(),
      consecutive_skips=counter(),
      count=counter(),
      mean=jnp.zeros((), dtype),
      var=jnp.zeros((), dtype),
      inner_state=inner.init(params),
      consecutive_spikes=counter(),
      restarts=counter(),
      skipped_nonfinite=counter(),
      skipped_max_norm=counter(),
      skipped_spike=counter(),
      z_score=jnp.zeros((), dtype),
    )

  def update_fn(updates, state, params=None, **extra_args):
    _checks.check_float_leaves(updates, f"{who}: updates")
    leaves = jax.tree.leaves(updates)
    flags = (
      _static.sharded_flags(updates, sharded, who, axis_name)
      if axis_name
      else None
    )
    dtype = _norms.promote_types(
      state.mean.dtype, _norms.tree_accumulation_dtype(leaves)
    )
    scaled = jax.lax.stop_gradient(
      _norms.global_norm_scaled(leaves, axis_name=axis_name, sharded=flags)
    )
    norm = scaled.as_float().astype(dtype)
    mean, var = state.mean.astype(dtype), state.var.astype(dtype)
    # NaN/Inf in the gradient. A norm of finite values beyond the dtype's
    # range is not one (inf as a number: above any bound, kept out of the
    # statistics).
    nonfinite = ~jnp.isfinite(scaled.value)
    finite = jnp.isfinite(norm)
    warming = state.count < warmup_steps

    cap = jnp.asarray(jnp.inf if max_norm is None else max_norm, dtype)
    spike = restart = jnp.zeros((), bool)
    seen = norm  # what the statistics take in
    bound = jnp.asarray(jnp.inf, dtype)
    if spike_z is not None:
      bound = jnp.where(warming, jnp.inf, mean + spike_z * jnp.sqrt(var))
      spike = finite & (norm > bound)
      no_scale = var == 0  # equal norms so far: no spread to judge by
      restart = spike & ((state.consecutive_spikes >= patience) | no_scale)
      spike = spike & ~restart
      seen = jnp.where(spike, bound, norm)
    threshold = jnp.minimum(cap, jnp.where(restart, jnp.inf, bound))
    # An infinite norm is above any finite bound, whatever skip_nonfinite.
    skip = (norm > cap) | spike | (jnp.isinf(norm) & (bound < jnp.inf))
    if skip_nonfinite:
      skip = skip | nonfinite
    # One cause per skipped step, first match in this order, so that the
    # cause counters add up to `skipped`.
    by_nonfinite = skip & nonfinite if skip_nonfinite else jnp.zeros((), bool)
    by_max_norm = skip & ~by_nonfinite & (norm > cap)
    by_spike = skip & ~by_nonfinite & ~by_max_norm
    std = jnp.sqrt(var)
    judged = ~warming & finite & (std > 0)
    z_score = jnp.where(judged, (norm - mean) / jnp.where(judged, std, 1), 0)

    old_inner = state.inner_state
    # inner's outputs may differ from the updates in dtype: ask for them.
    out_shapes = jax.eval_shape(
      lambda: inner.update(updates, old_inner, params, **extra_args)
    )
    # Inside shard_map both branches must vary over the same mesh axes.
    state_axes = jax.tree.map(
      lambda new, old: _varying_axes(new) | _varying_axes(old),
      out_shapes[1],
      old_inner,
    )

    def step():
      new_updates, new_inner = inner.update(
        updates, old_inner, params, **extra_args
      )
      return new_updates, jax.tree.map(_vary, new_inner, state_axes)

    def skip_step():
      zeros = jax.tree.map(_zeros_like_struct, out_shapes[0])
      return zeros, jax.tree.map(_vary, old_inner, state_axes)

    # A cond rather than selecting between both results: a skipped step
    # costs nothing, and the state is not copied. The real step goes in the
    # true branch: on XLA:CPU the other order was measured 4x slower.
    new_updates, new_inner = jax.lax.cond(~skip, step, skip_step)

    count, new_mean, new_var = _adaptive.running_moments(
      state.count,
      mean,
      var,
      seen,
      alpha=alpha,
      warmup_steps=warmup_steps,
      finite=finite,
      take=jnp.ones((), bool),
      restart=restart,
    )
    return new_updates, GuardState(
      norm=norm.astype(state.norm.dtype),
      threshold=threshold.astype(state.threshold.dtype),
      skipped=jnp.where(
        skip, optax.safe_increment(state.skipped), state.skipped
      ),
      nonfinite=jnp.where(
        nonfinite, optax.safe_increment(state.nonfinite), state.nonfinite
      ),
      consecutive_skips=jnp.where(
        skip, optax.safe_increment(state.consecutive_skips), 0
      ),
      count=count,
      mean=new_mean.astype(state.mean.dtype),
      var=new_var.astype(state.var.dtype),
      inner_state=new_inner,
      consecutive_spikes=_adaptive.streak(
        state.consecutive_spikes, spike, finite
      ),
      restarts=_adaptive.add_count(state.restarts, restart),
      skipped_nonfinite=_adaptive.add_count(
        state.skipped_nonfinite, by_nonfinite
      ),
      skipped_max_norm=_adaptive.add_count(state.skipped_max_norm, by_max_norm),
      skipped_spike=_adaptive.add_count(state.skipped_spike, by_spike),
      z_score=z_score.astype(state.z_score.dtype),
    )

  return optax.GradientTransformationExtraArgs(
    init_fn, _compiled.jit_update(update_fn)
  )
