"""Per-example clipping for differentially private training (DP-SGD).

The aggregation step is built from three named parts that
:func:`optaxclip.clipped_grad` and :func:`optaxclip.dp_noise` share with
:func:`clip_per_example`:

* :func:`clip_and_sum`: each example clipped to its limit and summed, with
  examples whose norm is not finite zeroed and counted;
* :func:`add_noise`: Gaussian noise on the sum;
* :func:`adapt_clip_norm`: the geometric update of the clip norm towards a
  target quantile of the per-example norms (Andrew et al. 2021).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import math
from typing import Any, Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxclip import _checks
from optaxclip import _compiled
from optaxclip import _norms
from optaxclip import _schedules
from optaxclip import _stats
from optaxclip._typing import AxisName
from optaxclip._typing import Scalar
from optaxclip._typing import ScalarOrSchedule
from optaxclip._typing import Scope
from optaxclip._typing import Seed

STAT_FIELDS = (
  "norm",
  "clipped_norm",
  "clip_fraction",
  "nonfinite",
  "clip_norm",
  "threshold",
)


@_stats.register("clip_per_example", STAT_FIELDS)
class ClipPerExampleState(NamedTuple):
  """State of :func:`clip_per_example`.

  Attributes:
    norm: the mean per-example global L2 norm before clipping, over the
      real (non-padding) examples (non-finite ones count as 0).
    clipped_norm: the mean per-example global L2 norm after clipping.
    clip_fraction: the share of the real examples scaled down (zeroed
      non-finite examples included).
    clip_norm: the clip norm the next step will use: ``l2_clip`` at the
      start, adapted after each step when ``target_quantile`` is set.
    key: the random key of the noise.
    nonfinite: the number of examples whose norm was not finite (an Inf or
      NaN element), zeroed this step instead of entering the sum.
    threshold: the clip norm this step used (``l2_clip``, a schedule's value
      at the step, or the adapted clip norm; before the first update, the
      clip norm of the first).
    count: updates so far (int32, saturating), the step at which a schedule
      is evaluated.
  """

  norm: jax.Array  # float32 scalar
  clipped_norm: jax.Array  # float32 scalar
  clip_fraction: jax.Array  # float32 scalar
  clip_norm: jax.Array  # float32 scalar
  key: jax.Array  # a PRNG key
  # int32 scalar (a count). New after release 0.1.0: a state restored from
  # a 0.1.0 checkpoint (restore with the five older fields as the target)
  # upgrades with ClipPerExampleState(*old), this count starting at 0.
  nonfinite: jax.typing.ArrayLike = np.int32(0)
  # New after release 0.1.0 too (optaxclip.upgrade_state fills them in).
  threshold: jax.typing.ArrayLike = np.float32(0)
  count: jax.typing.ArrayLike = np.int32(0)  # pyright: ignore[reportIncompatibleMethodOverride]


# Andrew et al. 2021 recommend noising the unclipped count with a standard
# deviation of the expected number of examples per step over 20.
COUNT_NOISE_DIVISOR = 20.0

# A clip factor below this is applied in two steps (an exact power of two on
# the example, then the rest on the weight): a factor near 2**-126 would be
# flushed to zero, or x * factor would.
_SMALL_FACTOR = 2.0**-60


def count_noise_std(batch_size: int, noise_multiplier: Any) -> Any:
  """The standard deviation of the noise on the unclipped count (sigma_b).

  ``batch_size / 20`` as Andrew et al. 2021 recommend, when the clip norm
  adapts and noise is on; else 0.
  """
  return jnp.where(
    jnp.asarray(noise_multiplier) > 0, batch_size / COUNT_NOISE_DIVISOR, 0.0
  )


def sum_noise_multiplier(noise_multiplier: Any, count_std: Any) -> Any:
  """The noise multiplier of the sum when the count takes its share.

  Theorem 1 of Andrew et al. 2021: releasing the sum with noise multiplier
  ``z_sum`` and the centred count (sensitivity 1/2) with noise ``count_std``
  is as private as one Gaussian mechanism of multiplier ``z`` when
  ``z ** -2 = z_sum ** -2 + (2 * count_std) ** -2``. So the sum gets
  ``z_sum = (z ** -2 - (2 * count_std) ** -2) ** -1/2``, a little above ``z``.
  """
  z = jnp.asarray(noise_multiplier, jnp.float32)
  two_b = 2.0 * jnp.asarray(count_std, jnp.float32)
  inv = (
    1.0 / jnp.where(z > 0, z, 1.0) ** 2
    - 1.0 / jnp.where(two_b > 0, two_b, jnp.inf) ** 2
  )
  # inv <= 0 (batch too small) gives NaN: a loud failure, never a weak one.
  return jnp.where(
    z > 0,
    jnp.where(inv > 0, 1.0 / jnp.sqrt(jnp.where(inv > 0, inv, 1.0)), jnp.nan),
    0.0,
  )


def _batch_size(leaves, paths, who="clip_per_example") -> int:
  sizes = set()
  for x, path in zip(leaves, paths):
    if x.ndim == 0:
      raise ValueError(
        f"{who}: leaf {path} is a scalar; every leaf needs a "
        "leading batch axis (per-example gradients, e.g. from "
        "jax.vmap(jax.grad(loss), in_axes=(None, 0)))."
      )
    sizes.add(x.shape[0])
  if len(sizes) > 1:
    detail = ", ".join(f"{p}: {x.shape[0]}" for x, p in zip(leaves, paths))
    raise ValueError(
      f"{who}: the leaves' leading (batch) axes differ: {detail}."
    )
  size = sizes.pop()
  if size == 0:
    raise ValueError(f"{who}: the batch is empty.")
  return size


def _summed_batch_sharding(x: jax.Array):
  """The sharding of ``x`` summed over its batch axis, when that axis is
  split over an Explicit mesh axis (JAX then asks for it); else None.
  """
  typeof = getattr(jax, "typeof", None)
  sharding = getattr(typeof(x), "sharding", None) if typeof else None
  spec: tuple[Any, ...] = tuple(getattr(sharding, "spec", None) or ())
  if sharding is None or not spec or spec[0] is None:
    return None
  rest = spec[1:] + (None,) * (x.ndim - len(spec))
  return jax.sharding.NamedSharding(
    sharding.mesh, jax.sharding.PartitionSpec(*rest)
  )


def weighted_sum(x: jax.Array, weights: jax.Array) -> jax.Array:
  """``sum_b weights[b] * x[b]`` in the accumulation dtype.

  A contraction (``tensordot``) at full float32 precision: on XLA:CPU a
  product summed over the leading axis makes :func:`clip_per_example`'s
  step tens of times slower (``docs/performance.md``).
  """
  dtype = _norms.promote_types(_norms.accumulation_dtype(x.dtype), x.dtype)
  out_sharding = _summed_batch_sharding(x)
  kwargs: dict[str, Any] = (
    {} if out_sharding is None else {"out_sharding": out_sharding}
  )
  return jnp.tensordot(
    weights.astype(_norms.accumulation_dtype(x.dtype)),
    x.astype(dtype),
    axes=1,
    precision=jax.lax.Precision.HIGHEST,
    **kwargs,
  )


def _per_example(v: jax.Array, x: jax.Array) -> jax.Array:
  """``v`` of shape ``(B,)`` shaped to broadcast against ``x`` (B, ...)."""
  return v.reshape(v.shape + (1,) * (x.ndim - 1))


def noise_state_init(state_cls: type, l2_clip: Any, make_key: Callable):
  """The ``init`` of a state laid out as :class:`ClipPerExampleState` (norm,
  clipped_norm, clip_fraction, clip_norm, key, nonfinite, threshold,
  count): zero statistics, the clip norm ``l2_clip`` (a schedule's value at
  step 0) and a fresh key. Shared with ``dp_noise``.
  """

  def init_fn(params):
    del params
    first = _stats.as_stat(
      _schedules.first_value(
        l2_clip, who=_stats.short_name(state_cls), name="l2_clip"
      )
    )
    return state_cls(
      *_stats.zeros(3),
      clip_norm=first,
      key=make_key(),
      nonfinite=jnp.zeros((), jnp.int32),
      threshold=first,
      count=jnp.zeros((), jnp.int32),
    )

  return init_fn


def sum_clipped(
  leaves: Sequence[jax.Array],
  norms: Sequence[Any],
  limits: Sequence[Any],
  keep: jax.Array,
  factors: Optional[Sequence[Any]] = None,
) -> list[jax.Array]:
  """``sum_b keep_b * min(1, limit / norms[b]) * x[b]`` for each leaf.

  Args:
    leaves: per-example arrays, leading axis ``B``.
    norms: per leaf, the ``(B,)`` norms the limit applies to (the example's
      global norm for a global clip, the leaf's own for a per-leaf one):
      plain arrays or :class:`~optaxclip._norms.Scaled` (exact beyond the
      dtype's range).
    limits: per leaf, the clip limit (a scalar).
    keep: ``(B,)`` bool, False for examples to leave out (their elements
      never reach the sum, whatever they hold).
    factors: per leaf, the ``(B,)`` factors (plain or Scaled) to apply
      instead of ``min(1, limit / norm)`` (e.g. automatic clipping's
      ``limit / (norm + gamma)``); each at most ``limit / norm``.

  Returns:
    One array per leaf, without the batch axis, in the accumulation dtype.

  The ordinary step is one contraction per leaf with the clip factors as
  weights. When an example is left out (a NaN times a zero weight is NaN) or
  a factor is so small that it or its products would be flushed to zero (a
  norm above about 2**60 times the limit, or beyond the dtype's range), one
  ``lax.cond`` takes a careful path: left-out examples are zeroed, and each
  kept example is scaled by its factor exactly (exact powers of two, then
  the mantissa: :func:`optaxclip._norms.scale_leaf`) before the sum.
  """
  # Leaves that share their norm and limit (a global clip: all of them)
  # or their factor share one computation of it: a program of the size of
  # one, not of one per leaf.
  if factors is None:
    by_pair: dict = {}
    factors = [
      _shared(
        by_pair, (n, limit), lambda n=n, lim=limit: _norms.clip_scale(n, lim)
      )
      for n, limit in zip(norms, limits)
    ]
  by_factor: dict = {}
  factors = [
    _shared(by_factor, (f,), lambda f=f: _norms.as_scaled(f)) for f in factors
  ]
  by_scaled: dict = {}
  plain_factors = [
    _shared(by_scaled, (f,), lambda f=f: f.as_float()) for f in factors
  ]
  distinct = {id(f): f for f in plain_factors}.values()
  tiny = _any_of([keep & ~(f >= _SMALL_FACTOR) for f in distinct])
  ordinary = jnp.all(keep) & ~jnp.any(tiny)

  def plain(leaves_):
    return [weighted_sum(x, f) for x, f in zip(leaves_, plain_factors)]

  def careful(leaves_):
    out = []
    for x, f in zip(leaves_, factors):
      wide = _norms.promote_types(_norms.accumulation_dtype(x.dtype), x.dtype)
      f = _norms.Scaled(
        _per_example(jnp.where(keep, f.value, 0), x),
        _per_example(jnp.where(keep, f.exponent, 0), x),
      )
      scaled = _norms.scale_leaf(x.astype(wide), f)
      scaled = jnp.where(_per_example(keep, x), scaled, 0)
      out.append(jnp.sum(scaled, axis=0))
    return out

  return jax.lax.cond(ordinary, plain, careful, list(leaves))


def _shared(cache: dict, key: tuple, make: Callable) -> Any:
  """``make()``, once per ``key`` (its objects compared by identity)."""
  ids = tuple(id(k) for k in key)
  if ids not in cache:
    cache[ids] = (key, make())  # the key kept alive: its ids stay unique
  return cache[ids][1]


def reported_norm(norm: _norms.Scaled) -> jax.Array:
  """A per-example norm as a plain number: a finite norm beyond the dtype's
  range as its largest value (not inf, which means a non-finite example);
  inf and NaN as they are.
  """
  plain = norm.as_float()
  top = jnp.finfo(plain.dtype).max
  return jnp.where(
    jnp.isfinite(norm.value), jnp.minimum(plain, top), norm.value
  )


def example_norms_scaled(
  leaves: Sequence[jax.Array],
) -> tuple[list[_norms.Scaled], _norms.Scaled]:
  """Per leaf and for the whole example, the ``(B,)`` L2 norms of the
  examples of per-example ``leaves``, exact beyond the dtype's range.
  """
  batch = leaves[0].shape[0]
  axes = [tuple(range(1, x.ndim)) for x in leaves]
  leaf_norms = [
    _norms.Scaled(n.value.reshape(batch), n.exponent.reshape(batch))
    for n in _norms.unit_norms_scaled(leaves, 2.0, axes)
  ]
  return leaf_norms, stack_and_combine(leaf_norms)


def stack_and_combine(norms: Sequence[_norms.Scaled]) -> _norms.Scaled:
  """The ``(B,)`` L2 norms of the union of units whose ``(B,)`` norms are
  ``norms`` (exact: :func:`optaxclip._norms.reduce_norms`).
  """
  return _norms.reduce_norms(
    _norms.Scaled(
      jnp.stack([n.value for n in norms]),
      jnp.stack([n.exponent for n in norms]),
    ),
    2.0,
    (0,),
  )


def _any_of(masks: Sequence[jax.Array]) -> jax.Array:
  out = masks[0]
  for m in masks[1:]:
    out = out | m
  return out


class ClipCounts(NamedTuple):
  """Sums over the examples of one step, for the statistics and the clip
  norm's adaptation (summed over devices when the batch is split).
  """

  norm_sum: jax.Array  # pre-clip norms of the examples in the sum
  clipped_norm_sum: jax.Array  # their norms after clipping
  clipped: jax.Array  # examples scaled down, zeroed ones included
  nonfinite: jax.Array  # examples zeroed for a non-finite norm
  # The examples that count (padding does not); None: the whole batch.
  examples: Any = None


def counts_from_norms(
  example_norms: jax.Array, clip: Any, real: Optional[jax.Array] = None
) -> ClipCounts:
  """:class:`ClipCounts` of a global clip from the per-example norms.

  ``real`` (``(B,)`` bool) marks the examples that count (padding does not).
  """
  examples = None if real is None else _norms.count(real)
  real = jnp.ones(example_norms.shape, bool) if real is None else real
  finite = jnp.isfinite(example_norms) & real
  kept = jnp.where(finite, example_norms, 0)
  clip = jnp.asarray(clip, kept.dtype)
  return ClipCounts(
    norm_sum=jnp.sum(kept),
    clipped_norm_sum=jnp.sum(jnp.minimum(kept, clip)),
    clipped=_norms.count(real & ~(example_norms <= clip)),
    nonfinite=_norms.count(real & ~jnp.isfinite(example_norms)),
    examples=examples,
  )


def clip_and_sum(
  leaves: Sequence[jax.Array],
  clip: Any,
  scope: str = "global",
  real: Optional[jax.Array] = None,
) -> tuple[list[jax.Array], jax.Array, ClipCounts]:
  """Clips each example of per-example ``leaves`` and sums them.

  ``scope="global"`` clips each example's whole gradient to ``clip``;
  ``scope="leaf"`` each of its ``K`` leaves to ``clip / sqrt(K)``. An
  example holding an Inf or NaN element is left out of the sum, zeroed, and
  counted: it can leak none of its other coordinates, and one example still
  moves the sum by at most ``clip``. A finite example is clipped along its
  direction even where its norm exceeds the dtype's range (norms are exact
  :class:`~optaxclip._norms.Scaled` numbers); its reported norm is then the
  dtype's largest value.

  Args:
    leaves: per-example arrays with a common leading batch axis ``B``.
    clip: the clip norm (a scalar, ``inf`` for none).
    scope: ``"global"`` or ``"leaf"``.
    real: ``(B,)`` bool, the examples that count; padding (False) is left
      out of the sum and of every count. None: all of them.

  Returns:
    The per-leaf sums (accumulation dtype, no batch axis), the ``(B,)``
    per-example global norms before clipping, and the :class:`ClipCounts`
    of this batch (not summed over devices).
  """
  scaled_leaf_norms, scaled_norms = example_norms_scaled(leaves)
  # A finite example whose norm exceeds the dtype's range is clipped like
  # any other: only an example holding an Inf or NaN is left out.
  finite = jnp.isfinite(scaled_norms.value)
  example_norms = reported_norm(scaled_norms)
  clip = jnp.asarray(clip, example_norms.dtype)
  if scope == "global":
    limits = [clip] * len(leaves)
    norms = [scaled_norms] * len(leaves)
    counts = counts_from_norms(example_norms, clip, real)
  else:
    leaf_norms = [reported_norm(n) for n in scaled_leaf_norms]
    limit = clip / math.sqrt(len(leaves))
    limits = [limit] * len(leaves)
    norms = scaled_leaf_norms
    was_clipped = _any_of([~(n <= limit) for n in leaf_norms])
    clipped_norms = jax.vmap(_norms.combine_norms)(
      [jnp.minimum(n, limit) for n in leaf_norms]
    )
    counted = jnp.ones_like(finite) if real is None else real
    kept = finite & counted
    counts = ClipCounts(
      norm_sum=jnp.sum(jnp.where(kept, example_norms, 0)),
      clipped_norm_sum=jnp.sum(jnp.where(kept, clipped_norms, 0)),
      clipped=_norms.count(counted & (was_clipped | ~finite)),
      nonfinite=_norms.count(counted & ~finite),
      examples=None if real is None else _norms.count(real),
    )
  if real is not None:
    finite = finite & real
  sums = sum_clipped(leaves, norms, limits, finite)
  return sums, example_norms, counts


def psum_counts(counts: ClipCounts, axis_name) -> ClipCounts:
  if not axis_name:
    return counts
  examples = counts.examples
  return ClipCounts(
    norm_sum=jax.lax.psum(counts.norm_sum, axis_name),
    clipped_norm_sum=jax.lax.psum(counts.clipped_norm_sum, axis_name),
    clipped=jax.lax.psum(counts.clipped, axis_name),
    nonfinite=jax.lax.psum(counts.nonfinite, axis_name),
    examples=None if examples is None else jax.lax.psum(examples, axis_name),
  )


def standard_normals(key, leaves, extra: int) -> tuple[list, jax.Array]:
  """Standard normal noise shaped like each leaf (complex: on both parts),
  and ``extra`` more values, from one draw (one PRNG call compiles faster
  than one per leaf).
  """
  dtype = _norms.tree_accumulation_dtype(leaves)
  sizes = [x.size * (2 if jnp.iscomplexobj(x) else 1) for x in leaves]
  flat = jax.random.normal(key, (sum(sizes) + extra,), dtype)
  out, start = [], 0
  for x, size in zip(leaves, sizes):
    part = flat[start : start + size]
    start += size
    if jnp.iscomplexobj(x):
      part = part[: x.size] + 1j * part[x.size :]
    out.append(part.reshape(x.shape))
  return out, flat[start:]


def add_noise(
  sums: Sequence[jax.Array], key: jax.Array, std: Any, extra: int = 0
) -> tuple[list[jax.Array], jax.Array]:
  """``sums`` plus Gaussian noise of standard deviation ``std`` (per element),
  and ``extra`` more standard normals from the same draw. The same key on
  every device gives the same noise: it is added once, not per device.
  """
  noises, rest = standard_normals(key, sums, extra)
  std = jnp.asarray(std)
  return [s + (std * n).astype(s.dtype) for s, n in zip(sums, noises)], rest


def adapt_clip_norm(
  clip: Any, unclipped_share: Any, target_quantile: Any, quantile_lr: Any
) -> jax.Array:
  """Andrew et al. 2021's geometric step of the clip norm:
  ``C * exp(-quantile_lr * (unclipped_share - target_quantile))``.
  """
  return clip * jnp.exp(
    -jnp.asarray(quantile_lr, jnp.float32)
    * (unclipped_share - jnp.asarray(target_quantile, jnp.float32))
  )


def check_l2_clip(who: str, l2_clip: Any, target_quantile: Any) -> None:
  """``l2_clip``: a number >= 0 (or inf), or a schedule when the clip norm
  does not adapt (with ``target_quantile`` it is the adaptation's start).
  """
  _schedules.check(who, "l2_clip", l2_clip, low=0.0, allow_inf=True)
  if target_quantile is not None and _schedules.is_schedule(l2_clip):
    raise ValueError(
      f"{who}: l2_clip must be a number when target_quantile is set (the "
      "adaptive clip norm starts from it); got a schedule."
    )


def clip_at(
  who: str, l2_clip: Any, state: Any, adaptive: bool, dtype: Any
) -> jax.Array:
  """The clip norm of this step: the adapted one kept in ``state`` (a
  float32 statistic), or ``l2_clip`` (a schedule's value at the state's step
  count) in ``dtype``, the examples' accumulation dtype: a float64 bound is
  not rounded to float32 (``0.1`` would bound each example at
  ``0.10000000149``, and a bound beyond float32's range would read 0 or inf).
  """
  if adaptive:
    return state.clip_norm
  value = _schedules.value_at(l2_clip, state.count, who=who, name="l2_clip")
  return jnp.asarray(value, dtype).reshape(())


class Noised(NamedTuple):
  out: list  # the noised (and reduced) sums
  clip_norm: jax.Array  # the next step's clip norm
  key: jax.Array  # the next step's key


def check_batch_for_count_noise(
  who, batch, noise_multiplier, adaptive, no_noise
):
  if (
    adaptive
    and not no_noise
    and _checks.is_concrete_number(noise_multiplier)
    and batch <= 10 * noise_multiplier
  ):
    raise ValueError(
      f"{who}: a batch of {batch} examples is too small to "
      "noise the unclipped count as Andrew et al. do (sigma_b = B / 20 "
      f"needs B > 10 * noise_multiplier = {10 * noise_multiplier:g}); "
      "use a larger batch, less noise, or target_quantile=None."
    )


def noise_and_adapt(
  sums: Sequence[jax.Array],
  counts: ClipCounts,
  clip: jax.Array,
  key: jax.Array,
  *,
  batch: int,
  noise_multiplier: Any,
  no_noise: bool,
  target_quantile: Any,
  quantile_lr: Any,
  reduce: str,
  divisor: Optional[Any] = None,
) -> Noised:
  """Noise on the clipped sum, the reduction, and the clip norm's next value.

  The one implementation behind :func:`clip_per_example` and
  :func:`optaxclip.dp_noise`. ``counts`` are over the whole batch of
  ``batch`` examples (summed over devices); ``divisor`` (default ``batch``)
  divides the noised sum for ``reduce="mean"``.
  """
  adaptive = target_quantile is not None
  key, noise_key = jax.random.split(key)
  count_std = (
    count_noise_std(batch, noise_multiplier)
    if adaptive and not no_noise
    else 0.0
  )
  count_noise = jnp.zeros((), jnp.float32)
  sums = list(sums)
  if not no_noise:
    z_sum = (
      sum_noise_multiplier(noise_multiplier, count_std)
      if adaptive
      else jnp.asarray(noise_multiplier, jnp.float32)
    )
    # z = 0 with an infinite clip norm is no noise, not 0 * inf = NaN.
    sum_std = jnp.where(z_sum > 0, z_sum * clip, 0.0)
    sums, rest = add_noise(sums, noise_key, sum_std, extra=1)
    count_noise = count_std * rest[0].astype(jnp.float32)
  if reduce == "mean":
    divisor = batch if divisor is None else divisor
    sums = [s / jnp.asarray(divisor, s.real.dtype) for s in sums]
  new_clip = clip
  if adaptive:
    # Over the examples that count: padding is neither clipped nor not.
    # Without noise the share is exact; with noise the noised, centred
    # count is divided by the batch size, a public number (the number of
    # real examples is not: dividing by it would release it unnoised), as
    # Andrew et al. divide by the expected batch size.
    examples = batch if counts.examples is None else counts.examples
    unclipped = examples - counts.clipped
    if no_noise:
      unclipped_share = jnp.where(
        examples > 0, unclipped / jnp.maximum(examples, 1), target_quantile
      )
    else:
      centred = unclipped - 0.5 * examples + count_noise
      unclipped_share = jnp.clip(centred / batch + 0.5, 0.0, 1.0)
    new_clip = adapt_clip_norm(
      clip, unclipped_share, target_quantile, quantile_lr
    )
  return Noised(sums, new_clip, key)


@_compiled.compiled_once
def clip_per_example(
  l2_clip: ScalarOrSchedule,
  *,
  scope: Scope = "global",
  reduce: Literal["mean", "sum"] = "mean",
  noise_multiplier: Scalar = 0.0,
  seed: Seed = 0,
  target_quantile: Optional[Scalar] = None,
  quantile_lr: Scalar = 0.2,
  axis_name: AxisName = None,
) -> optax.GradientTransformation:
  """Clips each example's gradient, aggregates the batch, adds Gaussian noise.

  The aggregation step of DP-SGD (Abadi et al. 2016). Its input holds
  per-example gradients: every leaf carries a leading batch axis of size
  ``B`` (from ``jax.vmap(jax.grad(loss), in_axes=(None, 0))``). Each example
  is clipped to L2 norm ``C`` (``l2_clip``), the clipped examples are summed,
  Gaussian noise of standard deviation ``noise_multiplier * C`` is added to
  the sum, and the result is divided by ``B`` (``reduce="mean"``) or not
  (``reduce="sum"``). The output has the parameters' shapes (no batch axis),
  ready for the optimizer chained after it.

  ``scope="global"`` clips each example's whole gradient (the numbers of
  ``optax.per_example_global_norm_clip``); ``scope="leaf"`` clips each of the
  ``K`` leaves of an example to ``C / sqrt(K)`` (McMahan et al. 2017; the
  numbers of ``optax.per_example_layer_norm_clip(uniform=True)``). Either way
  one example moves the sum by at most ``C``.

  With ``target_quantile``, ``C`` adapts so that about that share of examples
  goes unclipped, by the geometric rule of Andrew et al. 2021:
  ``C <- C * exp(-quantile_lr * (b - target_quantile))``, ``b`` the share of
  examples left unclipped this step (for ``scope="leaf"``: with no leaf
  clipped). With noise on, ``b`` is noised as the paper does: the count of
  unclipped examples, centred (each example counts +-1/2), gets Gaussian noise
  of standard deviation ``sigma_b = B / 20`` (the paper's recommendation), and
  so that the step as a whole stays a Gaussian mechanism of multiplier
  ``noise_multiplier`` (the paper's Theorem 1), the sum's noise multiplier
  rises to ``(noise_multiplier ** -2 - (2 * sigma_b) ** -2) ** -1/2``. This
  needs ``B > 10 * noise_multiplier``; a smaller batch raises a ValueError.

  Padding: ``tx.update(per_example, state, is_padding_example=mask)``
  (``(B,)`` bool, True for padding, as under Poisson sampling into a fixed
  batch shape) leaves those examples out of the sum and of every statistic:
  ``norm``, ``clipped_norm`` and ``clip_fraction`` are means over the real
  examples, and the clip norm adapts to their unclipped share (exactly
  without noise; with noise, the noised centred count of the real examples
  over ``B``, a public number, as the paper divides by the expected batch
  size). ``B`` still divides the sum for ``reduce="mean"``: a
  data-independent divisor.

  An example whose norm is not finite (an Inf or NaN element) is zeroed,
  not summed: none of its other coordinates leaks into the result, and the
  number of such examples is the state's ``nonfinite`` (they count as
  clipped for ``clip_fraction`` and the clip norm's adaptation). A finite
  example is clipped along its direction whatever its size, a norm beyond
  the dtype's range included (norms and factors are computed exactly, as
  power-of-two scaled numbers, and a factor that would flush to zero is
  applied in exact steps); such a norm enters the statistics as the
  dtype's largest value.

  **No privacy accounting is done here.** This clips and adds noise; what
  (epsilon, delta) that buys depends on the sampling of batches, the number
  of steps and ``noise_multiplier``, which an accountant must track: use
  e.g. Google's ``dp_accounting`` library (its RDP or PLD accountant, as TF
  Privacy does). Batches must be sampled as the accountant assumes (e.g.
  Poisson sampling), and ``seed`` must differ between runs whose noise must
  be independent.

  Args:
    l2_clip: the clip norm ``C`` per example (>= 0, or ``inf`` for no
      clipping without noise, as in optax's examples): a number or a
      schedule (``step -> value``), evaluated at this clipper's step count
      (0 on the first update); the noise follows it (``noise_multiplier *
      C`` of the step). With ``target_quantile``, the starting value (a
      number).
    scope: ``"global"`` (the example's whole gradient) or ``"leaf"`` (each
      leaf at ``C / sqrt(K)``).
    reduce: ``"mean"`` (divide the noised sum by ``B``) or ``"sum"``.
    noise_multiplier: the noise standard deviation on the sum, in units of
      ``C`` (>= 0; 0 means no noise).
    seed: seeds the random key kept in the state; each step uses a fresh one.
    target_quantile: the share of examples to leave unclipped, in [0, 1],
      or ``None`` for a fixed ``C``.
    quantile_lr: the geometric learning rate of ``C`` (>= 0); 0.2 as the
      paper recommends.
    axis_name: inside ``shard_map``/``pmap`` with the batch split over this
      data-parallel axis (or axes), equally on every device: the clipped sums,
      counts and norms are summed over it, ``B`` is the global batch size, and
      every device adds the same noise once, so the result equals the whole
      batch on one device.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`ClipPerExampleState`.

  References:
    Abadi et al., `Deep Learning with Differential Privacy
    <https://arxiv.org/abs/1607.00133>`_, 2016;
    McMahan et al., `Learning Differentially Private Recurrent Language Models
    <https://arxiv.org/abs/1710.06963>`_, 2017;
    Andrew et al., `Differentially Private Learning with Adaptive Clipping
    <https://arxiv.org/abs/1905.03871>`_, 2021;
    Google's ``dp_accounting`` library for the privacy accounting:
    https://github.com/google/differential-privacy/tree/main/python/dp_accounting

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> tx = optaxclip.clip_per_example(5.0)
    >>> per_example = {"w": jnp.array([[3.0, 4.0], [0.0, 10.0]])}  # B = 2
    >>> mean, state = tx.update(per_example, tx.init({"w": jnp.zeros(2)}))
    >>> mean["w"]  # ([3, 4] + [0, 5]) / 2: the second example is clipped.
    Array([1.5, 4.5], dtype=float32)
    >>> float(state.norm), float(state.clip_fraction)
    (7.5, 0.5)
  """
  who = "clip_per_example"
  check_l2_clip(who, l2_clip, target_quantile)
  # "layer" is the deprecated spelling of "leaf", the word clip_zscore and
  # clip_percentile use.
  scope = _checks.check_choice(
    who, "scope", scope, ("global", "leaf"), aliases={"layer": "leaf"}
  )
  _checks.check_choice(who, "reduce", reduce, ("mean", "sum"))
  _checks.check_number("noise_multiplier", noise_multiplier, who=who, low=0.0)
  make_key = _checks.check_seed(who, seed)
  _checks.check_number(
    "target_quantile",
    target_quantile,
    who=who,
    low=0.0,
    high=1.0,
    allow_none=True,
  )
  _checks.check_number("quantile_lr", quantile_lr, who=who, low=0.0)
  axis_name = _checks.check_axis_name(who, axis_name)
  no_noise = bool(
    _checks.is_concrete_number(noise_multiplier) and noise_multiplier == 0
  )
  _checks.check_finite_with_noise(who, l2_clip, noise_multiplier)
  adaptive = target_quantile is not None

  init_fn = noise_state_init(ClipPerExampleState, l2_clip, make_key)

  def update_fn(updates, state, params=None, *, is_padding_example=None):
    del params
    _checks.check_float_leaves(updates, "clip_per_example: updates")
    leaves, treedef = jax.tree.flatten(updates)
    leaves = [jnp.asarray(x) for x in leaves]
    if not leaves:
      return updates, state
    paths = [p for p, _ in _checks.leaves_with_paths(updates)]
    local = _batch_size(leaves, paths)
    real = None
    if is_padding_example is not None:
      real = ~padding_mask(who, is_padding_example, local)
    batch = local * _norms.axis_size(axis_name)
    check_batch_for_count_noise(
      "clip_per_example", batch, noise_multiplier, adaptive, no_noise
    )
    # A fixed C is read from the hyperparameter (optax.inject_hyperparams can
    # change it) or its schedule; an adaptive one lives in the state.
    clip = clip_at(
      who, l2_clip, state, adaptive, _norms.tree_accumulation_dtype(leaves)
    )
    sums, _, counts = clip_and_sum(leaves, clip, scope, real)
    if axis_name:
      sums = [jax.lax.psum(s, axis_name) for s in sums]
    counts = psum_counts(counts, axis_name)
    noised = noise_and_adapt(
      sums,
      counts,
      clip,
      state.key,
      batch=batch,
      noise_multiplier=noise_multiplier,
      no_noise=no_noise,
      target_quantile=target_quantile,
      quantile_lr=quantile_lr,
      reduce=reduce,
    )
    out = [s.astype(x.dtype) for s, x in zip(noised.out, leaves)]
    return jax.tree.unflatten(treedef, out), state_from_counts(
      ClipPerExampleState, counts, batch, noised, clip, state, l2_clip
    )

  def update(updates, state, params=None, *, is_padding_example=None, **extra):
    del extra  # other transformations' extra arguments, in a chain
    return jitted(updates, state, params, is_padding_example=is_padding_example)

  jitted = _compiled.jit_update(update_fn)
  return optax.GradientTransformationExtraArgs(init_fn, update)


def padding_mask(who: str, is_padding_example: Any, batch: int) -> jax.Array:
  """``is_padding_example`` as a ``(batch,)`` bool array, or a clear error."""
  shape = np.shape(is_padding_example)
  if shape != (batch,):
    raise ValueError(
      f"{who}: is_padding_example must have shape ({batch},), one flag per "
      f"example of the batch; got shape {shape}."
    )
  mask = jnp.asarray(is_padding_example)
  if not (mask.dtype == bool or jnp.issubdtype(mask.dtype, jnp.integer)):
    raise TypeError(
      f"{who}: is_padding_example must be booleans (True for padding); got "
      f"dtype {mask.dtype}."
    )
  return mask.astype(bool)


def state_from_counts(
  cls,
  counts: ClipCounts,
  batch: int,
  noised: Noised,
  clip: jax.Array,
  state: Any,
  l2_clip: Any,
):
  """A state of ``cls`` (the fields of :data:`STAT_FIELDS`, ``key`` and
  ``count``) after a step that clipped to ``clip``. Its ``clip_norm`` is the
  next step's: adapted, or a schedule's value at the next step.
  """
  count = _schedules.next_count(state.count)
  clip_norm = noised.clip_norm
  if _schedules.is_schedule(l2_clip):  # never adapted (check_l2_clip)
    clip_norm = _schedules.value_at(
      l2_clip, count, who=_stats.short_name(cls), name="l2_clip"
    )
  # Means over the examples that count (padding does not); 0 without any.
  examples = batch if counts.examples is None else counts.examples
  examples = jnp.maximum(jnp.asarray(examples, jnp.float32), 1)
  return cls(
    norm=_stats.as_stat(counts.norm_sum / examples),
    clipped_norm=_stats.as_stat(counts.clipped_norm_sum / examples),
    clip_fraction=_stats.as_stat(counts.clipped / examples),
    clip_norm=_stats.as_stat(clip_norm),
    key=noised.key,
    nonfinite=counts.nonfinite.astype(jnp.int32).reshape(()),
    threshold=_stats.as_stat(clip),
    count=count,
  )
