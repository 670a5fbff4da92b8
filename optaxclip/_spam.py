"""Spike-aware Adam variants, SPAM and Stable-SPAM, and the gradient
transformations they are built from.

SPAM (Huang et al., ICLR 2025) clips each coordinate whose square exceeds
``threshold`` times Adam's second moment, resets both moments every
``reset_interval`` steps and warms the step size up again (a cosine) after
each reset. Stable-SPAM (Huang et al., 2025) clips elements against an EMA of
each tensor's largest magnitude, rescales each tensor to an EMA of its own
norm, and resets Adam's moments too. Both follow the authors' PyTorch classes
step for step; the docstrings say where and why they differ.

The parts that act on the gradient alone are public transformations, to chain
before any optax optimizer: :func:`clip_spikes` (SPAM's clipping, with its own
second moment), :func:`clip_spikes_adaptive` and :func:`scale_by_norm_ema`
(Stable-SPAM's clipping and norm scaling).
"""

from __future__ import annotations

from collections.abc import Callable
import math
from typing import Any, NamedTuple, Optional, Union, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxclip import _checks
from optaxclip import _compiled
from optaxclip import _functional
from optaxclip import _measure
from optaxclip import _moments
from optaxclip import _norms
from optaxclip import _packed
from optaxclip import _schedules
from optaxclip import _stats
from optaxclip._typing import AxisName
from optaxclip._typing import Scalar

# A hyperparameter given as a number or as an optax schedule (step -> value),
# evaluated at the transformation's own step count (0 on the first update).
ScalarOrSchedule = Union[Scalar, Callable[[jax.Array], Any]]

_F32 = jnp.float32


# --- shared pieces ----------------------------------------------------------


def _at(
  value: ScalarOrSchedule, count: jax.Array, dtype: Any = _F32
) -> jax.Array:
  """A number, or a schedule's value at ``count`` (unbounded: the
  references take learning rates and gammas as they come), in ``dtype``.
  """
  return jnp.asarray(_schedules.value_at(value, count, low=None), dtype)


def _threshold_at(threshold: Any, count: jax.Array, who: str) -> jax.Array:
  """SPAM's ``threshold`` at step ``count``, as float32 (a schedule's
  negative values count as 0: clipping off that step).
  """
  value = _schedules.value_at(threshold, count, who=who, name="threshold")
  return jnp.asarray(value, _F32)


def _log(base: Any, dtype: Any = _F32) -> jax.Array:
  """``log(base)`` in ``dtype``, taken in float64 when ``base`` is a number:
  ``1 - 0.999`` is 1.3e-5 off in float32, ``log(0.999)`` is exact to 6e-8.
  """
  if _checks.is_concrete_number(base):
    b = float(base)
    return jnp.asarray(-np.inf if b == 0.0 else math.log(b), dtype)
  return jnp.log(jnp.asarray(base).astype(dtype))


def _one_minus_power(base: Any, n: jax.Array, dtype: Any = _F32) -> jax.Array:
  """``1 - base**n`` (bias correction) for ``n >= 1``, accurate near 1;
  in ``dtype``.
  """
  return -jnp.expm1(n.astype(dtype) * _log(base, dtype))


def _over(v: Any, c: Any) -> jax.Array:
  """``v / c`` for a vector ``v`` and a scalar ``c``, each entry correctly
  rounded. XLA compiles a division by a broadcast scalar as a product with
  its reciprocal, up to an ulp off, so that a leaf's per-leaf statistic
  would change with the number of leaves beside it in the vector; the
  divisor, hidden behind an ``optimization_barrier``, is divided by entry by
  entry.
  """
  return v / jax.lax.optimization_barrier(jnp.broadcast_to(c, v.shape))


def _check_learning_rate(who: str, learning_rate: Any) -> None:
  if not callable(learning_rate):
    _checks.check_number("learning_rate", learning_rate, who=who, low=0.0)


def _check_decay(who: str, name: str, value: Any) -> None:
  _checks.check_number(name, value, who=who, low=0.0, high=1.0, high_open=True)


def _check_interval(who: str, value: Any, *, allow_none: bool) -> Any:
  """A reset interval: a positive whole number, possibly traced (or None / 0
  for no resets, if allowed).
  """
  if allow_none and (value is None or (isinstance(value, int) and value == 0)):
    return None
  if value is None:
    raise TypeError(f"{who}: reset_interval must be a whole number; got None.")
  _checks.check_steps(who, "reset_interval", value)
  return value


def _split_flags(
  updates: Any, sharded: Any, who: str, axis_name: AxisName
) -> Optional[list[tuple[str, ...]]]:
  """Per leaf, the axes of ``axis_name`` it is split over (None without
  ``axis_name``).
  """
  if not axis_name:
    return None
  return _functional.sharded_flags(updates, sharded, who, axis_name)


def _global_size(leaves: list[jax.Array], flags) -> int:
  """The number of elements of the whole (unsplit) leaves."""
  if flags is None:
    return sum(x.size for x in leaves)
  return sum(x.size * _norms.axis_size(f) for x, f in zip(leaves, flags))


def _float_leaves(updates: Any, who: str) -> tuple[list[jax.Array], Any]:
  leaves, treedef = jax.tree.flatten(updates)
  _checks.check_float_leaves(updates, f"{who}: updates", real=True)
  return [jnp.asarray(x) for x in leaves], treedef


def _per_leaf_zeros(params: Any, who: str) -> jax.Array:
  """A vector of zeros, one entry per leaf of ``params``, in the statistics
  dtype (float32; float64 when a leaf is float64).
  """
  _checks.check_float_leaves(params, f"{who}: params", real=True)
  dtype = _measure.stats_dtype(params, who)
  return jnp.zeros((len(jax.tree.leaves(params)),), dtype)


def _per_leaf(v: jax.Array, leaves: list, who: str, name: str) -> jax.Array:
  """State ``name``'s vector ``v`` (one entry per leaf), checked against the
  updates' ``leaves``, in its dtype (fixed at ``init``).
  """
  shape = getattr(v, "shape", None)
  if shape != (len(leaves),):
    got = f"shape {shape}" if shape is not None else f"a {type(v).__name__}"
    raise ValueError(
      f"{who}: state.{name} must hold one entry per leaf of the updates "
      f"({len(leaves)}); got {got}. Call init with parameters of the same "
      "structure as the updates."
    )
  return jnp.asarray(v)


def _share(count: jax.Array, leaves: list[jax.Array], flags=None) -> jax.Array:
  size = _global_size(leaves, flags)
  return (count / max(size, 1)).astype(_F32)


def _ema_step_count(t: jax.Array, interval: Any) -> jax.Array:
  """The step count of Stable-SPAM's reference for the EMAs of its clipping
  and norm scaling: ``t``, restarting with 2 on the step after each reset
  (the reference keeps one counter per tensor, set to 1 at a reset).
  """
  if interval is None:
    return t
  return jnp.where(t <= interval, t, (t - 1) % interval + 2)


def _step_with_resets(
  leaves: list[jax.Array],
  moments: list[list[jax.Array]],
  reset: jax.Array,
  step: Callable[..., tuple[jax.Array, ...]],
  spikes: Optional[tuple[Any, jax.Array]] = None,
) -> tuple[list[list[jax.Array]], jax.Array]:
  """Per leaf ``g`` with its moments (one list of leaves per moment, the
  second moment ``nu`` last): the moments are zeroed where ``reset``; with
  ``spikes = (threshold, clip_on)``, ``g`` is clipped against the zeroed
  ``nu`` (:func:`_clip_to_moment`, counted); then ``step(g, *moments)``
  gives the leaf's update and new moments, element-wise.

  Small leaves are stepped in packed vectors (:class:`_packed.Packing`: a
  few instructions per leaf, not a few dozen, for XLA to compile on a
  many-leaf tree); the others one by one, their spikes counted stacked
  (:func:`_spike_counter`) and clipped before the moments' update
  (:func:`_clipped_before_update`).

  Returns:
    ``([updates, *moments], clipped)``: per-leaf lists, and the number of
    coordinates clipped (float32, 0 without ``spikes``).
  """
  slots = [leaves, *moments]
  out = [list(slot) for slot in slots]
  clipped = jnp.zeros((), _F32)

  def zeroed(v):
    return _norms.select(reset, jax.lax.full_like(v, 0), v)

  packing = _packed.Packing(slots)
  stepped = [[] for _ in slots]
  for g, *m in zip(*(packing.pack(slot) for slot in slots)):
    m = [zeroed(v) for v in m]
    if spikes is not None:
      g, counted = _clip_and_count(g, m[-1], *spikes)
      clipped = clipped + counted
    # Computed once into memory (one kernel) for the leaves' gathers.
    new = _norms.materialized_rows(step(g, *m))
    for parts, v in zip(stepped, new):
      parts.append(v)
  for slot, parts, tree in zip(slots, stepped, out):
    for i, v in packing.unpack(parts, slot).items():
      tree[i] = v
  own = packing.own
  own_m = [[zeroed(slot[i]) for slot in moments] for i in own]
  stacked, alone = clipped, set()
  if spikes is not None:
    stacked, alone = _spike_counter(
      [leaves[i] for i in own], [moments[-1][i] for i in own], reset, *spikes
    )
    clipped = clipped + stacked
  for k, i in enumerate(own):
    g, m = leaves[i], own_m[k]
    if spikes is not None:
      counted = stacked
      if k in alone:
        counted = _norms.count(_spikes(g, m[-1], *spikes)[0])
        clipped = clipped + counted
      g, m[-1] = _clipped_before_update(g, m[-1], counted, spikes)
    for tree, v in zip(out, step(g, *m)):
      tree[i] = v
  return out, clipped


def _adam_with_resets(
  leaves: list[jax.Array],
  treedef: Any,
  state: Any,
  reset: jax.Array,
  b1: Any,
  b2: Any,
  direction: Callable[[jax.Array, jax.Array, Any], jax.Array],
  spikes: Optional[tuple[Any, jax.Array]] = None,
) -> tuple[Any, Any, Any, jax.Array]:
  """One step of Adam with moment resets, the part SPAM and Stable-SPAM share.

  Per leaf ``g``: the moments ``state.mu``, ``state.nu`` are zeroed where
  ``reset``; with ``spikes = (threshold, clip_on)``, ``g`` is clipped by
  :func:`_clip_to_moment` against the zeroed second moment (SPAM's spike
  clipping, counted by :func:`_spike_counter`); the moments take
  in ``g``, ``m <- b1 m + (1 - b1) g`` and ``v <- b2 v + (1 - b2) g^2``
  (a traced ``b1``, stable_spam's scaled one, is cast to the moments'
  dtype); ``direction(m, v, dtype)`` is the leaf's update, cast to ``g``'s
  dtype (``dtype``: the stored moments').

  Returns:
    ``(updates, mu, nu, clipped)``: trees like ``treedef``'s, and the number
    of coordinates clipped (0 without ``spikes``).
  """
  mu_leaves = treedef.flatten_up_to(state.mu)
  nu_leaves = treedef.flatten_up_to(state.nu)

  def moments(g, mu, nu):
    dtype = mu.dtype
    if isinstance(b1, jax.Array):
      mu = b1.astype(dtype) * mu + (1 - b1).astype(dtype) * g
    else:
      mu = b1 * mu + (1 - b1) * g
    nu = _second_moment(b2, nu, g)
    return direction(mu, nu, dtype).astype(g.dtype), mu, nu

  (out, mus, nus), clipped = _step_with_resets(
    leaves, [mu_leaves, nu_leaves], reset, moments, spikes
  )
  return (
    treedef.unflatten(out),
    treedef.unflatten(mus),
    treedef.unflatten(nus),
    clipped,
  )


# --- SPAM -------------------------------------------------------------------


def _spam_clock(
  count: jax.Array, reset_interval: Any, grad_accu_steps: Any, threshold: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """``(t, reset, clip_on, resets)`` of SPAM's step ``t = count + 1``.

  The moments are reset when ``t`` is a multiple of ``reset_interval``;
  clipping is on once ``grad_accu_steps`` steps have filled the second moment
  since the last reset (``t mod reset_interval >= grad_accu_steps``), and
  never with ``threshold == 0``.
  """
  t = count + 1
  since = t % reset_interval
  reset = since == 0
  clip_on = (since >= grad_accu_steps) & (jnp.asarray(threshold) != 0)
  return t, reset, clip_on, (t // reset_interval).astype(jnp.int32)


def _spam_warmup(t: jax.Array, reset_interval: Any, warmup_steps: Any):
  """SPAM's step-size factor: ``0.01 + 0.99 sin^2(pi c / (2 (W + 1)))`` for
  the ``c``-th step (from 0) after a reset while ``c < W`` (``warmup_steps``),
  else 1 -- the reference's ``1 - CosineDecay(0.99, W)``, written without
  its cancellation. The reference restarts its warm-up after a step, so a
  reset on the very first step (``reset_interval == 1``) has none.
  """
  since = t % reset_interval
  restarted = (t >= reset_interval) & (t >= 2)
  c = jnp.where(restarted, since, warmup_steps)
  half_angle = (math.pi / 2) * c.astype(_F32) / (jnp.asarray(warmup_steps) + 1)
  warm = 0.01 + 0.99 * jnp.square(jnp.sin(half_angle))
  return jnp.where(c < warmup_steps, warm, 1.0).astype(_F32)


def _second_moment(b2: Any, nu: jax.Array, g: jax.Array) -> jax.Array:
  """``b2 nu + (1 - b2) g^2`` with the new term capped at ``(1 - b2)`` times
  the dtype's largest value: a finite element whose square overflows
  (``|g|`` above about 8000 in float16 with ``b2 = 0.999``, about 5.8e20 in
  float32) would leave the moment inf for good (every later
  ``g^2 > threshold nu`` false: clipping switched off until a reset), where
  the capped one decays. The new term is capped, not the sum: capping the
  sum makes XLA copy the donated moment. The EMA keeps the uncapped form's
  operations in their order, so that packed and per-leaf steps round
  float16 elements alike.
  """
  # (1 - b2) g g, in that order (the uncapped EMA's roundings), capped.
  new = (1 - b2) * g * g
  return b2 * nu + jnp.minimum(new, (1 - b2) * jnp.finfo(new.dtype).max)


def _spikes(
  g: jax.Array, nu: jax.Array, threshold: Any, clip_on: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """``(where g^2 > threshold nu, threshold nu)``, in their dtypes; every
  coordinate where ``threshold`` is NaN (a schedule's NaN gives a NaN
  update, as for the other clippers' thresholds). A coordinate whose ``nu``
  is 0 is not judged (a deviation from SPAM's reference, which clips it to
  0): its moment has seen nothing since the last reset, or only squares
  that underflowed (float16 elements below about 5.5e-3 with ``b2 =
  0.999``), and clipping it to 0 would zero such elements for good.
  """
  threshold = jnp.asarray(threshold)
  limit = threshold.astype(nu.dtype) * nu
  spike = clip_on & (g * g > limit) & (nu > 0)
  return spike | jnp.isnan(threshold), limit


def _clip_to_moment(
  g: jax.Array, nu: jax.Array, threshold: Any, clip_on: jax.Array
) -> jax.Array:
  """SPAM's spike clipping: each coordinate with ``g^2 > threshold nu`` is
  set to ``sign(g) sqrt(threshold nu)``; an infinite one to NaN (the
  non-finite policy: the reference turns it into the finite limit).
  """
  return _clip_and_count(g, nu, threshold, clip_on)[0]


def _clip_and_count(
  g: jax.Array, nu: jax.Array, threshold: Any, clip_on: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """:func:`_clip_to_moment` and the number of coordinates it clips."""
  spike, limit = _spikes(g, nu, threshold, clip_on)
  # g - g: 0 where g is finite, NaN where it is infinite.
  clipped = jnp.sign(g) * jnp.sqrt(limit) + (g - g)
  return jnp.where(spike, clipped, g), _norms.count(spike)


def _clipped_before_update(
  g: jax.Array, nu: jax.Array, counted: jax.Array, spikes: tuple[Any, Any]
) -> tuple[jax.Array, jax.Array]:
  """``g`` clipped against ``nu`` (:func:`_clip_to_moment`), computed once
  into memory, and ``nu`` plus ``0 * counted`` (the same values): the
  moment's update then reads the clip and the count of its spikes
  (``counted``), so that XLA orders every read of the old moment before
  its in-place update. Otherwise, as XLA:CPU fuses the clip into each of
  its consumers (the moment's update and the optimizer's), each would read
  the old moment again, and XLA would copy every moment first to keep it:
  a kernel, a read and a write per leaf at every step
  (``docs/performance.md``).
  """
  g = _norms.materialized(_clip_to_moment(g, nu, *spikes))
  return g, nu + (0 * counted).astype(nu.dtype)


def _spike_counter(
  leaves: list[jax.Array],
  nus: list[jax.Array],
  reset: jax.Array,
  threshold: Any,
  clip_on: jax.Array,
) -> tuple[jax.Array, set[int]]:
  """The number of coordinates :func:`_clip_to_moment` clips in the small
  leaves stacked together (float32), against the second moments ``nus``
  zeroed where ``reset``, and the leaves left for the caller to count.

  Small leaves of one size and the same (gradient, moment) dtypes are
  counted in their stacked parts, in those dtypes (exactly the coordinates
  clipped): a few reductions, not one per leaf (compile time on many-leaf
  trees). The moments are stacked as stored and zeroed in their parts, so
  that each leaf's zeroed moment stays fused into its own update. A leaf of
  its own part is counted by the caller next to its clip, which computes the
  same test: a pass of its own here would read a large leaf once more.
  """
  n = len(leaves)
  # Inside shard_map, leaves that vary across devices apart from the others.
  keys = [
    (np.dtype(g.dtype), np.dtype(nu.dtype), _norms.varying(g, nu))
    for g, nu in zip(leaves, nus)
  ]
  layout = _norms.UnitLayout(leaves, [None] * n, keys)
  own = {what for kind, what, _ in layout.parts if kind == "leaf"}
  total = jnp.zeros((), _F32)
  stacked = [j for j, (kind, _, _) in enumerate(layout.parts) if kind != "leaf"]
  if stacked:
    g_parts, nu_parts = layout.pack(leaves), layout.pack(nus)
    for j in stacked:
      g_dtype, nu_dtype = layout.parts[j][2]
      nu = jnp.where(
        reset, jnp.zeros((), nu_dtype), nu_parts[j].astype(nu_dtype)
      )
      spike, _ = _spikes(g_parts[j].astype(g_dtype), nu, threshold, clip_on)
      total = total + _norms.count(spike)
  return total, own


def _check_spam_clip(who, threshold, b2, reset_interval, grad_accu_steps):
  _schedules.check(who, "threshold", threshold, low=0.0)
  _check_decay(who, "b2", b2)
  reset_interval = _check_interval(who, reset_interval, allow_none=False)
  _checks.check_steps(who, "grad_accu_steps", grad_accu_steps, low=0)
  return reset_interval


@_stats.register(
  "clip_spikes", ("clipped", "clip_fraction", "resets", "threshold")
)
class ClipSpikesState(NamedTuple):
  """State of :func:`clip_spikes`.

  Attributes:
    count: updates so far (int32).
    nu: the EMA of the squared clipped gradient, shaped like the updates.
    clipped: coordinates clipped this step (float32: exact up to 2**24).
    clip_fraction: the share of coordinates clipped this step.
    resets: resets of ``nu`` so far (int32).
    threshold: this step's ``threshold`` (a schedule's value at ``count``).
  """

  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  nu: optax.Updates
  clipped: jax.Array  # float32 scalar
  clip_fraction: jax.Array  # float32 scalar in [0, 1]
  resets: jax.Array  # int32 scalar
  threshold: jax.Array  # float32 scalar


@_compiled.compiled_once
def clip_spikes(
  threshold: ScalarOrSchedule = 5000.0,
  *,
  b2: Scalar = 0.999,
  reset_interval: Scalar = 500,
  grad_accu_steps: Scalar = 20,
) -> optax.GradientTransformation:
  r"""SPAM's spike-aware clipping, to chain before any optimizer.

  Each coordinate whose square exceeds ``threshold`` times its second moment
  ``nu`` (before this step) is clipped to ``sign(g) sqrt(threshold nu)``;
  then ``nu <- b2 nu + (1 - b2) g^2`` takes in the clipped gradient. ``nu``
  is reset to zero on every step ``t`` (from 1) that is a multiple of
  ``reset_interval``, and clipping waits ``grad_accu_steps`` steps after
  each reset (``t mod reset_interval >= grad_accu_steps``), while ``nu``
  fills again; as in the authors' code. One difference (the non-finite
  policy of every optaxclip clipper): an infinite coordinate that would be
  clipped comes out NaN and is counted, where the reference turns it into
  the finite ``sqrt(threshold nu)``, hiding it; a NaN stays NaN.

  It keeps its own second moment rather than reading an inner Adam's: the
  clip needs ``nu`` before this step's update, which an inner optimizer
  holds in a layout of its own (``ScaleByAdamState``, ``ScaleByLionState``,
  ...), updated after the clip, and only Adam-like optimizers have one; with
  its own copy it chains before any of them. The cost is one buffer the size
  of the parameters. Chained before ``optax.adam(b2=b2)``, its ``nu`` equals
  Adam's until the first reset (Adam's is not reset). :func:`spam`, which
  owns the Adam moments too, clips against them and holds ``nu`` once.

  A coordinate whose ``nu`` is 0 is not judged: its gradient stayed exactly
  zero since the last reset, or its squared term underflowed (float16
  elements below about 5.5e-3 with ``b2 = 0.999``). The reference clips it to
  zero until the next reset, which zeroes such float16 gradients at every
  step (a deviation, as the non-finite one above); a spike there passes
  unclipped. In float16, ``nu`` below float16's smallest normal number
  (6.1e-5) is a count of subnormal steps rather than an EMA (``b2 nu``
  rounds back to ``nu``), as Adam's own moment is there: keep the
  parameters, or the moments, in float32 for exact clip limits.

  Args:
    threshold: the spike threshold ``theta`` on ``g^2 / nu`` (>= 0; 0 turns
      clipping off): a number or a schedule (``step -> value``, evaluated
      at the update count, 0 on the first update); a schedule's NaN makes
      that step's update NaN.
    b2: the decay of ``nu``, in [0, 1).
    reset_interval: reset ``nu`` every this many steps (a positive int).
    grad_accu_steps: steps without clipping after each reset (>= 0).

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`ClipSpikesState`.

  References:
    Huang et al., `SPAM: Spike-Aware Adam with Momentum Reset for Stable LLM
    Training <https://arxiv.org/abs/2501.06842>`_, ICLR 2025; the authors'
    code, github.com/TianjinYellow/SPAM-Optimizer, ``galore_torch/SPAM.py``.

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> tx = optaxclip.clip_spikes(4.0, b2=0.5, grad_accu_steps=2)
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> _, state = tx.update({"w": jnp.array([1.0, 1.0])}, state)
    >>> g, state = tx.update({"w": jnp.array([1.0, 10.0])}, state)
    >>> g["w"], float(state.clipped)  # 10^2 > 4 * 0.5: clipped to sqrt(2)
    (Array([1.       , 1.4142135], dtype=float32), 1.0)
  """
  who = "clip_spikes"
  reset_interval = _check_spam_clip(
    who, threshold, b2, reset_interval, grad_accu_steps
  )

  def init_fn(params):
    _checks.check_float_leaves(params, f"{who}: params", real=True)
    return ClipSpikesState(
      count=jnp.zeros((), jnp.int32),
      nu=jax.tree.map(jnp.zeros_like, params),
      clipped=jnp.zeros((), _F32),
      clip_fraction=jnp.zeros((), _F32),
      resets=jnp.zeros((), jnp.int32),
      threshold=_threshold_at(threshold, jnp.zeros((), jnp.int32), who),
    )

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = _float_leaves(updates, who)
    threshold_now = _threshold_at(threshold, state.count, who)
    _, reset, clip_on, resets = _spam_clock(
      state.count, reset_interval, grad_accu_steps, threshold_now
    )
    nu_leaves = treedef.flatten_up_to(state.nu)

    def step(g, nu):
      return g, _second_moment(b2, nu, g)

    (out, nus), clipped = _step_with_resets(
      leaves, [nu_leaves], reset, step, (threshold_now, clip_on)
    )
    return treedef.unflatten(out), ClipSpikesState(
      count=optax.safe_int32_increment(state.count),
      nu=treedef.unflatten(nus),
      clipped=clipped,
      clip_fraction=_share(clipped, leaves),
      resets=resets,
      threshold=threshold_now,
    )

  return optax.GradientTransformation(init_fn, _compiled.jit_update(update_fn))


@_stats.register(
  "spam", ("clipped", "clip_fraction", "resets", "scale", "threshold")
)
class SpamState(NamedTuple):
  """State of :func:`spam`'s Adam part.

  Attributes:
    count: updates so far (int32).
    mu: the first moment of the clipped gradient.
    nu: the second moment of the clipped gradient.
    clipped: coordinates clipped this step (float32: exact up to 2**24).
    clip_fraction: the share of coordinates clipped this step.
    resets: moment resets so far (int32).
    scale: this step's warm-up factor of the step size, in [0.01, 1].
    threshold: this step's ``threshold`` (a schedule's value at ``count``).
  """

  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  mu: optax.Updates
  nu: optax.Updates
  clipped: jax.Array  # float32 scalar
  clip_fraction: jax.Array  # float32 scalar in [0, 1]
  resets: jax.Array  # int32 scalar
  scale: jax.Array  # float32 scalar
  threshold: jax.Array  # float32 scalar


def _scale_by_spam(
  b1, b2, eps, threshold, reset_interval, warmup_steps, grad_accu_steps
) -> optax.GradientTransformation:
  """SPAM's direction, before the learning rate: spike clipping, Adam with
  moment resets, the reference's bias correction, the warm-up factor.
  """
  who = "spam"

  def init_fn(params):
    # Refused here, as at update: complex leaves have no SPAM moments.
    _checks.check_float_leaves(params, f"{who}: params", real=True)
    return SpamState(
      count=jnp.zeros((), jnp.int32),
      mu=jax.tree.map(jnp.zeros_like, params),
      nu=jax.tree.map(jnp.zeros_like, params),
      clipped=jnp.zeros((), _F32),
      clip_fraction=jnp.zeros((), _F32),
      resets=jnp.zeros((), jnp.int32),
      scale=jnp.ones((), _F32),
      threshold=_threshold_at(threshold, jnp.zeros((), jnp.int32), who),
    )

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = _float_leaves(updates, who)
    threshold_now = _threshold_at(threshold, state.count, who)
    t, reset, clip_on, resets = _spam_clock(
      state.count, reset_interval, grad_accu_steps, threshold_now
    )
    scale = _spam_warmup(t, reset_interval, warmup_steps)
    # The reference counts bias correction from the first step and never
    # restarts it: after a reset, the fresh moments are divided by
    # 1 - b**t for the global t (the warm-up makes up for it).
    step = jnp.sqrt(_one_minus_power(b2, t)) / _one_minus_power(b1, t)
    factor = step * scale

    def direction(mu, nu, dtype):
      del dtype
      d = mu / (jnp.sqrt(nu) + eps)
      return d * factor.astype(d.dtype)

    out, mu, nu, clipped = _adam_with_resets(
      leaves, treedef, state, reset, b1, b2, direction, (threshold_now, clip_on)
    )
    return out, SpamState(
      count=optax.safe_int32_increment(state.count),
      mu=mu,
      nu=nu,
      clipped=clipped,
      clip_fraction=_share(clipped, leaves),
      resets=resets,
      scale=scale,
      threshold=threshold_now,
    )

  return optax.GradientTransformation(init_fn, _compiled.jit_update(update_fn))


def _step_then_decay(
  learning_rate: ScalarOrSchedule, weight_decay: Any
) -> optax.GradientTransformation:
  """``-lr d``, then weight decay on the stepped parameters, as SPAM's
  reference applies it: ``p <- (p - lr d) (1 - lr wd)``.
  """

  def init_fn(params):
    del params
    return optax.ScaleByScheduleState(count=jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None):
    lr = _at(learning_rate, state.count)
    decays = not (
      _checks.is_concrete_number(weight_decay) and float(weight_decay) == 0.0
    )
    if decays and params is None:
      raise ValueError(
        "spam: params must be passed to update when weight_decay is "
        "not 0; got params=None."
      )

    def step(d, p):
      wide = _norms.accumulation_dtype(d.dtype)
      u = -lr.astype(wide) * d.astype(wide)
      if decays:
        rate = (lr * weight_decay).astype(wide)
        u = u - rate * (p.astype(wide) + u)
      return u.astype(d.dtype)

    stepped = jax.tree.map(step, updates, params if decays else updates)
    count = optax.safe_int32_increment(state.count)
    return stepped, optax.ScaleByScheduleState(count=count)

  return optax.GradientTransformation(init_fn, update_fn)


@_compiled.compiled_once
def spam(
  learning_rate: ScalarOrSchedule,
  *,
  b1: Scalar = 0.9,
  b2: Scalar = 0.999,
  eps: Scalar = 1e-6,
  weight_decay: Scalar = 0.0,
  threshold: ScalarOrSchedule = 5000.0,
  reset_interval: Scalar = 500,
  warmup_steps: Scalar = 150,
  grad_accu_steps: Scalar = 20,
) -> optax.GradientTransformation:
  r"""SPAM: Adam with spike-aware clipping, moment resets and re-warm-up.

  Step ``t`` (from 1), as the authors' ``AdamW`` class does it:

  1. if ``t`` is a multiple of ``reset_interval``, ``m`` and ``v`` are reset
     to zero;
  2. once ``t mod reset_interval >= grad_accu_steps``, each coordinate with
     ``g^2 > threshold v`` is clipped to ``sign(g) sqrt(threshold v)``
     (an infinite one to NaN, and a coordinate with ``v = 0`` not judged,
     as in :func:`clip_spikes`);
  3. ``m <- b1 m + (1 - b1) g``, ``v <- b2 v + (1 - b2) g^2``;
  4. ``p <- p - lr s_t sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps)``,
     with the bias correction counted from the first step, never restarted
     (so fresh moments after a reset are not debiased: the warm-up factor
     ``s_t`` makes up for it), and ``eps`` added to ``sqrt(v)`` before the
     correction (the reference's order, not optax's);
  5. ``p <- p - lr weight_decay p`` on the stepped parameters.

  ``s_t`` is 1 but for the ``warmup_steps`` steps that start with each
  reset, where it rises from 0.01 as ``0.01 + 0.99 sin^2(pi c / (2
  (warmup_steps + 1)))`` on the ``c``-th of them (the reference's
  ``1 - CosineDecay(0.99, warmup_steps)``).

  Differences from the reference: its random-mask ``density`` option
  (sparse momentum) is not offered; ``learning_rate`` may be an optax
  schedule (the reference reads a PyTorch scheduler's value), used for the
  step and the decay alike.

  Built as ``optax.chain`` of SPAM's direction (state :class:`SpamState`,
  which clips against its own ``v``: see :func:`clip_spikes` for the same
  clip before any other optimizer) and the step with weight decay.

  Args:
    learning_rate: a number (>= 0) or an optax schedule ``step -> lr``.
    b1: the first moment's decay, in [0, 1).
    b2: the second moment's decay, in [0, 1).
    eps: added to ``sqrt(v)`` (>= 0).
    weight_decay: decoupled weight decay (>= 0).
    threshold: the spike threshold on ``g^2 / v`` (>= 0; 0 turns clipping
      off): a number or a schedule (``step -> value``, evaluated at the
      update count, 0 on the first update); a schedule's NaN makes that
      step's update NaN.
    reset_interval: reset the moments every this many steps (a positive
      int; ``DeltaT`` in the paper).
    warmup_steps: steps of cosine warm-up after each reset (>= 0).
    grad_accu_steps: steps without clipping after each reset (>= 0).

  Returns:
    An ``optax.GradientTransformation``; :func:`stats` reports
    ``spam/clipped``, ``spam/clip_fraction``, ``spam/resets`` and
    ``spam/scale`` (the warm-up factor).

  References:
    Huang et al., `SPAM: Spike-Aware Adam with Momentum Reset for Stable LLM
    Training <https://arxiv.org/abs/2501.06842>`_, ICLR 2025; the authors'
    code, github.com/TianjinYellow/SPAM-Optimizer, ``galore_torch/SPAM.py``
    (class ``AdamW``).

  Example:
    >>> import jax.numpy as jnp, optax, optaxclip
    >>> tx = optaxclip.spam(1e-2, reset_interval=3, warmup_steps=2)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> for _ in range(4):
    ...   updates, state = tx.update({"w": jnp.ones(2)}, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> logs = optaxclip.stats(state)
    >>> int(logs["spam/resets"]), round(float(logs["spam/scale"]), 4)
    (1, 0.2575)
  """
  who = "spam"
  _check_learning_rate(who, learning_rate)
  _check_decay(who, "b1", b1)
  _checks.check_number("eps", eps, who=who, low=0.0)
  _checks.check_number("weight_decay", weight_decay, who=who, low=0.0)
  reset_interval = _check_spam_clip(
    who, threshold, b2, reset_interval, grad_accu_steps
  )
  _checks.check_steps(who, "warmup_steps", warmup_steps, low=0)
  return optax.chain(
    _scale_by_spam(
      b1, b2, eps, threshold, reset_interval, warmup_steps, grad_accu_steps
    ),
    _step_then_decay(learning_rate, weight_decay),
  )


# --- Stable-SPAM ------------------------------------------------------------


@_stats.register("clip_spikes_adaptive", ("clipped", "clip_fraction"))
class ClipSpikesAdaptiveState(NamedTuple):
  """State of :func:`clip_spikes_adaptive`.

  Attributes:
    count: updates so far (int32).
    max_ema: per leaf, the bias-corrected EMA of its largest magnitude,
      ``T_hat`` (the limit of the last step): a vector with one entry per
      leaf, in ``jax.tree.leaves`` order, float32 (float64 for float64
      parameters).
    clipped: elements clipped this step (float32: exact up to 2**24).
    clip_fraction: the share of elements clipped this step.
  """

  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  max_ema: jax.Array  # float32 or float64 (leaves,)
  clipped: jax.Array  # float32 scalar
  clip_fraction: jax.Array  # float32 scalar in [0, 1]


@_compiled.compiled_once
def clip_spikes_adaptive(
  gamma3: Scalar = 0.999,
  *,
  reset_interval: Optional[Scalar] = None,
  axis_name: AxisName = None,
  sharded: Any = True,
) -> optax.GradientTransformation:
  r"""Stable-SPAM's adaptive spike clipping (AdaClip), per leaf.

  Each leaf keeps ``T``, an EMA of its largest magnitude:
  ``T <- gamma3 T + (1 - gamma3) max|g|``, bias-corrected as
  ``T_hat = T / (1 - gamma3^k)``. Every element with ``|g| > T_hat`` is
  scaled by ``T_hat / max|g|``: the largest comes down to ``T_hat`` and the
  clipped elements keep their sign and their ratios to one another.

  ``k`` is the step count, from 1. With ``reset_interval``, ``k`` restarts
  as Stable-SPAM's reference counts it (the reference keeps one step count
  per tensor for all its statistics and sets it to 1 when it resets Adam's
  moments): 2 on the step after each multiple of ``reset_interval``. ``T``
  itself is never reset, so for a while after each reset ``T_hat`` is
  inflated and little is clipped. :func:`stable_spam` passes its own
  ``reset_interval``; standalone, leave it None (the paper's formula).

  Differences from the reference, for inputs it gets wrong: the state holds
  ``T_hat`` itself, updated as a weighted sum of the last ``T_hat`` and
  ``max|g|`` (the same numbers, rounding apart), not ``T``: the reference's
  ``(1 - gamma3) max|g|`` underflows for ``max|g|`` below about 1e-35 in
  float32 (``T_hat`` 0, then NaN); ``T_hat`` is capped at the dtype's
  largest value. A leaf holding a NaN or an inf comes out NaN (every
  element counted as clipped; the reference passes the leaf's finite
  elements unclipped) and leaves its ``T_hat`` as it was (in the
  reference, an inf or NaN ``T`` switches the leaf's clipping off for
  good). The factor ``T_hat / max|g|`` is computed with ``max|g|``'s power
  of two apart, so that its derivatives do not go through ``max|g|**2``
  (NaN near 1e-20 in float32). The statistic is float64 for float64
  parameters.

  Args:
    gamma3: the decay of the EMA, in [0, 1).
    reset_interval: None, or restart ``k`` as described (a positive int).
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split (as for :func:`clip_global`): each
      leaf's statistic is of the whole leaf, the same on every device.
    sharded: which leaves are split over ``axis_name``: a bool, a pytree
      prefix of bools, tuples of axis names or ``PartitionSpec`` s, or a
      callable ``(path, leaf) -> entry`` (as for :func:`clip_global`).

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`ClipSpikesAdaptiveState`.

  References:
    Huang et al., `Stable-SPAM: How to Train in 4-Bit More Stably than
    16-Bit Adam <https://arxiv.org/abs/2502.17055>`_, 2025 (AdaClip); the
    authors' code, github.com/TianjinYellow/StableSPAM,
    ``galore_torch/stablespam.py``.

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> tx = optaxclip.clip_spikes_adaptive(0.5)
    >>> state = tx.init({"w": jnp.zeros(3)})
    >>> _, state = tx.update({"w": jnp.array([1.0, 0.5, 0.0])}, state)
    >>> g, state = tx.update({"w": jnp.array([4.0, -3.5, 2.0])}, state)
    >>> g["w"]  # T_hat = (0.25 + 2) / 0.75 = 3: above it, scaled by 3 / 4
    Array([ 3.   , -2.625,  2.   ], dtype=float32)
  """
  who = "clip_spikes_adaptive"
  _check_decay(who, "gamma3", gamma3)
  interval = _check_interval(who, reset_interval, allow_none=True)
  axis_name = _checks.check_sharding(who, axis_name, sharded)

  def init_fn(params):
    return ClipSpikesAdaptiveState(
      count=jnp.zeros((), jnp.int32),
      max_ema=_per_leaf_zeros(params, who),
      clipped=jnp.zeros((), _F32),
      clip_fraction=jnp.zeros((), _F32),
    )

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = _float_leaves(updates, who)
    ema = _per_leaf(state.max_ema, leaves, who, "max_ema")
    dtype = ema.dtype
    # T_hat directly: T_hat = (gamma3 T + (1 - gamma3) max|g|) / c_k with
    # T = T_hat' c_k' (the step before) is a weighted sum of T_hat' and
    # max|g| with weights of order 1, so that no product by 1 - gamma3
    # underflows (the reference's T does, for max|g| below about 1e-35 in
    # float32: T_hat is then 0 or NaN).
    k = _ema_step_count(state.count + 1, interval)
    k_before = _ema_step_count(state.count, interval)
    # c_k, c_k' and 1 - gamma3 in one expm1, so that 1 - gamma3 is computed
    # as c_k is and w_new is exactly 1 on the first step (from a constant
    # count of 1 it would come out an ulp above 1).
    correction, before, first = _one_minus_power(
      gamma3, jnp.stack([k, jnp.maximum(k_before, 1), jnp.minimum(k, 1)]), dtype
    )
    before = jnp.where(k_before > 0, before, 0)
    w_before = jnp.asarray(gamma3, dtype) * before / correction
    w_new = first / correction
    # The per-leaf scalars as vectors (compile time on many-leaf trees:
    # see scale_by_norm_ema).
    flags = _split_flags(updates, sharded, who, axis_name)
    layout, largest = _leaf_norm_vector(
      leaves, math.inf, flags, axis_name, dtype
    )
    # A leaf holding a NaN or an inf leaves its T_hat as it was, and comes
    # out NaN (its limit NaN: every element a spike, times NaN).
    finite = jnp.isfinite(largest)
    fresh = jnp.minimum(
      w_before * ema + w_new * jnp.where(finite, largest, 0),
      jnp.finfo(dtype).max,
    )
    new_ema = jnp.where(finite, fresh, ema)
    # From the new state, not the old: a donated state is then updated in
    # place (the old one read only for the new one, not after it).
    limit = jnp.where(finite, new_ema, jnp.nan)
    # The factor limit / max|g| as (limit / (max|g| 2**-E)) 2**-E, 2**E the
    # power of two of max|g|: the same number, and derivatives without
    # max|g|**2 (which underflows for max|g| below about 1e-19 in float32).
    scale = _norms.pow2(-_norms.scale_exponent(largest), dtype)
    factor = scale * (
      jnp.minimum(limit, largest) / jnp.where(largest > 0, largest * scale, 1)
    )
    out, clipped, own = _clip_in_stacked_parts(
      layout, leaves, limit, factor, axis_name
    )
    rest = [i for i, y in enumerate(out) if y is None]
    if rest:
      index = np.asarray(rest)
      rows = _norms.take_each(jnp.stack([limit[index], factor[index]], axis=1))
      for i, row in zip(rest, rows):
        g = leaves[i]
        wide = _norms.accumulation_dtype(g.dtype)
        spike = _above(_norms.magnitude(g, wide), row[0])
        if i in own:
          split = () if flags is None else flags[i]
          clipped = clipped + _norms.psum_sharded(
            _norms.count(spike), split, axis_name
          )
        out[i] = jnp.where(spike, _shrunk(g, row[1]), g)
    return treedef.unflatten(out), ClipSpikesAdaptiveState(
      count=optax.safe_int32_increment(state.count),
      max_ema=new_ema,
      clipped=clipped,
      clip_fraction=_share(clipped, leaves, flags),
    )

  return optax.GradientTransformation(init_fn, _compiled.jit_update(update_fn))


def _above(magnitude: jax.Array, limit: jax.Array) -> jax.Array:
  """``magnitude > limit``, and true everywhere where ``limit`` is NaN."""
  return ~(magnitude <= limit)


def _shrunk(x: jax.Array, factor: jax.Array) -> jax.Array:
  """``x factor`` in the accumulation dtype, back in ``x``'s."""
  wide = _norms.accumulation_dtype(x.dtype)
  return (x.astype(wide) * factor.astype(wide)).astype(x.dtype)


@_stats.register("scale_by_norm_ema", ("norm", "scaled_norm", "scale"))
class ScaleByNormEmaState(NamedTuple):
  """State of :func:`scale_by_norm_ema`.

  Attributes:
    count: updates so far (int32).
    mu: per leaf, the EMA of its L2 norm: a vector with one entry per leaf,
      in ``jax.tree.leaves`` order, float32 (float64 for float64
      parameters); kept at least ``2**-22 sqrt(nu)`` above 0 (``nu``'s
      scale comes from it).
    nu: per leaf, the EMA of its squared L2 norm (as ``mu``): itself while
      ``2**-41 <= mu < 2**40`` (``2**-489`` to ``2**488`` in float64),
      beyond that times ``4**-e`` with ``e`` the binary exponent of ``mu``
      less (plus) 40 (488), as :class:`ClipZscoreState`'s ``var``.
    norm: this step's global L2 norm before scaling.
    scaled_norm: the global L2 norm after scaling.
    scale: ``scaled_norm / norm`` (1 for a zero gradient).
  """

  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  mu: jax.Array  # float32 or float64 (leaves,)
  nu: jax.Array  # float32 or float64 (leaves,)
  norm: jax.Array  # float32 scalar
  scaled_norm: jax.Array  # float32 scalar
  scale: jax.Array  # float32 scalar


@_compiled.compiled_once
def scale_by_norm_ema(
  gamma1: ScalarOrSchedule = 0.7,
  gamma2: Scalar = 0.9,
  *,
  eps: Scalar = 1e-8,
  reset_interval: Optional[Scalar] = None,
  axis_name: AxisName = None,
  sharded: Any = True,
) -> optax.GradientTransformation:
  r"""Stable-SPAM's adaptive norm scaling (AdaGN), per leaf.

  Each leaf's L2 norm ``n`` feeds two EMAs, ``m <- g1 m + (1 - g1) n`` and
  ``v <- gamma2 v + (1 - gamma2) n^2``, bias-corrected with ``1 - g1^k`` and
  ``1 - gamma2^k``; the leaf is then rescaled to norm ``m_hat / (sqrt(v_hat)
  + eps)``. A leaf of norm 0 passes as it is. So each leaf's size follows
  the first-to-second moment ratio of its recent norms: a spike in one step
  is brought down to the recent level.

  ``g1`` is ``gamma1``, or its value at this step when ``gamma1`` is a
  schedule (:func:`stable_spam` decays it with a cosine); its bias
  correction uses this step's value. ``k`` counts steps from 1, or, with
  ``reset_interval``, restarts as in Stable-SPAM's reference (see
  :func:`clip_spikes_adaptive`). ``v`` is kept scaled by a power of two
  once ``m`` leaves ``2**-41..2**40`` (as :func:`clip_zscore`'s variance),
  so that the squares of norms above about 1e19 or below about 1e-19
  (float32) neither saturate nor flush to 0: the ratio is the same at every
  scale (``eps`` apart, an absolute floor). ``n`` is capped at the dtype's
  largest value where a finite leaf's norm exceeds its range; the leaf is
  then divided by its exact norm (the reference, dividing by an overflowed
  float32 norm, returns NaN there). The bias-corrected EMAs are
  capped likewise (the division may round above the largest value, which
  would make the target 0). A leaf holding a NaN or an inf comes out NaN and
  leaves its EMAs as they were (in the reference, they stay NaN for good).
  With ``eps = 0``, a leaf whose ``v`` is 0 while ``m`` is not (squares
  that underflowed even at ``v``'s scale) is rescaled to norm 1, the ratio
  of equal norms, instead of dividing by 0. The EMAs are float64 for float64
  parameters (their squares then capped at float64's largest value).

  Args:
    gamma1: the decay of the norm's EMA, in [0, 1), or a schedule.
    gamma2: the decay of the squared norm's EMA, in [0, 1).
    eps: added to ``sqrt(v_hat)`` (>= 0).
    reset_interval: None, or restart ``k`` as Stable-SPAM's reference does.
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split (as for :func:`clip_global`): each
      leaf's statistic is of the whole leaf, the same on every device.
    sharded: which leaves are split over ``axis_name`` (as for
      :func:`clip_spikes_adaptive`).

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`ScaleByNormEmaState`.

  References:
    Huang et al., `Stable-SPAM: How to Train in 4-Bit More Stably than
    16-Bit Adam <https://arxiv.org/abs/2502.17055>`_, 2025 (AdaGN); the
    authors' code, github.com/TianjinYellow/StableSPAM,
    ``galore_torch/stablespam.py``.

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> tx = optaxclip.scale_by_norm_ema(0.5, 0.5, eps=0.0)
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> g, state = tx.update({"w": jnp.array([3.0, 4.0])}, state)
    >>> g["w"]  # first step: m_hat = 5, sqrt(v_hat) = 5, norm 1
    Array([0.6, 0.8], dtype=float32)
    >>> g, state = tx.update({"w": jnp.array([30.0, 40.0])}, state)
    >>> round(float(state.scaled_norm), 3)  # a 10x spike comes out at 0.855
    0.855
  """
  who = "scale_by_norm_ema"
  if not callable(gamma1):
    _check_decay(who, "gamma1", gamma1)
  _check_decay(who, "gamma2", gamma2)
  _checks.check_number("eps", eps, who=who, low=0.0)
  interval = _check_interval(who, reset_interval, allow_none=True)
  axis_name = _checks.check_sharding(who, axis_name, sharded)

  def init_fn(params):
    return ScaleByNormEmaState(
      count=jnp.zeros((), jnp.int32),
      mu=_per_leaf_zeros(params, who),
      nu=_per_leaf_zeros(params, who),
      norm=jnp.zeros((), _F32),
      scaled_norm=jnp.zeros((), _F32),
      scale=jnp.ones((), _F32),
    )

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = _float_leaves(updates, who)
    mu = _per_leaf(state.mu, leaves, who, "mu")
    nu = _per_leaf(state.nu, leaves, who, "nu")
    dtype = mu.dtype
    largest = jnp.finfo(dtype).max
    k = _ema_step_count(state.count + 1, interval)
    g1 = _at(gamma1, state.count, dtype)
    correction1 = _one_minus_power(g1, k, dtype)
    correction2 = _one_minus_power(gamma2, k, dtype)
    # One vector of the leaves' norms and EMAs, whatever the number of
    # leaves: a few kernels, not a few per leaf (compile time on many-leaf
    # trees; docs/performance.md). The EMAs are stored as vectors too: a
    # scalar per leaf in the state would take a kernel per leaf and field
    # to write back.
    flags = _split_flags(updates, sharded, who, axis_name)
    layout, exact = _leaf_norm_scaled(leaves, 2.0, flags, axis_name)
    n = exact.as_float().astype(dtype)
    # A finite leaf whose norm exceeds the range enters the EMAs as the
    # dtype's largest value (inf would stay in them, and inf / inf is NaN);
    # the leaf itself is divided by its exact norm below. A leaf holding a
    # NaN or an inf leaves its EMAs as they were (and comes out NaN).
    finite = jnp.isfinite(exact.value)
    n_ema = jnp.where(finite, jnp.minimum(n, largest), 0)
    new_mu = g1 * mu + (1 - g1) * n_ema
    # nu is kept scaled by 4**-e, e from mu as clip_zscore's variance from
    # its mean (0 for mu within 2**-41..2**40: nu itself), so that squares
    # of norms above ~1e19 or below ~1e-19 (float32) neither saturate nor
    # flush to 0: the ratio below is the same at every scale. It is updated
    # at an exponent that holds the new square and the old nu, then kept
    # with mu's, mu held at least 2**-22 of sqrt(nu) above 0 (after steps of
    # zero norms mu decays faster than nu when gamma1 < gamma2; at 0, nu
    # would saturate and lose its history; see _moments.kept_moments).
    # Two kernels read the stored mu (nu's update, for its old scale) and one
    # overwrites it in place: XLA copies the vector first (a few bytes).
    # At e_new the square is at most 2**80 (2**976 in float64): no cap.
    e_new = _moments.safe_exponent(new_mu, mu, n_ema)
    square = _norms.ldexp(n_ema, -e_new, 1) ** 2
    new_nu = (
      gamma2 * _moments.rescaled(nu, _moments.spread_exponent(mu), e_new)
      + (1 - gamma2) * square
    )
    new_mu, new_nu = _moments.kept_moments(new_mu, new_nu, e_new)
    mu = jnp.where(finite, new_mu, mu)
    nu = jnp.where(finite, new_nu, nu)
    e = _moments.spread_exponent(mu)
    # Bias-corrected, capped at the largest value too: near it, the division
    # by 1 - gamma^k may round above it (inf would make the target 0).
    mu_hat = jnp.minimum(_over(mu, correction1), largest)
    nu_hat = jnp.minimum(_over(nu, correction2), largest)
    # The ratio at nu's scale: mu_hat and eps times 2**-e. safe_root: a root
    # of 0 (a zero leaf so far) with derivative 0, not inf.
    mu_hat = _norms.ldexp(mu_hat, -e, 1)
    denominator = _norms.safe_root(nu_hat, 2.0) + _norms.ldexp(
      jnp.asarray(eps, dtype), -e, 1
    )
    # With eps = 0, squares that underflowed even at nu's scale leave no
    # denominator: the ratio is taken as 1 (that of equal norms), not
    # mu_hat / 0 = inf.
    target = jnp.where(
      denominator > 0,
      mu_hat / jnp.where(denominator > 0, denominator, 1),
      jnp.where(mu_hat > 0, 1, 0).astype(dtype),
    )
    positive = n > 0
    # target / norm with the norm's power of two apart (exact, no overflow);
    # NaN for a leaf holding a NaN or an inf (the non-finite policy).
    m, e = _norms.normalize(exact)
    value = jnp.where(positive, target / jnp.where(positive, m, 1.0), 1.0)
    factor = _norms.Scaled(
      jnp.where(finite, value, jnp.nan).astype(exact.value.dtype),
      jnp.where(positive, -e, 0),
    )
    out = _scale_leafwise(layout, leaves, factor)
    norm = _global([n])
    scaled = _global([jnp.where(positive, target, 0.0)])
    return treedef.unflatten(out), ScaleByNormEmaState(
      count=optax.safe_int32_increment(state.count),
      mu=mu.astype(dtype),
      nu=nu.astype(dtype),
      norm=norm,
      scaled_norm=scaled,
      scale=jnp.where(norm > 0, scaled / jnp.where(norm > 0, norm, 1.0), 1.0),
    )

  return optax.GradientTransformation(init_fn, _compiled.jit_update(update_fn))


def _leaf_norm_vector(
  leaves: list[jax.Array],
  ord: float = 2.0,  # pylint: disable=redefined-builtin
  flags: Optional[list[tuple[str, ...]]] = None,
  axis_name: AxisName = None,
  dtype: Any = _F32,
) -> tuple[Optional[_norms.UnitLayout], jax.Array]:
  """The ``ord``-norm of each leaf (``inf``: its largest magnitude), a
  vector in ``dtype`` (inf beyond its range), and the layout it was
  computed on (small leaves stacked: see _norms.UnitLayout; None for no
  leaves). With ``axis_name``, of the whole leaves: leaf ``i`` split over
  ``flags[i]``.
  """
  layout, norms = _leaf_norm_scaled(leaves, ord, flags, axis_name)
  return layout, norms.as_float().astype(dtype)


def _leaf_norm_scaled(
  leaves: list[jax.Array],
  ord: float = 2.0,  # pylint: disable=redefined-builtin
  flags: Optional[list[tuple[str, ...]]] = None,
  axis_name: AxisName = None,
) -> tuple[Optional[_norms.UnitLayout], _norms.Scaled]:
  """As :func:`_leaf_norm_vector`, the norms exact (:class:`_norms.Scaled`,
  in the tree's accumulation dtype): a finite leaf's norm may exceed the
  dtype's range.
  """
  acc = _norms.tree_accumulation_dtype(leaves)
  if not leaves:
    return None, _norms.as_scaled(jnp.zeros((0,), acc))
  layout, per_part = _norms.unit_norms_packed(
    leaves, ord, axis_name=axis_name, sharded=flags
  )
  return layout, layout.leaf_vector_scaled(per_part, acc)


def _clip_in_stacked_parts(
  layout,
  leaves,
  limit: jax.Array,
  factor: jax.Array,
  axis_name: AxisName,
) -> tuple[list[Optional[jax.Array]], jax.Array, set]:
  """Stable-SPAM's clip (``x factor[i]`` where ``|x| > limit[i]``, and
  everywhere where ``limit[i]`` is NaN) of the small leaves in ``layout``'s
  stacked parts, done on the parts.

  Every element of a stacked part is counted there (float32 sum). Leaves of
  at most ``_packed.PACKED_SIZE`` elements are also clipped there, each
  taking its elements back by :func:`_norms.take_leaf` (kernels shared by
  the leaves of a shape; compile time on many-leaf trees); the others are None
  in the list returned, for the caller to clip, with the leaves that are
  parts of their own, which it also counts (returned as a set). With
  ``axis_name``, a part's count is summed over the axes its leaves are split
  over (the layout's keys: ``(axes, ...)``).
  """
  out: list[Optional[jax.Array]] = [None] * len(leaves)
  total = jnp.zeros((), _F32)
  if layout is None:
    return out, total, set()
  own = {what for kind, what, _ in layout.parts if kind == "leaf"}
  stacked = [j for j, (kind, _, _) in enumerate(layout.parts) if kind != "leaf"]
  if not stacked:
    return out, total, own
  parts = layout.pack(leaves)
  for j in stacked:
    # Whole leaves as units: one row a leaf.
    members = [i for i, _, _ in layout.parts[j][1]]
    rows = np.asarray(members)
    part = parts[j]
    limits = jnp.take(limit, rows, axis=0).astype(part.dtype)[:, None]
    spike = _above(_norms.magnitude(part), limits)
    # The layout's keys are (split axes, ...).
    total = total + _norms.psum_sharded(
      _norms.count(spike), layout.parts[j][2][0], axis_name
    )
    if leaves[members[0]].size > _packed.PACKED_SIZE:
      continue
    shrunk = _shrunk(part, jnp.take(factor, rows, axis=0)[:, None])
    # In memory once, for the leaves' gathers.
    flat = _norms.materialized(jnp.where(spike, shrunk, part))
    like = [leaves[i] for i in members]
    for i, y in zip(members, _norms.take_leaves(flat.reshape(-1), like)):
      out[i] = y
  return out, total, own


def _scale_leafwise(
  layout, leaves, factor: Union[jax.Array, _norms.Scaled]
) -> list[jax.Array]:
  """Each leaf times its entry of the float32 vector ``factor`` (or a
  :class:`_norms.Scaled` one; small leaves scaled in their stacked parts:
  see UnitLayout.scale_leafwise).
  """
  if layout is None:
    return []
  # In memory: each part's scaling would compute it again otherwise.
  scale = _norms.materialized_scaled(_norms.as_scaled(factor))
  return layout.scale_leafwise(leaves, scale)


def _global(norms: list[jax.Array]) -> jax.Array:
  """The L2 norm of per-leaf norms (overflow-safe), a float32 scalar."""
  if not norms:
    return jnp.zeros((), _F32)
  return _norms.combine_norms(norms).astype(_F32).reshape(())


@_stats.register("stable_spam", ("resets", "scale"))
class StableSpamState(NamedTuple):
  """State of :func:`stable_spam`'s Adam part.

  Attributes:
    count: updates so far (int32).
    mu: Adam's first moment.
    nu: Adam's second moment.
    resets: moment resets so far (int32).
    scale: this step's cosine factor on ``b1`` and ``gamma1`` (1 without
      ``total_steps``).
  """

  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  mu: optax.Updates
  nu: optax.Updates
  resets: jax.Array  # int32 scalar
  scale: jax.Array  # float32 scalar


class _Cosine(NamedTuple):
  """Stable-SPAM's factor at step ``count + 1``, times ``base``: ``eta_min +
  (1 - eta_min) cos^2(pi t / (2 (total_steps + 1)))``, held at ``eta_min``
  after ``total_steps``; 1 without ``total_steps``. A NamedTuple, so that two
  equal configurations share one compiled update (see _compiled).
  """

  total_steps: Any
  eta_min: Any
  base: Any = 1.0

  def __call__(self, count: jax.Array) -> jax.Array:
    if self.total_steps is None:
      return jnp.asarray(self.base).astype(_F32)
    end = jnp.asarray(self.total_steps) + 1
    t = jnp.minimum(count + 1, end).astype(_F32)
    half_angle = (math.pi / 2) * t / end.astype(_F32)
    cos2 = jnp.square(jnp.cos(half_angle))
    return (self.base * (self.eta_min + (1 - self.eta_min) * cos2)).astype(_F32)


def _scale_by_stable_spam_adam(
  b1, b2, eps, scale_at: Callable, interval: Any
) -> optax.GradientTransformation:
  """Adam with moment resets, ``b1`` scaled by ``scale_at(count)``; the
  moments are reset before the step that takes in the gradient (the paper's
  order), and the bias correction restarts at 1 on the reset step.
  """
  who = "stable_spam"

  def init_fn(params):
    return StableSpamState(
      count=jnp.zeros((), jnp.int32),
      mu=jax.tree.map(jnp.zeros_like, params),
      nu=jax.tree.map(jnp.zeros_like, params),
      resets=jnp.zeros((), jnp.int32),
      scale=jnp.ones((), _F32),
    )

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = _float_leaves(updates, who)
    t = state.count + 1
    scale = scale_at(state.count)
    if interval is None:
      reset, k, resets = jnp.zeros((), bool), t, jnp.zeros((), jnp.int32)
    else:
      reset = t % interval == 0
      k = jnp.where(t < interval, t, t % interval + 1)
      resets = (t // interval).astype(jnp.int32)
    beta1 = b1 * scale
    correction1 = _one_minus_power(beta1, k)
    root2 = jnp.sqrt(_one_minus_power(b2, k))

    def direction(mu, nu, dtype):
      denom = jnp.sqrt(nu) / root2.astype(dtype) + eps
      return (mu / correction1.astype(dtype)) / denom

    out, mu, nu, _ = _adam_with_resets(
      leaves, treedef, state, reset, beta1, b2, direction
    )
    return out, StableSpamState(
      count=optax.safe_int32_increment(state.count),
      mu=mu,
      nu=nu,
      resets=resets,
      scale=scale,
    )

  return optax.GradientTransformation(init_fn, _compiled.jit_update(update_fn))


@_compiled.compiled_once
def stable_spam(
  learning_rate: ScalarOrSchedule,
  *,
  b1: Scalar = 0.9,
  b2: Scalar = 0.999,
  eps: Scalar = 1e-8,
  weight_decay: Scalar = 0.0,
  gamma1: Scalar = 0.7,
  gamma2: Scalar = 0.9,
  gamma3: Scalar = 0.999,
  total_steps: Optional[Scalar] = None,
  eta_min: Scalar = 0.5,
  reset_interval: Optional[Scalar] = 1000,
  axis_name: AxisName = None,
  sharded: Any = True,
) -> optax.GradientTransformation:
  r"""Stable-SPAM: adaptive spike clipping, norm scaling and Adam with
  moment resets.

  Step ``t`` (from 1), per parameter tensor, as the authors' ``StableSPAM``
  class does it:

  1. decoupled weight decay, ``p <- p (1 - lr weight_decay)``;
  2. :func:`clip_spikes_adaptive` (``gamma3``): elements above the EMA of
     the tensor's largest magnitude are scaled down to it;
  3. :func:`scale_by_norm_ema` (``gamma1 s_t``, ``gamma2``, ``eps``): the
     tensor is rescaled to the EMA ratio of its recent norms;
  4. Adam with ``b1 s_t`` and ``b2``, ``p <- p - lr m_hat / (sqrt(v_hat) +
     eps)``, its moments reset to zero when ``t`` is a multiple of
     ``reset_interval``.

  ``s_t`` is 1 without ``total_steps``; with it, ``eta_min + (1 - eta_min)
  cos^2(pi t / (2 (total_steps + 1)))``, from 1 down to ``eta_min``. The
  reference keeps one step count per tensor for every bias correction and
  sets it to 1 at a reset: Adam's moments are debiased as fresh ones, and
  the clipping's and norm scaling's EMAs (not reset) with a count that
  restarts too; this does the same.

  Differences from the reference:

  * At a reset step the reference binds new zero buffers for ``m`` and
    ``v`` in its state, but updates the old ones, which it still holds, and
    takes that step from them (debiased as if fresh: about 0.3 times an
    ordinary step); the zeros take in a gradient only from the next step, on
    which the bias correction counts 2. This follows the paper (Algorithm 1:
    reset, then update): the reset step's gradient goes into the zeroed
    moments and the step is taken from them, debiased with a count of 1.
    Both agree on every step before the first reset; parity tests against a
    NumPy transcription of the reference, with and without this artifact,
    are in ``tests/test_spam.py``.
  * The reference's cosine rises again after ``total_steps`` (a closed-form
    ``CosineAnnealingLR`` called past its period); here ``s_t`` stays at
    ``eta_min``.
  * ``learning_rate`` may be an optax schedule; ``reset_interval=None`` (the
    reference's 0) turns resets off; the reference's ``amsgrad`` option and
    ``gamma1=-1`` (meaning ``b1``) are not offered.

  Built as ``optax.chain`` of :func:`clip_spikes_adaptive`,
  :func:`scale_by_norm_ema`, the Adam part (state :class:`StableSpamState`),
  ``optax.add_decayed_weights`` and ``optax.scale_by_learning_rate`` (its
  state is the chain's tuple of theirs), run as one program in which the
  small leaves that one stage packs into a vector are handed on packed to
  the next (compile time on many-leaf trees). The first two chain before any
  optimizer, e.g. ``optax.chain(optaxclip.clip_spikes_adaptive(),
  optaxclip.scale_by_norm_ema(), optax.adamw(1e-3))``.

  Args:
    learning_rate: a number (>= 0) or an optax schedule ``step -> lr``.
    b1: Adam's first-moment decay, in [0, 1).
    b2: Adam's second-moment decay, in [0, 1).
    eps: added to ``sqrt(v_hat)`` in Adam and in the norm scaling (>= 0).
    weight_decay: decoupled weight decay (>= 0).
    gamma1: the decay of the norm's EMA, in [0, 1).
    gamma2: the decay of the squared norm's EMA, in [0, 1).
    gamma3: the decay of the largest magnitude's EMA, in [0, 1).
    total_steps: None, or the training length over which ``s_t`` decays
      (a positive whole number).
    eta_min: the final ``s_t``, in [0, 1].
    reset_interval: reset Adam's moments every this many steps (a positive
      int), or None / 0 for never.
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split (as for :func:`clip_global`): each
      leaf's largest magnitude and norm are of the whole leaf, the same on
      every device (Adam's part is element-wise).
    sharded: which leaves are split over ``axis_name`` (as for
      :func:`clip_global`).

  Returns:
    An ``optax.GradientTransformation``; :func:`stats` reports
    ``clip_spikes_adaptive/clipped`` and ``/clip_fraction``,
    ``scale_by_norm_ema/norm``, ``/scaled_norm`` and ``/scale``, and
    ``stable_spam/resets`` and ``/scale`` (``s_t``).

  References:
    Huang et al., `Stable-SPAM: How to Train in 4-Bit More Stably than
    16-Bit Adam <https://arxiv.org/abs/2502.17055>`_, 2025; the authors'
    code, github.com/TianjinYellow/StableSPAM, ``galore_torch/stablespam.py``
    (class ``StableSPAM``).

  Example:
    >>> import jax.numpy as jnp, optax, optaxclip
    >>> tx = optaxclip.stable_spam(1e-2, reset_interval=2)
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> for g in ([1.0, 1.0, 1.0], [1.0, 1.0, 50.0], [1.0, 1.0, 1.0]):
    ...   updates, state = tx.update({"w": jnp.array(g)}, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> logs = optaxclip.stats(state)
    >>> int(logs["stable_spam/resets"]), float(logs["stable_spam/scale"])
    (1, 1.0)
  """
  who = "stable_spam"
  _check_learning_rate(who, learning_rate)
  _check_decay(who, "b1", b1)
  _check_decay(who, "b2", b2)
  _checks.check_number("eps", eps, who=who, low=0.0)
  _checks.check_number("weight_decay", weight_decay, who=who, low=0.0)
  _check_decay(who, "gamma1", gamma1)
  _check_decay(who, "gamma2", gamma2)
  _check_decay(who, "gamma3", gamma3)
  if total_steps is not None:
    _checks.check_steps(who, "total_steps", total_steps)
  _checks.check_number("eta_min", eta_min, who=who, low=0.0, high=1.0)
  interval = _check_interval(who, reset_interval, allow_none=True)
  axis_name = _checks.check_sharding(who, axis_name, sharded)
  scale_at = _Cosine(total_steps, eta_min)
  stages = (
    clip_spikes_adaptive(
      gamma3, reset_interval=interval, axis_name=axis_name, sharded=sharded
    ),
    scale_by_norm_ema(
      _Cosine(total_steps, eta_min, gamma1),
      gamma2,
      eps=eps,
      reset_interval=interval,
      axis_name=axis_name,
      sharded=sharded,
    ),
    _scale_by_stable_spam_adam(b1, b2, eps, scale_at, interval),
    optax.add_decayed_weights(cast(Any, weight_decay)),
    optax.scale_by_learning_rate(cast(Any, learning_rate)),
  )
  chained = optax.chain(*stages)
  raw = [_compiled._raw_update(stage) for stage in stages]  # noqa: SLF001

  def init_fn(params):
    # Checked here so that a bad leaf's message names stable_spam, not the
    # stage that would find it first.
    _checks.check_float_leaves(params, f"{who}: params", real=True)
    return chained.init(params)

  def update_fn(updates, state, params=None):
    _checks.check_float_leaves(updates, f"{who}: updates", real=True)
    # optax.chain's step, in one program (the stages' updates without their
    # own jit), the stages handing their packed small leaves to the next.
    new_state = []
    with _norms.handing_over():
      for stage_update, stage_state in zip(raw, state):
        updates, stage_state = stage_update(updates, stage_state, params)
        new_state.append(stage_state)
    return updates, tuple(new_state)

  return optax.GradientTransformation(init_fn, _compiled.jit_update(update_fn))
