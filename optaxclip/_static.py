"""Clippers with a fixed threshold: by value, per-tensor norm, global norm,
block RMS and unit-wise (AGC).
"""

from __future__ import annotations

from collections.abc import Callable
import math
from typing import Any, Literal, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxclip import _checks
from optaxclip import _compiled
from optaxclip import _functional
from optaxclip import _norms
from optaxclip import _schedules
from optaxclip import _sharding
from optaxclip import _stats
from optaxclip import _telemetry
from optaxclip._typing import Axis
from optaxclip._typing import AxisName
from optaxclip._typing import Ord
from optaxclip._typing import Scalar
from optaxclip._typing import ScalarOrSchedule

# The statistics of every fixed-threshold clipper.
STAT_FIELDS = (*_stats.CLIP_FIELDS, "threshold")


@_stats.register("clip_value", STAT_FIELDS)
class ClipValueState(NamedTuple):
  """State of :func:`clip_value`: this step's statistics.

  Attributes:
    norm: the largest pre-clip magnitude ``max |g|`` (the inf-norm).
    clipped_norm: the largest magnitude after clipping (NaN when the update
      holds a NaN).
    clip_fraction: the share of elements clipped (every element of a leaf
      made NaN counts); with ``stats="sampled"``, in leaves of more than
      65536 elements, estimated from every 257th element (see
      :func:`clip_value`).
    threshold: the ``max_delta`` this step used (a schedule's value at the
      step; before the first update, its value at step 0).
    count: updates so far (int32, saturating), the step at which a
      schedule is evaluated.
  """

  norm: jax.Array  # float32 scalar
  clipped_norm: jax.Array  # float32 scalar
  clip_fraction: jax.Array  # float32 scalar in [0, 1]
  threshold: jax.Array  # float32 scalar
  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]


@_stats.register("clip_norm", STAT_FIELDS)
class ClipNormState(NamedTuple):
  """State of :func:`clip_norm`: this step's statistics.

  Attributes:
    norm: the ``ord``-norm of the whole tree before clipping.
    clipped_norm: the same norm after clipping.
    clip_fraction: the share of units (leaves or slices) scaled down.
    threshold: the ``max_norm`` this step used (a schedule's value at the
      step; before the first update, its value at step 0).
    count: updates so far (int32, saturating), the step at which a
      schedule is evaluated.
    leaf_norms: with ``leaf_stats=True``, each leaf's pre-clip ``ord``-norm
      (a ``(L,)`` vector per layer for a leaf with a ``layer_axis``), a
      :class:`LeafNorms` (one vector; ``.tree()`` is a pytree shaped like
      the updates); else ``None``.
    top_leaf_share: with ``leaf_stats=True``, the share of ``norm**ord``
      carried by the largest leaf or layer; else ``None``.
    top_leaf: with ``leaf_stats=True``, that leaf's or layer's index in the
      flattened ``leaf_norms``; else ``None``.
  """

  norm: jax.Array  # float32 scalar
  clipped_norm: jax.Array  # float32 scalar
  clip_fraction: jax.Array  # float32 scalar in [0, 1]
  threshold: jax.Array  # float32 scalar
  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  leaf_norms: Any = None  # LeafNorms: float32 (entries,), static structure
  top_leaf_share: Optional[jax.Array] = None  # float32 scalar in [0, 1]
  top_leaf: Optional[jax.Array] = None  # int32 scalar


@_stats.register("clip_global", STAT_FIELDS)
class ClipGlobalState(NamedTuple):
  """State of :func:`clip_global`: this step's statistics.

  Attributes:
    norm: the global ``ord``-norm before clipping.
    clipped_norm: the global ``ord``-norm after clipping.
    clip_fraction: 1.0 when the tree was scaled down, else 0.0.
    threshold: the ``max_norm`` this step used (a schedule's value at the
      step; before the first update, its value at step 0).
    count: updates so far (int32, saturating), the step at which a
      schedule is evaluated.
    leaf_norms: with ``leaf_stats=True``, each leaf's pre-clip ``ord``-norm
      (a ``(L,)`` vector per layer for a leaf with a ``layer_axis``), a
      :class:`LeafNorms` (one vector; ``.tree()`` is a pytree shaped like
      the updates); else ``None``.
    top_leaf_share: with ``leaf_stats=True``, the share of ``norm**ord``
      carried by the largest leaf or layer; else ``None``.
    top_leaf: with ``leaf_stats=True``, that leaf's or layer's index in the
      flattened ``leaf_norms``; else ``None``.
  """

  norm: jax.Array  # float32 scalar
  clipped_norm: jax.Array  # float32 scalar
  clip_fraction: jax.Array  # float32 scalar in [0, 1]
  threshold: jax.Array  # float32 scalar
  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  leaf_norms: Any = None  # LeafNorms: float32 (entries,), static structure
  top_leaf_share: Optional[jax.Array] = None  # float32 scalar in [0, 1]
  top_leaf: Optional[jax.Array] = None  # int32 scalar


@_stats.register("clip_block_rms", STAT_FIELDS)
class ClipBlockRMSState(NamedTuple):
  """State of :func:`clip_block_rms`: this step's statistics.

  Attributes:
    norm: the global L2 norm before clipping.
    clipped_norm: the global L2 norm after clipping.
    clip_fraction: the share of leaves scaled down.
    threshold: the ``threshold`` this step used (a schedule's value at the
      step; before the first update, its value at step 0).
    count: updates so far (int32, saturating), the step at which a
      schedule is evaluated.
    leaf_norms: with ``leaf_stats=True``, each leaf's pre-clip L2 norm
      (not its RMS; a ``(L,)`` vector per layer for a leaf with a
      ``layer_axis``), a :class:`LeafNorms` (one vector; ``.tree()`` is a
      pytree shaped like the updates); else ``None``.
    top_leaf_share: with ``leaf_stats=True``, the share of ``norm**2``
      carried by the largest leaf or layer; else ``None``.
    top_leaf: with ``leaf_stats=True``, that leaf's or layer's index in the
      flattened ``leaf_norms``; else ``None``.
  """

  norm: jax.Array  # float32 scalar
  clipped_norm: jax.Array  # float32 scalar
  clip_fraction: jax.Array  # float32 scalar in [0, 1]
  threshold: jax.Array  # float32 scalar
  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  leaf_norms: Any = None  # LeafNorms: float32 (entries,), static structure
  top_leaf_share: Optional[jax.Array] = None  # float32 scalar in [0, 1]
  top_leaf: Optional[jax.Array] = None  # int32 scalar


@_stats.register("clip_unitwise", STAT_FIELDS)
class ClipUnitwiseState(NamedTuple):
  """State of :func:`clip_unitwise`: this step's statistics.

  Attributes:
    norm: the global L2 norm of the gradient before clipping.
    clipped_norm: the global L2 norm after clipping.
    clip_fraction: the share of units scaled down.
    threshold: the ``clipping`` ratio this step used (a schedule's value at the
      step; before the first update, its value at step 0).
    count: updates so far (int32, saturating), the step at which a
      schedule is evaluated.
    leaf_norms: with ``leaf_stats=True``, each leaf's pre-clip L2 norm
      (a ``(L,)`` vector per layer for a leaf with a ``layer_axis``), a
      :class:`LeafNorms` (one vector; ``.tree()`` is a pytree shaped like
      the updates); else ``None``.
    top_leaf_share: with ``leaf_stats=True``, the share of ``norm**2``
      carried by the largest leaf or layer; else ``None``.
    top_leaf: with ``leaf_stats=True``, that leaf's or layer's index in the
      flattened ``leaf_norms``; else ``None``.
  """

  norm: jax.Array  # float32 scalar
  clipped_norm: jax.Array  # float32 scalar
  clip_fraction: jax.Array  # float32 scalar in [0, 1]
  threshold: jax.Array  # float32 scalar
  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]
  leaf_norms: Any = None  # LeafNorms: float32 (entries,), static structure
  top_leaf_share: Optional[jax.Array] = None  # float32 scalar in [0, 1]
  top_leaf: Optional[jax.Array] = None  # int32 scalar


Sharded = Union[bool, Any, Callable[[Any, jax.Array], bool]]


def _init_stats(
  state_cls,
  threshold,
  who: str,
  name: str,
  leaf_stats: bool = False,
  layer_axis: Any = None,
):
  """``init`` of a fixed-threshold state: zero statistics, the threshold at
  step 0, a zero step count (and the telemetry fields, when on).
  """

  def init_fn(params):
    fields = dict(
      threshold=_stats.as_stat(
        _schedules.first_value(threshold, who=who, name=name)
      ),
      count=jnp.zeros((), jnp.int32),
    )
    if leaf_stats:
      layers = _telemetry.layer_axes(who, params, layer_axis)
      fields.update(_telemetry.init(params, leaf_stats, layers)._asdict())
    return state_cls(*_stats.zeros(), **fields)

  return init_fn


_flatten = _functional.flatten
sharded_flags = _functional.sharded_flags


def _fraction(numerator, denominator) -> jax.Array:
  return _stats.as_stat(numerator / max(denominator, 1))


@_compiled.compiled_once
def clip_value(
  max_delta: ScalarOrSchedule,
  *,
  stats: Literal["exact", "sampled"] = "exact",
) -> optax.GradientTransformation:
  """Clips each element of the updates into ``[-max_delta, max_delta]``.

  The element-wise clipping of ``tf.clip_by_value``, Keras' ``clipvalue``,
  ``torch.nn.utils.clip_grad_value_`` and ``optax.clip``. It changes the
  update's direction; prefer :func:`clip_global` unless you want exactly
  this. Complex elements keep their phase and have their modulus clipped.

  Non-finite gradients: a leaf that holds a NaN or an inf comes out all NaN
  (``optax.clip`` and torch would clip an inf to ``max_delta`` and hide it);
  the other leaves are clipped as usual (see the guide on precision and
  non-finite input, ``docs/numerics.md``).

  Statistics: ``norm`` (``max |g|``) and ``clip_fraction`` are exact (the
  count of clipped elements to float32's precision, exact up to 2**24; an
  element counts when its magnitude exceeds ``max_delta`` in exact
  arithmetic, a subnormal above a ``max_delta`` of 0 too). A leaf of its
  own is read once for both, by one reduction of the magnitudes' bits as
  integers that yields the largest and the count of those above
  ``max_delta``'s (integer maxima keep NaN without a select, and XLA:CPU
  vectorises them); small leaves are stacked and reduced along their rows
  the same way. That read is the cost: XLA:CPU fuses no reduction into the
  clip's or Adam's element-wise loop, so the floor is one extra read of
  the gradients, and the integers' reduction sits near it; the same
  statistics as a reduction of floats, whose NaN-keeping maximum runs as a
  scalar loop, cost several times more. Statistics from a sample alone
  cost less but give up the exact ``norm``, the exact count and the
  leaf-wise non-finite policy (figures and the formulations tried in
  ``docs/performance.md``).

  ``stats="sampled"`` is that cheaper formulation, for when the step's cost
  matters more than exact statistics: the clip waits for no pass over the
  leaf, which brings its step close to ``optax.clip``'s.
  Each element is judged on its own, as ``optax.clip`` and torch do,
  except that an inf element becomes NaN (it is never hidden as
  ``max_delta``); the other elements of its leaf are clipped as usual.
  ``norm``, ``clipped_norm`` and ``clip_fraction`` are estimated, in
  leaves of more than 65536 elements, from every 257th element (exact in
  smaller ones): a rare outlier may be missed, so ``norm`` is a lower bound
  of ``max |g|`` there, and a NaN or inf may be absent from the statistics
  while present in the update.

  Args:
    max_delta: the largest absolute value an element may keep (>= 0): a
      number or a schedule (``step -> value``, such as an optax schedule),
      evaluated at this clipper's step count (0 on the first update); see
      "Threshold schedules" in the docs.
    stats: ``"exact"`` (the default: exact ``norm``, the leaf-wise
      non-finite policy, one read pass of the gradients) or ``"sampled"``
      (statistics from a sample, the element-wise non-finite policy above,
      no extra pass).

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`ClipValueState`.

  References:
    Mikolov, `Statistical Language Models Based on Neural Networks
    <https://www.fit.vut.cz/study/phd-thesis-file/283/283.pdf>`_, 2012

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> tx = optaxclip.clip_value(1.0)
    >>> g = {"w": jnp.array([-3.0, 0.5, 2.0])}
    >>> clipped, state = tx.update(g, tx.init(g))
    >>> clipped["w"]
    Array([-1. ,  0.5,  1. ], dtype=float32)
    >>> round(float(state.clip_fraction), 4)
    0.6667
  """
  _schedules.check(
    "clip_value", "max_delta", max_delta, low=0.0, allow_inf=True
  )
  sampled = (
    _checks.check_choice("clip_value", "stats", stats, ("exact", "sampled"))
    == "sampled"
  )

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = _flatten(updates, "clip_value")
    max_delta_now = _schedules.value_at(
      max_delta, _schedules.count_of(state), who="clip_value", name="max_delta"
    )
    # Small leaves are stacked (one reduction for many: compile time on
    # many-leaf trees); each leaf gets its own poison back.
    layout = _norms.UnitLayout(
      leaves, [None] * len(leaves), [None] * len(leaves)
    )
    poisons, largest, finite, clipped, total = _value_statistics(
      layout, leaves, max_delta_now, sampled=sampled
    )
    out = []
    for x, poison in zip(leaves, poisons):
      if x.size == 0:
        out.append(x)
        continue
      bound = jnp.asarray(max_delta_now, poison.dtype)
      y = _functional.clip_leaf_to_range(x, -bound, bound, poison)
      if sampled and not jnp.iscomplexobj(x):
        # The element-wise policy: x - x is NaN at an inf or NaN element
        # and +0 elsewhere, so that y - (x - x) is y, -0 included. Two
        # operations an element in the loop of Adam's moments, cheaper
        # there than a NaN poison on both bounds.
        y = y - (x - x)
      out.append(y)
    new_state = _value_state(
      state, max_delta_now, largest, finite, clipped, total
    )
    return jax.tree.unflatten(treedef, out), new_state

  return optax.GradientTransformation(
    _init_stats(ClipValueState, max_delta, "clip_value", "max_delta"),
    _compiled.jit_update(update_fn),
  )


def _value_statistics(layout, leaves, max_delta_now, *, sampled=False):
  """clip_value's statistics over the parts of ``layout`` (whole leaves as
  units): per leaf, its poison (0 for a finite leaf, NaN otherwise: a leaf
  holding a NaN or an inf comes out all NaN, the non-finite policy), and
  ``(largest, finite, clipped, total)`` (see _value_state).

  ``sampled``: ``stats="sampled"``'s statistics (large leaves' from a
  sample: see _norms.largest_and_count_parts) and its element-wise policy:
  a complex leaf's poison is NaN at its inf elements only and 0 elsewhere,
  computed from the leaf alone (the clip does not wait for a statistic), a
  real leaf's is 0 (the update makes its inf elements NaN itself), and a
  non-finite leaf counts its NaN, inf and clipped elements as clipped.

  The per-leaf values of the stacked parts of one dtype are concatenated
  into one vector and reduced at once, and each leaf takes its poison from
  it with :func:`_norms.take_each`: a few kernels for all of them, not a
  few per part shape (compile time on many-leaf trees).
  """
  largest = jnp.zeros((), jnp.float32)
  clipped, total, finite = jnp.zeros((), jnp.float32), 0, jnp.array(True)
  stats = _norms.largest_and_count_parts(
    layout, leaves, max_delta_now, sampled=sampled
  )
  poisons: list[Any] = [None] * len(leaves)
  if sampled:
    for i, x in enumerate(leaves):
      dtype = _norms.accumulation_dtype(x.dtype)
      # Real leaves take their element-wise NaN in clip_value's update.
      poisons[i] = (
        jnp.where(jnp.isinf(x), jnp.nan, 0).astype(dtype)
        if jnp.iscomplexobj(x)
        else jnp.zeros((), dtype)
      )
  groups = {}
  for j, ((kind, _, _), (biggest, *_)) in enumerate(zip(layout.parts, stats)):
    if kind == "leaf":
      groups[("leaf", j)] = [j]
    else:
      groups.setdefault(np.dtype(biggest.dtype), []).append(j)
  for members in groups.values():
    if len(members) == 1:
      biggest, n_over, size, leaf_finite = stats[members[0]]
      sizes = size
    else:
      parts = [stats[j] for j in members]
      biggest = _norms.concat_parts([b for b, _, _, _ in parts])
      n_over = _norms.concat_parts([n for _, n, _, _ in parts])
      leaf_finite = biggest < jnp.inf
      sizes = np.concatenate(
        [np.full(b.size, size, np.float32) for b, _, size, _ in parts]
      )
      size = 1
    # 0 for a finite leaf, NaN otherwise. Computed from the statistics, it
    # also makes a leaf's clip wait for them, so that XLA computes them
    # while the leaf is in cache.
    poison = jnp.where(leaf_finite, 0 * n_over, jnp.nan).astype(biggest.dtype)
    if sampled:
      pass  # the element-wise poisons above
    elif len(members) == 1:
      for i, piece in zip(
        _leaves_of(layout, members[0]), layout.unpack_part(members[0], poison)
      ):
        poisons[i] = piece
    else:
      rows = [i for j in members for i in _leaves_of(layout, j)]
      for i, piece in zip(rows, _norms.take_each(poison)):
        poisons[i] = piece.reshape(layout.unit_shape(i))
    if size == 0:
      continue
    limit = jnp.asarray(max_delta_now, biggest.dtype) + poison
    # A sampled count may miss rare outliers: a leaf whose largest element
    # is clipped counts at least one clipped element.
    n_over = jnp.clip(n_over, (biggest > limit).astype(n_over.dtype), sizes)
    if not sampled:
      # The non-finite policy: such a leaf comes out all NaN, all clipped.
      n_over = jnp.where(leaf_finite, n_over, sizes)
    if len(members) == 1:
      largest = jnp.maximum(
        largest, _norms.nan_max(biggest).astype(jnp.float32)
      )
      # In the leaf's own dtype: a finite float64 may be inf in float32.
      finite = finite & jnp.all(leaf_finite)
      clipped = clipped + jnp.sum(n_over)
      total += size * biggest.size
    else:
      top, n_clipped, every = _norms.max_sum_all(biggest, n_over, leaf_finite)
      largest = jnp.maximum(largest, top.astype(jnp.float32))
      finite = finite & every
      clipped = clipped + n_clipped
      total += int(sizes.sum())
  return poisons, largest, finite, clipped, total


def _leaves_of(layout, j) -> list[int]:
  """The leaves of part ``j`` of ``layout``, in the order of its rows."""
  kind, what, _ = layout.parts[j]
  return [what] if kind == "leaf" else [i for i, _, _ in what]


def _value_state(state, max_delta_now, largest, finite, clipped, total):
  """clip_value's next state: ``largest`` is ``max |g|`` (float32),
  ``finite`` whether every leaf was, ``clipped`` of ``total`` elements
  clipped.
  """
  limit = jnp.asarray(max_delta_now, jnp.float32)
  return ClipValueState(
    norm=_stats.as_stat(largest),
    clipped_norm=_stats.as_stat(
      jnp.where(finite, jnp.minimum(largest, limit), jnp.nan)
    ),
    clip_fraction=_fraction(clipped, total),
    threshold=_stats.as_stat(limit),
    count=_schedules.next_count(_schedules.count_of(state)),
  )


def _per_unit_clip(leaves, layout, norms, limits, ord, smallest=0.0):  # pylint: disable=redefined-builtin
  """Scales each unit to its limit; returns updates and the statistics.

  ``smallest``: a bound on the clip factors known when tracing (see
  ``_norms.scale_leaf``), or 0.

  ``norms`` and ``limits`` are per part of ``layout`` (see
  ``_norms.UnitLayout``): factors and statistics are computed on the few
  parts, and each leaf is scaled by its own entries of its part's factors.
  ``norms`` are :class:`_norms.Scaled`, as are the factors: exact for norms
  beyond the dtype's range and factors below its smallest normal number.
  The layout's keys are ``(sharded, across)``: ``across`` are the mapped
  axes over which devices hold other units of a leaf (their statistics are
  summed across them; see combine_norms).
  """
  across = [key[1] for key in layout.keys]
  out, factors = _functional.scale_units(
    leaves, layout, norms, limits, smallest
  )
  groups = _norms.part_groups(norms, layout.keys)
  if len(groups) == 1 and not across[groups[0][0]]:
    # One vector of units, on each device whole: the statistics in one pass
    # (one kernel to compile: see _norms.combine_norms_each).
    n = _norms.concat_parts([norms[i] for i in groups[0]])
    f = _norms.concat_parts([factors[i] for i in groups[0]])
    (total, clipped), (scaled,) = _norms.combine_norms_each(
      [n, n * f], ord, counts=[_norms.is_scaled_down(f)]
    )
    units = sum(n.value.size for n in norms)
    stats = (
      _stats.as_stat(total),
      _stats.as_stat(clipped),
      _fraction(scaled, units),
    )
    return out, stats
  # Per group of parts (one concatenation each: see _norms.part_groups).
  clipped_norms: list[Any] = [None] * len(norms)
  scaled = jnp.zeros((), jnp.float32)
  for group in groups:
    n = _norms.concat_parts([norms[i] for i in group])
    f = _norms.concat_parts([factors[i] for i in group])
    pieces = _norms.split_parts(n * f, [norms[i] for i in group])
    for i, piece in zip(group, pieces):
      clipped_norms[i] = piece
    names = across[group[0]]
    scaled = scaled + _norms.psum_sharded(
      _norms.count(_norms.is_scaled_down(f)), names, names
    )
  units = sum(
    n.value.size * _norms.axis_size(names) for n, names in zip(norms, across)
  )
  stats = (
    _stats.as_stat(_norms.combine_norms(norms, ord, across=across)),
    _stats.as_stat(_norms.combine_norms(clipped_norms, ord, across=across)),
    _fraction(scaled, units),
  )
  return out, stats


@_compiled.compiled_once
def clip_norm(
  max_norm: ScalarOrSchedule,
  *,
  ord: Ord = None,
  axis: Axis = None,
  axis_name: AxisName = None,
  sharded: Sharded = True,
  leaf_stats: bool = False,
  layer_axis: _telemetry.LayerAxis = None,
) -> optax.GradientTransformation:
  """Clips each leaf (or each slice of it) to ``ord``-norm at most ``max_norm``.

  Per-tensor clipping as ``tf.clip_by_norm(t, max_norm, axes=axis)`` and
  Keras' ``clipnorm``: every leaf is scaled by ``min(1, max_norm / ||leaf||)``
  on its own. With ``axis``, the norm is taken over those axes and each slice
  across the remaining ones is clipped on its own (e.g. ``axis=0`` clips each
  column of a matrix).

  Args:
    max_norm: the largest norm a leaf (or slice) may keep (>= 0): a number
      or a schedule (``step -> value``), evaluated at this clipper's step
      count (0 on the first update).
    ord: the norm's order: any p >= 1, or ``inf`` (the largest magnitude);
      ``None`` (the default) means 2, the Euclidean norm, as in
      ``numpy.linalg.norm``. Not a traceable hyperparameter: with
      ``optax.inject_hyperparams``, name it in ``static_args``.
    axis: the axis or axes a norm spans; ``None`` for the whole leaf. Every
      leaf must have these axes. Not traceable either (``static_args``).
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split; their partial norms are summed across
      devices, so every device clips with the norm of the whole leaf.
    sharded: per leaf, which axes of ``axis_name`` split it: ``True`` (all;
      the default), ``False``/``None`` (replicated: counted once), a tuple
      of axis names, or a ``PartitionSpec`` (as in ``shard_map``'s
      ``in_specs``); one for all leaves, a pytree prefix of them (it
      survives ``optax.masked`` and ``FrozenDict`` updates) or a callable
      ``(path, leaf) -> entry``. With ``axis``, a bool or names mean "split
      along an axis a norm spans"; a leaf split only along the other axes
      holds whole slices (mark it False: clipped exactly, but its share of
      the statistics is the local one). A PartitionSpec tells the two
      apart: slices and statistics are then exact.
    leaf_stats: also keep each leaf's pre-clip ``ord``-norm in the state
      (``leaf_norms``; :func:`optaxclip.stats` shows them as
      ``clip_norm/leaf_norm/<path>``), with ``top_leaf_share`` and
      ``top_leaf``; from the same single pass over the gradients. A leaf
      norm beyond float32's range reads +inf.
    layer_axis: with ``leaf_stats``, the stacking axis of stacked layers
      (``nn.scan``): such a leaf reports one norm per layer. An int, a
      pytree prefix of ints/``None`` or a callable ``(path, leaf) -> int |
      None`` (as ``sharded``); not an axis split over ``axis_name`` (a
      leaf split across devices needs a PartitionSpec in ``sharded`` that
      says so; else an error).

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`ClipNormState`.

  References:
    Pascanu et al., `On the difficulty of training Recurrent Neural Networks
    <https://arxiv.org/abs/1211.5063>`_, 2013

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> tx = optaxclip.clip_norm(1.0)
    >>> g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.6, 0.0])}
    >>> clipped, state = tx.update(g, tx.init(g))
    >>> clipped["a"], clipped["b"]
    (Array([0.6, 0.8], dtype=float32), Array([0.6, 0. ], dtype=float32))
    >>> float(state.clip_fraction)
    0.5
  """
  who = "clip_norm"
  _schedules.check(who, "max_norm", max_norm, low=0.0, allow_inf=True)
  p = _checks.check_ord("ord", ord, who=who)
  axis = _checks.check_axis("axis", axis, who=who)
  axis_name = _checks.check_sharding(who, axis_name, sharded)
  leaf_stats = _telemetry.check(who, leaf_stats, layer_axis)

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = _flatten(updates, who)
    limit = _schedules.value_at(
      max_norm, _schedules.count_of(state), who=who, name="max_norm"
    )
    paths = [p_ for p_, _ in _checks.leaves_with_paths(updates)]
    axes = [
      _checks.leaf_axes(who, axis, x, path) for x, path in zip(leaves, paths)
    ]
    layout, norms, telemetry = _telemetry.unit_norms(
      who,
      updates,
      leaves,
      p,
      axes,
      on=leaf_stats,
      state_norms=state.leaf_norms if leaf_stats else None,
      layer_axis=layer_axis,
      axis_name=axis_name,
      splits=_sharding.resolve(updates, sharded, axis_name, who),
    )
    # A bound on the factors when max_norm is a number (half of it: the
    # factor's quotient is rounded): two multipliers (see clip_unitwise).
    smallest = _norms.smallest_clip_factor(
      leaves, None if callable(max_norm) else max_norm / 2, axis_name
    )
    out, stats = _per_unit_clip(
      leaves, layout, norms, [limit] * len(norms), p, smallest
    )
    return jax.tree.unflatten(treedef, out), ClipNormState(
      *stats,
      _stats.as_stat(limit),
      _schedules.next_count(_schedules.count_of(state)),
      *telemetry,
    )

  return optax.GradientTransformation(
    _init_stats(
      ClipNormState, max_norm, who, "max_norm", leaf_stats, layer_axis
    ),
    _compiled.jit_update(update_fn),
  )


@_compiled.compiled_once
def clip_global(
  max_norm: ScalarOrSchedule,
  *,
  ord: Ord = None,
  axis_name: AxisName = None,
  sharded: Sharded = True,
  leaf_stats: bool = False,
  layer_axis: _telemetry.LayerAxis = None,
) -> optax.GradientTransformation:
  """Scales the whole update to a global ``ord``-norm of at most ``max_norm``.

  The global-norm clipping of Pascanu et al., ``tf.clip_by_global_norm``,
  Keras' ``global_clipnorm``, ``torch.nn.utils.clip_grad_norm_`` and
  ``optax.clip_by_global_norm``: every leaf is multiplied by the same
  ``min(1, max_norm / ||g||)``, so the update keeps its direction. The norm
  accumulates in float32 (bfloat16 trees get it right), is overflow-safe, and
  its pre-clip value is kept in the state (``stats()``), as torch returns it.
  PyTorch divides by ``norm + 1e-6``; this uses the exact ratio.

  Args:
    max_norm: the largest global norm the update may keep (>= 0): a number
      or a schedule (``step -> value``), evaluated at this clipper's step
      count (0 on the first update).
    ord: the norm's order: any p >= 1, or ``inf``; torch's ``norm_type``.
      ``None`` (the default) means 2, the Euclidean norm, as in
      ``numpy.linalg.norm``. Not a traceable hyperparameter: with
      ``optax.inject_hyperparams``, name it in ``static_args``.
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split; partial norms are summed across them.
    sharded: per leaf, which axes of ``axis_name`` split it: ``True`` (all;
      the default), ``False``/``None`` (replicated: counted once), a tuple
      of axis names, or a ``PartitionSpec`` (as in ``shard_map``'s
      ``in_specs``); one for all leaves, a pytree prefix of them (it
      survives ``optax.masked`` and ``FrozenDict`` updates) or a callable
      ``(path, leaf) -> entry``. Each leaf's partial sum is summed over
      exactly its axes.
    leaf_stats: also keep each leaf's pre-clip ``ord``-norm in the state
      (``leaf_norms``, shown by :func:`optaxclip.stats` as
      ``clip_global/leaf_norm/<path>``), with ``top_leaf_share`` and
      ``top_leaf``: the global norm is then put together from per-leaf
      sums, in the same single pass over the gradients (equal up to
      rounding). A leaf norm beyond float32's range reads +inf.
    layer_axis: with ``leaf_stats``, the stacking axis of stacked layers
      (``nn.scan``): such a leaf reports one norm per layer. An int for
      every leaf, a pytree prefix of ints/``None`` or a callable
      ``(path, leaf) -> int | None`` (as ``sharded``). Each device must
      hold every layer (the axis is not split over ``axis_name``; a leaf
      split across devices needs a PartitionSpec in ``sharded`` that says
      so, else an error).

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`ClipGlobalState`.

  References:
    Pascanu et al., `On the difficulty of training Recurrent Neural Networks
    <https://arxiv.org/abs/1211.5063>`_, 2013

  Example:
    >>> import jax.numpy as jnp, optax, optaxclip
    >>> tx = optax.chain(optaxclip.clip_global(5.0), optax.sgd(1.0))
    >>> params = {"a": jnp.zeros(2), "b": jnp.zeros(1)}
    >>> g = {"a": jnp.array([6.0, 8.0]), "b": jnp.array([0.0])}
    >>> updates, state = tx.update(g, tx.init(params), params)
    >>> updates["a"]
    Array([-3., -4.], dtype=float32)
    >>> float(optaxclip.stats(state)["clip_global/norm"])
    10.0

    A schedule instead of a number (here 10, then 5 from step 1):

    >>> tx = optaxclip.clip_global(
    ...     optax.piecewise_constant_schedule(10.0, {1: 0.5}))
    >>> state = tx.init(params)
    >>> for _ in range(2):
    ...   clipped, state = tx.update(g, state)
    >>> clipped["a"], float(state.threshold), int(state.count)
    (Array([3., 4.], dtype=float32), 5.0, 2)
  """
  who = "clip_global"
  _schedules.check(who, "max_norm", max_norm, low=0.0, allow_inf=True)
  p = _checks.check_ord("ord", ord, who=who)
  axis_name = _checks.check_sharding(who, axis_name, sharded)
  leaf_stats = _telemetry.check(who, leaf_stats, layer_axis)

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = _flatten(updates, who)
    count = _schedules.count_of(state)
    limit = _schedules.value_at(max_norm, count, who=who, name="max_norm")
    telemetry = _telemetry.LeafStats()
    norm = None
    if leaf_stats:
      norm, telemetry = _telemetry.global_norm_with_leaves(
        who,
        updates,
        leaves,
        p,
        state.leaf_norms,
        layer_axis,
        axis_name=axis_name,
        splits=_sharding.resolve(updates, sharded, axis_name, who),
      )
    out, norm, factor = _functional.global_clip(
      leaves,
      limit,
      p,
      axis_name=axis_name,
      flags=None
      if leaf_stats
      else sharded_flags(updates, sharded, who, axis_name),
      norm=norm,
    )
    new_state = ClipGlobalState(
      _stats.as_stat(norm.as_float()),
      _stats.as_stat((norm * factor).as_float()),
      _stats.as_stat(_norms.is_scaled_down(factor)),
      _stats.as_stat(limit),
      _schedules.next_count(count),
      *telemetry,
    )
    return jax.tree.unflatten(treedef, out), new_state

  return optax.GradientTransformation(
    _init_stats(
      ClipGlobalState, max_norm, who, "max_norm", leaf_stats, layer_axis
    ),
    _compiled.jit_update(update_fn),
  )


@_compiled.compiled_once
def clip_block_rms(
  threshold: ScalarOrSchedule,
  *,
  axis_name: AxisName = None,
  sharded: Sharded = True,
  leaf_stats: bool = False,
  layer_axis: _telemetry.LayerAxis = None,
) -> optax.GradientTransformation:
  """Clips each leaf to a root-mean-square of at most ``threshold``.

  The same numbers as ``optax.clip_by_block_rms``: a leaf of RMS ``r`` is
  divided by ``max(1, r / threshold)``. Useful when leaves differ wildly in
  size, since the RMS does not grow with the leaf's element count.

  Args:
    threshold: the largest RMS a leaf may keep (>= 0): a number or a
      schedule (``step -> value``), evaluated at this clipper's step count
      (0 on the first update).
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split: their squared norms are summed and
      their element counts multiplied by the number of devices, so each
      shard is clipped by the RMS of the whole leaf.
    sharded: per leaf, which axes of ``axis_name`` split it: ``True`` (all;
      the default), ``False``/``None`` (replicated), a tuple of axis names
      or a ``PartitionSpec``; one for all leaves, a pytree prefix of them or
      a callable ``(path, leaf) -> entry``. A leaf's element count is
      multiplied by the number of devices along its axes.
    leaf_stats: also keep each leaf's pre-clip L2 norm (not its RMS) in the
      state (``leaf_norms``; :func:`optaxclip.stats` shows them as
      ``clip_block_rms/leaf_norm/<path>``), with ``top_leaf_share`` and
      ``top_leaf``; from the same single pass over the gradients. A leaf
      norm beyond float32's range reads +inf.
    layer_axis: with ``leaf_stats``, the stacking axis of stacked layers
      (``nn.scan``): such a leaf reports one norm per layer. An int, a
      pytree prefix of ints/``None`` or a callable ``(path, leaf) -> int |
      None`` (as ``sharded``); not an axis split over ``axis_name`` (a
      leaf split across devices needs a PartitionSpec in ``sharded`` that
      says so; else an error).

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`ClipBlockRMSState`.

  References:
    Shazeer and Stern, `Adafactor: Adaptive Learning Rates with Sublinear
    Memory Cost <https://arxiv.org/abs/1804.04235>`_, 2018 (update clipping
    by RMS)

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> tx = optaxclip.clip_block_rms(1.0)
    >>> g = {"w": jnp.array([4.0, -4.0, 4.0, -4.0])}
    >>> clipped, _ = tx.update(g, tx.init(g))
    >>> clipped["w"]
    Array([ 1., -1.,  1., -1.], dtype=float32)
  """
  who = "clip_block_rms"
  _schedules.check(who, "threshold", threshold, low=0.0, allow_inf=True)
  axis_name = _checks.check_sharding(who, axis_name, sharded)
  leaf_stats = _telemetry.check(who, leaf_stats, layer_axis)

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = _flatten(updates, "clip_block_rms")
    rms = _schedules.value_at(
      threshold, _schedules.count_of(state), who=who, name="threshold"
    )
    splits = _sharding.resolve(updates, sharded, axis_name, who)
    flags = [s.axes for s in splits]
    # A leaf is one unit: every name that splits it is summed over.
    layout, norms, telemetry = _telemetry.unit_norms(
      who,
      updates,
      leaves,
      2.0,
      [None] * len(leaves),
      on=leaf_stats,
      state_norms=state.leaf_norms if leaf_stats else None,
      layer_axis=layer_axis,
      axis_name=axis_name,
      splits=splits,
    )
    roots = layout.pack_static(
      [
        math.sqrt(max(x.size * _norms.axis_size(f), 1))
        for x, f in zip(leaves, flags)
      ]
    )
    # rms * sqrt(n) may exceed the dtype's range (a threshold near 3.4e38
    # on a leaf of several elements) or fall below its smallest normal (a
    # threshold near 1.2e-38 times sqrt(n)'s mantissa) while the clip is
    # still meaningful: the limit as a Scaled number, sqrt(n) = m * 2**e.
    limits = [
      _norms.scaled_product(jnp.asarray(rms, n.value.dtype), *np.frexp(r))
      for r, n in zip(roots, norms)
    ]
    out, stats = _per_unit_clip(leaves, layout, norms, limits, 2.0)
    return jax.tree.unflatten(treedef, out), ClipBlockRMSState(
      *stats,
      _stats.as_stat(rms),
      _schedules.next_count(_schedules.count_of(state)),
      *telemetry,
    )

  return optax.GradientTransformation(
    _init_stats(
      ClipBlockRMSState, threshold, who, "threshold", leaf_stats, layer_axis
    ),
    _compiled.jit_update(update_fn),
  )


def default_unit_axes(x: jax.Array) -> Optional[tuple[int, ...]]:
  """The axes a unit spans for AGC, by the leaf's rank (as optax 0.2.8).

  Scalars and vectors (also after squeezing): the whole leaf; rank 2 or 3:
  axis 0 (a Dense kernel's inputs, one unit per output; a multi-head kernel's
  inputs, one unit per head and output); rank 4: axes (0, 1, 2) (a conv
  kernel, HWIO); rank 5 and up: every axis but the last (optax stops at 5).

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> optaxclip.default_unit_axes(jnp.zeros((1, 8))) is None
    True
    >>> optaxclip.default_unit_axes(jnp.zeros((8, 4, 2)))
    (0,)
    >>> optaxclip.default_unit_axes(jnp.zeros((3, 3, 8, 16)))
    (0, 1, 2)
  """
  return _unit_axes_of_shape(tuple(x.shape))


def _unit_axes_of_shape(shape: tuple[int, ...]) -> Optional[tuple[int, ...]]:
  if sum(d != 1 for d in shape) <= 1:
    return None
  if len(shape) in (2, 3):
    return (0,)
  if len(shape) == 4:
    return (0, 1, 2)
  return tuple(range(len(shape) - 1))


def _unitwise_limit(w_norm, clipping, eps):
  """``clipping * max(||w||, eps)`` as a Scaled (params' norms may exceed the
  dtype's range).
  """
  dtype = w_norm.value.dtype
  small = w_norm.as_float() < jnp.asarray(eps, dtype)
  value = jnp.where(small, jnp.asarray(eps, dtype), w_norm.value)
  # clipping=inf: no limit. Not inf * value, whose derivative with respect
  # to the params would be inf * 0 = NaN.
  clipping = jnp.asarray(clipping, dtype)
  unlimited = clipping == jnp.inf
  # A product of normalised mantissas: a clipping near float32's smallest
  # normal times a norm's value below 1 would be subnormal (flushed to 0).
  limit = _norms.product(
    _norms.Scaled(value, jnp.where(small, 0, w_norm.exponent)),
    jnp.where(unlimited, 1, clipping),
  )
  return _norms.Scaled(
    jnp.where(unlimited, jnp.inf, limit.value), limit.exponent
  )


def _global_unit_axes(x, split: _sharding.LeafSharding, path: str):
  """:func:`default_unit_axes` of the leaf's global shape.

  Inside ``shard_map``/``pmap`` the leaf is a local shard: a Dense kernel
  (8, 2) split 8 ways along its inputs is (1, 2) on each device, which the
  rule by shape would read as a vector. A PartitionSpec in ``sharded`` gives
  the global shape. Without it, the local shape gives the same units unless
  it has a dimension of size 1 and at most one other: then the split may
  have made that 1, and the units cannot be told (an error, not a guess).
  """
  shape = _sharding.global_shape(x, split)
  if shape is None:
    local = tuple(x.shape)
    if 1 in local and sum(d != 1 for d in local) <= 1:
      raise ValueError(
        f"clip_unitwise: sharded must give the leaf {path} as a "
        "PartitionSpec (or axis= must be given), since it is split over "
        f"{split.axes} and its local shape {local} does not tell its "
        "units; got a bool or axis names."
      )
    shape = local
  return _unit_axes_of_shape(shape)


@_compiled.compiled_once
def clip_unitwise(
  clipping: ScalarOrSchedule = 0.01,
  *,
  eps: Scalar = 1e-3,
  axis: Axis = None,
  axis_name: AxisName = None,
  sharded: Sharded = True,
  leaf_stats: bool = False,
  layer_axis: _telemetry.LayerAxis = None,
) -> optax.GradientTransformation:
  """Adaptive gradient clipping: ``||g_u|| <= clipping * max(||w_u||, eps)``.

  Each unit ``u`` of each leaf (an output unit of a layer: see
  :func:`default_unit_axes`) is clipped relative to the norm of the matching
  unit of the parameters, as in NFNets. Same numbers as
  ``optax.adaptive_grad_clip`` (which guards its divisor with 1e-6; this uses
  the exact ratio). Needs ``params`` in ``update``.

  Args:
    clipping: the largest allowed ratio of gradient to parameter norm (>= 0):
      a number or a schedule (``step -> value``), evaluated at this
      clipper's step count (0 on the first update).
    eps: parameter norms below it count as ``eps``, so zero-initialised
      parameters still move (>= 0).
    axis: the axes a unit spans, for every leaf; ``None`` picks them by rank.
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves (and their params) are split: partial unit norms
      of gradient and parameters are summed across devices.
    sharded: per leaf, which axes of ``axis_name`` split it (leaf and
      params alike): ``True`` (all; the default), ``False``/``None``
      (replicated), a tuple of axis names, or a ``PartitionSpec`` (as in
      ``shard_map``'s ``in_specs``); one for all leaves, a pytree prefix or
      a callable ``(path, leaf) -> entry``. Units come from the leaf's
      global shape: give a PartitionSpec (it tells the global shape, and
      which axes split units and which split a unit's own axes: numbers and
      statistics are then exact) or ``axis``. A bool or names mean "split
      along an axis the units span" (FSDP's split of a Dense kernel's
      inputs); mark a leaf split only along the other axes False (whole
      units on each device, local statistics). A split leaf whose local
      shape cannot tell its units, such as a kernel (8, 2) split 8 ways into
      (1, 2), raises a ValueError unless a PartitionSpec or ``axis`` says.
    leaf_stats: also keep each leaf's pre-clip L2 norm in the state
      (``leaf_norms``; :func:`optaxclip.stats` shows them as
      ``clip_unitwise/leaf_norm/<path>``), with ``top_leaf_share`` and
      ``top_leaf``; from the same single pass over the gradients. A leaf
      norm beyond float32's range reads +inf.
    layer_axis: with ``leaf_stats``, the stacking axis of stacked layers
      (``nn.scan``): such a leaf reports one norm per layer. An int, a
      pytree prefix of ints/``None`` or a callable ``(path, leaf) -> int |
      None`` (as ``sharded``); not an axis split over ``axis_name`` (a
      leaf split across devices needs a PartitionSpec in ``sharded`` that
      says so; else an error).

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`ClipUnitwiseState`.

  References:
    Brock et al., `High-Performance Large-Scale Image Recognition Without
    Normalization <https://arxiv.org/abs/2102.06171>`_, 2021

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> tx = optaxclip.clip_unitwise(0.1)
    >>> params = {"w": jnp.array([[3.0, 1.0], [4.0, 0.0]])}
    >>> g = {"w": jnp.array([[3.0, 0.0], [4.0, 0.05]])}
    >>> clipped, state = tx.update(g, tx.init(params), params)
    >>> clipped["w"]
    Array([[0.3 , 0.  ],
           [0.4 , 0.05]], dtype=float32)
    >>> float(state.clip_fraction)
    0.5
  """
  who = "clip_unitwise"
  _schedules.check(who, "clipping", clipping, low=0.0, allow_inf=True)
  _checks.check_number("eps", eps, who=who, low=0.0)
  axis = _checks.check_axis("axis", axis, who=who)
  axis_name = _checks.check_sharding(who, axis_name, sharded)
  leaf_stats = _telemetry.check(who, leaf_stats, layer_axis)

  def update_fn(updates, state, params=None):
    _checks.check_same_structure(updates, params, "clip_unitwise")
    ratio = _schedules.value_at(
      clipping, _schedules.count_of(state), who=who, name="clipping"
    )
    leaves, treedef = _flatten(updates, "clip_unitwise")
    try:
      param_leaves = [jnp.asarray(w) for w in treedef.flatten_up_to(params)]
    except (ValueError, TypeError) as err:
      raise ValueError(
        f"clip_unitwise: params do not have the structure of the updates: {err}"
      ) from None
    _checks.check_float_leaves(params, "clip_unitwise: params")
    paths = [p_ for p_, _ in _checks.leaves_with_paths(updates)]
    splits = _sharding.resolve(updates, sharded, axis_name, "clip_unitwise")
    axes = [
      _global_unit_axes(x, s, path)
      if axis is None
      else _checks.leaf_axes(who, axis, x, path)
      for x, s, path in zip(leaves, splits, paths)
    ]
    layout, g_norms, telemetry = _telemetry.unit_norms(
      who,
      updates,
      leaves,
      2.0,
      axes,
      on=leaf_stats,
      state_norms=state.leaf_norms if leaf_stats else None,
      layer_axis=layer_axis,
      axis_name=axis_name,
      splits=splits,
    )
    w_norms = _norms.part_norms(layout, param_leaves, 2.0, axis_name=axis_name)
    if leaf_stats:  # the units of the pass may be split per layer
      w_norms = _telemetry.coarse_norms(
        layout,
        w_norms,
        axes,
        _telemetry.layer_axes(who, updates, layer_axis),
        2.0,
      )
    # Per group of parts, as the norms were computed (_norms.part_groups).
    limits: list[Any] = [None] * len(w_norms)
    for group in _norms.part_groups(w_norms, layout.keys):
      like = [w_norms[i] for i in group]
      limit = _unitwise_limit(_norms.concat_parts(like), ratio, eps)
      for i, piece in zip(group, _norms.split_parts(limit, like)):
        limits[i] = piece
    # Each factor is at least clipping * eps over the largest norm the
    # gradients may have (half of it: the limit's product is rounded).
    # (A schedule's or an array's bound is not known: 0, three multipliers.)
    least_limit = None if callable(clipping) else clipping * eps / 2
    smallest = _norms.smallest_clip_factor(leaves, least_limit, axis_name)
    out, stats = _per_unit_clip(leaves, layout, g_norms, limits, 2.0, smallest)
    return jax.tree.unflatten(treedef, out), ClipUnitwiseState(
      *stats,
      _stats.as_stat(ratio),
      _schedules.next_count(_schedules.count_of(state)),
      *telemetry,
    )

  return optax.GradientTransformation(
    _init_stats(
      ClipUnitwiseState, clipping, who, "clipping", leaf_stats, layer_axis
    ),
    _compiled.jit_update(update_fn),
  )
