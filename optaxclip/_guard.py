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
from optaxclip import _stats

_F32 = jnp.float32

@_stats.register(
    "guard", ("norm", "threshold", "skipped", "nonfinite", "consecutive_skips"))
class GuardState(NamedTuple):
  """State of :func:`guard`.

  Attributes:
    norm: this step's global L2 gradient norm.
    threshold: the largest norm that passed this step: ``max_norm`` and,
      after warm-up, the spike bound; +inf when neither applies.
    skipped: steps skipped so far.
    nonfinite: steps with a NaN/Inf norm so far.
    consecutive_skips: skipped steps in a row, ending with this one (0 when
      this step went through).
    count: finite norms gathered for the warm-up, at most ``warmup_steps``.
    mean: the mean of the norm (the warm-up's plain mean, then an EMA).
    var: the variance of the norm, likewise.
    inner_state: the state of the guarded transformation.
  """
  norm: jax.Array  # float32 scalar
  threshold: jax.Array  # float32 scalar
  skipped: jax.Array  # int32 scalar
  nonfinite: jax.Array  # int32 scalar
  consecutive_skips: jax.Array  # int32 scalar
  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  mean: jax.Array  # float32 scalar
  var: jax.Array  # float32 scalar
  inner_state: Any


def _zeros_like_struct(struct: jax.ShapeDtypeStruct) -> jax.Array:
  """Zeros of the struct's shape and dtype, and of its sharding when that is
  explicit (on an Explicit mesh both branches of a cond must agree).
  """
  sharding = getattr(struct, "sharding", None)
  spec = getattr(sharding, "spec", None) or ()
  if any(entry is not None for entry in spec):
    return jnp.zeros(struct.shape, struct.dtype, out_sharding=sharding)
  return jnp.zeros(struct.shape, struct.dtype)


@_compiled.compiled_once
def guard(
    inner: optax.GradientTransformation,
    *,
    skip_nonfinite: bool = True,
    spike_z: Optional[float] = None,
    max_norm: Optional[float] = None,
    alpha: float = 0.97,
    warmup_steps: int = 25,
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
  (x - m)^2`` (the update order of ZClip, :func:`clip_zscore`), a spike
  entering at the spike bound ``m + spike_z s`` rather than at its own
  size (as in ZClip's "percentile" mode). So one spike barely moves the
  bound, while a lasting rise in the norm lifts it step by step (the
  standard deviation grows geometrically while such steps are skipped)
  until the new level passes. NaN/Inf norms never enter.

  Unlike ``optax.apply_if_finite``, it also catches spikes, counts what it
  skipped, and never gives up and applies a non-finite update (watch
  ``consecutive_skips`` to detect a run that has diverged). It is the
  skip-the-batch remedy PaLM used for loss spikes, inside the optimizer.

  Args:
    inner: the transformation to guard (usually the whole optimizer chain).
    skip_nonfinite: skip steps whose gradient norm is NaN or infinite.
    spike_z: skip steps more than this many standard deviations above the
      EMA mean of the norm (> 0); ``None`` to skip no spikes.
    max_norm: skip steps whose norm is above it (>= 0); ``None`` for none.
    alpha: EMA smoothing of the norm's mean and variance, in (0, 1).
    warmup_steps: finite norms to gather before spikes are detected (>= 1).

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
  _checks.check_bool(who, "skip_nonfinite", skip_nonfinite)
  _checks.check_number("spike_z", spike_z, who=who, low=0.0, low_open=True,
                       allow_none=True)
  _checks.check_number("max_norm", max_norm, who=who, low=0.0, allow_inf=True,
                       allow_none=True)
  _checks.check_probability("alpha", alpha, who=who)
  _checks.check_steps(who, "warmup_steps", warmup_steps)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    # A fresh array per field: a donated state must not hold one buffer twice.
    def counter():
      return jnp.zeros((), jnp.int32)

    return GuardState(
        norm=jnp.zeros((), _F32), threshold=jnp.full((), jnp.inf, _F32),
        skipped=counter(), nonfinite=counter(), consecutive_skips=counter(),
        count=counter(), mean=jnp.zeros((), _F32), var=jnp.zeros((), _F32),
        inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    _checks.check_float_leaves(updates, f"{who}: updates")
    norm = jax.lax.stop_gradient(
        _norms.global_norm(jax.tree.leaves(updates))).astype(_F32)
    finite = jnp.isfinite(norm)
    warming = state.count < warmup_steps

    threshold = jnp.full((), jnp.inf, _F32)
    if max_norm is not None:
      threshold = jnp.minimum(threshold, max_norm)
    seen = norm  # what the statistics take in
    if spike_z is not None:
      bound = jnp.where(warming, jnp.inf,
                        state.mean + spike_z * jnp.sqrt(state.var))
      threshold = jnp.minimum(threshold, bound)
      seen = jnp.minimum(norm, bound)
    skip = norm > threshold
    if skip_nonfinite:
      skip = skip | ~finite

    def step():
      return inner.update(updates, state.inner_state, params, **extra_args)

    def skip_step():
      zeros = jax.tree.map(_zeros_like_struct, out_shapes)
      return zeros, state.inner_state

    # inner's outputs may differ from the updates in dtype: ask for them.
    out_shapes = jax.eval_shape(step)[0]
    # A cond rather than selecting between both results: a skipped step
    # costs nothing, and the state is not copied. The real step goes in the
    # true branch: on XLA:CPU the other order was measured 4x slower.
    new_updates, new_inner = jax.lax.cond(~skip, step, skip_step)

    warm_mean, warm_var = _adaptive.welford(state.count, state.mean,
                                            state.var, seen)
    ema_mean, ema_var = _adaptive.ema_mean_var(alpha, state.mean, state.var,
                                               seen)
    count = jnp.where(finite, jnp.minimum(state.count + 1, warmup_steps),
                      state.count)
    mean = jnp.where(finite, jnp.where(warming, warm_mean, ema_mean),
                     state.mean)
    var = jnp.where(finite, jnp.where(warming, warm_var, ema_var), state.var)
    return new_updates, GuardState(
        norm=norm, threshold=_stats.as_stat(threshold),
        skipped=jnp.where(skip, optax.safe_increment(state.skipped),
                          state.skipped),
        nonfinite=jnp.where(finite, state.nonfinite,
                            optax.safe_increment(state.nonfinite)),
        consecutive_skips=jnp.where(
            skip, optax.safe_increment(state.consecutive_skips), 0),
        count=count.astype(jnp.int32), mean=mean.astype(_F32),
        var=var.astype(_F32), inner_state=new_inner)

  return optax.GradientTransformationExtraArgs(
      init_fn, _compiled.jit_update(update_fn))
