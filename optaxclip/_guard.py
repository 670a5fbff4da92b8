"""``guard``: skip an optimizer step (or some of its tensors) on a NaN/Inf,
spiking gradient or a spiking loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional
import warnings

import jax
import jax.numpy as jnp
import optax

from optaxclip import _adaptive
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

Window = _moments.Window
Window.__module__ = "optaxclip"


class Moments(NamedTuple):
  """The running statistics of one value :func:`guard` watches: the gradient
  norm's (``GuardState.norm_moments``) or the loss's
  (``GuardState.loss_monitor.moments``).

  Float fields are in the statistics dtype chosen at ``init``. With
  ``scope="leaf"`` the norm's hold one entry per leaf, in the order of
  ``jax.tree.leaves(params)``.

  Attributes:
    count: finite values gathered for the warm-up, at most ``warmup_steps``
      (with ``window``: values of steps that went through, back to 1 when a
      window of only zeros restarts); the loss's count only steps that went
      through.
    mean: the mean (the warm-up's plain mean, then an EMA; with ``window``,
      the mean of the window).
    var: the variance, likewise (with the scale of
      :class:`ClipZscoreState`'s ``var`` outside ``2**-41`` to ``2**40``).
    consecutive_spikes: values in a row above the spike bound of the
      statistics as they were before any raise (see :func:`guard`).
    window: the last ``window`` accepted values, an ``optaxclip.Window``;
      ``None`` for the EMA.
  """

  count: jax.Array  # int32  # pyright: ignore[reportIncompatibleMethodOverride]
  mean: jax.Array  # float
  var: jax.Array  # float
  consecutive_spikes: jax.Array  # int32
  window: Optional[Window]


class GuardVerdict(NamedTuple):
  """What :func:`guard` measured and decided on the last step.

  Attributes:
    norm: the step's global L2 gradient norm.
    threshold: the largest norm that passed: ``max_norm`` and, after
      warm-up, the spike bound; +inf when neither applies (with
      ``scope="leaf"``: the L2 norm of the per-leaf thresholds).
    z_score: the norm in standard deviations above the mean of the
      statistics it was judged by, ``(norm - mean) / sqrt(var)``; 0 where
      that is undefined (during warm-up, for a NaN/Inf norm, or when the
      variance is 0). With ``scope="leaf"``: the largest over the leaves.
    skip_cause: why the step was skipped (int32): 0 when it went through,
      else the counter it was counted in: 1 ``skipped_nonfinite``, 2
      ``skipped_max_norm``, 3 ``skipped_spike``, 4 ``skipped_loss_spike``.
      :func:`optaxclip.explain` reads it.
    skipped_leaves: leaves skipped (``scope="leaf"``; ``None`` with
      ``scope="global"``).
  """

  norm: jax.Array  # float scalar
  threshold: jax.Array  # float scalar
  z_score: jax.Array  # float scalar
  skip_cause: jax.Array  # int32 scalar: SKIP_CAUSES index
  skipped_leaves: Optional[jax.Array]  # int32 scalar


class GuardCounts(NamedTuple):
  """What :func:`guard` counted since ``init`` (int32 scalars, saturating).

  Each skipped step is counted once, under the first cause that holds:
  the four ``skipped_*`` counters add up to ``skipped`` (for a state
  counted from ``init``; one upgraded from release 0.1.0 starts them at 0).

  Attributes:
    skipped: steps skipped, whatever the cause (with ``scope="leaf"``, steps
      in which at least one leaf was skipped).
    consecutive_skips: skipped steps in a row, ending with the last one (0
      when it went through).
    nonfinite: steps with a NaN/Inf gradient, skipped or not (with
      ``skip_nonfinite=False`` they pass and are still counted here).
    restarts: steps on which statistics (of the norm, per leaf with
      ``scope="leaf"``, or of the loss) moved to a new level: a first value
      above 0 after only zeros, or a mean raised after ``patience`` spikes
      in a row (each unit and each statistic counted).
    skipped_nonfinite: skipped because the gradient (or, when loss-aware,
      the loss) held NaN/Inf.
    skipped_max_norm: skipped because the norm was above ``max_norm``.
    skipped_spike: skipped as a spike of the norm; an infinite norm of
      finite values counts here when only the spike bound stops it.
    skipped_loss_spike: skipped as a spike of the loss; always 0 without
      ``loss_spike_z``.
  """

  skipped: jax.Array
  consecutive_skips: jax.Array
  nonfinite: jax.Array
  restarts: jax.Array
  skipped_nonfinite: jax.Array
  skipped_max_norm: jax.Array
  skipped_spike: jax.Array
  skipped_loss_spike: jax.Array


class LossMonitor(NamedTuple):
  """The loss as a loss-aware :func:`guard` (``loss_spike_z``) watches it.

  Attributes:
    value: the last step's loss (the ``value`` given to ``update``; averaged
      over ``axis_name``).
    z_score: the loss in standard deviations above its mean, 0 where
      undefined (as :class:`GuardVerdict`'s ``z_score``).
    moments: the statistics of the loss, a :class:`Moments`.
  """

  value: jax.Array  # float scalar
  z_score: jax.Array  # float scalar
  moments: Moments


# Where each field of GuardState's earlier flat layout lives now: the stats()
# key it still names, the deprecated attribute that reads it, and the map
# upgrade_state follows to restore a checkpoint of that layout.
FLAT_FIELDS = {
  "norm": ("verdict", "norm"),
  "threshold": ("verdict", "threshold"),
  "z_score": ("verdict", "z_score"),
  "skip_cause": ("verdict", "skip_cause"),
  "skipped_leaves": ("verdict", "skipped_leaves"),
  **{
    name: ("counts", name)
    for name in GuardCounts._fields  # pyright: ignore[reportAttributeAccessIssue]
  },
  **{
    name: ("norm_moments", name)
    for name in Moments._fields  # pyright: ignore[reportAttributeAccessIssue]
  },
  "loss": ("loss_monitor", "value"),
  "loss_z_score": ("loss_monitor", "z_score"),
  "loss_moments": ("loss_monitor", "moments"),
}


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
    "skipped_loss_spike",
    "loss",
    "loss_z_score",
    "skipped_leaves",
  ),
  paths=FLAT_FIELDS,
)
class GuardState(NamedTuple):
  """State of :func:`guard`, grouped by concern.

  :func:`optaxclip.stats` reports it under flat keys (``guard/skipped``,
  ``guard/norm``, ``guard/loss``, ...), the names of the fields inside the
  groups. The flat attributes of the earlier layout (``state.skipped``,
  ``state.mean``, ``state.loss``, ...) still read the same values, with a
  ``DeprecationWarning``; :func:`optaxclip.upgrade_state` restores a
  checkpoint saved in that layout.

  Float fields are in the statistics dtype chosen at ``init`` (float32, or
  float64 for float64 parameters). Fields that a configuration does not
  use are ``None`` (and left out of :func:`stats`).

  Attributes:
    inner_state: the state of the guarded transformation.
    step: updates so far, skipped ones included (int32, saturating): the
      step at which a schedule of ``max_norm``, ``spike_z`` or
      ``loss_spike_z`` is evaluated.
    verdict: the last step's norm, threshold, z-score and skip cause, a
      :class:`GuardVerdict`.
    counts: the skip counters, a :class:`GuardCounts`.
    norm_moments: the statistics of the norm, a :class:`Moments` (one entry
      per leaf with ``scope="leaf"``).
    loss_monitor: the loss and its statistics, a :class:`LossMonitor`;
      ``None`` without ``loss_spike_z``.
    leaf_norms: with ``leaf_stats=True``, each leaf's L2 norm this step (a
      ``(L,)`` vector per layer for a leaf with a ``layer_axis``), float32,
      a :class:`LeafNorms` (one vector; ``.tree()`` is a pytree shaped
      like the updates); else ``None``.
    top_leaf_share: with ``leaf_stats=True``, the share of the squared
      global norm carried by the largest leaf or layer; else ``None``.
    top_leaf: with ``leaf_stats=True``, that leaf's or layer's index in the
      flattened ``leaf_norms``; else ``None``.
  """

  inner_state: Any
  step: jax.Array  # int32 scalar
  verdict: GuardVerdict
  counts: GuardCounts
  norm_moments: Moments
  loss_monitor: Optional[LossMonitor]
  leaf_norms: Any = None  # LeafNorms: float32 (entries,), static structure
  top_leaf_share: Optional[jax.Array] = None  # float32 scalar in [0, 1]
  top_leaf: Optional[jax.Array] = None  # int32 scalar


def _flat_alias(name: str, path: tuple[str, ...]) -> property:
  """A read-only attribute of the flat layout, reading ``path``."""
  where = ".".join(path)

  def read(state: GuardState) -> Any:
    warnings.warn(
      f"GuardState.{name} is deprecated: read state.{where} (the stats() "
      f"key guard/{name} is unchanged).",
      DeprecationWarning,
      stacklevel=2,
    )
    return _stats.follow(state, path)

  return property(read, doc=f"Deprecated: ``{where}``.")


for _name, _path in FLAT_FIELDS.items():
  setattr(GuardState, _name, _flat_alias(_name, _path))

for _cls in (Moments, GuardVerdict, GuardCounts, LossMonitor):
  _cls.__module__ = "optaxclip"


# GuardState.skip_cause's values: the cause counter each one is counted in.
SKIP_CAUSES = (
  None,
  "skipped_nonfinite",
  "skipped_max_norm",
  "skipped_spike",
  "skipped_loss_spike",
)


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


def _state_axes(new: Any, old: Any) -> Any:
  """Per leaf of ``new`` (an inner state, or its structs), the mesh axes
  over which it or ``old``'s leaf varies inside ``shard_map``.
  """
  return jax.tree.map(
    lambda n, o: _varying_axes(n) | _varying_axes(o), new, old
  )


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


class _Judged(NamedTuple):
  """The verdict of :func:`_judge` on one statistic, per unit."""

  mean: jax.Array  # the mean it was judged by (raised where ``raised``)
  var: jax.Array  # the variance, kept with that mean's scale
  bound: jax.Array  # the spike bound it was judged by (+inf: none)
  spike: jax.Array  # above that bound: skipped
  held: jax.Array  # above the bound before any raise (the streak's)
  restart: jax.Array  # a first nonzero value after only zeros
  raised: jax.Array  # judged against the raised level
  z_score: jax.Array  # against ``mean``; 0 where undefined


def _above(x, finite, mean, std, z):
  """The spike bound ``mean + z * std`` and whether ``x`` is above it.

  A value equal to the mean up to rounding is no spike, however small the
  variance: a constant stream's moments carry rounding noise (a mean one ulp
  off, a variance of 1e-16), against which its own value would read as a
  spike at every step.
  """
  bound = mean + z * std
  eps = jnp.finfo(x.dtype).eps
  rounding = 4 * eps * jnp.maximum(jnp.abs(x), jnp.abs(mean))
  return bound, finite & (x > bound) & (x - mean > rounding)


def _raised_level(mean, std, growth):
  """The level a held-back statistic is judged by after a raise:
  ``max(mean, 0) + (growth - 1) * max(|mean|, std)``, kept finite.

  ``growth * mean`` for a positive mean above its spread. A negative mean
  (a signed loss) rises above 0 at once: ``mean + (growth - 1) |mean|``
  would, with ``growth`` below 2 and no spread, only approach 0 and never
  pass a positive level. Above 0 unless mean and spread are both 0 (the
  statistics of only zeros, which restart instead).
  """
  scale = jnp.maximum(jnp.abs(mean), std)
  step = (jnp.asarray(growth, mean.dtype) - 1) * scale
  up = jnp.maximum(mean, 0) + step
  return jnp.minimum(up, jnp.finfo(mean.dtype).max)


def _judge(
  x, finite, count, mean, var, run, *, z, warmup_steps, patience, growth
):
  """The spike test of one statistic (per unit) against its moments.

  Statistics that have seen only zeros (mean and variance exactly 0: no
  scale) take the first value above 0 as a new level (``restart``). Else a
  value above ``mean + z * std`` is a spike (with a variance of 0, any value
  above the mean); once ``run`` (``patience`` or more) spikes in a row came
  before it, the mean is first raised to :func:`_raised_level` (the variance
  kept, at the new mean's scale) and the value is judged against that.
  """
  warming = count < warmup_steps
  std = _moments.spread(mean, var)
  no = jnp.zeros(jnp.shape(x), bool)
  if z is None:
    bound, spike = jnp.full(jnp.shape(x), jnp.inf, x.dtype), no
    restart = held = raised = no
  else:
    bound, spike = _above(x, finite, mean, std, z)
    bound = jnp.where(warming, jnp.inf, bound)
    spike = spike & ~warming
    restart = spike & (mean == 0) & (var == 0)
    held = spike & ~restart
    raised = held & (run >= patience)
    up = jnp.where(raised, _raised_level(mean, std, growth), mean)
    e_up = _moments.spread_exponent(up)
    e_from = _moments.spread_exponent(mean)
    var = jnp.where(raised, _moments.rescaled(var, e_from, e_up), var)
    bound_up, spike_up = _above(x, finite, up, std, z)
    bound = jnp.where(raised, bound_up, bound)
    spike = jnp.where(raised, spike_up, held)
    mean = up
  judged = ~warming & finite & (std > 0)
  z_score = jnp.where(judged, (x - mean) / jnp.where(judged, std, 1), 0)
  return _Judged(mean, var, bound, spike, held, restart, raised, z_score)


def _shifted(win: Window, by: jax.Array, where: jax.Array) -> Window:
  """``win`` with the values of the units ``where`` moved by ``by`` (kept
  finite): their mean moves by ``by``, their spread stays.
  """
  values = win.values
  rows = jnp.arange(values.shape[0]).reshape((-1,) + (1,) * by.ndim)
  big = jnp.finfo(values.dtype).max
  moved = jnp.clip(values + by, -big, big)
  return win._replace(
    values=jnp.where(where & (rows < win.filled), moved, values)
  )


def _is_masked(node: Any) -> bool:
  return isinstance(node, optax.MaskedNode)


def _mirrors(node: Any, paths: list) -> bool:
  """Whether ``node`` holds one slot per parameter leaf: its leaves sit at
  the parameters' paths (``optax.MaskedNode`` standing in for masked ones),
  as Adam's ``mu`` and ``nu`` or Adafactor's factored moments do.
  """
  flat = jax.tree_util.tree_flatten_with_path(node, is_leaf=_is_masked)[0]
  return bool(paths) and [p for p, _ in flat] == paths


def _children(node: Any):
  """``node``'s immediate children with their path entries, and a rebuild."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(
    node, is_leaf=lambda child: child is not node
  )
  return flat, treedef


def _splits(state: Any, paths: list, where: str = "") -> None:
  """Raises unless ``state`` can be split per parameter leaf."""
  if _mirrors(state, paths):
    return
  flat, treedef = _children(state)
  if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # an array
    dtype = getattr(state, "dtype", None)
    if (
      dtype is not None
      and jnp.issubdtype(dtype, jnp.inexact)
      and jnp.ndim(state) > 0
    ):
      raise ValueError(
        "guard: with scope='leaf', inner's state must hold only scalars, "
        "integer arrays and subtrees with one slot per parameter leaf (as "
        "Adam's mu and nu); got a float array of shape "
        f"{tuple(jnp.shape(state))} at inner_state{where or ''}, which "
        "cannot be split by leaf."
      )
    return
  for path, child in flat:
    _splits(child, paths, where + jax.tree_util.keystr(tuple(path)))


def _split(new: Any, old: Any, keep: list, paths: list, keep_rest) -> Any:
  """``new``, but with ``old``'s slot of every leaf whose ``keep`` is true
  in the subtrees that mirror the parameters, and ``old``'s rest (scalars,
  integer arrays) where ``keep_rest`` is.
  """
  if _mirrors(new, paths):
    leaves_new, treedef = jax.tree.flatten(new, is_leaf=_is_masked)
    leaves_old = jax.tree.leaves(old, is_leaf=_is_masked)
    out = [
      n if _is_masked(n) else _norms.select(k, o, n)
      for n, o, k in zip(leaves_new, leaves_old, keep)
    ]
    return jax.tree.unflatten(treedef, out)
  flat, treedef = _children(new)
  if treedef.num_nodes == 1 and treedef.num_leaves == 1:
    if new is None or _is_masked(new):
      return new
    return jnp.where(keep_rest, old, new)
  old_children = [c for _, c in _children(old)[0]]
  return jax.tree_util.tree_unflatten(
    treedef,
    [
      _split(n, o, keep, paths, keep_rest)
      for (_, n), o in zip(flat, old_children)
    ],
  )


def _cause_index(*hits) -> jax.Array:
  """The :data:`SKIP_CAUSES` index of a step's cause (``hits`` from
  :func:`_one_cause`, at most one of them true), 0 for none.
  """
  index = jnp.zeros((), jnp.int32)
  for i, hit in enumerate(hits, start=1):
    index = jnp.where(hit, jnp.int32(i), index)
  return index


def _one_cause(skip_any, *causes):
  """The first of ``causes`` that holds, for a skipped step: one cause per
  skipped step, so that the cause counters add up to ``skipped``.
  """
  taken = jnp.zeros((), bool)
  out = []
  for cause in causes:
    hit = skip_any & cause & ~taken
    out.append(hit)
    taken = taken | hit
  return out


def _skip_whole_step(inner, updates, old_inner, params, skip, extra_args):
  """``inner``'s update where ``skip`` is False, else zero updates and
  ``old_inner`` as it was, in a ``lax.cond``: a skipped step costs nothing
  and the state is not copied.
  """
  # inner's outputs may differ from the updates in dtype, and inside
  # shard_map both branches must vary over the same mesh axes: the skip
  # branch takes both from the step's outputs. JAX traces the true branch
  # first, so inner is traced once (a second trace of inner on a tree of
  # thousands of leaves is a large share of guard's tracing time);
  # eval_shape is the fallback for a JAX that does not.
  seen = {}

  def record(out_shapes):
    seen["updates"] = out_shapes[0]
    seen["axes"] = _state_axes(out_shapes[1], old_inner)

  def step():
    new_updates, new_inner = inner.update(
      updates, old_inner, params, **extra_args
    )
    record(jax.eval_shape(lambda: (new_updates, new_inner)))
    return new_updates, jax.tree.map(_vary, new_inner, seen["axes"])

  def skip_step():
    if not seen:
      record(
        jax.eval_shape(
          lambda: inner.update(updates, old_inner, params, **extra_args)
        )
      )
    zeros = jax.tree.map(_zeros_like_struct, seen["updates"])
    return zeros, jax.tree.map(_vary, old_inner, seen["axes"])

  # The real step goes in the true branch: XLA:CPU runs the other order
  # several times slower.
  return jax.lax.cond(~skip, step, skip_step)


def _skip_leaves(inner, updates, old_inner, params, skip, extra_args):
  """``inner``'s update with the leaves where ``skip`` (per leaf) is True
  zeroed, in the updates and in the slots of ``inner``'s state that mirror
  the parameters (``_split``).

  One step for every outcome, the skipped leaves masked in and out, no
  cond: inner is traced and compiled once, not once more in a branch of its
  own without the masks, and the state is selected in the kernels that
  compute it, not copied through a cond's outputs. The skipped leaves enter
  as zeros: a NaN leaf must not reach the others through a global norm
  inside ``inner``.
  """
  leaves, treedef = jax.tree.flatten(updates)
  # take_each, not skip[i]: a constant slice fused into each leaf's select
  # would be a kernel of its own per leaf (compile time).
  keep = [k > 0 for k in _norms.take_each(skip.astype(jnp.int32))]
  paths = _leaf_paths(updates)
  g = jax.tree.unflatten(
    treedef,
    [
      _norms.select(k, jax.lax.full_like(x, 0), x) for x, k in zip(leaves, keep)
    ],
  )
  # Traced once, without jax.eval_shape first (no cond here needs the shapes
  # before the step).
  new_updates, new_inner = inner.update(g, old_inner, params, **extra_args)
  out = jax.tree.leaves(new_updates)
  new_updates = jax.tree.unflatten(
    jax.tree.structure(new_updates),
    [_norms.select(k, jax.lax.full_like(u, 0), u) for u, k in zip(out, keep)],
  )
  # Every leaf skipped: the whole step is (inner's scalars do not move).
  new_inner = _split(new_inner, old_inner, keep, paths, jnp.all(skip))
  state_axes = _state_axes(new_inner, old_inner)
  return new_updates, jax.tree.map(_vary, new_inner, state_axes)


def _loss_value(extra_args: dict, dtype, axis_name) -> jax.Array:
  """The loss passed as ``value=``, a scalar of ``dtype`` (averaged over
  ``axis_name``), or a clear error.
  """
  if "value" not in extra_args or extra_args["value"] is None:
    raise ValueError(
      "guard: value must be passed to update when loss_spike_z is set, as "
      "tx.update(grads, state, params, value=loss); got no value."
    )
  loss = jnp.asarray(extra_args["value"])
  if loss.shape != ():
    raise ValueError(
      f"guard: value must be a scalar loss; got shape {loss.shape}."
    )
  loss = jax.lax.stop_gradient(loss).astype(dtype)
  if axis_name:
    loss = jax.lax.pmean(loss, axis_name)
  return loss


@dataclasses.dataclass(frozen=True)
class _Config:
  """What a :func:`guard` was built with, for the pieces of its update."""

  skip_nonfinite: bool
  spike_z: Optional[ScalarOrSchedule]
  max_norm: Optional[ScalarOrSchedule]
  loss_spike_z: Optional[ScalarOrSchedule]
  alpha: Scalar
  warmup_steps: Scalar
  patience: Scalar
  growth: Scalar
  window: Optional[int]
  axis_name: AxisName

  def at(self, schedule: ScalarOrSchedule, step: jax.Array, name: str):
    return _schedules.value_at(schedule, step, who="guard", name=name)


def _init_moments(cfg: _Config, shape: tuple, dtype) -> Moments:
  """Statistics that have seen nothing, one entry per unit of ``shape``."""
  return Moments(
    count=jnp.zeros(shape, jnp.int32),
    mean=jnp.zeros(shape, dtype),
    var=jnp.zeros(shape, dtype),
    consecutive_spikes=jnp.zeros(shape, jnp.int32),
    window=None
    if cfg.window is None
    else _moments.window_init(cfg.window, shape, dtype),
  )


def _judge_against(cfg: _Config, moments: Moments, x, finite, z) -> _Judged:
  """:func:`_judge` of ``x`` against ``moments`` (in ``x``'s dtype)."""
  return _judge(
    x,
    finite,
    moments.count,
    moments.mean.astype(x.dtype),
    moments.var.astype(x.dtype),
    moments.consecutive_spikes,
    z=z,
    warmup_steps=cfg.warmup_steps,
    patience=cfg.patience,
    growth=cfg.growth,
  )


def _next_moments(
  cfg: _Config, moments: Moments, judged: _Judged, x, *, finite, take
) -> Moments:
  """``moments`` after taking ``x`` in where ``finite & take``, from those
  ``judged`` by (a raise is kept whether ``x`` enters or not: a window's
  values move with the mean).
  """
  old_mean = moments.mean.astype(x.dtype)
  restart = judged.restart
  win = moments.window
  if win is None:
    count, mean, var = _moments.running_moments(
      moments.count,
      judged.mean,
      judged.var,
      x,
      alpha=cfg.alpha,
      warmup_steps=cfg.warmup_steps,
      finite=finite & (take | restart),
      take=jnp.ones((), bool),
      restart=restart,
    )
  else:
    win = _shifted(win, judged.mean - old_mean, judged.raised)
    count, win, mean, var = _moments.rolling_moments(
      moments.count,
      win,
      x,
      warmup_steps=cfg.warmup_steps,
      take=finite & take,
      restart=finite & restart,
    )
  return Moments(
    count=count,
    mean=mean.astype(moments.mean.dtype),
    var=var.astype(moments.var.dtype),
    consecutive_spikes=_moments.streak(
      moments.consecutive_spikes, judged.held, finite
    ),
    window=win,
  )


class _NormCheck(NamedTuple):
  """The judgement of a step's gradient norm, per unit (the whole gradient,
  or each leaf with ``scope="leaf"``).
  """

  norm: jax.Array  # per unit
  finite: jax.Array  # the norm is finite
  nonfinite: jax.Array  # NaN/Inf in the gradient
  judged: _Judged
  cap: jax.Array  # max_norm this step (+inf: none)
  above_cap: jax.Array
  spike: jax.Array  # stopped by the spike bound
  skip: jax.Array  # skipped for the norm's sake


def _check_norm(
  cfg: _Config, moments: Moments, step: jax.Array, measured
) -> _NormCheck:
  """This step's norm against ``max_norm`` and the spike bound."""
  g = measured.stat_norm
  dtype = g.dtype
  # NaN/Inf in the gradient. A norm of finite values beyond the dtype's
  # range is not one (inf as a number: above any bound, kept out of the
  # statistics).
  nonfinite = ~measured.unit_finite
  finite = jnp.isfinite(g)
  cap = jnp.asarray(
    jnp.inf if cfg.max_norm is None else cfg.at(cfg.max_norm, step, "max_norm"),
    dtype,
  )
  z = None if cfg.spike_z is None else cfg.at(cfg.spike_z, step, "spike_z")
  judged = _judge_against(cfg, moments, g, finite, z)
  bound = judged.bound
  # An infinite norm is above any finite bound, whatever skip_nonfinite.
  # A NaN bound (from a schedule) skips the step.
  spike = judged.spike | (jnp.isinf(g) & (bound < jnp.inf)) | jnp.isnan(bound)
  # A bound of 0 lets nothing through, not even a zero gradient (whose
  # inner update, with momentum, need not be zero); nor does a NaN one.
  above_cap = (g > cap) | ~(cap > 0)
  skip = above_cap | spike
  if cfg.skip_nonfinite:
    skip = skip | nonfinite
  return _NormCheck(g, finite, nonfinite, judged, cap, above_cap, spike, skip)


class _LossCheck(NamedTuple):
  """The judgement of a step's loss."""

  loss: jax.Array
  finite: jax.Array
  judged: _Judged
  spike: jax.Array  # stopped by the loss's spike bound
  nonfinite: jax.Array  # skipped as NaN/Inf (with skip_nonfinite)


def _check_loss(
  cfg: _Config, monitor: LossMonitor, step, extra_args: dict, dtype
) -> _LossCheck:
  """This step's loss (``value=``) against its spike bound."""
  assert cfg.loss_spike_z is not None
  loss = _loss_value(extra_args, dtype, cfg.axis_name)
  finite = jnp.isfinite(loss)
  z = cfg.at(cfg.loss_spike_z, step, "loss_spike_z")
  judged = _judge_against(cfg, monitor.moments, loss, finite, z)
  # A NaN bound (from a schedule) skips the step, as a spike would.
  spike = judged.spike | jnp.isnan(judged.bound)
  nonfinite = ~finite if cfg.skip_nonfinite else jnp.zeros((), bool)
  return _LossCheck(loss, finite, judged, spike, nonfinite)


def _next_loss_monitor(
  cfg: _Config, monitor: LossMonitor, check: _LossCheck, applied
) -> LossMonitor:
  """The loss's statistics after a step: only a step that went through (in
  any leaf) enters them.
  """
  dtype = monitor.moments.mean.dtype
  return LossMonitor(
    value=check.loss.astype(dtype),
    z_score=check.judged.z_score.astype(dtype),
    moments=_next_moments(
      cfg,
      monitor.moments,
      check.judged,
      check.loss,
      finite=check.finite,
      take=jnp.any(applied),
    ),
  )


def _next_counts(
  counts: GuardCounts, skip_any, nonfinite, restarts, causes
) -> GuardCounts:
  """The counters after a step; ``causes`` from :func:`_one_cause`."""
  by_nonfinite, by_max_norm, by_spike, by_loss = causes
  add = _moments.add_count
  return GuardCounts(
    skipped=jnp.where(
      skip_any, optax.safe_increment(counts.skipped), counts.skipped
    ),
    consecutive_skips=jnp.where(
      skip_any, optax.safe_increment(counts.consecutive_skips), 0
    ),
    nonfinite=add(counts.nonfinite, nonfinite),
    restarts=restarts,
    skipped_nonfinite=add(counts.skipped_nonfinite, by_nonfinite),
    skipped_max_norm=add(counts.skipped_max_norm, by_max_norm),
    skipped_spike=add(counts.skipped_spike, by_spike),
    skipped_loss_spike=add(counts.skipped_loss_spike, by_loss),
  )


def _verdict(
  norm: _NormCheck, skip, causes, dtype, per_leaf: bool
) -> GuardVerdict:
  """The step's verdict: per-unit values summed into one (the L2 norm of
  the per-leaf norms and thresholds, the largest z-score).
  """
  judged = norm.judged
  threshold = jnp.minimum(
    norm.cap, jnp.where(judged.restart, jnp.inf, judged.bound)
  )
  z_score = judged.z_score
  if per_leaf:
    top = _norms.nan_max(z_score, initial=-jnp.inf) if z_score.size else 0.0
    z_score = jnp.where(jnp.isfinite(top), top, 0)
  return GuardVerdict(
    norm=_measure.total(norm.norm, dtype),
    threshold=_measure.total(threshold, dtype),
    z_score=jnp.asarray(z_score).astype(dtype),
    skip_cause=_cause_index(*causes),
    skipped_leaves=jnp.sum(skip, dtype=jnp.int32) if per_leaf else None,
  )


@_compiled.compiled_once
def guard(
  inner: optax.GradientTransformation,
  *,
  skip_nonfinite: bool = True,
  spike_z: Optional[ScalarOrSchedule] = None,
  max_norm: Optional[ScalarOrSchedule] = None,
  alpha: Scalar = 0.97,
  warmup_steps: Scalar = 25,
  patience: Scalar = 25,
  growth: Scalar = 2.0,
  axis_name: AxisName = None,
  sharded: Any = True,
  loss_spike_z: Optional[ScalarOrSchedule] = None,
  window: Optional[int] = None,
  scope: Scope = "global",
  leaf_stats: bool = False,
  layer_axis: _telemetry.LayerAxis = None,
) -> optax.GradientTransformationExtraArgs:
  """Skips the ``inner`` update when the gradient is NaN/Inf or spikes, or
  when the loss spikes.

  A skipped step returns zero updates and leaves ``inner``'s state exactly
  as it was (its step count included), as if the batch never happened. A
  step is skipped when its global L2 gradient norm ``g`` is

  * NaN or infinite (with ``skip_nonfinite``), or
  * above ``max_norm`` (if given), or
  * once ``warmup_steps`` finite norms have been seen, above
    ``m + spike_z * s`` (if ``spike_z`` is given), with ``m`` and ``s`` the
    mean and standard deviation of the norm (an EMA, or over a window);

  or, with ``loss_spike_z``, when the loss passed as
  ``tx.update(grads, state, params, value=loss)`` (optax's convention for
  extra arguments, which ``optax.chain`` passes on to every transformation
  that takes them) is NaN/Inf (with ``skip_nonfinite``) or, after its own
  warm-up, more than ``loss_spike_z`` standard deviations above its mean.
  The loss statistics take in only the finite losses of steps that went
  through; a loss-aware guard called without ``value`` fails when traced.
  Each skipped step is counted once, under the first cause that holds in
  the order non-finite, ``max_norm``, spike of the norm, spike of the loss
  (``state.counts``: ``skipped_nonfinite``, ``skipped_max_norm``,
  ``skipped_spike``, ``skipped_loss_spike``; they add up to ``skipped``),
  and ``state.verdict.z_score`` / ``state.loss_monitor.z_score`` record how
  far above its mean each value was.

  **The statistics.** With ``window=None`` (the default), the norm's start
  as the plain mean and variance of the first ``warmup_steps`` finite norms
  and then follow every finite norm ``x``, ``m <- alpha m + (1 - alpha) x``
  then ``v <- alpha v + (1 - alpha) (x - m)^2`` (the update order of ZClip,
  :func:`clip_zscore`, and the same code), a spike entering at the spike
  bound ``m + spike_z s`` rather than at its own size (as in ZClip's
  "percentile" mode). So one spike barely moves the bound, while a lasting
  rise in the norm lifts it step by step until the new level passes. The
  loss's follow the same rule, from accepted steps only. With an int
  ``window``, both are instead the exact mean and (Bessel-corrected)
  standard deviation of the last ``window`` accepted values -- OLMo-core's
  ``SkipStepOptimizer`` rule, with these differences: only steps that went
  through enter the window (OLMo-core records every step's values, so a
  skipped spike widens the window it is judged by); only values *above*
  the mean are spikes (OLMo-core takes ``|x - m|``, so it also skips a
  sudden drop of the loss); its warm-up is ``max(20, window // 2)``
  recorded values, the current one included (pass
  ``warmup_steps=max(20, window // 2) - 1`` for the same). NaN/Inf values
  never enter any statistics. Statistics with no spread (variance exactly
  0, e.g. a warm-up of equal norms) judge any value above their mean a
  spike.

  **No absorbing state.** Statistics can fall behind a lasting new level:
  a window never takes in the values it skipped, the loss's statistics see
  only accepted steps, equal values have no spread, and a jump far beyond
  the spread lifts an EMA slowly. So once a statistic has been above its
  spike bound ``m + z s`` on ``patience`` steps in a row, each further such
  step first raises its mean to ``u = max(m, 0) + (growth - 1) c``, with
  ``c = max(|m|, s)`` (``growth * m`` for a positive mean above its spread;
  a negative mean of a signed loss rises above 0), its spread kept, and is
  then judged against the raised bound ``u + z s``: skipped above it,
  through below it. The raise stays whether the step passes or not (the
  EMA continues from ``u``; a window's values move by ``u - m``; the loss's
  statistics keep it on a skipped step). The level judged by so grows by
  ``growth`` a raise: a lasting level ``L`` is skipped on at most
  ``patience + max(0, ceil(log(L / ((growth - 1) c)) / log(growth)))``
  steps in a row (``c`` when the first raise comes; ``patience`` when ``L
  <= (growth - 1) c``), then passes for good unless ``max_norm`` or a
  NaN/Inf stops it.
  What the rule never does: let a value through above the bound it was
  judged by (``m + z s``, or ``u + z s`` on a raised step), so a spike
  never passes at its own size unless it lies within that raised bound;
  and skip a step without counting it (``skipped_spike``,
  ``skipped_loss_spike``). ``restarts`` counts the raised steps. The one
  exception: statistics that have seen only zeros (mean and variance
  exactly 0: the gradients of an unused leaf, a loss switched on by a
  schedule) have no scale, and the first value above 0 passes and starts
  them (the EMA's mean moves to it and its variance takes in the jump; a
  window starts again from it, warm-up included); ``restarts`` counts these
  too. A level above ``max_norm`` is skipped for as long as it lasts: that
  is the fixed limit asked for.

  **Per tensor.** With ``scope="leaf"``, each leaf of the gradient (each
  parameter tensor) has its own norm statistics, ``max_norm`` applies to
  each leaf's norm, and only the leaves that are non-finite or spike are
  skipped: their update is zero and their slots in ``inner``'s state are
  left as they were, while the other leaves step. ``inner`` sees the
  skipped leaves' gradients as zeros (a NaN leaf must not poison a global
  norm inside it). Its state is split where it mirrors the parameters: a
  subtree whose leaves sit at the parameters' paths (Adam's ``mu`` and
  ``nu``, momentum traces, Adafactor's factored moments; ``optax.masked``
  and ``optax.multi_transform`` states, whose masked slots are
  ``optax.MaskedNode``). Everything else in it is taken from the new state:
  scalars such as Adam's ``count`` and ``optax.inject_hyperparams``'
  values advance on a partial skip (Adam's bias correction then counts the
  step for the skipped leaves too), and so do integer arrays (PRNG keys).
  A float array that is neither -- a per-leaf vector of
  :func:`clip_zscore` with ``scope="leaf"``, :func:`clip_percentile`'s
  history, a flattened state -- cannot be split: ``init`` (or the first
  update) raises a ``ValueError`` naming its path. A loss spike, or a NaN
  loss, skips every leaf. ``skipped`` then counts the steps in which at
  least one leaf was skipped and ``skipped_leaves`` how many were this step.
  It costs more than the whole-step skip, in compile time and step time:
  XLA computes Adam's new moments twice, for the update and for the
  selection of the state, and copies the old ones (the figures are in
  ``docs/performance.md``).

  Unlike ``optax.apply_if_finite``, it also catches spikes, counts what it
  skipped, and never gives up and applies a non-finite update (watch
  ``consecutive_skips`` to detect a run that has diverged). It is the
  skip-the-batch remedy PaLM used for loss spikes, inside the optimizer.

  The norm and the statistics are in the accumulation dtype of the
  parameters given to ``init`` (float64 ones keep float64: a finite norm of
  1e200 is finite). With ``axis_name`` (inside ``shard_map`` or ``pmap``),
  every device computes the norms of the whole arrays, averages the loss
  over the devices, and takes the same decision, so the inner states stay
  equal across devices.

  Args:
    inner: the transformation to guard (usually the whole optimizer chain).
    skip_nonfinite: skip steps whose gradient norm (or, when loss-aware,
      loss) is NaN or infinite.
    spike_z: skip steps more than this many standard deviations above the
      mean of the norm (> 0): a number or a schedule (``step -> value``;
      values below 0 count as 0), evaluated at the guard's step count (0 on
      the first update); ``None`` to skip no spikes of the norm.
    max_norm: skip steps whose norm is above it (>= 0): a number or a
      schedule, likewise; ``None`` for none. A bound of 0 skips every step
      (a schedule that reaches 0 stops training: zero updates). A NaN from
      a schedule skips the step.
    alpha: EMA smoothing of the means and variances, in (0, 1) (unused with
      ``window``).
    warmup_steps: finite values to gather before spikes are detected (>= 1),
      for the norm and for the loss.
    patience: steps in a row above the spike bound (>= 1) before the
      statistics' mean is raised by ``growth`` a step (see above), for the
      norm and for the loss.
    growth: how fast a held-back statistic's level is raised on each
      further spike (> 1): to ``max(m, 0) + (growth - 1) max(|m|, s)``.
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split (as for :func:`clip_global`).
    sharded: which leaves are split over ``axis_name``: a bool, a pytree
      prefix of bools or a callable ``(path, leaf) -> bool``.
    loss_spike_z: skip steps whose loss is more than this many standard
      deviations above its mean (> 0): a number or a schedule, as
      ``spike_z``; ``None`` (the default) to ignore the loss. Needs
      ``value=loss`` at every update.
    window: ``None`` for the EMA statistics, or the number of recent
      accepted values (>= 2) whose exact mean and standard deviation judge
      the next one; the state then holds ``window`` values per statistic
      (per leaf with ``scope="leaf"``).
    scope: ``"global"`` (skip the whole step) or ``"leaf"`` (judge and skip
      each parameter tensor on its own; see above).

    leaf_stats: also keep each leaf's L2 norm in the state (``leaf_norms``;
      :func:`optaxclip.stats` shows them as ``guard/leaf_norm/<path>``),
      with ``top_leaf_share`` and ``top_leaf``, so that
      :func:`optaxclip.explain` says which leaf blew up on a skipped step
      (the first leaf whose norm is NaN, or the one that carried most of
      the squared norm); from the same single pass over the gradients. A
      leaf norm beyond float32's range reads +inf.
    layer_axis: with ``leaf_stats``, the stacking axis of stacked layers
      (``nn.scan``): such a leaf reports one norm per layer. An int, a
      pytree prefix of ints/``None`` or a callable ``(path, leaf) -> int |
      None`` (as ``sharded``); each device must hold every layer.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`GuardState` holding ``inner``'s state, the last step's
    ``verdict``, the skip ``counts`` and the statistics of the norm
    (``norm_moments``) and of the loss (``loss_monitor``). Extra arguments
    (``value`` included) are passed on to ``inner``.

  References:
    Chowdhery et al., `PaLM: Scaling Language Modeling with Pathways
    <https://arxiv.org/abs/2204.02311>`_, 2022 (skipping batches around
    loss spikes); ``optax.apply_if_finite``; OLMo-core's
    ``SkipStepOptimizer`` (github.com/allenai/OLMo-core,
    ``src/olmo_core/optim/skip_step_optimizer.py``: the rolling window of
    the loss and the gradient norm); Wang et al., `AdaGC
    <https://arxiv.org/abs/2502.11034>`_, 2025 (statistics per tensor).

  Example:
    >>> import jax.numpy as jnp, optax, optaxclip
    >>> tx = optaxclip.guard(optax.sgd(1.0), max_norm=10.0)
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state)
    >>> counts = state.counts
    >>> updates["w"], int(counts.skipped), int(counts.skipped_nonfinite)
    (Array([0., 0.], dtype=float32), 1, 1)
    >>> updates, state = tx.update({"w": jnp.array([30.0, 40.0])}, state)
    >>> counts = state.counts
    >>> updates["w"], int(counts.skipped), int(counts.skipped_max_norm)
    (Array([0., 0.], dtype=float32), 2, 1)
    >>> updates, state = tx.update({"w": jnp.array([3.0, 4.0])}, state)
    >>> updates["w"], int(state.counts.consecutive_skips)
    (Array([-3., -4.], dtype=float32), 0)

    Loss-aware, over a window of the last 4 accepted losses:

    >>> tx = optaxclip.guard(
    ...   optax.adam(0.1), loss_spike_z=3.0, window=4, warmup_steps=3)
    >>> state = tx.init(params)
    >>> g = {"w": jnp.ones(2)}
    >>> for loss in [2.0, 2.1, 1.9, 2.0, 9.0]:
    ...   updates, state = tx.update(g, state, params, value=loss)
    >>> skips, z = state.counts.skipped_loss_spike, state.loss_monitor.z_score
    >>> int(skips), round(float(z), 1)
    (1, 85.7)

    Per tensor: only the leaf with a NaN is skipped.

    >>> tx = optaxclip.guard(optax.adam(0.1), scope="leaf")
    >>> params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    >>> g = {"a": jnp.array([1.0, jnp.nan]), "b": jnp.ones(2)}
    >>> updates, state = tx.update(g, tx.init(params), params)
    >>> updates["a"], int(state.verdict.skipped_leaves)
    (Array([0., 0.], dtype=float32), 1)
    >>> adam = state.inner_state[0]  # a's moments kept, b's moved on
    >>> adam.mu["a"], adam.mu["b"], int(adam.count)
    (Array([0., 0.], dtype=float32), Array([0.1, 0.1], dtype=float32), 1)
  """
  who = "guard"
  _checks.check_transformation(who, "inner", inner)
  skip_nonfinite = _checks.check_bool(who, "skip_nonfinite", skip_nonfinite)
  _schedules.check(
    who, "spike_z", spike_z, low=0.0, low_open=True, allow_none=True
  )
  _schedules.check(
    who, "max_norm", max_norm, low=0.0, allow_inf=True, allow_none=True
  )
  _checks.check_probability("alpha", alpha, who=who)
  _checks.check_steps(who, "warmup_steps", warmup_steps)
  _checks.check_steps(who, "patience", patience)
  _checks.check_number("growth", growth, who=who, low=1.0, low_open=True)
  axis_name = _checks.check_sharding(who, axis_name, sharded)
  leaf_stats = _telemetry.check(who, leaf_stats, layer_axis)
  _schedules.check(
    who, "loss_spike_z", loss_spike_z, low=0.0, low_open=True, allow_none=True
  )
  if window is not None:
    window = _checks.check_count(who, "window", window, low=2)
  scope = _checks.check_choice(who, "scope", scope, _adaptive.SCOPES)
  inner = optax.with_extra_args_support(inner)
  per_leaf = scope == "leaf"
  cfg = _Config(
    skip_nonfinite=skip_nonfinite,
    spike_z=spike_z,
    max_norm=max_norm,
    loss_spike_z=loss_spike_z,
    alpha=alpha,
    warmup_steps=warmup_steps,
    patience=patience,
    growth=growth,
    window=window,
    axis_name=axis_name,
  )

  def init_fn(params):
    # A fresh array per field: a donated state must not hold one buffer twice.
    dtype = _measure.stats_dtype(params, who)
    inner_state = inner.init(params)
    if per_leaf:
      _splits(inner_state, _leaf_paths(params))
    counter = lambda: jnp.zeros((), jnp.int32)
    loss_monitor = None
    if loss_spike_z is not None:
      loss_monitor = LossMonitor(
        value=jnp.zeros((), dtype),
        z_score=jnp.zeros((), dtype),
        moments=_init_moments(cfg, (), dtype),
      )
    return GuardState(
      inner_state=inner_state,
      step=counter(),
      verdict=GuardVerdict(
        norm=jnp.zeros((), dtype),
        threshold=jnp.full((), jnp.inf, dtype),
        z_score=jnp.zeros((), dtype),
        skip_cause=counter(),
        skipped_leaves=counter() if per_leaf else None,
      ),
      counts=GuardCounts(*(counter() for _ in GuardCounts._fields)),
      norm_moments=_init_moments(
        cfg, _measure.unit_shape(params, scope), dtype
      ),
      loss_monitor=loss_monitor,
      **_telemetry.init_fields(who, params, leaf_stats, layer_axis),
    )

  def update_fn(updates, state, params=None, **extra_args):
    moments = state.norm_moments
    measured = _measure.Measured(
      updates,
      scope,
      who,
      moments.mean.dtype,
      moments.mean.shape if per_leaf else None,
      axis_name=axis_name,
      sharded=sharded,
      leaf_stats=leaf_stats,
      layer_axis=layer_axis,
      state_norms=state.leaf_norms if leaf_stats else None,
    )
    norm = _check_norm(cfg, moments, state.step, measured)
    loss = None
    skip = norm.skip
    if loss_spike_z is not None:
      loss = _check_loss(
        cfg, state.loss_monitor, state.step, extra_args, measured.dtype
      )
      skip = skip | loss.spike | loss.nonfinite
    skip_any = jnp.any(skip)
    applied = ~skip  # per unit
    no = jnp.zeros((), bool)
    causes = _one_cause(
      skip_any,
      jnp.any(norm.nonfinite) & skip_nonfinite
      | (no if loss is None else loss.nonfinite),
      jnp.any(norm.above_cap),
      jnp.any(norm.spike),
      no if loss is None else loss.spike,
    )
    apply = _skip_leaves if per_leaf else _skip_whole_step
    new_updates, new_inner = apply(
      inner, updates, state.inner_state, params, skip, extra_args
    )
    judged = norm.judged
    # The EMA takes in every finite norm (a spike at its bound); a window
    # only the norms of units that went through.
    if window is None:
      x = jnp.where(judged.spike, judged.bound, norm.norm)
      take = jnp.ones((), bool)
    else:
      x, take = norm.norm, applied
    new_moments = _next_moments(
      cfg, moments, judged, x, finite=norm.finite, take=take
    )
    restarts = _moments.add_count(
      state.counts.restarts, judged.restart | judged.raised
    )
    loss_monitor = None
    if loss is not None:
      loss_monitor = _next_loss_monitor(cfg, state.loss_monitor, loss, applied)
      restarts = _moments.add_count(
        restarts, loss.judged.restart | loss.judged.raised
      )
    return new_updates, GuardState(
      inner_state=new_inner,
      step=_schedules.next_count(state.step),
      verdict=_verdict(norm, skip, causes, state.verdict.norm.dtype, per_leaf),
      counts=_next_counts(
        state.counts, skip_any, jnp.any(norm.nonfinite), restarts, causes
      ),
      norm_moments=new_moments,
      loss_monitor=loss_monitor,
      **measured.telemetry._asdict(),
    )

  return optax.GradientTransformationExtraArgs(
    init_fn, _compiled.jit_update(update_fn)
  )


def _leaf_paths(tree: Any) -> list:
  """The paths of ``tree``'s leaves, in ``jax.tree.leaves`` order."""
  return [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
