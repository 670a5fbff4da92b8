"""StableAdamW: AdamW with per-tensor update clipping against Adam's second
moment (Wortsman et al. 2023), step for step with torch-optimi's
``StableAdamW``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxclip import _checks
from optaxclip import _compiled
from optaxclip import _functional
from optaxclip import _norms
from optaxclip import _schedules
from optaxclip import _stats
from optaxclip import _telemetry
from optaxclip._typing import AxisName
from optaxclip._typing import Scalar
from optaxclip._typing import ScalarOrSchedule

# Parameter dtypes whose updates are summed with a Kahan compensation.
_LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@_stats.register("stable_adamw", ("max_rms", "scaled", "clip_fraction"))
class StableAdamWState(NamedTuple):
  """State of :func:`stable_adamw`.

  Attributes:
    count: updates so far (int32, saturating); schedules are evaluated at
      it and the betas debiased at ``count + 1``.
    mu: the first moment, float32 (float64 for float64 parameters).
    nu: the second moment, as ``mu``.
    kahan: per leaf, the Kahan compensation of a bfloat16 or float16
      parameter (its dtype and shape); a ``(0,)`` array for other leaves
      and with ``kahan_sum=False``.
    rms: each tensor's update RMS this step, ``sqrt(mean(g**2 / max(v,
      eps**2)))``, as a :class:`LeafNorms` (float32, one entry per leaf;
      :func:`optaxclip.stats` reports ``stable_adamw/rms/<path>``).
    max_rms: the largest of them (NaN when one is NaN).
    scaled: how many tensors had their learning rate divided by their RMS
      (those with RMS > 1), int32.
    clip_fraction: ``scaled`` over the number of tensors.
  """

  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  mu: optax.Updates
  nu: optax.Updates
  kahan: optax.Updates
  rms: Any  # LeafNorms: float32 (leaves,), static structure
  max_rms: jax.Array  # float32 scalar
  scaled: jax.Array  # int32 scalar
  clip_fraction: jax.Array  # float32 scalar in [0, 1]

  def stats_items(self, key: str) -> list[tuple[str, jax.Array]]:
    """``(key, value)`` of each tensor's RMS, for :func:`optaxclip.stats`."""
    return _per_leaf_items(f"{key}/rms", self.rms)


def _per_leaf_items(base: str, norms: Any) -> list[tuple[str, jax.Array]]:
  """``(base/<path>, value)`` per entry of a :class:`LeafNorms`."""
  if not isinstance(norms, _telemetry.LeafNorms):
    return []
  values = norms.values
  return [
    (f"{base}/{name}" if name else base, values[..., i])
    for i, name in enumerate(norms.names())
  ]


def _log(base: Any, dtype: Any) -> jax.Array:
  """``log(base)``, taken in float64 when ``base`` is a number."""
  if _checks.is_concrete_number(base):
    b = float(base)
    return jnp.asarray(-np.inf if b == 0.0 else math.log(b), dtype)
  return jnp.log(jnp.asarray(base).astype(dtype))


def debiased_beta(beta: Any, t: jax.Array, dtype: Any) -> tuple[Any, Any]:
  """``(beta_hat, 1 - beta_hat)`` at step ``t >= 1``: the bias correction
  folded into the decay, ``beta_hat = beta (1 - beta**(t-1)) / (1 -
  beta**t)`` (0 at ``t = 1``: the first moment is the first gradient).

  ``1 - beta**k`` is taken as ``-expm1(k log beta)`` and the complement as
  ``(1 - beta) / (1 - beta**t)``, so that neither loses digits to
  cancellation near ``beta = 1`` (torch-optimi's ``debias_beta`` writes
  ``(beta**t - beta) / (beta**t - 1)`` in float64); ``1 - beta`` is
  ``1 - beta**1`` computed alike, so that the complement is exactly 1 at
  the first step.
  """
  t = t.astype(dtype)
  log_b = _log(beta, dtype)
  prev = t - 1
  # 0 * log(0) would be NaN: no power of beta at the first step.
  done = -jnp.expm1(jnp.where(prev > 0, prev * log_b, 0))
  whole = -jnp.expm1(t * log_b)
  whole = jnp.where(whole > 0, whole, 1)  # beta = 1 is refused when concrete
  first = -jnp.expm1(log_b)
  beta = jnp.asarray(beta, dtype)
  return beta * done / whole, jnp.where(first > 0, first, 1) / whole


def _leaf_moments(g, m, v, b1, b2, eps_sq):
  """Moments after this gradient and the update-to-moment ratio ``g /
  sqrt(max(v, eps**2))`` whose RMS scales the learning rate.
  """
  w = m.dtype
  g = g.astype(w)
  m = m + b1[1].astype(w) * (g - m)
  v = b2[0].astype(w) * v + b2[1].astype(w) * (g * g)
  return m, v, g / jnp.sqrt(jnp.maximum(v, eps_sq.astype(w)))


def _step(p, m, v, kahan, rate, decay, eps, out_dtype):
  """This leaf's update and its new Kahan compensation.

  ``p <- p (1 - decay) - rate m / (sqrt(v) + eps)``, as one increment in
  the moments' dtype. For a low-precision leaf with a compensation, the
  increment joins the compensation, and the update is what takes ``p`` to
  the nearest representable value of ``p + compensation`` (exactly, under
  ``optax.apply_updates``); what rounding left out is the new compensation.
  """
  w = m.dtype
  p_wide = p.astype(w)
  delta = -rate.astype(w) * (m / (jnp.sqrt(v) + eps.astype(w)))
  delta = delta - decay.astype(w) * p_wide
  if kahan.size == 0:
    return delta.astype(out_dtype), kahan
  total = kahan.astype(w) + delta
  target = (p_wide + total).astype(p.dtype)
  update = (target.astype(w) - p_wide).astype(p.dtype)
  landed = (p + update).astype(p.dtype)  # what optax.apply_updates gives
  left = total - (landed.astype(w) - p_wide)
  return update, left.astype(kahan.dtype)


@_compiled.compiled_once
def stable_adamw(
  learning_rate: ScalarOrSchedule,
  *,
  b1: Scalar = 0.9,
  b2: Scalar = 0.99,
  eps: Scalar = 1e-6,
  weight_decay: ScalarOrSchedule = 0.01,
  decouple_lr: bool = False,
  max_lr: Optional[Scalar] = None,
  kahan_sum: bool = True,
  axis_name: AxisName = None,
  sharded: Any = True,
) -> optax.GradientTransformation:
  r"""StableAdamW: AdamW whose learning rate each tensor divides by the RMS
  of its update against Adam's second moment.

  Update clipping of Wortsman et al. (an AdamW-Adafactor hybrid), as
  torch-optimi 0.3.3's ``StableAdamW`` computes it, at step ``t`` (from 1),
  for each tensor (leaf):

  1. the betas are debiased: ``b_hat = b (1 - b**(t-1)) / (1 - b**t)``;
  2. ``m <- b1_hat m + (1 - b1_hat) g``, ``v <- b2_hat v + (1 - b2_hat)
     g**2`` (no further bias correction);
  3. ``rms = sqrt(mean(g**2 / max(v, eps**2)))``, taken after the moment
     update, over the whole tensor;
  4. ``lr_t = lr / max(1, rms)``;
  5. ``p <- p (1 - lr_t weight_decay)`` (with ``decouple_lr``: ``p <- p
     (1 - lr_t / max_lr weight_decay)``), then ``p <- p - lr_t m /
     (sqrt(v) + eps)``.

  The RMS is the L2 norm of ``g / sqrt(max(v, eps**2))`` over the square
  root of the tensor's size, taken with the package's norms (float32
  accumulation; inside ``shard_map``, summed across the devices that split
  the tensor). Since ``v >= (1 - b2_hat) g**2``, each term is at most
  ``1 / (1 - b2_hat)``: the RMS cannot overflow.

  Where it differs from torch-optimi: the moments are float32 whatever the
  parameters' dtype (float64 for float64 parameters; torch-optimi keeps
  them in the parameters' dtype), which costs 8 bytes a parameter; the
  Kahan summation of bfloat16 and float16 parameters (torch-optimi's
  ``kahan_sum``, on by default there as here) carries the weight decay in
  the compensated increment too, and its compensation is kept in the
  state: the update returned takes the parameter exactly to its rounded
  target under ``optax.apply_updates``, so apply it as returned (a
  transformation chained after it that changes the update leaves the
  difference in the compensation, to be added at the next step). A NaN
  gradient makes the tensor's update NaN (torch-optimi's ``max(1, nan)``
  is 1; the update is NaN there too). A gradient element beyond the
  square root of float32's range (1.8e19) makes ``v`` infinite, as in any
  float32 Adam: that element steps by 0, as in torch-optimi, and counts 0
  in the RMS (torch-optimi squares it first: its RMS is NaN). The Triton,
  ``foreach`` and gradient-release paths are PyTorch's.

  Args:
    learning_rate: ``lr`` (>= 0): a number or an optax schedule, evaluated
      at the update count (0 on the first update).
    b1: the first moment's decay, in [0, 1).
    b2: the second moment's decay, in [0, 1).
    eps: added to ``sqrt(v)``, and ``eps**2`` bounds ``v`` below in the
      RMS (>= 0).
    weight_decay: decoupled weight decay (>= 0), a number or a schedule.
    decouple_lr: fully decoupled weight decay: the decay is scaled by
      ``lr_t / max_lr`` instead of ``lr_t``.
    max_lr: with ``decouple_lr``, the largest learning rate of the schedule
      (> 0); by default ``learning_rate`` when it is a number (required
      when it is a schedule).
    kahan_sum: sum the updates of bfloat16 and float16 parameters with a
      Kahan compensation (as torch-optimi does by default); other dtypes
      never need it.
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split: their RMS is taken over the whole
      tensor.
    sharded: per leaf, which axes of ``axis_name`` split it (as for
      :func:`clip_global`).

  Returns:
    An ``optax.GradientTransformation`` (``update`` needs ``params``) whose
    state is a :class:`StableAdamWState`; :func:`optaxclip.stats` reports
    ``stable_adamw/max_rms``, ``stable_adamw/scaled``,
    ``stable_adamw/clip_fraction`` and ``stable_adamw/rms/<path>`` per
    tensor.

  References:
    Wortsman et al., `Stable and low-precision training for large-scale
    vision-language models <https://arxiv.org/abs/2304.13013>`_, NeurIPS
    2023; torch-optimi 0.3.3 (Benjamin Warner), ``optimi/stableadamw.py``
    (``_single_param_stableadamw``) and ``optimi/utils.py``
    (``debias_beta``).

  Example:
    >>> import jax.numpy as jnp, optax, optaxclip
    >>> tx = optaxclip.stable_adamw(1e-3, weight_decay=0.0)
    >>> params = {"w": jnp.ones(4), "b": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> g = {"w": jnp.array([1.0, -2.0, 3.0, 0.5]), "b": jnp.zeros(2)}
    >>> updates, state = tx.update(g, state, params)
    >>> updates["w"]  # the first step: -lr sign(g), as Adam's
    Array([-0.001,  0.001, -0.001, -0.001], dtype=float32)
    >>> g = {"w": jnp.array([100.0, -2.0, 3.0, 0.5]), "b": jnp.zeros(2)}
    >>> updates, state = tx.update(g, state, params)
    >>> logs = optaxclip.stats(state)
    >>> round(float(logs["stable_adamw/rms/w"]), 3), int(logs[
    ...   "stable_adamw/scaled"])
    (1.117, 1)
  """
  who = "stable_adamw"
  _schedules.check(who, "learning_rate", learning_rate, low=0.0)
  for name, beta in (("b1", b1), ("b2", b2)):
    _checks.check_number(name, beta, who=who, low=0.0, high=1.0, high_open=True)
  _checks.check_number("eps", eps, who=who, low=0.0)
  _schedules.check(who, "weight_decay", weight_decay, low=0.0)
  decouple_lr = _checks.check_bool(who, "decouple_lr", decouple_lr)
  kahan_sum = _checks.check_bool(who, "kahan_sum", kahan_sum)
  if decouple_lr and max_lr is None:
    if _schedules.is_schedule(learning_rate):
      raise ValueError(
        f"{who}: max_lr must be given with decouple_lr=True when "
        "learning_rate is a schedule (the decay is scaled by lr_t / max_lr); "
        "got None."
      )
    max_lr = cast(Scalar, learning_rate)
  if decouple_lr:
    _checks.check_number("max_lr", max_lr, who=who, low=0.0, low_open=True)
  axis_name = _checks.check_sharding(who, axis_name, sharded)

  def init_fn(params):
    _checks.check_float_leaves(params, f"{who}: params", real=True)
    leaves, treedef = jax.tree.flatten(params)

    def zeros(x):
      return jnp.zeros(jnp.shape(x), _norms.accumulation_dtype(x.dtype))

    def compensation(x):
      x = jnp.asarray(x)
      if kahan_sum and x.dtype in _LOW_PRECISION:
        return jnp.zeros(x.shape, x.dtype)
      return jnp.zeros((0,), x.dtype)

    rms = _telemetry.init(params, True, [None] * len(leaves)).leaf_norms
    return StableAdamWState(
      count=jnp.zeros((), jnp.int32),
      mu=jax.tree.unflatten(treedef, [zeros(x) for x in leaves]),
      nu=jax.tree.unflatten(treedef, [zeros(x) for x in leaves]),
      kahan=jax.tree.unflatten(treedef, [compensation(x) for x in leaves]),
      rms=rms,
      max_rms=jnp.zeros((), jnp.float32),
      scaled=jnp.zeros((), jnp.int32),
      clip_fraction=jnp.zeros((), jnp.float32),
    )

  def update_fn(updates, state, params=None):
    _checks.check_same_structure(
      updates, params, who, why="weight decay and the Kahan summation read them"
    )
    leaves, treedef = _functional.flatten(updates, who)
    _checks.check_float_leaves(updates, f"{who}: updates", real=True)
    p_leaves = [jnp.asarray(x) for x in treedef.flatten_up_to(params)]
    m_leaves = treedef.flatten_up_to(state.mu)
    v_leaves = treedef.flatten_up_to(state.nu)
    k_leaves = treedef.flatten_up_to(state.kahan)
    count = state.count
    f32 = jnp.float32
    t = count.astype(f32) + 1
    lr = jnp.asarray(
      _schedules.value_at(learning_rate, count, low=None), f32
    ).reshape(())
    wd = jnp.asarray(
      _schedules.value_at(weight_decay, count, low=None), f32
    ).reshape(())
    betas = (debiased_beta(b1, t, f32), debiased_beta(b2, t, f32))
    eps_ = jnp.asarray(eps, f32)
    moments = [
      _leaf_moments(g, m, v, *betas, eps_ * eps_)
      for g, m, v in zip(leaves, m_leaves, v_leaves)
    ]
    flags = _functional.sharded_flags(updates, sharded, who, axis_name)
    norms = _norms.unit_norms_scaled(
      [q for _, _, q in moments], 2.0, axis_name=axis_name, sharded=flags
    )
    sizes = [x.size * _norms.axis_size(f) for x, f in zip(leaves, flags)]
    rms = [
      n.as_float().reshape(()).astype(f32)
      * np.float32(1 / math.sqrt(max(s, 1)))
      for n, s in zip(norms, sizes)
    ]
    out, kahan = [], []
    for i, (p, (m, v, _)) in enumerate(zip(p_leaves, moments)):
      rate = lr / jnp.maximum(1.0, rms[i])
      decay = rate * (wd / jnp.asarray(max_lr, f32) if decouple_lr else wd)
      u, k = _step(p, m, v, k_leaves[i], rate, decay, eps_, p.dtype)
      out.append(u)
      kahan.append(k)
    vector = jnp.stack(rms) if rms else jnp.zeros((0,), f32)
    vector = jax.lax.stop_gradient(vector)
    scaled = jnp.sum(vector > 1, dtype=jnp.int32)
    largest = jnp.max(vector, initial=0.0)
    largest = jnp.where(jnp.any(jnp.isnan(vector)), jnp.nan, largest)
    old = state.rms
    new_state = StableAdamWState(
      count=_schedules.next_count(count),
      mu=jax.tree.unflatten(treedef, [m for m, _, _ in moments]),
      nu=jax.tree.unflatten(treedef, [v for _, v, _ in moments]),
      kahan=jax.tree.unflatten(treedef, kahan),
      rms=_telemetry.LeafNorms(vector, old.treedef, old.layers),
      max_rms=largest.astype(f32),
      scaled=scaled,
      clip_fraction=(scaled / max(len(leaves), 1)).astype(f32),
    )
    return jax.tree.unflatten(treedef, out), new_state

  return optax.GradientTransformation(init_fn, _compiled.jit_update(update_fn))
