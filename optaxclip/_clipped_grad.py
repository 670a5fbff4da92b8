"""Clipped per-example gradients straight from the loss (DP-SGD at scale)."""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import math
import numbers
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxclip import _checks
from optaxclip import _ghost
from optaxclip import _loss_audit
from optaxclip import _norms
from optaxclip import _per_example
from optaxclip import _remat
from optaxclip import _stats
from optaxclip._typing import ScalarOrSchedule

WHO = "clipped_grad"


class Sensitivity(NamedTuple):
  """The L2 sensitivity of what a :func:`clipped_grad` function returns.

  Attributes:
    add_remove: adding or removing one example moves the result by at most
      this much (``C``, or ``sqrt(sum C_k^2)`` with per-layer clip norms).
    replace_one: replacing one example by another: ``2 *`` that.
    divided_by_batch_size: True for ``reduce="mean"``: the result is the sum
      divided by ``B`` (the padded batch size), and so are both figures
      above once divided by ``B``. Calibrate noise for the sum (``noise
      multiplier * add_remove``) and divide the noised sum, never the other
      way round.
  """

  add_remove: Optional[float]  # None when l2_clip is traced
  replace_one: Optional[float]
  divided_by_batch_size: bool


def _groups(l2_clip: Any, params: Any):
  """``l2_clip`` as a pytree prefix of ``params``: per group its clip norm,
  and per leaf of ``params`` its group index.
  """
  if _is_scalar(l2_clip):
    return [l2_clip], [0] * len(jax.tree.leaves(params))
  clips, prefix = jax.tree.flatten(l2_clip)
  try:
    subtrees = prefix.flatten_up_to(params)
  except (ValueError, TypeError) as err:
    raise ValueError(
      f"{WHO}: l2_clip must be a number or a pytree prefix of the "
      f"parameters (one clip norm per layer); got {l2_clip!r}: {err}"
    ) from err
  group_of_leaf = []
  for i, sub in enumerate(subtrees):
    group_of_leaf += [i] * len(jax.tree.leaves(sub))
  return clips, group_of_leaf


def _is_scalar(value) -> bool:
  return isinstance(value, (numbers.Number, np.generic)) or (
    hasattr(value, "shape") and np.ndim(value) == 0
  )


def _check_clip(value) -> None:
  for c in jax.tree.leaves(value):
    _checks.check_number("l2_clip", c, who=WHO, low=0.0, allow_inf=True)


def _batch_arg_size(args, batch_argnums) -> int:
  sizes = set()
  for i in batch_argnums:
    for path, leaf in _checks.leaves_with_paths(args[i]):
      shape = np.shape(leaf)
      if not shape:
        raise ValueError(
          f"{WHO}: argument {i + 1} of loss_fn is a batch (batch_argnums) "
          f"but its leaf {path} is a scalar; every leaf needs a leading "
          "batch axis."
        )
      sizes.add(shape[0])
  if len(sizes) != 1:
    raise ValueError(
      f"{WHO}: the batch arguments' leading axes differ: {sorted(sizes)}."
    )
  size = sizes.pop()
  if size == 0:
    raise ValueError(f"{WHO}: the batch is empty.")
  return size


def _take(args, batch_argnums, fn):
  return tuple(
    jax.tree.map(fn, a) if i in batch_argnums else a for i, a in enumerate(args)
  )


def _chunks(batch: int, most: int = 64) -> int:
  """The largest divisor of ``batch`` up to ``most``: chunks of the rare
  recompute. Its memory (a forward and backward pass of one chunk) sits in
  a branch of a ``lax.cond`` next to the ordinary backward pass, so it adds
  to the step's temporary memory: 8 chunks cost about an eighth of the
  activations, 64 chunks under 2%.
  """
  return max(k for k in range(1, most + 1) if batch % k == 0)


def _recompute_chunks(
  batch: int, spans: bool, microbatch_size: Optional[int]
) -> int:
  """How many chunks a rare recompute (non-finite or exact norms) takes: one
  for a batch split over devices (chunking would reshape the split axis),
  else ``microbatch_size``'s or :func:`_chunks`'.
  """
  if spans:
    return 1
  if microbatch_size is not None:
    return batch // microbatch_size
  return _chunks(batch)


def _factors(norms, clips, normalize, gamma):
  """Per group, the ``(B,)`` factors: ``min(1, C / n)`` or ``C / (n + g)``,
  as :class:`~optaxclip._norms.Scaled` numbers (exact for norms, plain or
  Scaled, beyond the dtype's range).
  """
  out = []
  for n, c in zip(norms, clips):
    n = _norms.as_scaled(n)
    if not normalize:
      out.append(_norms.clip_scale(n, c))
      continue
    c = _norms.as_scaled(jnp.asarray(c, n.value.dtype))
    # n + gamma: gamma is lost in a norm beyond the dtype's range.
    plain = n.as_float()
    ok = jnp.isfinite(plain)
    plus = _norms.Scaled(
      jnp.where(ok, plain + jnp.asarray(gamma, plain.dtype), n.value),
      jnp.where(ok, 0, n.exponent),
    )
    out.append(_quotient(c, plus))
  return out


def _quotient(a, b):
  """``a / b`` of two :class:`~optaxclip._norms.Scaled` numbers, exact:
  ``b`` is brought to a mantissa in [0.5, 1) by an exact power of two (no
  reciprocal of a large number to flush), the exponents subtracted.
  """
  e = _norms.exponent(b.value)
  e = jnp.where(e > jnp.finfo(b.value.dtype).maxexp, 0, e)  # inf, NaN
  mantissa = _norms.ldexp(b.value, -e, pieces=2)
  return _norms.Scaled(
    a.value / jnp.where(mantissa > 0, mantissa, 1), a.exponent - b.exponent - e
  )


@dataclasses.dataclass(frozen=True)
class _Setup:
  """What a clipped-gradient function carries: the loss and the options
  every path reads.
  """

  loss_fn: Callable
  batch_argnums: tuple
  microbatch_size: Optional[int]
  has_aux: bool
  normalize: bool
  gamma: float
  bookkeeping: bool

  def split(self, out):
    """The loss's output as ``(losses, aux)`` (aux None without has_aux)."""
    return out if self.has_aux else (out, None)


def _vmap_path(setup, args, real, clips, group_of_leaf, batch):
  """Exact: per-example gradients of each microbatch, clipped and summed
  as they come (one pass: an example's factor needs its own norm only).
  """
  params = args[0]
  argnums = setup.batch_argnums
  size = setup.microbatch_size or batch
  chunks = batch // size
  n_groups = len(clips)
  in_axes = (tuple(0 if i in argnums else None for i in range(len(args))),)

  def per_example(example_args):
    def one(p):
      ex = _take((p, *example_args[1:]), argnums, lambda x: x[None])
      return setup.split(setup.loss_fn(*ex))[0].reshape(())

    return jax.grad(one)(params)

  c_args = _take(
    args,
    argnums,
    lambda x: jnp.asarray(x).reshape(chunks, size, *x.shape[1:]),
  )
  c_real = real.reshape(chunks, size)

  def body(acc, i):
    grads = jax.vmap(per_example, in_axes=in_axes)(
      _take(c_args, argnums, lambda x: x[i])
    )
    leaves = jax.tree.leaves(grads)
    leaf_norms, _ = _per_example.example_norms_scaled(leaves)
    r = c_real[i]
    group_norms = []
    for g in range(n_groups):
      members = [n for n, k in zip(leaf_norms, group_of_leaf) if k == g]
      n = (
        _per_example.stack_and_combine(members)
        if members
        else _norms.as_scaled(jnp.zeros(size, jnp.float32))
      )
      group_norms.append(
        _norms.Scaled(jnp.where(r, n.value, 0), jnp.where(r, n.exponent, 0))
      )
    # Only an example holding an Inf or NaN is left out: a finite one
    # whose norm exceeds the dtype's range is clipped.
    keep = r & jnp.isfinite(_per_example.stack_and_combine(group_norms).value)
    factors = _factors(group_norms, clips, setup.normalize, setup.gamma)
    sums = _per_example.sum_clipped(
      leaves,
      [group_norms[k] for k in group_of_leaf],
      [jnp.asarray(clips[k], jnp.float32) for k in group_of_leaf],
      keep,
      factors=[factors[k] for k in group_of_leaf],
    )
    stacked = (
      jnp.stack([n.value for n in group_norms]),
      jnp.stack([n.exponent for n in group_norms]),
    )
    return [a + s for a, s in zip(acc, sums)], stacked

  leaves, treedef = jax.tree.flatten(params)
  init = [
    jnp.zeros(
      x.shape, jnp.promote_types(_norms.accumulation_dtype(x.dtype), x.dtype)
    )
    for x in leaves
  ]
  acc, chunk_norms = jax.lax.scan(body, init, jnp.arange(chunks))
  grads = jax.tree.unflatten(
    treedef, [a.astype(x.dtype) for a, x in zip(acc, leaves)]
  )
  values, exponents = (
    jnp.moveaxis(v, 1, 0).reshape(n_groups, batch) for v in chunk_norms
  )
  group_norms = [
    _norms.Scaled(v, e) for v, e in zip(list(values), list(exponents))
  ]
  aux = setup.split(setup.loss_fn(*args))[1] if setup.has_aux else None
  return group_norms, grads, aux


def _ghost_norms(setup, args, group_of_leaf, n_groups, batch):
  params = args[0]

  def apply_loss(p):
    losses, aux = setup.split(setup.loss_fn(p, *args[1:]))
    return losses.reshape(batch), aux

  plan, fallback = _audited_plan(setup, params, args, group_of_leaf, batch)
  # A batch split over devices takes two passes: the caught layer inputs
  # and output gradients would be typed like the (unsplit) catchers.
  spans = any(
    _norms.may_span_devices(jnp.asarray(leaf))
    for i in setup.batch_argnums
    for leaf in jax.tree.leaves(args[i])
  )
  one_pass = (
    setup.bookkeeping and not spans and _ghost.can_bookkeep(plan, params)
  )
  losses, aux, vjp, fns = _ghost.forward(
    apply_loss,
    params,
    plan,
    batch,
    n_groups,
    catch=one_pass,
    batch_arg=jnp.asarray(jax.tree.leaves(args[setup.batch_argnums[0]])[0]),
  )
  caught, rows = vjp(jnp.ones_like(losses))
  fast, needs = _ghost.read_rows(rows, n_groups)
  # The rare step where some finite example's fast squares overflowed:
  # the exact squares, recomputed in a branch after the backward pass.
  group_norms = jax.lax.cond(
    jnp.any(needs),
    lambda _: _exact_norms(
      setup, args, plan, n_groups, batch, spans, fast, needs
    ),
    lambda _: fast,
    None,
  )
  if any(fallback):
    exact = _fallback_norms(
      setup, args, fallback, group_of_leaf, n_groups, batch
    )
    group_norms = [
      _per_example.stack_and_combine([a, b]) for a, b in zip(group_norms, exact)
    ]
  treedef = jax.tree.structure(params)

  def by_group(grads_of_group):
    """The parameters' gradients, each leaf from its group's weights."""
    out = {}
    for g in range(n_groups):
      if g in group_of_leaf:
        out[g] = jax.tree.leaves(grads_of_group(g))
    return jax.tree.unflatten(
      treedef, [out[k][i] for i, k in enumerate(group_of_leaf)]
    )

  def grads_fn(factors, keep, all_finite):
    def shared(_):
      if one_pass:
        # Book-keeping: from the caught layer inputs and output
        # gradients, no second backward pass.
        return _ghost.weighted_grads(
          plan,
          params,
          caught,
          fns,
          [f.astype(losses.dtype) for f in factors],
          group_of_leaf,
        )
      # The second backward pass of the same forward, re-weighted.
      return by_group(
        lambda g: vjp(_ghost.like(factors[g].astype(losses.dtype), losses))[0]
      )

    # The shared backward runs outside the cond: inside a branch the
    # forward's residuals are operands of the cond, which XLA keeps alive
    # (and never overwrites) for the whole branch, e.g. the softmax, where
    # a plain jax.grad writes the logits' cotangent in place of it. Only
    # the rare recompute sits in a branch, after the residuals are dead.
    grads = jax.lax.cond(
      all_finite,
      lambda g: g,
      lambda g: _recompute_weighted(
        setup, params, args, factors, keep, batch, spans, n_groups, by_group
      ),
      shared(None),
    )
    any_kept = jnp.any(keep)
    grads = jax.tree.map(lambda g: jnp.where(any_kept, g, 0), grads)
    return grads, aux

  return group_norms, grads_fn


def _recompute_weighted(
  setup, params, args, factors, keep, batch, spans, n_groups, by_group
):
  """The weighted gradient ``sum_b w_b grad loss_b`` of the kept examples,
  recomputed without the others.

  An example with a non-finite gradient: a NaN activation times its zero
  weight would still be NaN in the shared backward. Such examples are
  replaced by a kept one (weight 0) and the weighted gradient recomputed,
  in chunks (a bounded extra memory). The kept example is picked by a
  masked sum over the batch (an all-reduce of one example where the batch
  is split, no gather).
  """
  first = jnp.arange(batch) == jnp.argmax(keep)

  def replace(x):
    x = jnp.asarray(x)
    shape = (batch,) + (1,) * (x.ndim - 1)
    pick = jnp.where(
      _ghost.batch_like(first, x).reshape(shape), x, jnp.zeros_like(x)
    )
    kept = (
      jnp.any(pick, axis=0)
      if x.dtype == bool
      else jnp.sum(pick, axis=0, dtype=x.dtype)
    )
    return jnp.where(_ghost.batch_like(keep, x).reshape(shape), x, kept[None])

  safe = _take(args, setup.batch_argnums, replace)
  # Chunk c holds the examples b with b % chunks == c: the split axis
  # stays whole, and a chunk is indexed along an unsplit one.
  chunks = _recompute_chunks(batch, spans, setup.microbatch_size)
  size = batch // chunks
  c_args = _take(
    safe,
    setup.batch_argnums,
    lambda x: x.reshape(size, chunks, *x.shape[1:]),
  )
  weights = jnp.stack(factors).reshape(n_groups, size, chunks)

  def body(acc, i):
    chunk_args = _take(
      c_args,
      setup.batch_argnums,
      lambda x: jax.lax.dynamic_index_in_dim(x, i, 1, keepdims=False),
    )
    w_i = jax.lax.dynamic_index_in_dim(weights, i, 2, keepdims=False)

    def weighted(p, w):
      chunk_losses = setup.split(setup.loss_fn(p, *chunk_args[1:]))[0]
      chunk_losses = chunk_losses.reshape(size)
      return jnp.sum(_ghost.like(w, chunk_losses) * chunk_losses)

    grads = by_group(lambda g: jax.grad(weighted)(params, w_i[g]))
    return jax.tree.map(jnp.add, acc, grads), None

  zeros = jax.tree.map(jnp.zeros_like, params)
  return jax.lax.scan(body, zeros, jnp.arange(chunks))[0]


def _exact_norms(setup, args, plan, n_groups, batch, spans, fast, needs):
  """Per group, the ``(B,)`` norms of the ghosted parameters from the
  exact squares (:func:`_ghost.forward` with ``exact=True``): a forward
  and backward pass per chunk of the batch (as in the non-finite
  recompute of ``grads_fn``), only for the chunks holding an example
  that ``needs`` them; the others keep their ``fast`` norms.
  """
  params = args[0]

  def exact_of(chunk_args, size):
    def chunk_loss(p):
      losses, aux = setup.split(setup.loss_fn(p, *chunk_args[1:]))
      return losses.reshape(size), aux

    losses, _, vjp, _ = _ghost.forward(
      chunk_loss,
      params,
      plan,
      size,
      n_groups,
      batch_arg=jnp.asarray(
        jax.tree.leaves(chunk_args[setup.batch_argnums[0]])[0]
      ),
      exact=True,
    )
    return _ghost.read_rows(vjp(jnp.ones_like(losses))[1], n_groups)[0]

  chunks = _recompute_chunks(batch, spans, setup.microbatch_size)
  if chunks == 1:
    return exact_of(args, batch)
  size = batch // chunks
  # Chunk c holds the examples b with b % chunks == c.
  split_chunks = lambda x: x.reshape(size, chunks, *x.shape[1:])
  c_args = _take(args, setup.batch_argnums, split_chunks)
  c_needs = split_chunks(needs)
  c_fast = jax.tree.map(split_chunks, fast)

  def body(_, i):
    def pick(x):
      return jax.lax.dynamic_index_in_dim(x, i, 1, keepdims=False)

    chunk_args = _take(c_args, setup.batch_argnums, pick)
    out = jax.lax.cond(
      jnp.any(pick(c_needs)),
      lambda _: exact_of(chunk_args, size),
      lambda _: jax.tree.map(pick, c_fast),
      None,
    )
    return None, out

  stacked = jax.lax.scan(body, None, jnp.arange(chunks))[1]
  # (chunks, size) each: back to the batch's order.
  return jax.tree.map(lambda v: v.T.reshape(batch), stacked)


def _fallback_norms(setup, args, fallback, group_of_leaf, n_groups, batch):
  """Per group, the ``(B,)`` norms (Scaled, exact beyond the dtype's
  range) of the fallback leaves, from their exact per-example gradients
  (the other leaves held constant).
  """
  params = args[0]
  leaves, treedef = jax.tree.flatten(params)
  fb_idx = [i for i, f in enumerate(fallback) if f]
  size = setup.microbatch_size or batch
  chunks = batch // size

  def per_example(fb_leaves, example_args):
    def one(fb):
      full = list(leaves)
      for i, x in zip(fb_idx, fb):
        full[i] = x
      p = jax.tree.unflatten(treedef, full)
      ex = _take((p, *example_args[1:]), setup.batch_argnums, lambda x: x[None])
      return setup.split(setup.loss_fn(*ex))[0].reshape(())

    return jax.grad(one)(fb_leaves)

  fb_leaves = [leaves[i] for i in fb_idx]
  c_args = _take(
    args,
    setup.batch_argnums,
    lambda x: jnp.asarray(x).reshape(chunks, size, *x.shape[1:]),
  )
  in_axes = (
    None,
    tuple(0 if i in setup.batch_argnums else None for i in range(len(args))),
  )

  def chunk(i):
    grads = jax.vmap(per_example, in_axes=in_axes)(
      fb_leaves, _take(c_args, setup.batch_argnums, lambda x: x[i])
    )
    leaf_norms, _ = _per_example.example_norms_scaled(grads)
    norms = []
    for g in range(n_groups):
      members = [n for n, j in zip(leaf_norms, fb_idx) if group_of_leaf[j] == g]
      norms.append(
        _per_example.stack_and_combine(members)
        if members
        else _norms.as_scaled(jnp.zeros(size, jnp.float32))
      )
    return (
      jnp.stack([n.value for n in norms]),
      jnp.stack([n.exponent for n in norms]),
    )

  # (chunks, groups, size) each: chunk c holds examples c*size onwards.
  values, exponents = (
    jnp.moveaxis(v, 1, 0).reshape(n_groups, batch)
    for v in jax.lax.map(chunk, jnp.arange(chunks))
  )
  return [_norms.Scaled(values[g], exponents[g]) for g in range(n_groups)]


def _audited_plan(setup, params, args, group_of_leaf, batch):
  """The ghost plan, from the traced loss (``_ghost.discover``); a loss
  that is not per example, or mixes examples, is refused here.
  """

  def loss_of(p, batch_args):
    full = list(args)
    for i, b in zip(setup.batch_argnums, batch_args):
      full[i] = b
    return setup.split(setup.loss_fn(p, *full[1:]))[0]

  try:
    return _ghost.discover(
      loss_of,
      params,
      tuple(args[i] for i in setup.batch_argnums),
      batch,
      group_of_leaf,
    )
  except _loss_audit.MixesExamples as err:
    raise ValueError(
      f"{WHO}: loss_fn mixes examples: {err}. A per-example gradient "
      "has no meaning there: use per-example normalisation (LayerNorm, "
      "GroupNorm) instead of batch statistics, and normalise the loss by "
      "a constant."
    ) from None
  except ValueError as err:
    if str(err).startswith("loss_fn must return"):
      raise ValueError(f"{WHO}: {err}.") from None
    raise


def clipped_grad(
  loss_fn: Callable,
  l2_clip: Any,
  *,
  batch_argnums: Union[int, tuple[int, ...]] = 1,
  method: str = "ghost",
  microbatch_size: Optional[int] = None,
  reduce: str = "sum",
  has_aux: bool = False,
  normalize: bool = False,
  gamma: float = 0.01,
  bookkeeping: bool = False,
  remat: Any = None,
) -> Callable:
  """The sum of per-example gradients, each clipped, straight from the loss.

  ``loss_fn(params, *args)`` returns the per-example losses, shape ``(B,)``
  (or ``(losses, aux)`` with ``has_aux``), for a batch: the arguments at
  ``batch_argnums`` are pytrees whose leaves have a leading batch axis
  ``B``. The returned function takes the same arguments and returns
  ``(grads, norms)`` (``(grads, norms, aux)`` with ``has_aux``): ``grads``
  is ``sum_b min(1, C / |g_b|) g_b`` over the examples (divided by ``B`` for
  ``reduce="mean"``), ``g_b`` the gradient of example ``b``'s loss with
  respect to ``params``, and ``norms`` the ``(B,)`` per-example norms
  ``|g_b|`` before clipping.

  ``method="vmap"`` is the exact reference: per-example gradients under
  ``jax.vmap``, in microbatches of ``microbatch_size`` examples to bound
  memory. ``method="ghost"`` computes the norms without per-example
  gradients, then the clipped sum (a second, re-weighted backward pass, or
  ``bookkeeping``). Per layer:

  * ghosted (norm from the layer's input and output gradient, no
    per-example gradient): Flax linen ``Dense``, ``DenseGeneral``
    (contracting trailing axes, no ``batch_dims``; attention's projections),
    ``Embed`` (from the token ids); nnx ``Linear`` and ``Embed``;
  * exact for that layer only (its own per-example gradient under
    ``vmap``, memory ``B`` times the layer's parameters): linen ``Conv``,
    ``Einsum``, ``LayerNorm``, ``RMSNorm``;
  * all of these also under ``nn.scan`` with stacked parameters
    (``variable_axes={"params": 0}``);
  * exact per-example gradient of that parameter (the fallback): anything
    else, a ``DenseGeneral`` with ``batch_dims`` and a subclass of a listed
    layer included.

  **Guarantee.** Each example's contribution to ``grads`` has norm at most
  ``l2_clip`` (per group: its own clip norm), for every model and input, by
  both methods. The ghost method earns it by construction: the loss is
  traced once (``jax.make_jaxpr``) and a parameter is ghosted only when the
  traced program reads it in exactly one supported layer call, once per
  example, on an input batched along its leading axis. A parameter read
  anywhere else -- by attribute (a tied embedding's
  ``self.emb.embedding.T``), through another method (``attend``), by a
  layer called twice, transformed before use, shared by every step of a
  loop (``nn.scan`` with ``variable_broadcast``, ``nn.RNN``), applied under
  ``nn.vmap``, inside a ``cond`` or ``while`` -- takes the exact path,
  whatever its layer. ``fn.plan(params, *args)`` says, per parameter,
  ghost or exact and why (``str(plan)``; its ``ghosted`` and ``fallback``
  lists, and ``reasons``). Where the audit cannot prove a parameter's
  ghost norm, the parameter is exact: never a wrong norm.

  **Refused.** A loss whose forward pass mixes examples has no per-example
  gradient: batch normalisation with batch statistics, a loss divided by a
  batch statistic, a time-major sequence scanned along its leading axis.
  Both methods follow the batch axis through the traced program and raise
  a ``ValueError`` naming the operation and the line that crosses it. They
  refuse nothing that keeps examples apart; mixing inside a ``while`` loop,
  or past a layout they cannot follow (after a scatter, say), goes
  undetected. A loss that does not return one loss per example, shape
  ``(B,)``, is refused too.

  The returned function also takes keyword arguments ``is_padding_example``
  (``(B,)`` bool: padding for a fixed batch shape under Poisson sampling;
  those examples contribute nothing and their norm is reported as 0; any other
  shape is refused) and ``l2_clip`` (this call's clip norm, e.g. an adapted
  one from :func:`dp_noise`'s state). An example whose gradient is not finite
  is left out (its ``norms`` entry is Inf or NaN): none of its coordinates
  reaches ``grads``. A finite example whose norm exceeds the dtype's range (or
  whose squared norm does: above about 1.8e19 in float32) is clipped like any
  other, by both methods (its ``norms`` entry is the dtype's largest value
  when the norm is beyond it): the norms are exact at every size. (The ghost
  method squares each layer's factors as they are; on the rare step where that
  overflows for a finite example, it recomputes the norms of the chunks of the
  batch holding such examples exactly, one more forward and backward pass of
  each, so ordinary steps pay nothing for it in memory.) The ghost method
  applies the clip factor as a weight of the backward pass, so an example
  whose factor ``C / |g_b|`` is below the dtype's smallest normal number (a
  norm above ``C * 2**126``, 8.5e37 for ``C = 1`` in float32) contributes
  nothing rather than its clipped gradient (the vmap method scales exactly
  there too); either way no example contributes more than ``C``.

  Its ``sensitivity`` attribute is a :class:`Sensitivity`: the L2
  sensitivity of ``grads`` for add/remove and replace-one adjacency.

  **No privacy accounting is done here**: pair this with an accountant such
  as Google's ``dp_accounting``.

  Args:
    loss_fn: ``(params, *args) -> (B,)`` per-example losses.
    l2_clip: the clip norm ``C`` (>= 0, ``inf`` for none), or a pytree
      prefix of ``params`` holding one clip norm per group (per-layer
      clipping: each group of each example is clipped to its own norm).
    batch_argnums: the positions, in ``loss_fn``'s arguments, of the batch
      arguments (1: the first after ``params``).
    method: ``"ghost"`` or ``"vmap"``.
    microbatch_size: examples per chunk of the exact per-example
      computation (``vmap``, and the ghost method's fallback); must divide
      ``B``. ``None``: the whole batch at once.
    reduce: ``"sum"`` or ``"mean"`` (divided by ``B``, padding included: a
      data-independent divisor).
    has_aux: whether ``loss_fn`` returns ``(losses, aux)``; ``aux`` is
      returned from one forward pass on the whole batch.
    normalize: automatic clipping (Bu et al. 2022): every example is scaled
      by ``C / (|g_b| + gamma)`` instead of ``min(1, C / |g_b|)``.
    gamma: the stabiliser of ``normalize`` (> 0).
    bookkeeping: the ghost method's second half. ``False`` (the default):
      a second backward pass of the same forward, the loss re-weighted by
      the clip factors. ``True``: Book-Keeping (Bu et al. 2023), one
      backward pass that keeps each ghosted layer's input and output
      gradient (of a layer on the exact per-example path, its per-example
      gradient where that is smaller) and forms the clipped sum from them
      and the clip factors (the layer's own VJP with weighted output
      gradients); it applies when every parameter is in a tapped linen
      layer and the batch is not split over devices, otherwise two passes
      are taken. The default follows memory, since one pass is not
      consistently faster: two passes hold what a plain ``jax.grad`` holds
      and the per-layer norm computation (about a tenth more), one pass
      also every layer's kept values, which under ``nn.scan`` add to all
      the layers' residuals. One pass saves the second backward pass, a
      gain that varies from model to model (figures in
      ``docs/performance.md``). Take ``True`` where the backward pass is
      costly (long sequences, deep attention) and memory is not the limit.
    remat: ``None`` (nothing rematerialised), or a Flax linen module class
      (or a tuple of them), typically the model's transformer block: every
      call of such a module inside ``loss_fn`` is rematerialised
      (``flax.linen.remat``, nothing saved, the model's code unchanged), so
      the backward passes keep each call's inputs and recompute its
      intermediates when they get there. Under ``nn.scan`` this is per
      layer: the residuals stacked over the layers shrink to the layers'
      inputs. The ghost method then holds less than a plain ``jax.grad``
      without remat, and a small fraction of what the vmap path holds
      (remat leaves that unchanged: per-example gradients dominate it).
      The price is one more forward pass of those modules per backward
      pass (two with two passes). Results are unchanged (the same
      operations). Applies to every method; book-keeping keeps what it
      keeps of every layer all the same (figures in ``docs/dp.md`` and
      ``docs/performance.md``).

  Returns:
    A function with ``loss_fn``'s arguments (plus the keywords above)
    returning ``(grads, norms)`` or ``(grads, norms, aux)``.

  References:
    Abadi et al. 2016 (DP-SGD); Li et al. 2021 and Bu et al. 2023 (ghost
    clipping, mixed per layer); Bu et al., `Automatic Clipping
    <https://arxiv.org/abs/2206.07136>`_, 2022; jax_privacy's
    ``clipped_grad`` (microbatching, padding, per-layer clip norms,
    sensitivity) was read for the interface.

  Example:
    >>> import jax, jax.numpy as jnp, optaxclip
    >>> def loss_fn(w, x):  # per-example squared error of a linear model
    ...   return (x @ w - 1.0) ** 2
    >>> x = jnp.array([[1.0, 0.0], [0.0, 3.0]])
    >>> grad_fn = optaxclip.clipped_grad(loss_fn, 1.0, method="vmap")
    >>> grads, norms = grad_fn(jnp.zeros(2), x)
    >>> norms  # |d/dw (x.w - 1)^2| = 2 |x| at w = 0
    Array([2., 6.], dtype=float32)
    >>> grads  # each example's gradient clipped to norm 1, then summed
    Array([-1., -1.], dtype=float32)
    >>> grad_fn.sensitivity.add_remove
    1.0
  """
  if not callable(loss_fn):
    raise TypeError(f"{WHO}: loss_fn must be callable; got {loss_fn!r}.")
  _check_clip(l2_clip)
  method = _checks.check_choice(WHO, "method", method, ("ghost", "vmap"))
  reduce = _checks.check_choice(WHO, "reduce", reduce, ("sum", "mean"))
  has_aux = _checks.check_bool(WHO, "has_aux", has_aux)
  normalize = _checks.check_bool(WHO, "normalize", normalize)
  bookkeeping = _checks.check_bool(WHO, "bookkeeping", bookkeeping)
  loss_fn = _remat.rematerialised(loss_fn, _remat.check_classes(remat))
  if isinstance(batch_argnums, (numbers.Integral, np.integer)):
    batch_argnums = (int(batch_argnums),)
  batch_argnums = tuple(batch_argnums)  # pyright: ignore[reportArgumentType]
  if not batch_argnums or any(
    isinstance(i, bool)
    or not isinstance(i, (numbers.Integral, np.integer))
    or i < 1
    for i in batch_argnums
  ):
    raise ValueError(
      f"{WHO}: batch_argnums must be ints >= 1 (0 is the "
      f"parameters); got {batch_argnums!r}."
    )
  if microbatch_size is not None:
    _checks.check_number(
      "microbatch_size", microbatch_size, who=WHO, low=1, integer=True
    )
  _checks.check_number("gamma", gamma, who=WHO, low=0.0, low_open=True)
  clip_leaves = jax.tree.leaves(l2_clip)
  concrete = all(_checks.is_concrete_number(c) for c in clip_leaves)
  # hypot: no square overflows or underflows (a float64 bound of 1e200).
  total = math.hypot(*(float(c) for c in clip_leaves)) if concrete else None
  sensitivity = Sensitivity(
    add_remove=total,
    replace_one=None if total is None else 2 * total,
    divided_by_batch_size=reduce == "mean",
  )

  setup = _Setup(
    loss_fn,
    batch_argnums,
    microbatch_size,
    has_aux,
    normalize,
    gamma,
    bookkeeping,
  )

  def grad_fn(params, *args, is_padding_example=None, l2_clip=l2_clip):
    args = (params, *args)
    if max(batch_argnums) >= len(args):
      raise ValueError(
        f"{WHO}: batch_argnums {batch_argnums} but loss_fn "
        f"got {len(args)} arguments."
      )
    batch = _batch_arg_size(args, batch_argnums)
    if microbatch_size is not None and batch % microbatch_size:
      raise ValueError(
        f"{WHO}: microbatch_size must divide the batch size "
        f"{batch}; got {microbatch_size}."
      )
    clips, group_of_leaf = _groups(l2_clip, params)
    if is_padding_example is None:
      real = jnp.ones(batch, bool)
    else:
      real = ~_per_example.padding_mask(WHO, is_padding_example, batch)
    if method == "vmap":
      # The audit's refusals (a loss that is not per example, or mixes
      # examples) hold for both methods.
      _audited_plan(setup, params, args, group_of_leaf, batch)
      group_norms, grads, aux = _vmap_path(
        setup, args, real, clips, group_of_leaf, batch
      )
      norms = _per_example.reported_norm(
        _per_example.stack_and_combine(group_norms)
      )
    else:
      group_norms, grads_fn = _ghost_norms(
        setup, args, group_of_leaf, len(clips), batch
      )
      all_finite = jnp.all(
        jnp.isfinite(_per_example.stack_and_combine(group_norms).value)
      )
      group_norms = [
        _norms.Scaled(
          jnp.where(real, n.value, 0), jnp.where(real, n.exponent, 0)
        )
        for n in group_norms
      ]
      total = _per_example.stack_and_combine(group_norms)
      norms = _per_example.reported_norm(total)
      # As with vmap, only an example holding an Inf or NaN is left out.
      keep = real & jnp.isfinite(total.value)
      factors = [
        jnp.where(keep, f.as_float(), 0)
        for f in _factors(group_norms, clips, normalize, gamma)
      ]
      grads, aux = grads_fn(factors, keep, all_finite)
    if reduce == "mean":
      grads = jax.tree.map(lambda g: g / batch, grads)
    return (grads, norms, aux) if has_aux else (grads, norms)

  def plan(params, *args):
    """The ghost plan for these arguments: per parameter path, ghosted or
    exact and why (``str(plan)``; its ``ghosted`` and ``fallback`` lists).
    """
    args_ = (params, *args)
    batch = _batch_arg_size(args_, batch_argnums)
    _, group_of_leaf = _groups(l2_clip, params)
    return _audited_plan(setup, params, args_, group_of_leaf, batch)[0]

  # Attributes of the returned function (it stays a plain function, which
  # jax.jit and functools.partial take as it is).
  setattr(grad_fn, "sensitivity", sensitivity)  # noqa: B010
  setattr(grad_fn, "plan", plan)  # noqa: B010
  return grad_fn


# ---------------------------------------------------------------- dp_noise


@_stats.register("dp_noise", _per_example.STAT_FIELDS)
class DpNoiseState(NamedTuple):
  """State of :func:`dp_noise`.

  Attributes:
    norm: the mean per-example norm before clipping, over the real
      (non-padding) examples (non-finite ones count as 0).
    clipped_norm: the mean per-example norm after clipping.
    clip_fraction: the share of the real (non-padding) examples scaled
      down, zeroed non-finite ones included.
    clip_norm: the clip norm for the next step (pass it to the
      :func:`clipped_grad` function as ``l2_clip=``).
    key: the random key of the noise.
    nonfinite: the number of examples left out for a non-finite gradient.
    threshold: the clip norm this step used.
    count: updates so far (int32, saturating), the step at which a
      schedule is evaluated.
  """

  norm: jax.Array  # float32 scalar
  clipped_norm: jax.Array  # float32 scalar
  clip_fraction: jax.Array  # float32 scalar
  clip_norm: jax.Array  # float32 scalar
  key: jax.Array  # a PRNG key
  nonfinite: jax.Array  # int32 scalar
  threshold: jax.Array  # float32 scalar
  count: jax.Array  # int32 scalar  # pyright: ignore[reportIncompatibleMethodOverride]


def dp_noise(
  l2_clip: ScalarOrSchedule,
  *,
  noise_multiplier: float = 0.0,
  seed: int = 0,
  target_quantile: Optional[float] = None,
  quantile_lr: float = 0.2,
  reduce: str = "mean",
) -> optax.GradientTransformationExtraArgs:
  """Noise and an adaptive clip norm for the sums :func:`clipped_grad` returns.

  The second half of :func:`clip_per_example`, with the same implementation
  (``_per_example.noise_and_adapt``): its input is the clipped **sum**
  (``clipped_grad(..., reduce="sum")``) and, as an extra argument, the
  per-example norms: ``tx.update(grads, state, params,
  example_norms=norms)`` (optionally ``is_padding_example=``). It adds
  Gaussian noise of standard deviation ``noise_multiplier * C`` to the sum,
  divides by ``B`` for ``reduce="mean"``, and with ``target_quantile`` moves
  ``C`` by Andrew et al. 2021's geometric rule (noised count, noise split as
  :func:`clip_per_example` documents). The next step's ``C`` is
  ``state.clip_norm``: pass it to the clipped-gradient function as
  ``l2_clip=`` (a scalar clip norm only). No privacy accounting is done.

  Padding (``is_padding_example``, shape ``(B,)``) counts nowhere: the
  statistics are means over the real examples and the clip norm adapts to
  their unclipped share, as :func:`clip_per_example` documents.
  ``example_norms`` must be the ``(B,)`` norms; another shape is refused.

  Args:
    l2_clip: the clip norm ``C``: a number or a schedule (``step ->
      value``), evaluated at this transformation's step count (0 on the
      first update; ``state.clip_norm`` holds the next step's value, to
      pass to the clipped-gradient function); a number, its starting
      value, when adaptive.
    noise_multiplier: noise standard deviation in units of ``C`` (>= 0).
    seed: seeds the key kept in the state.
    target_quantile: the share of examples to leave unclipped, or ``None``.
    quantile_lr: the geometric learning rate of ``C``.
    reduce: ``"mean"`` (divide the noised sum by ``B``) or ``"sum"``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`DpNoiseState`.

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> tx = optaxclip.dp_noise(1.0, reduce="sum")
    >>> sums, norms = {"w": jnp.array([1.0, 2.0])}, jnp.array([0.5, 3.0])
    >>> out, state = tx.update(sums, tx.init(sums), example_norms=norms)
    >>> float(state.clip_fraction), float(state.clipped_norm)
    (0.5, 0.75)
  """
  _per_example.check_l2_clip("dp_noise", l2_clip, target_quantile)
  _checks.check_number(
    "noise_multiplier", noise_multiplier, who="dp_noise", low=0.0
  )
  if target_quantile is not None:
    _checks.check_number(
      "target_quantile", target_quantile, who="dp_noise", low=0.0, high=1.0
    )
  _checks.check_number("quantile_lr", quantile_lr, who="dp_noise", low=0.0)
  reduce = _checks.check_choice("dp_noise", "reduce", reduce, ("mean", "sum"))
  make_key = _checks.check_seed("dp_noise", seed)
  _checks.check_finite_with_noise("dp_noise", l2_clip, noise_multiplier)
  no_noise = (
    _checks.is_concrete_number(noise_multiplier) and noise_multiplier == 0
  )
  adaptive = target_quantile is not None

  init_fn = _per_example.noise_state_init(DpNoiseState, l2_clip, make_key)

  def update_fn(
    updates,
    state,
    params=None,
    *,
    example_norms=None,
    is_padding_example=None,
    **extra,
  ):
    del params, extra
    _checks.check_float_leaves(updates, "dp_noise: updates")
    if example_norms is None:
      raise ValueError(
        "dp_noise: update needs example_norms=, the (B,) "
        "per-example norms clipped_grad returns."
      )
    example_norms = jnp.asarray(example_norms)
    if example_norms.ndim != 1 or not jnp.issubdtype(
      example_norms.dtype, jnp.floating
    ):
      raise ValueError(
        "dp_noise: example_norms must be the (B,) float per-example norms "
        "clipped_grad returns; got shape "
        f"{example_norms.shape} and dtype {example_norms.dtype}."
      )
    batch = example_norms.shape[0]
    _per_example.check_batch_for_count_noise(
      "dp_noise", batch, noise_multiplier, adaptive, no_noise
    )
    clip = _per_example.clip_at(
      "dp_noise",
      l2_clip,
      state,
      adaptive,
      _norms.tree_accumulation_dtype(
        [example_norms, *jax.tree.leaves(updates)]
      ),
    )
    real = (
      None
      if is_padding_example is None
      else ~_per_example.padding_mask("dp_noise", is_padding_example, batch)
    )
    counts = _per_example.counts_from_norms(example_norms, clip, real)
    leaves, treedef = jax.tree.flatten(updates)
    noised = _per_example.noise_and_adapt(
      [jnp.asarray(x) for x in leaves],
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
    out = [s.astype(jnp.asarray(x).dtype) for s, x in zip(noised.out, leaves)]
    return jax.tree.unflatten(treedef, out), _per_example.state_from_counts(
      DpNoiseState, counts, batch, noised, clip, state, l2_clip
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
