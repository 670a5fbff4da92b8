"""Clippers whose threshold follows the gradient norms seen so far: ZClip
(z-score of an EMA), AutoClip (a percentile of recent norms) and AdaGC (per
leaf, relative to an EMA of its own clipped norms).

All their memory lives in the optax state, so they run inside ``jit`` without
host transfers, never retrace, and survive a checkpoint round trip. Rules
they share:

* **dtype.** Statistics, thresholds and the clip decision are kept in the
  accumulation dtype of the parameters given to ``init``: float32, or float64
  when a leaf is float64 (under ``jax_enable_x64``). It is fixed at ``init``,
  so the state's dtypes never change from step to step (no retrace).
* **Non-finite steps.** A step whose norm is NaN or infinite leaves the
  statistics untouched (one bad step must not poison them) and gives a
  non-finite update, the policy of every clipper (``optaxclip/_norms.py``):
  every value of a unit (the tree, or a leaf with per-leaf scope) whose norm
  is NaN or infinite comes out NaN, so no finite part of it passes
  unclipped and :func:`guard` can skip the step. ``clipped_norm`` is then
  NaN (it describes the update returned) and such units count as clipped in
  ``clip_fraction``.
* **Faithful defaults; opt-in escape from a frozen threshold.** With their
  defaults they follow their paper (and ZClip its reference code), with the
  differences each docstring lists. Where the paper's statistics can hold a
  lasting new level of the norm back for a long time or for ever (ZClip,
  AdaGC), ``patience`` (off by default) bounds it: after ``patience``
  clipped steps in a row the level the clipper judges by is raised by at
  most ``growth`` a step, from where it was, until the new level passes.
  A spike is so never let through at its own size; ``restarts`` counts
  the raised steps. AutoClip's window of recent norms bounds it by
  itself: a new level passes within ``history`` steps.
* **Many devices.** ``axis_name`` and ``sharded`` mean what they mean for
  :func:`clip_global`: inside ``shard_map``/``pmap`` every device computes
  the norms of the whole arrays, takes the same decision and holds the same
  state, equal to one device's.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
from typing import Any, Literal, NamedTuple, Optional
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxclip import _checks
from optaxclip import _compiled
from optaxclip import _measure
from optaxclip import _moments
from optaxclip import _norms
from optaxclip import _schedules
from optaxclip import _stats
from optaxclip import _telemetry
from optaxclip._typing import AxisName
from optaxclip._typing import Scalar
from optaxclip._typing import ScalarOrSchedule
from optaxclip._typing import Scope

_F32 = jnp.float32
_INT32_MAX = np.iinfo(np.int32).max
ADAPTIVE_FIELDS = (*_stats.CLIP_FIELDS, "threshold")
SCOPES = ("global", "leaf")


@_stats.register("clip_zscore", (*ADAPTIVE_FIELDS, "restarts"))
class ClipZscoreState(NamedTuple):
  """State of :func:`clip_zscore`.

  Float fields are in the statistics dtype chosen at ``init`` (float32, or
  float64 for float64 parameters).

  Attributes:
    norm: the global L2 norm before clipping.
    clipped_norm: the global L2 norm of the update returned (NaN when it
      holds NaN).
    clip_fraction: the share of clipping units (the tree, or each leaf)
      scaled down.
    threshold: the norm above which a step counts as a spike, capped by
      ``max_norm`` (during warm-up: ``max_norm``, or +inf without one; with
      ``scope='leaf'``: the L2 norm of the per-leaf thresholds).
    count: warm-up norms gathered, at most ``warmup_steps``.
    mean: the mean of the norm: the warm-up's plain mean until it ends, then
      an EMA (kept at least ``2**-22`` standard deviations from 0, so that
      ``var`` has room beside it: a z-score moves by less than ``2**-21``).
    var: the variance of the norm, likewise: the variance itself while
      ``2**-41 <= |mean| < 2**40`` (about 4.5e-13 to 1.1e12; ``2**-489`` to
      ``2**488`` in float64), beyond that ``var * 4**-e`` with ``e`` the
      mean's binary exponent less (plus) 40 (488), so that spreads from
      ``2**-24`` to ``2**24`` times the mean stay in range
      (``optaxclip._moments.spread`` gives the standard deviation).
    consecutive_spikes: spikes in a row so far, per unit (judged against
      the statistics as they were before any raise).
    restarts: steps on which a unit's statistics moved to a new level: a
      first nonzero norm after only zeros, or (with ``patience``) a mean
      raised by ``growth``.
    step: updates so far (int32, saturating): the step at which a schedule
      of ``spike_z`` or ``max_norm`` is evaluated.
    leaf_norms: with ``leaf_stats=True``, each leaf's pre-clip L2 norm (a
      ``(L,)`` vector per layer for a leaf with a ``layer_axis``), float32,
      a :class:`LeafNorms` (one vector; ``.tree()`` is a pytree shaped
      like the updates); else ``None``.
    top_leaf_share: with ``leaf_stats=True``, the share of ``norm**2``
      carried by the largest leaf or layer (float32); else ``None``.
    top_leaf: with ``leaf_stats=True``, that leaf's or layer's index in the
      flattened ``leaf_norms``; else ``None``.
  """

  norm: jax.Array  # float scalar
  clipped_norm: jax.Array  # float scalar
  clip_fraction: jax.Array  # float scalar
  threshold: jax.Array  # float scalar
  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  mean: jax.Array  # float: scalar, or (n_leaves,) with scope="leaf"
  var: jax.Array  # float: as mean
  consecutive_spikes: jax.Array  # int32: as mean
  restarts: jax.Array  # int32 scalar
  step: jax.Array  # int32 scalar
  leaf_norms: Any = None  # LeafNorms: float32 (entries,), static structure
  top_leaf_share: Optional[jax.Array] = None  # float32 scalar in [0, 1]
  top_leaf: Optional[jax.Array] = None  # int32 scalar


@_stats.register("clip_percentile", ADAPTIVE_FIELDS)
class ClipPercentileState(NamedTuple):
  """State of :func:`clip_percentile`.

  Float fields are in the statistics dtype chosen at ``init``.

  Attributes:
    norm: the global L2 norm before clipping.
    clipped_norm: the global L2 norm of the update returned.
    clip_fraction: the share of clipping units scaled down.
    threshold: the percentile of the recent norms (with ``scope='leaf'``,
      the L2 norm of the per-leaf thresholds).
    filled: how many entries of ``history`` hold a step's norm.
    index: the slot the next norm goes to.
    history: a ring buffer of the last norms; +inf marks an empty slot or a
      zero norm, which does not count.
    ordered: the same values as ``history``, sorted along the first axis
      (kept so that a step costs one insertion and one removal, no sort).
    count: updates so far (int32, saturating): the step at which a
      schedule of ``percentile`` is evaluated.
    leaf_norms: with ``leaf_stats=True``, each leaf's pre-clip L2 norm (a
      ``(L,)`` vector per layer for a leaf with a ``layer_axis``), float32,
      a :class:`LeafNorms` (one vector; ``.tree()`` is a pytree shaped
      like the updates); else ``None``.
    top_leaf_share: with ``leaf_stats=True``, the share of ``norm**2``
      carried by the largest leaf or layer (float32); else ``None``.
    top_leaf: with ``leaf_stats=True``, that leaf's or layer's index in the
      flattened ``leaf_norms``; else ``None``.
  """

  norm: jax.Array  # float scalar
  clipped_norm: jax.Array  # float scalar
  clip_fraction: jax.Array  # float scalar
  threshold: jax.Array  # float scalar
  filled: jax.Array  # int32 scalar
  index: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  history: jax.Array  # float, (history,) or (history, n_leaves)
  ordered: jax.Array  # float: as history
  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  leaf_norms: Any = None  # LeafNorms: float32 (entries,), static structure
  top_leaf_share: Optional[jax.Array] = None  # float32 scalar in [0, 1]
  top_leaf: Optional[jax.Array] = None  # int32 scalar


@_stats.register("clip_relative", (*ADAPTIVE_FIELDS, "restarts"))
class ClipRelativeState(NamedTuple):
  """State of :func:`clip_relative`.

  Float fields are in the statistics dtype chosen at ``init``.

  Attributes:
    norm: the global L2 norm before clipping.
    clipped_norm: the global L2 norm of the update returned.
    clip_fraction: the share of leaves scaled down.
    threshold: ``warmup_max_norm`` during warm-up, then the L2 norm of the
      per-leaf limits ``factor * gamma_i``.
    count: steps with a finite norm, at most ``warmup_steps``.
    gamma: the EMA of each leaf's clipped norm (+inf until the leaf has had
      a nonzero gradient).
    consecutive_clips: per leaf, steps in a row after the warm-up whose
      norm was above the leaf's limit ``factor * gamma_i`` (the steps the
      paper's rule clips).
    restarts: with ``patience``, how many times a leaf's ``gamma`` was
      raised by ``growth`` (leaf-steps); 0 with the default
      ``patience=None``.
    step: updates so far (int32, saturating): the step at which a schedule
      of ``factor`` or ``warmup_max_norm`` is evaluated.
    leaf_norms: with ``leaf_stats=True``, each leaf's pre-clip L2 norm (a
      ``(L,)`` vector per layer for a leaf with a ``layer_axis``), float32,
      a :class:`LeafNorms` (one vector; ``.tree()`` is a pytree shaped
      like the updates); else ``None``.
    top_leaf_share: with ``leaf_stats=True``, the share of ``norm**2``
      carried by the largest leaf or layer (float32); else ``None``.
    top_leaf: with ``leaf_stats=True``, that leaf's or layer's index in the
      flattened ``leaf_norms``; else ``None``.
  """

  norm: jax.Array  # float scalar
  clipped_norm: jax.Array  # float scalar
  clip_fraction: jax.Array  # float scalar
  threshold: jax.Array  # float scalar
  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  gamma: jax.Array  # float, (n_leaves,)
  consecutive_clips: jax.Array  # int32, (n_leaves,)
  restarts: jax.Array  # int32 scalar
  step: jax.Array  # int32 scalar
  leaf_norms: Any = None  # LeafNorms: float32 (entries,), static structure
  top_leaf_share: Optional[jax.Array] = None  # float32 scalar in [0, 1]
  top_leaf: Optional[jax.Array] = None  # int32 scalar


# --- Shared pieces ---------------------------------------------------------


def _keep_if(finite: jax.Array, new, old):
  """``new`` where the step's norm was finite, else ``old`` (leaf by leaf)."""
  return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def _nan_if_nan(limit: Any, value: Any) -> Any:
  """``limit``, or NaN where the hyperparameter ``value`` (a schedule's or
  an injected one) is NaN: the non-finite policy, not a silent pass.
  """
  if not isinstance(value, jax.Array):
    return limit
  return jnp.where(jnp.isnan(value), jnp.nan, limit)


# --- ZClip -------------------------------------------------------------------


@_compiled.compiled_once
def clip_zscore(
  *,
  alpha: Scalar = 0.97,
  spike_z: ScalarOrSchedule = 2.5,
  max_norm: Optional[ScalarOrSchedule] = None,
  eps: Scalar = 1e-6,
  warmup_steps: Scalar = 25,
  mode: Literal["zscore", "percentile"] = "zscore",
  clip_option: Literal["adaptive_scaling", "mean"] = "adaptive_scaling",
  clip_factor: Scalar = 1.0,
  skip_update_on_spike: bool = False,
  scope: Scope = "global",
  patience: Optional[Scalar] = None,
  growth: Scalar = 2.0,
  axis_name: AxisName = None,
  sharded: Any = True,
  leaf_stats: bool = False,
  layer_axis: _telemetry.LayerAxis = None,
  z_thresh: Optional[ScalarOrSchedule] = None,
) -> optax.GradientTransformation:
  r"""ZClip: clips gradient-norm spikes detected by the z-score of an EMA.

  Warm-up: the first ``warmup_steps`` steps only gather the gradient norm
  (and clip to ``max_norm`` if given); their mean and (population) variance
  start the statistics. Afterwards, with ``m`` and ``s`` the EMA mean and
  standard deviation of the norm and ``g`` this step's norm:

  * ``mode="zscore"``: ``z = (g - m) / (s + eps)``. When ``z > spike_z`` the
    step is a spike and its norm is clipped to
    ``(m + spike_z * s / (z / spike_z)) * clip_factor``
    (``clip_option="adaptive_scaling"``: the larger the outlier, the harder
    it is clipped) or to ``m`` (``clip_option="mean"``).
  * ``mode="percentile"``: a norm above ``m + spike_z * s`` is a spike,
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
  * the warm-up's mean and variance are accumulated step by step (Welford)
    in the statistics dtype instead of from a list of Python floats: the
    same values up to rounding;
  * a NaN or infinite norm leaves the statistics untouched (in the
    reference it enters them: a NaN would disable clipping for good);
  * statistics that have seen only zero norms (mean and variance exactly
    0: a norm of 0 has no scale) take the first nonzero norm as a new level:
    it is clipped only by ``max_norm``, the mean moves to it and the
    variance takes in the jump, ``v <- alpha v + (1 - alpha) g^2``. In the
    reference every later step is clipped to 0 (no update for ever);
  * ``max_norm`` defaults to ``None``: no fixed cap (the reference's
    constructor defaults ``max_grad_norm`` to 1.0, which caps the norm at
    every step, warm-up included; pass ``max_norm=1.0`` for that), and
    ``warmup_steps`` must be at least 1 (the reference treats 0 as 1);
  * ``scope="leaf"`` (not in the reference) keeps statistics per leaf and
    clips each leaf on its own;
  * ``axis_name`` computes the norm across devices with a collective, like
    the reference's FSDP branch, and keeps the decision in the state's dtype.

  As in the reference, a lasting rise of the norm can be clipped for a long
  time or for ever: after a warm-up of equal norms (variance 0) every later
  step above the mean is clipped to it, and a large jump is clipped to near
  the old mean while the variance decays. ``patience`` (off by default, as
  the reference has no such rule) bounds it without ever letting a spike
  through at its own size: once a unit has been a spike on ``patience``
  steps in a row, each further spike first multiplies the unit's mean by
  ``growth``; the step is then judged and clipped against the raised mean
  (and the same variance), and the EMAs continue from it. The level it is
  judged by so grows geometrically, by at most ``growth`` a step, until the
  new level of the norm is no spike; ``restarts`` counts the raised steps
  and the restarts after zeros.

  Args:
    alpha: EMA smoothing of the norm's mean and variance, in (0, 1).
    spike_z: the z-score above which a norm is a spike (> 0; the name
      :func:`guard` uses, ZClip's ``z_thresh``): a number or a schedule
      (``step -> value``; values below 0 count as 0, where every norm above
      the mean is a spike clipped to the mean), evaluated at this clipper's
      step count (0 on the first update).
    max_norm: a fixed cap on the norm (on each leaf's with
      ``scope="leaf"``), applied during warm-up too: a number or a
      schedule, likewise (one that reaches 0 gives zero updates); ``None``
      for none.
    eps: added to the standard deviation in the z-score (>= 0).
    warmup_steps: steps whose norms start the statistics (>= 1).
    mode: ``"zscore"`` or ``"percentile"`` (see above).
    clip_option: ``"adaptive_scaling"`` or ``"mean"``, for ``mode="zscore"``.
    clip_factor: multiplies the adaptive-scaling limit (> 0); values below 1
      clip harder.
    skip_update_on_spike: leave the statistics unchanged on a spike step.
    scope: ``"global"`` (one norm for the whole tree) or ``"leaf"`` (each
      leaf its own norm, statistics and clipping).
    patience: ``None`` (the default: the reference's rule), or the spikes
      in a row (>= 1) a unit is clipped before its mean is raised by
      ``growth`` a step (see above).
    growth: with ``patience``, the factor (> 1) by which a held-back unit's
      mean is raised on each further spike; unused without ``patience``.
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split (as for :func:`clip_global`).
    sharded: which leaves are split over ``axis_name``: a bool, a pytree
      prefix of bools or a callable ``(path, leaf) -> bool``.
    leaf_stats: also keep each leaf's pre-clip L2 norm in the state
      (``leaf_norms``; :func:`optaxclip.stats` shows them as
      ``clip_zscore/leaf_norm/<path>``), with ``top_leaf_share`` and
      ``top_leaf``; from the same single pass over the gradients. A leaf
      norm beyond float32's range reads +inf.
    layer_axis: with ``leaf_stats``, the stacking axis of stacked layers
      (``nn.scan``): such a leaf reports one norm per layer. An int, a
      pytree prefix of ints/``None`` or a callable ``(path, leaf) -> int |
      None`` (as ``sharded``); each device must hold every layer (with
      ``axis_name``, a leaf split across devices needs a PartitionSpec in
      ``sharded`` that leaves its layer axis unsplit; else an error).
    z_thresh: the deprecated spelling of ``spike_z`` (ZClip's name): taken,
      with a DeprecationWarning, when given.

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
  if z_thresh is not None:
    warnings.warn(
      "clip_zscore: z_thresh is deprecated; write spike_z (the name guard "
      "uses for the same z-score).",
      DeprecationWarning,
      stacklevel=2,
    )
    spike_z = z_thresh
  _checks.check_probability("alpha", alpha, who=who)
  _schedules.check(who, "spike_z", spike_z, low=0.0, low_open=True)
  _schedules.check(
    who, "max_norm", max_norm, low=0.0, allow_inf=True, allow_none=True
  )
  _checks.check_number("eps", eps, who=who, low=0.0)
  _checks.check_steps(who, "warmup_steps", warmup_steps)
  _checks.check_choice(who, "mode", mode, ("zscore", "percentile"))
  _checks.check_choice(
    who, "clip_option", clip_option, ("adaptive_scaling", "mean")
  )
  _checks.check_number(
    "clip_factor", clip_factor, who=who, low=0.0, low_open=True
  )
  skip_update_on_spike = _checks.check_bool(
    who, "skip_update_on_spike", skip_update_on_spike
  )
  scope = _checks.check_choice(who, "scope", scope, SCOPES)
  if patience is not None:
    _checks.check_steps(who, "patience", patience)
  _checks.check_number("growth", growth, who=who, low=1.0, low_open=True)
  axis_name = _checks.check_sharding(who, axis_name, sharded)
  leaf_stats = _telemetry.check(who, leaf_stats, layer_axis)

  def init_fn(params):
    shape = _measure.unit_shape(params, scope)
    dtype = _measure.stats_dtype(params, who)
    return ClipZscoreState(
      *(jnp.zeros((), dtype) for _ in ADAPTIVE_FIELDS),
      count=jnp.zeros((), jnp.int32),
      mean=jnp.zeros(shape, dtype),
      var=jnp.zeros(shape, dtype),
      consecutive_spikes=jnp.zeros(shape, jnp.int32),
      restarts=jnp.zeros((), jnp.int32),
      step=jnp.zeros((), jnp.int32),
      **_telemetry.init_fields(who, params, leaf_stats, layer_axis),
    )

  def spike_rule(g, mean, var, z_thresh):
    """Returns (spike?, value to clip to on a spike, spike boundary)."""
    std = _moments.spread(mean, var)
    if mode == "percentile":
      boundary = mean + z_thresh * std
      return g > boundary, boundary, boundary
    z = (g - mean) / (std + eps)
    spike = z > z_thresh
    if clip_option == "mean":
      value = mean
    else:
      eta = jnp.where(spike, z, z_thresh) / z_thresh
      # std * (z_thresh / eta), not z_thresh * std / eta: below the norm
      # whenever the norm is finite, where z_thresh * std may overflow (a
      # spread near the dtype's largest value: inf / inf = NaN).
      value = (mean + std * (z_thresh / eta)) * clip_factor
    return spike, value, mean + z_thresh * (std + eps)

  def update_fn(updates, state, params=None):
    del params
    measured = _measure.Measured(
      updates,
      scope,
      who,
      state.mean.dtype,
      state.mean.shape,
      axis_name=axis_name,
      sharded=sharded,
      leaf_stats=leaf_stats,
      layer_axis=layer_axis,
      state_norms=state.leaf_norms if leaf_stats else None,
    )
    g, finite = measured.stat_norm, measured.finite
    mean = state.mean.astype(measured.dtype)
    var = state.var.astype(measured.dtype)
    warming = state.count < warmup_steps
    z_now = _schedules.value_at(spike_z, state.step, who=who, name="spike_z")
    cap = (
      math.inf
      if max_norm is None
      else _schedules.value_at(max_norm, state.step, who=who, name="max_norm")
    )

    # After warm-up: detect a spike against the statistics so far.
    spike, value, boundary = spike_rule(g, mean, var, z_now)
    spike = spike & ~warming & measured.unit_finite
    no_scale = (mean == 0) & (var == 0)  # only zero norms so far
    restart = spike & no_scale
    spike = spike & ~restart
    held = spike  # a spike against the statistics as they were
    raised = jnp.zeros_like(spike)
    if patience is not None:
      # Held back `patience` spikes in a row: the mean first rises by
      # `growth` (kept finite), the variance kept at the new mean's scale.
      raised = spike & (state.consecutive_spikes >= patience)
      big = jnp.finfo(mean.dtype).max
      up = jnp.where(raised, jnp.minimum(growth * mean, big), mean)
      var = _moments.rescaled(
        var, _moments.spread_exponent(mean), _moments.spread_exponent(up)
      )
      mean = up
      spike_up, value_up, boundary_up = spike_rule(g, mean, var, z_now)
      spike = jnp.where(raised, spike_up, spike)
      value = jnp.where(raised, value_up, value)
      boundary = jnp.where(raised, boundary_up, boundary)
    count, new_mean, new_var = _moments.running_moments(
      state.count,
      mean,
      var,
      jnp.where(spike, value, g),
      alpha=alpha,
      warmup_steps=warmup_steps,
      finite=finite,
      take=~(spike & skip_update_on_spike),
      restart=restart,
    )

    limit = jnp.minimum(jnp.where(spike, value, jnp.inf), cap)
    new_updates, stats, (restarted,) = measured.clip(
      _nan_if_nan(limit, z_now), [restart | raised]
    )
    threshold = jnp.minimum(jnp.where(warming, jnp.inf, boundary), cap)
    stats = stats[:3] + (_measure.total(threshold, state.mean.dtype),)
    return new_updates, ClipZscoreState(
      *stats,
      count=count,
      mean=new_mean.astype(state.mean.dtype),
      var=new_var.astype(state.var.dtype),
      consecutive_spikes=_moments.streak(
        state.consecutive_spikes, held, finite
      ),
      restarts=jnp.where(
        finite,
        _moments.add_count(state.restarts, restarted.astype(jnp.int32)),
        state.restarts,
      ),
      step=_schedules.next_count(state.step),
      **measured.telemetry._asdict(),
    )

  return optax.GradientTransformation(init_fn, _compiled.jit_update(update_fn))


# --- AutoClip ----------------------------------------------------------------


def _rows(x: jax.Array, ndim: int) -> jax.Array:
  """``x`` (one value per column) shaped to broadcast against rows."""
  return jnp.reshape(x, (1,) * (ndim - jnp.ndim(x)) + jnp.shape(x))


def replace_sorted(
  ordered: jax.Array, old: jax.Array, new: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """``ordered`` (sorted along axis 0, per column) with one copy of ``old``
  replaced by ``new``, still sorted: one removal and one insertion; and the
  number of finite entries of ``ordered`` per column (int32).

  ``old`` must be in each column (exactly). Costs one comparison pass and
  one shifting pass over the array, no sort.
  """
  rows = ordered.shape[0]
  i = jnp.arange(rows).reshape((rows,) + (1,) * (ordered.ndim - 1))
  old_r, new_r = _rows(old, ordered.ndim), _rows(new, ordered.ndim)
  # j: the removed position; k: where `new` goes once `old` is out.
  first, (below, finite) = _first_and_count(
    ordered == old_r, [ordered < new_r, ordered < jnp.inf]
  )
  j = _rows(first, ordered.ndim)
  k = _rows(below - (old < new).astype(jnp.int32), ordered.ndim)
  pad = jnp.full((1,) + ordered.shape[1:], jnp.inf, ordered.dtype)
  after = jnp.concatenate([ordered[1:], pad])  # ordered[i + 1]
  before = jnp.concatenate([pad, ordered[:-1]])  # ordered[i - 1]
  removed_i = jnp.where(i < j, ordered, after)  # without old, at i
  removed_prev = jnp.where(i - 1 < j, before, ordered)  # ... at i - 1
  replaced = jnp.where(i < k, removed_i, jnp.where(i == k, new_r, removed_prev))
  return replaced, finite


def _first_and_count(
  hit: jax.Array, counted: Sequence[jax.Array]
) -> tuple[jax.Array, list[jax.Array]]:
  """``argmax(hit, axis=0)`` and ``[sum(c, axis=0) for c in counted]``
  (int32), in one pass.

  One reduction with several outputs: XLA:CPU compiles it as one kernel with
  the comparisons, where it splits each plain sum along a long axis into two
  reductions and a kernel for its operand (compile time on many leaves).
  """
  index = jax.lax.broadcasted_iota(jnp.int32, hit.shape, 0)

  def merge(u, v):
    (h1, i1, *c1), (h2, i2, *c2) = u, v
    # The first True, as argmax: a True beats a False, then the lower index.
    first = (h1 & ~h2) | ((h1 == h2) & (i1 < i2))
    sums = [a + b for a, b in zip(c1, c2)]
    return (h1 | h2, jnp.where(first, i1, i2), *sums)

  zero = jnp.zeros((), jnp.int32)
  _, where, *counts = jax.lax.reduce(
    (hit, index, *[c.astype(jnp.int32) for c in counted]),
    (jnp.asarray(False), jnp.asarray(_INT32_MAX, jnp.int32))
    + (zero,) * len(counted),
    merge,
    (0,),
  )
  return where, counts


def percentile_sorted(ordered: jax.Array, n: jax.Array, q: Any) -> jax.Array:
  """``numpy.percentile(ordered[:n], q, axis=0)`` (method "linear") of
  values sorted along axis 0; ``n`` (per column) may be traced. +inf where
  ``n == 0``.
  """
  dtype = ordered.dtype
  last = jnp.maximum(n - 1, 0)
  rank = jnp.asarray(q, dtype) / 100 * last.astype(dtype)
  lo = jnp.clip(jnp.floor(rank).astype(jnp.int32), 0, last)
  hi = jnp.minimum(lo + 1, last)
  frac = rank - lo.astype(dtype)
  pick = lambda idx: jnp.take_along_axis(
    ordered, _rows(idx, ordered.ndim), axis=0
  )[0]
  below, above = pick(lo), pick(hi)
  # numpy's lerp: from the nearer end, so that frac = 1 gives `above` exactly.
  value = jnp.where(
    frac < 0.5,
    below + (above - below) * frac,
    above - (above - below) * (1 - frac),
  )
  return jnp.where(n > 0, value, jnp.inf)


def percentile_linear(values: jax.Array, n: jax.Array, q: Any) -> jax.Array:
  """``numpy.percentile(values[:n], q, axis=0)`` (method "linear").

  ``values`` holds at least ``n`` valid rows first in any order (along axis
  0); the rest is ignored. ``n`` may be traced. Returns +inf when ``n == 0``.
  """
  rows = values.shape[0]
  valid = (jnp.arange(rows) < n).reshape((rows,) + (1,) * (values.ndim - 1))
  ordered = jnp.sort(jnp.where(valid, values, jnp.inf), axis=0)
  return percentile_sorted(ordered, jnp.broadcast_to(n, values.shape[1:]), q)


def _from_release_0_1(history, ordered, filled):
  """``history`` and ``ordered`` of a state saved by release 0.1.0, whose
  history held zeros in empty slots and zero norms, and had no ``ordered``
  (restored at its fresh value): in today's form.
  """
  del ordered
  rows = history.shape[0]
  slot = jnp.arange(rows).reshape((rows,) + (1,) * (history.ndim - 1))
  kept = jnp.where((slot < filled) & (history > 0), history, jnp.inf)
  return kept, jnp.sort(kept, axis=0)


def _as_is(history, ordered, filled):
  del filled
  return history, ordered


@_compiled.compiled_once
def clip_percentile(
  percentile: ScalarOrSchedule = 10.0,
  *,
  history: int = 1024,
  scope: Scope = "global",
  axis_name: AxisName = None,
  sharded: Any = True,
  leaf_stats: bool = False,
  layer_axis: _telemetry.LayerAxis = None,
) -> optax.GradientTransformation:
  """AutoClip: clips to a percentile of the recent gradient norms.

  Each step records the gradient's norm, then takes as threshold the
  ``percentile``-th percentile (as ``numpy.percentile`` computes it, linear
  interpolation) of the last ``history`` norms, this step's included, and
  scales the update by ``min(1, threshold / norm)``. At first only the norms
  seen so far count, so the first step is never clipped. The recent norms
  are also kept sorted, so that a step costs one insertion and one removal
  (a few passes over ``history`` values per unit, no sort).

  With the defaults (``percentile=10``, the paper's recommendation) this is
  the paper's rule, exactly, for the first ``history`` (1024) steps.
  Differences from the paper: AutoClip keeps every norm since the start of
  training; this keeps the last ``history`` (a ring buffer in the state), so
  memory is fixed and the threshold follows the norm as training moves on:
  a lasting new level passes within ``history`` steps whatever came before,
  while a norm passes unclipped only where it is at or below the
  ``percentile``-th percentile of the window it enters (with the defaults,
  every norm above the smallest tenth of the recent ones is clipped: a spike
  never passes at its own size).
  A NaN or infinite norm is not recorded (one would otherwise stay in the
  history), nor does a norm of exactly zero count (it has no scale: after a
  run of zero gradients the first nonzero one is not clipped to 0; it takes
  its slot, so old norms still leave the window), and ``scope="leaf"`` (not
  in the paper) keeps one history per leaf and clips each leaf on its own.

  Args:
    percentile: which percentile of the recent norms to clip to, in
      [0, 100]; the paper recommends 10. A number or a schedule (``step ->
      value``; values outside [0, 100] count as the nearer end), evaluated
      at this clipper's step count (0 on the first update).
    history: how many recent norms to keep (>= 1); the state holds twice
      this many values (per leaf with ``scope="leaf"``) in the statistics
      dtype.
    scope: ``"global"`` (one norm for the whole tree) or ``"leaf"``.
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split (as for :func:`clip_global`).
    sharded: which leaves are split over ``axis_name``: a bool, a pytree
      prefix of bools or a callable ``(path, leaf) -> bool``.
    leaf_stats: also keep each leaf's pre-clip L2 norm in the state
      (``leaf_norms``; :func:`optaxclip.stats` shows them as
      ``clip_percentile/leaf_norm/<path>``), with ``top_leaf_share`` and
      ``top_leaf``; from the same single pass over the gradients. A leaf
      norm beyond float32's range reads +inf.
    layer_axis: with ``leaf_stats``, the stacking axis of stacked layers
      (``nn.scan``): such a leaf reports one norm per layer. An int, a
      pytree prefix of ints/``None`` or a callable ``(path, leaf) -> int |
      None`` (as ``sharded``); each device must hold every layer (with
      ``axis_name``, a leaf split across devices needs a PartitionSpec in
      ``sharded`` that leaves its layer axis unsplit; else an error).

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
  _schedules.check(who, "percentile", percentile, low=0.0, high=100.0)
  history = _checks.check_count(who, "history", history)
  scope = _checks.check_choice(who, "scope", scope, SCOPES)
  axis_name = _checks.check_sharding(who, axis_name, sharded)
  leaf_stats = _telemetry.check(who, leaf_stats, layer_axis)

  def init_fn(params):
    shape = (history,) + _measure.unit_shape(params, scope)
    dtype = _measure.stats_dtype(params, who)
    return ClipPercentileState(
      *(jnp.zeros((), dtype) for _ in ADAPTIVE_FIELDS),
      filled=jnp.zeros((), jnp.int32),
      index=jnp.zeros((), jnp.int32),
      history=jnp.full(shape, jnp.inf, dtype),
      ordered=jnp.full(shape, jnp.inf, dtype),
      count=jnp.zeros((), jnp.int32),
      **_telemetry.init_fields(who, params, leaf_stats, layer_axis),
    )

  def update_fn(updates, state, params=None):
    del params
    dtype = state.history.dtype
    measured = _measure.Measured(
      updates,
      scope,
      who,
      dtype,
      state.history.shape[1:],
      axis_name=axis_name,
      sharded=sharded,
      leaf_stats=leaf_stats,
      layer_axis=layer_axis,
      state_norms=state.leaf_norms if leaf_stats else None,
    )
    finite = measured.finite
    # Recorded in the state's dtype (so that it is found again when it
    # leaves the window); a zero norm is recorded as +inf: it does not count.
    value = measured.stat_norm.astype(dtype)
    value = jnp.where(value > 0, value, jnp.inf)
    # A state from release 0.1.0, restored with `ordered` at its fresh value
    # (all +inf: the sorted first row tells, without a pass over the rest).
    legacy = (state.filled > 0) & jnp.all(state.ordered[0] == jnp.inf)
    past, past_order = jax.lax.cond(
      legacy,
      _from_release_0_1,
      _as_is,
      state.history,
      state.ordered,
      state.filled,
    )
    leaving = past[state.index]
    replaced, before = replace_sorted(past_order, leaving, value)
    recorded, ordered, filled, index = _keep_if(
      finite,
      (
        past.at[state.index].set(value),
        replaced,
        jnp.minimum(state.filled + 1, history).astype(jnp.int32),
        ((state.index + 1) % history).astype(jnp.int32),
      ),
      (state.history, state.ordered, state.filled, state.index),
    )
    # The recorded norms (finite entries of `ordered`) per column, counted
    # in replace_sorted's pass: one removed, one added on a finite step; a
    # 0.1.0 state keeps its fresh `ordered` (all +inf) on a non-finite one.
    inf = jnp.inf
    counted = jnp.where(
      finite,
      before
      - (leaving < inf).astype(jnp.int32)
      + (value < inf).astype(jnp.int32),
      jnp.where(legacy, 0, before),
    ).astype(jnp.int32)
    q = _schedules.value_at(
      percentile, state.count, who=who, name="percentile", high=100.0
    )
    threshold = _nan_if_nan(percentile_sorted(ordered, counted, q), q)
    new_updates, stats, _ = measured.clip(threshold.astype(measured.dtype))
    return new_updates, ClipPercentileState(
      *stats,
      filled=filled,
      index=index,
      history=recorded,
      ordered=ordered,
      count=_schedules.next_count(state.count),
      **measured.telemetry._asdict(),
    )

  return optax.GradientTransformation(init_fn, _compiled.jit_update(update_fn))


# --- AdaGC -------------------------------------------------------------------


@_compiled.compiled_once
def clip_relative(
  factor: ScalarOrSchedule = 1.05,
  *,
  beta: Scalar = 0.98,
  warmup_steps: Scalar = 100,
  warmup_max_norm: ScalarOrSchedule = 1.0,
  patience: Optional[Scalar] = None,
  growth: Scalar = 2.0,
  axis_name: AxisName = None,
  sharded: Any = True,
  leaf_stats: bool = False,
  layer_axis: _telemetry.LayerAxis = None,
) -> optax.GradientTransformation:
  r"""AdaGC: clips each leaf relative to an EMA of its own clipped norms.

  Each leaf ``i`` keeps a threshold ``gamma_i``, +inf at first. During the
  first ``warmup_steps`` steps the whole tree is clipped to global norm
  ``warmup_max_norm``, ``g_hat = g min(1, warmup_max_norm / ||g||)``, and
  ``gamma_i = min(gamma_i, ||g_hat_i||)``. Afterwards each leaf is clipped
  on its own, ``g_hat_i = g_i min(1, factor gamma_i / ||g_i||)``, and
  ``gamma_i = beta gamma_i + (1 - beta) ||g_hat_i||``.

  With ``patience=None`` (the default) this is the paper's rule (its
  Algorithm 1: ``factor`` is ``lambda_rel``, ``warmup_steps`` is
  ``T_start``, ``warmup_max_norm`` is ``lambda_abs``), step for step, with
  these differences:

  * AdaGC is written there as part of AdamW (and its divisions carry an
    epsilon); here it is a transformation to chain before any optimizer and
    the ratios are exact;
  * a NaN or infinite norm leaves ``gamma`` and the step count untouched;
  * a leaf whose gradient is exactly zero leaves its ``gamma_i`` as it was
    (a zero norm has no scale), and a leaf that had only zero gradients
    until the warm-up ended takes its first nonzero norm, unclipped, as
    ``gamma_i``. In the paper a zero gradient during warm-up pins
    ``gamma_i`` at 0 for ever, which is the normal state of LoRA's A matrix
    at step 0.

  In the paper's rule a leaf's threshold can rise by at most a factor
  ``1 + (1 - beta)(factor - 1)`` a step (1.001 with the defaults): a lasting
  rise of a leaf's norm is clipped for a long time (a tenfold one for about
  2300 steps), and a run whose norms exceed ``warmup_max_norm`` starts with
  every leaf clipped. ``patience`` (off by default) bounds this without
  ever letting a spike through at its own size: once a leaf has been above
  its limit ``factor * gamma_i`` on ``patience`` steps in a row, each
  further step on which it is above it first multiplies ``gamma_i`` by
  ``growth``, and then the paper's step runs on the raised value (the leaf
  is clipped to ``factor * growth * gamma_i`` and the EMA continues from
  ``growth * gamma_i``). The limit so grows geometrically from the clipped
  level, by at most ``growth`` a step: a lasting new level ``L`` gets through
  within about ``patience + log(L / (factor gamma_i)) / log(growth)`` steps,
  while a spike on such a step comes out at most ``growth`` times the limit
  the paper would have used. ``restarts`` counts these raised leaf-steps.

  Args:
    factor: the relative threshold (``lambda_rel`` in the paper; >= 1:
      below 1 every leaf's limit, and so its update, decays to zero). A
      number or a schedule (``step -> value``), evaluated at this
      clipper's step count (0 on the first update); a schedule's values
      are not held to >= 1 (below 0 they count as 0). A step clipped by a
      limit of 0 gives a zero update and leaves ``gamma`` as it was.
    beta: EMA smoothing of each ``gamma_i``, in (0, 1).
    warmup_steps: steps of global clipping that set the ``gamma_i`` (>= 1).
    warmup_max_norm: the global norm limit during warm-up (``lambda_abs``;
      >= 0): a number or a schedule, likewise.
    patience: ``None`` (the default: the paper's rule), or the steps in a
      row (>= 1) a leaf is held above its limit before its ``gamma_i`` is
      raised by ``growth`` a step (see above).
    growth: with ``patience``, the factor (> 1) by which a held-back leaf's
      ``gamma_i`` is raised on each further step above its limit; unused
      without ``patience``.
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split (as for :func:`clip_global`).
    sharded: which leaves are split over ``axis_name``: a bool, a pytree
      prefix of bools or a callable ``(path, leaf) -> bool``.
    leaf_stats: also keep each leaf's pre-clip L2 norm in the state
      (``leaf_norms``; :func:`optaxclip.stats` shows them as
      ``clip_relative/leaf_norm/<path>``), with ``top_leaf_share`` and
      ``top_leaf``; from the same single pass over the gradients. A leaf
      norm beyond float32's range reads +inf.
    layer_axis: with ``leaf_stats``, the stacking axis of stacked layers
      (``nn.scan``): such a leaf reports one norm per layer. An int, a
      pytree prefix of ints/``None`` or a callable ``(path, leaf) -> int |
      None`` (as ``sharded``); each device must hold every layer (with
      ``axis_name``, a leaf split across devices needs a PartitionSpec in
      ``sharded`` that leaves its layer axis unsplit; else an error).

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
  _schedules.check(
    who,
    "factor",
    factor,
    low=1.0,
    why="below 1 a leaf's limit is under its own recent clipped norm: every"
    " step is clipped and the limit keeps shrinking",
  )
  _checks.check_probability("beta", beta, who=who)
  _checks.check_steps(who, "warmup_steps", warmup_steps)
  _schedules.check(
    who, "warmup_max_norm", warmup_max_norm, low=0.0, allow_inf=True
  )
  if patience is not None:
    _checks.check_steps(who, "patience", patience)
  _checks.check_number("growth", growth, who=who, low=1.0, low_open=True)
  axis_name = _checks.check_sharding(who, axis_name, sharded)
  leaf_stats = _telemetry.check(who, leaf_stats, layer_axis)

  def init_fn(params):
    shape = _measure.unit_shape(params, "leaf")
    dtype = _measure.stats_dtype(params, who)
    return ClipRelativeState(
      *(jnp.zeros((), dtype) for _ in ADAPTIVE_FIELDS),
      count=jnp.zeros((), jnp.int32),
      gamma=jnp.full(shape, jnp.inf, dtype),
      consecutive_clips=jnp.zeros(shape, jnp.int32),
      restarts=jnp.zeros((), jnp.int32),
      step=jnp.zeros((), jnp.int32),
      **_telemetry.init_fields(who, params, leaf_stats, layer_axis),
    )

  def update_fn(updates, state, params=None):
    del params
    measured = _measure.Measured(
      updates,
      "leaf",
      who,
      state.gamma.dtype,
      state.gamma.shape,
      axis_name=axis_name,
      sharded=sharded,
      leaf_stats=leaf_stats,
      layer_axis=layer_axis,
      state_norms=state.leaf_norms if leaf_stats else None,
    )
    norms, finite = measured.stat_norm, measured.finite
    gamma = state.gamma.astype(measured.dtype)
    factor_now = _schedules.value_at(factor, state.step, who=who, name="factor")
    warmup_max_norm_now = _schedules.value_at(
      warmup_max_norm, state.step, who=who, name="warmup_max_norm"
    )
    warming = state.count < warmup_steps
    total = measured.total
    # Each leaf's share of the global limit, norm_i / total * limit: the
    # share (<= 1) from clip_scale, with no tiny factor to flush to zero
    # (limit / total is subnormal for a total above ~1e38 in float32), and
    # from the exact norms: a finite tree's total may exceed the dtype's
    # range (inf as a float, and inf / inf is NaN).
    share = _norms.clip_scale(
      _norms.combine_norms_scaled([measured.scaled]), measured.scaled
    ).as_float()
    warm_limit = jnp.where(
      total > warmup_max_norm_now, share * warmup_max_norm_now, jnp.inf
    )
    # A factor of 0 (a schedule's) is a limit of 0 also where gamma is
    # still +inf (0 * inf would be NaN).
    relative = jnp.where(factor_now == 0, 0.0, factor_now * gamma)
    over = ~warming & (norms > relative) & measured.unit_finite
    over = over & (factor_now > 0)  # a zero limit is not a new level
    if patience is None:
      raised = jnp.zeros_like(over)
      base = gamma
    else:
      # Held back `patience` steps in a row: gamma first rises by `growth`
      # (kept finite: a finite gamma is never mistaken for an unseen leaf).
      raised = over & (state.consecutive_clips >= patience)
      big = jnp.finfo(gamma.dtype).max
      base = jnp.where(raised, jnp.minimum(growth * gamma, big), gamma)
      relative = jnp.where(factor_now == 0, 0.0, factor_now * base)
    limit = jnp.where(warming, warm_limit, relative)
    new_updates, stats, (n_raised,) = measured.clip(limit, [raised])
    clipped = jnp.minimum(norms, limit)
    # A limit of 0 (a zero factor or warm-up limit) says nothing of the
    # norm's scale: gamma stays, as for a zero norm.
    scaled = (norms > 0) & (limit > 0)
    unseen = jnp.isinf(gamma)  # no nonzero norm yet
    new_gamma = jnp.where(
      warming,
      jnp.minimum(gamma, clipped),
      jnp.where(unseen, clipped, beta * base + (1 - beta) * clipped),
    )
    new_gamma = jnp.where(scaled, new_gamma, gamma)  # zero: no scale
    threshold = jnp.where(
      warming,
      jnp.asarray(warmup_max_norm_now, stats[3].dtype),
      _measure.total(relative, stats[3].dtype),
    )
    count, new_gamma, restarts = _keep_if(
      finite,
      (
        jnp.minimum(state.count + 1, warmup_steps).astype(jnp.int32),
        new_gamma.astype(state.gamma.dtype),
        _moments.add_count(state.restarts, n_raised.astype(jnp.int32)),
      ),
      (state.count, state.gamma, state.restarts),
    )
    return new_updates, ClipRelativeState(
      *stats[:3],
      _measure.as_scalar(threshold, state.gamma.dtype),
      count=count,
      gamma=new_gamma,
      consecutive_clips=_moments.streak(state.consecutive_clips, over, finite),
      restarts=restarts,
      step=_schedules.next_count(state.step),
      **measured.telemetry._asdict(),
    )

  return optax.GradientTransformation(init_fn, _compiled.jit_update(update_fn))
