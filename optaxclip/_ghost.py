"""Ghost norms: per-example gradient norms of Flax layers without per-example
gradients.

How it works (one backward pass, no per-example gradient of the model): each
supported layer call is intercepted with ``flax.linen.intercept_methods`` and
its output ``y`` is passed through an identity "tap" with a custom VJP. The
tap's backward sees the layer's input ``a`` and the output gradient ``g`` of
every example, and writes the squared norm of that example's gradient of the
layer's parameters into the cotangent of a ``(groups * N_BUCKETS, B)``
"probe" array the whole loss closes over. The gradient of the summed loss
with respect to the probe is then the per-example squared norm, summed over
layers (and over the layers of an ``nn.scan``, whose body closes over the
same probe). The layer's real computation is untouched: the tap only reads.

Finite examples of any size: a squared norm is written as the rows of
``_norms.to_buckets`` (one row per range of exponents), so that sums beyond
float32's range stay exact, and ``_norms.bucket_norms`` reads the norms
back. Each layer squares its factors as they are, and flags, in the
probe's last row, the examples whose squares are not finite although their
factors are (a norm above about 1.8e19). Only on a step with such an
example does one ``lax.cond``, after the backward pass, recompute the
squares of the examples' chunks of the batch exactly, from factors scaled
per example by powers of two (``forward(..., exact=True)``; see
``clipped_grad``). A choice per layer would keep every layer's input and
output gradient alive until its branch runs, adding to the step's
temporary memory on every step.

Per layer kind:

* ``Dense`` and ``DenseGeneral`` (contracting trailing axes, no
  ``batch_dims``): the kernel's per-example gradient is ``A^T G`` with ``A``
  of shape ``(T, d_in)`` and ``G`` of shape ``(T, d_out)`` (``T`` the
  positions: sequence, patches). Its squared norm is either
  ``sum_{t,t'} (a_t . a_t') (g_t . g_t')`` (the Gram form of Li et al. 2021
  and Opacus' ghost clipping, cost ``T^2 (d_in + d_out)``) or that of the
  ``(d_in, d_out)`` matrix itself (cost ``T d_in d_out``): the cheaper is
  picked per layer. The bias: ``|sum_t g_t|^2``.
* ``Embed``: ``sum_{t,t'} [tok_t = tok_t'] (g_t . g_t')`` from the token
  ids, no one-hot and no ``(V, d)`` per-example matrix.
* ``Conv``, ``Einsum``, ``LayerNorm``, ``RMSNorm`` (and ``DenseGeneral``
  with ``batch_dims``): the exact per-example gradient of that layer's own
  parameters, one example at a time under ``vmap`` (memory ``B`` times the
  layer's parameters, never the model's).

``flax.nnx``: ``nnx.Linear`` and ``nnx.Embed`` calls are routed through the
same taps for the time of the trace (nnx has no method interceptors; the
parameters are matched by identity with the leaves the loss receives, so
``nnx.merge(graphdef, params)`` inside the loss is what it expects). Other
nnx layers take the exact path.

Which parameters the taps cover is decided from the traced program, not
from the module calls alone (:func:`discover`, ``_loss_audit``): a
parameter is ghosted only when the program reads it in exactly one tapped
call, once per example, on an input batched along its leading axis. Every
other parameter (a custom ``self.param``, a tied embedding read by
attribute or through ``attend``, a layer called twice or shared by the
steps of a loop, a parameter transformed before use) is left to the exact
per-example computation, for that parameter (and its layer's others) only.

References:
  Goodfellow, `Efficient Per-Example Gradient Computations
  <https://arxiv.org/abs/1510.01799>`_, 2015;
  Li et al., `Large Language Models Can Be Strong Differentially Private
  Learners <https://arxiv.org/abs/2110.05679>`_, 2021 (ghost clipping for
  sequences);
  Bu et al., `Differentially Private Optimization on Large Model at Small
  Cost <https://arxiv.org/abs/2210.00038>`_, 2023 (mixed ghost / direct
  choice per layer);
  Opacus' ``grad_sample_mode="ghost"`` and PAX' ``ghostnorm`` layers, read
  for the idea.
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip import _loss_audit
from optaxclip import _norms

try:  # Flax is optional: without it every parameter takes the exact path.
  import flax.linen as nn
except ImportError:  # pragma: no cover
  nn = None

_HIGHEST = jax.lax.Precision.HIGHEST


def _kinds() -> dict:
  if nn is None:  # pragma: no cover
    return {}
  kinds = {
    nn.Dense: "dense",
    nn.DenseGeneral: "dense_general",
    nn.Embed: "embed",
    nn.Conv: "direct",
    nn.LayerNorm: "direct",
    nn.RMSNorm: "direct",
  }
  einsum = getattr(nn, "Einsum", None)
  if einsum is not None:
    kinds[einsum] = "direct"
  return kinds


_KIND_NAMES = {
  "dense": "Dense: from its layer's input and output gradient",
  "dense_general": "DenseGeneral: from its layer's input and output gradient",
  "embed": "Embed: from the token ids and the output gradient",
  "direct": "its layer's own per-example gradient",
  "nnx": "nnx layer: from its input and output gradient",
}


def _kind_of(module) -> Optional[str]:
  for cls, kind in _kinds().items():
    if type(module) is cls:  # a subclass may change the computation.
      return kind
  return None


@dataclasses.dataclass
class Plan:
  """Which parameters the ghost pass covers, and how.

  Attributes:
    covered: module path -> {param name: group index}, for the layer calls
      the taps handle.
    kinds: module path -> layer kind ("dense", "embed", ...).
    fallback: the parameter paths (``keystr``) left to the exact path.
    ghosted: the parameter paths the taps cover.
    nnx_groups: for ``flax.nnx`` layers (``nnx.Linear``, ``nnx.Embed``),
      the covered leaf indices and their groups (matched by identity: the
      leaf is the array the layer reads).
    shapes: module path -> ``(x, y, params)``: the layer call's input and
      output (``jax.ShapeDtypeStruct``) and its parameters' shapes as the
      layer sees them (under ``nn.scan``, without the stacked axis).
    containers: module path -> the keys, from the root of the parameter
      tree, of the mapping that holds the layer's parameters.
    reasons: parameter path -> why it is ghosted or exact (``str(plan)``
      lists them, one parameter a line).
  """

  covered: dict
  kinds: dict
  fallback: list
  ghosted: list
  nnx_groups: dict = dataclasses.field(default_factory=dict)
  shapes: dict = dataclasses.field(default_factory=dict)
  containers: dict = dataclasses.field(default_factory=dict)
  reasons: dict = dataclasses.field(default_factory=dict)

  def __str__(self) -> str:
    width = max((len(k) for k in self.reasons), default=0)
    return "\n".join(
      f"{k.ljust(width)}  {'ghost' if k in self.ghosted else 'exact'}: {why}"
      for k, why in self.reasons.items()
    )


def _leaf_names(path) -> tuple:
  out = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        out.append(getattr(entry, attr))
        break
  return tuple(out)


def _theta_shapes(module) -> dict:
  return {k: np.shape(v) for k, v in module.variables.get("params", {}).items()}


def _call_form(method, args, kwargs, batch_size) -> Optional[str]:
  """None for a call the taps can read, ``module(x)`` with ``x`` batched
  first; else why not.
  """
  x = args[0] if args else None
  if method != "__call__":
    return f"its layer is also called through `{method}`"
  if len(args) != 1 or kwargs:
    return "its layer is called with more than its input"
  if x is None or not hasattr(x, "shape") or np.ndim(x) < 1:
    return "its layer's input is not an array"
  if np.shape(x)[0] != batch_size:
    return f"its layer's input has no leading batch axis of size {batch_size}"
  return None


def _marked(theta: dict, x, specs: dict):
  """``theta`` and ``x`` through markers of one new call (``_loss_audit``),
  and the call's id.
  """
  call = _loss_audit.new_call()
  marked = {
    n: _loss_audit.marker(call, n, np.shape(v), specs)(v)
    for n, v in theta.items()
  }
  x = _loss_audit.marker(call, _loss_audit.X, np.shape(x), specs)(x)
  return call, marked, x


class _MarkedTrace:
  """The method interceptors of the audit trace: every supported layer
  call is recorded, and those the taps can read run behind markers
  (``_loss_audit``).

  Attributes:
    calls: id(module) -> [module, path, kind, why, shapes] of each linen
      layer (``why``: the first reason a call of it cannot be tapped).
    specs: marker name -> ``_loss_audit.MarkerSpec``.
    call_paths: marker call -> the module path (linen) or None (nnx).
    nnx_reads: leaf index -> per nnx call reading it, why it cannot be
      tapped (or None).
  """

  def __init__(self, batch_size: int):
    self.batch_size = batch_size
    self.calls: dict = {}
    self.specs: dict = {}
    self.call_paths: dict = {}
    self.nnx_reads: dict = {}
    self.leaf_index: dict = {}
    self.marking: list = []  # non-empty inside a marked call

  def _why_not(self, module, kind, method, args, kwargs) -> Optional[str]:
    why = _call_form(method, args, kwargs, self.batch_size)
    if why is None and kind in ("direct", "dense_general"):
      if not _direct_ok(module):
        why = "its layer has batch_dims"
      elif (
        kind == "dense_general" and _dense_general_axes(module, args[0]) is None
      ):
        why = "its layer contracts axes that are not the trailing ones"
    return why

  def linen(self, next_fun, args, kwargs, context):
    """The linen interceptor: records the call, and runs it marked."""
    module = context.module
    kind = _kind_of(module)
    method = context.method_name
    if (
      self.marking
      or kind is None
      or module.path is None
      or not (method == "__call__" or not method.startswith(("_", "setup")))
    ):
      return next_fun(*args, **kwargs)
    path = tuple(module.path)
    entry = self.calls.setdefault(id(module), [module, path, kind, None, None])
    why = self._why_not(module, kind, method, args, kwargs)
    entry[3] = entry[3] or why
    x = args[0] if args else None
    if why is None:
      self.marking.append(path)
      try:
        theta = dict(module.variables.get("params", {}))
        call, marked, x_marked = _marked(theta, x, self.specs)
        self.call_paths[call] = path
        y = _ModuleFn(module)(marked, x_marked)
      finally:
        self.marking.pop()
    else:
      y = next_fun(*args, **kwargs)
    if isinstance(x, (jax.Array, np.ndarray)) and isinstance(
      y, (jax.Array, np.ndarray)
    ):
      entry[4] = (
        jax.ShapeDtypeStruct(np.shape(x), x.dtype),
        jax.ShapeDtypeStruct(np.shape(y), y.dtype),
        _theta_shapes(module),
      )
    return y

  def nnx(self, module, kind, method, original, args, kwargs):
    """The nnx wrapper: records which leaves the call reads, and runs it
    with its variables set to marked values for the call's time.
    """
    theta = _nnx_variables(module, kind)
    idx = {n: self.leaf_index.get(id(_value(v))) for n, v in theta.items()}
    why = _call_form(method, args, kwargs, self.batch_size)
    for i in idx.values():
      if i is not None:
        self.nnx_reads.setdefault(i, []).append(why)
    if why is not None:
      return original(module, *args, **kwargs)
    old = {n: _value(v) for n, v in theta.items()}
    call, marked, x = _marked(old, args[0], self.specs)
    self.call_paths[call] = None
    try:
      for n, v in marked.items():
        theta[n].set_value(v)
    except Exception:  # noqa: BLE001
      # A variable that cannot take the marked value here (an nnx
      # transform's own trace): the call stays unmarked, so the program
      # reads its parameters outside any marker and they are exact.
      for n, v in old.items():
        theta[n].set_value(v)
      return original(module, *args, **kwargs)
    try:
      return original(module, x)
    finally:
      for n, v in old.items():
        theta[n].set_value(v)

  def trace(self, loss_of: Callable, params: Any, batch: tuple):
    """The closed jaxpr of ``loss_of(params, batch)`` with the markers in."""

    def traced(p, b):
      self.leaf_index = {id(v): i for i, v in enumerate(jax.tree.leaves(p))}
      if nn is None:  # pragma: no cover
        return loss_of(p, b)
      with nn.intercept_methods(self.linen), _nnx_patched(self.nnx):
        return loss_of(p, b)

    return jax.make_jaxpr(traced)(params, batch)


def _per_example_losses(closed, batch_size: int) -> None:
  out = closed.out_avals[0] if closed.out_avals else None
  if out is None or tuple(out.shape) != (batch_size,):
    raise ValueError(
      "loss_fn must return one loss per example, shape "
      f"({batch_size},); got shape {None if out is None else tuple(out.shape)}"
      " (return the per-example losses, not their mean or sum)"
    )


def _layers(calls: dict) -> tuple[dict, dict]:
  """Per module path: ``(kind, why, parameter names)`` (``why``: the first
  reason a call of it cannot be tapped, or None) and its call's shapes.
  How many times a layer is applied is the audit's to count, in the traced
  program: a lifted transform may trace its body (two module objects at
  one path) more than once.
  """
  by_path: dict = {}
  shapes: dict = {}
  for module, path, kind, why, call_shapes in calls.values():
    shapes[path] = call_shapes
    old = by_path.get(path)
    if old is not None:
      why = why or old[1]
    by_path[path] = (kind, why, tuple(module.variables.get("params", {})))
  return by_path, shapes


def _audited(found, call_paths: dict, i: int, path, name) -> Optional[str]:
  """Why leaf ``i`` is not provably read by its layer call alone (None
  when it is).
  """
  other = found.other_use[i]
  if other is not None:
    return f"also {other}"
  uses = found.uses[i]
  if len(uses) != 1:
    return (
      f"read by {len(uses)} layer calls (a weight applied in several "
      "places needs the cross terms between its applications)"
    )
  call, used_as, same = uses[0]
  if call_paths.get(call, path) != path or used_as != name:
    return "read by another layer than its own"
  if not same:
    return "applied under a vectorising transformation (vmap)"
  if call in found.repeated:
    return f"its layer is applied more than once: {found.repeated[call]}"
  return found.x_batched.get(call, "its layer's input is not marked")


def _layer_of(leaf_names: tuple, by_path: dict):
  """``(path, kind, why)`` of the layer a leaf belongs to: the LONGEST
  recorded module path its names end with (a top-level ``Dense_0`` must
  not claim the kernel of a ``Dense_0`` nested in a block); or None.
  """
  hit = None
  for path, (kind, why, pnames) in by_path.items():
    n = len(path)
    if (
      len(leaf_names) > n
      and leaf_names[-1] in pnames
      and tuple(leaf_names[-n - 1 : -1]) == path
      and (hit is None or n > len(hit[0]))
    ):
      hit = (path, kind, why)
  return hit


def discover(
  loss_of: Callable,
  params: Any,
  batch: tuple,
  batch_size: int,
  group_of_leaf: list,
) -> tuple[Plan, list]:
  """Traces the loss once (``jax.make_jaxpr``) and plans the ghost pass.

  A parameter is ghosted only when its layer is one the taps handle, called
  once on an input batched along its leading axis, and the traced program
  reads the parameter nowhere else (``_loss_audit``): every other parameter
  takes the exact per-example path, with the reason in ``Plan.reasons``.

  Args:
    loss_of: ``(params, batch) -> (B,)`` per-example losses.
    params: the parameters (arrays or shapes).
    batch: the batch arguments (leading axis ``B``).
    batch_size: ``B``.
    group_of_leaf: per leaf of ``params`` (flattened), its clip group.

  Returns:
    The :class:`Plan` and, per leaf, whether it falls back (True).

  Raises:
    ValueError: the loss mixes examples (``_loss_audit.MixesExamples``), or
      does not return ``(B,)`` losses.
  """
  with_paths = jax.tree_util.tree_flatten_with_path(params)[0]
  names = [_leaf_names(p) for p, _ in with_paths]
  keystrs = [jax.tree_util.keystr(p) for p, _ in with_paths]
  marked = _MarkedTrace(batch_size)
  closed = marked.trace(loss_of, params, batch)
  _per_example_losses(closed, batch_size)
  n_batch = len(jax.tree.leaves(batch))
  found = _loss_audit.audit(
    closed, len(with_paths), [0] * n_batch, batch_size, marked.specs
  )
  by_path, shapes = _layers(marked.calls)

  reasons: dict = {}
  covered, kinds, containers = {}, {}, {}
  leaf_paths: list = [None] * len(names)
  for i, (leaf_names, group) in enumerate(zip(names, group_of_leaf)):
    hit = _layer_of(leaf_names, by_path)
    if hit is None:
      continue
    path, kind, why = hit
    why = why or _audited(found, marked.call_paths, i, path, leaf_names[-1])
    if why is not None:
      reasons[keystrs[i]] = why
      continue
    covered.setdefault(path, {})[leaf_names[-1]] = group
    containers[path] = tuple(leaf_names[:-1])
    kinds[path] = kind
    leaf_paths[i] = path
  # A layer is tapped only with all its parameters: one that falls back
  # takes its layer's others with it.
  for path in list(covered):
    missing = sorted(set(by_path[path][2]) - set(covered[path]))
    if missing:
      for i, p in enumerate(leaf_paths):
        if p == path:
          reasons[keystrs[i]] = (
            f"its layer's {', '.join(missing)} is on the exact path"
          )
          leaf_paths[i] = None
      del covered[path]
  nnx_groups = {}
  for i, whys in marked.nnx_reads.items():
    why = next((w for w in whys if w is not None), None)
    name = found.uses[i][0][1] if found.uses[i] else ""
    why = why or _audited(found, marked.call_paths, i, None, name)
    if why is None:
      nnx_groups[i] = group_of_leaf[i]
    else:
      reasons[keystrs[i]] = why
  flags = [p is None and i not in nnx_groups for i, p in enumerate(leaf_paths)]
  for i, flag in enumerate(flags):
    if not flag:
      kind = "nnx" if leaf_paths[i] is None else kinds[leaf_paths[i]]
      reasons[keystrs[i]] = _KIND_NAMES.get(kind, kind)
    elif keystrs[i] not in reasons:
      reasons[keystrs[i]] = "not a parameter of a layer the taps handle"
  plan = Plan(
    nnx_groups=nnx_groups,
    shapes={p: shapes[p] for p in covered},
    containers={p: containers[p] for p in covered},
    covered=covered,
    kinds=kinds,
    fallback=[k for k, f in zip(keystrs, flags) if f],
    ghosted=[k for k, f in zip(keystrs, flags) if not f],
    reasons=reasons,
  )
  return plan, flags


def _nnx_classes() -> dict:
  try:
    from flax import nnx
  except ImportError:  # pragma: no cover
    return {}
  return {nnx.Linear: "dense", nnx.Embed: "embed"}


def _value(variable):
  get = getattr(variable, "get_value", None)
  return get() if callable(get) else getattr(variable, "value", variable)


def _nnx_variables(module, kind) -> dict:
  names = ("kernel", "bias") if kind == "dense" else ("embedding",)
  return {
    n: getattr(module, n) for n in names if getattr(module, n, None) is not None
  }


def _nnx_params(module, kind) -> dict:
  return {n: _value(v) for n, v in _nnx_variables(module, kind).items()}


@contextlib.contextmanager
def _nnx_patched(around):
  """Routes every ``nnx.Linear`` / ``nnx.Embed`` call (and ``attend``)
  through ``around(module, kind, method, original, args, kwargs)`` for the
  time of one trace: nnx modules have no method interceptors.
  """
  saved = []
  try:
    for cls, kind in _nnx_classes().items():
      for method in ("__call__", "attend"):
        original = cls.__dict__.get(method)
        if original is None:
          continue
        saved.append((cls, method, original))

        def wrapper(self, *args, _f=original, _k=kind, _m=method, **kwargs):
          return around(self, _k, _m, _f, args, kwargs)

        setattr(cls, method, wrapper)
    yield
  finally:
    for cls, method, original in saved:
      setattr(cls, method, original)


def _direct_ok(module) -> bool:
  # A layer applied one example at a time must not mix examples or need an
  # RNG (dropout lives elsewhere); these flax layers qualify as they are.
  return not getattr(module, "batch_dims", ())


def _dense_general_axes(module, x) -> Optional[int]:
  """The number of trailing input axes a DenseGeneral contracts, or None
  when they are not trailing (then the direct form is used).
  """
  axis = module.axis
  axes = (axis,) if isinstance(axis, int) else tuple(axis)
  ndim = x.ndim
  norm = sorted(a % ndim for a in axes)
  if norm != list(range(ndim - len(norm), ndim)) or 0 in norm:
    return None
  return len(norm)


def _gram_or_direct_sq(a: jax.Array, g: jax.Array) -> jax.Array:
  """``|A_b^T G_b|_F^2`` per example, ``a`` (B, T, d_in), ``g`` (B, T, d_out),
  by the cheaper of the Gram and the direct form.
  """
  _, t, d_in = a.shape
  d_out = g.shape[-1]
  a = a.astype(jnp.promote_types(a.dtype, jnp.float32))
  g = g.astype(jnp.promote_types(g.dtype, jnp.float32))
  if t * (d_in + d_out) < d_in * d_out:
    aa = jnp.einsum("btd,bsd->bts", a, a, precision=_HIGHEST)
    gg = jnp.einsum("btd,bsd->bts", g, g, precision=_HIGHEST)
    return jnp.sum(aa * gg, axis=(1, 2))
  per_example = jnp.einsum("btd,bte->bde", a, g, precision=_HIGHEST)
  return jnp.sum(per_example * per_example, axis=(1, 2))


def _sum_sq(x: jax.Array) -> jax.Array:
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  return jnp.sum(x * x, axis=tuple(range(1, x.ndim)))


def _needs_exact(fast: dict, factors: tuple) -> jax.Array:
  """Per example, 1.0 where a fast square in ``fast`` (per name, ``(B,)``)
  is not finite, or below the smallest normal number, although the factors
  it was computed from are finite and not all zero (a norm above about
  1.8e19 squares to inf in float32, one below about 1e-19 to 0 or a
  subnormal; a huge Gram entry times a zero gives NaN): only the exact form
  (:func:`exact_sq_norms`) is right there. An example with a non-finite
  factor stays non-finite either way; one with a zero factor has a zero
  square.
  """
  bad = functools.reduce(
    jnp.logical_or,
    [
      ~(jnp.isfinite(v) & (v >= jnp.finfo(v.dtype).tiny)) for v in fast.values()
    ],
  )
  for f in factors:
    if jnp.issubdtype(f.dtype, jnp.inexact):
      # The largest magnitude (NaN if any is): a reduction of the factor
      # as it is, no (B, ...) mask of it.
      axes = tuple(range(1, f.ndim))
      top = jnp.max(jnp.abs(f), axis=axes)
      bad = bad & jnp.isfinite(top) & (top > 0)
  return bad.astype(jnp.float32)


# The exact recompute scales its factors chunk by chunk along their last
# (feature) axis, in at most this many chunks: a scaled copy of a whole
# output gradient would be one more buffer of the logits' size.
_MOST_CHUNKS = 16


def _chunk_sum(fn: Callable, x: jax.Array) -> jax.Array:
  """``sum_c fn(x_c)`` over the chunks ``x_c`` of ``x``'s last axis (``k``
  chunks, the largest divisor of its size up to ``_MOST_CHUNKS``), one at a
  time (slices along an axis no mesh splits).
  """
  d = x.shape[-1]
  k = max(i for i in range(1, _MOST_CHUNKS + 1) if d % i == 0)
  chunks = x.reshape(x.shape[:-1] + (k, d // k))
  axis = chunks.ndim - 2

  def chunk(i):
    return jax.lax.dynamic_index_in_dim(chunks, i, axis, keepdims=False)

  return jax.lax.fori_loop(
    1, k, lambda i, acc: acc + fn(chunk(i)), fn(chunk(0))
  )


def _scaled(x: jax.Array, scale: jax.Array) -> jax.Array:
  return x.astype(scale.dtype) * scale


def _gram(x: jax.Array, scale: jax.Array) -> jax.Array:
  """``(B, T, T)`` inner products of the positions of ``x * scale``."""
  return _chunk_sum(
    lambda c: jnp.einsum(
      "btd,bsd->bts", _scaled(c, scale), _scaled(c, scale), precision=_HIGHEST
    ),
    x,
  )


def _dense_sq(a, gm, bias: bool) -> dict:
  out = {"kernel": _gram_or_direct_sq(a, gm)}
  if bias:
    out["bias"] = _sum_sq(jnp.sum(gm.astype(jnp.float32), axis=1))
  return out


def _dense_sq_exact(a, gm, bias: bool) -> dict:
  """:func:`_dense_sq` of factors scaled per example (exact, Scaled)."""
  sa, ea = _norms.row_scales(a)
  sg, eg = _norms.row_scales(gm)
  _, t, d_in = a.shape
  d_out = gm.shape[-1]
  if t * (d_in + d_out) < d_in * d_out:
    kernel = jnp.sum(_gram(a, sa) * _gram(gm, sg), axis=(1, 2))
  else:

    def block(a_c, g_c):
      pe = jnp.einsum(
        "btd,bte->bde",
        _scaled(a_c, sa),
        _scaled(g_c, sg),
        precision=_HIGHEST,
      )
      return jnp.sum(pe * pe, axis=(1, 2))

    kernel = _chunk_sum(
      lambda g_c: _chunk_sum(lambda a_c: block(a_c, g_c), a), gm
    )
  out = {"kernel": _norms.Scaled(kernel, 2 * (ea + eg))}
  if bias:
    bias_sq = _chunk_sum(
      lambda g_c: _sum_sq(jnp.sum(_scaled(g_c, sg), axis=1)), gm
    )
    out["bias"] = _norms.Scaled(bias_sq, 2 * eg)
  return out


def _embed_sq(tokens, gm, scale=None) -> jax.Array:
  same = tokens[:, :, None] == tokens[:, None, :]
  if scale is None:
    gm = gm.astype(jnp.float32)
    gg = jnp.einsum("btd,bsd->bts", gm, gm, precision=_HIGHEST)
  else:
    gg = _gram(gm, scale)
  return jnp.sum(jnp.where(same, gg, 0), axis=(1, 2))


def _direct_sq(grads: dict, exact: bool) -> tuple[dict, jax.Array]:
  """Squared norms of per-example gradients (``(B, ...)`` each), as
  :func:`_layer_sq_norms` returns them.
  """
  if not exact:
    fast = {k: _sum_sq(v) for k, v in grads.items()}
    return fast, _needs_exact(fast, tuple(grads.values()))
  out = {}
  for k, v in grads.items():
    v = v.reshape(v.shape[0], -1)
    scale, e = _norms.row_scales(v)
    out[k] = _norms.Scaled(
      _chunk_sum(lambda c, s=scale: _sum_sq(_scaled(c, s)), v), 2 * e
    )
  return out, _no_need(grads)


def _no_need(tree) -> jax.Array:
  return jnp.zeros(jax.tree.leaves(tree)[0].shape[:1], jnp.float32)


def _layer_sq_norms(
  kind, module_fn, theta, x, y, g, exact: bool = False
) -> tuple[dict, jax.Array]:
  """Per parameter name, the ``(B,)`` squared norms of its per-example
  gradient, from the layer input ``x``, parameters ``theta`` (a dict) and
  output gradient ``g``; and per example whether they need the exact form.

  Fast (``exact=False``): the squares of the factors as they are (plain
  arrays), with :func:`_needs_exact`'s ``(B,)`` flags. Exact: the factors
  are scaled per example by the powers of two of their largest magnitudes
  (``_norms.row_scales``), the squares carry the exponents
  (:class:`~optaxclip._norms.Scaled`), right for every finite example, its
  norm beyond float32's range included; the flags are 0. The exact form
  costs scaled copies of the factors (chunk by chunk), which is why it is
  only taken on the rare step that needs it (``exact_norms``), not beside
  the fast one in every layer: a per-layer choice would keep every layer's
  factors alive until its own choice is made.
  """
  batch = x.shape[0]
  if kind == "dense" or kind == "dense_general":
    n_in = 1 if kind == "dense" else module_fn.n_in
    d_in = math.prod(x.shape[x.ndim - n_in :])
    a = x.reshape(batch, -1, d_in)
    features = theta["kernel"].shape[n_in:]
    gm = g.reshape(batch, -1, math.prod(features))
    bias = "bias" in theta
    if exact:
      return _dense_sq_exact(a, gm, bias), _no_need(a)
    fast = _dense_sq(a, gm, bias)
    return fast, _needs_exact(fast, (a, gm))
  if kind == "embed":
    tokens = x.reshape(batch, -1)
    d = theta["embedding"].shape[-1]
    gm = g.reshape(batch, -1, d)
    if exact:
      scale, e = _norms.row_scales(gm)
      sq = _norms.Scaled(_embed_sq(tokens, gm, scale), 2 * e)
      return {"embedding": sq}, _no_need(gm)
    fast = {"embedding": _embed_sq(tokens, gm)}
    return fast, _needs_exact(fast, (gm,))
  return _direct_sq(_direct_grads(module_fn, theta, x, y.dtype, g), exact)


def _direct_grads(module_fn, theta, x, y_dtype, g) -> dict:
  """The layer's own per-example parameter gradients, ``(B, ...)`` each."""

  def one(x_b, g_b):
    _, vjp = jax.vjp(lambda th: module_fn(th, x_b[None]), theta)
    return vjp(g_b[None].astype(y_dtype))[0]

  return jax.vmap(one)(x, g)


def like(value: jax.Array, probe: jax.Array) -> jax.Array:
  """``value`` with ``probe``'s sharding where an Explicit mesh types it
  (a ``(B,)``-sized array: matching moves next to nothing).
  """
  typeof = getattr(jax, "typeof", None)
  want = getattr(typeof(probe), "sharding", None) if typeof else None
  have = getattr(typeof(value), "sharding", None) if typeof else None
  mesh = getattr(want, "mesh", None)
  if (
    want is None
    or mesh is None
    or mesh.empty
    or have is None
    or have.spec == want.spec
  ):
    return value
  return jax.sharding.reshard(value, want.spec)


def batch_like(mask: jax.Array, x: jax.Array) -> jax.Array:
  """A ``(..., B)`` array (a ``(B,)`` one, or the probe's rows) with its
  last axis split like ``x``'s leading (batch) axis, where an Explicit mesh
  types ``x``.
  """
  typeof = getattr(jax, "typeof", None)
  sharding = getattr(typeof(x), "sharding", None) if typeof else None
  mesh = getattr(sharding, "mesh", None)
  spec = tuple(getattr(sharding, "spec", None) or ())
  if mesh is None or mesh.empty or not spec or spec[0] is None:
    return mask
  lead = (None,) * (mask.ndim - 1)
  return jax.sharding.reshard(mask, jax.sharding.PartitionSpec(*lead, spec[0]))


def _zero_cotangent(x):
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


# Names of the book-keeping catchers, set next to a layer's parameters for
# the time of one trace (see ``forward``): the layer's input and output
# gradient, or (``catch_per_example``) each parameter's per-example
# gradient.
CATCH_X = "__ghost_x__"
CATCH_G = "__ghost_g__"
CATCH_PE = "__ghost_pe_{}__"


def _make_tap(
  kind, module_fn, groups: dict, n_groups: int, catch: str, exact: bool
):
  """An identity on ``y`` whose backward writes per-example squared norms
  into the probe's cotangent (rows ``groups[name] * N_BUCKETS`` onwards for
  each parameter), fast or ``exact`` (see :func:`_layer_sq_norms`), and
  into the probe's last row, per example, how many of its squares need the
  exact form.

  The last input, ``catchers`` (a dict, empty unless ``catch``), receives
  as its cotangent what book-keeping needs of this layer: with ``catch ==
  "xg"``, the layer's input and output gradient (zeros shaped like ``x``
  and ``y`` at ``CATCH_X``, ``CATCH_G``); with ``"pe"``, each parameter's
  per-example gradient. That is how they leave the backward pass, and an
  ``nn.scan`` stacks them per layer as it stacks the parameters' gradients.
  """

  def rows_of(sq, needs, probe):
    # Per group, the rows of _norms.to_buckets (squares beyond float32's
    # range added up exactly), groups one after the other, then the flags.
    # One to_buckets per dtype for all the layer's parameters, stacked: it
    # works element by element, so each parameter's rows are those of a
    # call of its own, in a smaller program (a kernel and its bias share
    # one call), and they are added up in the same order.
    shape = (_norms.N_BUCKETS,) + probe.shape[1:]
    rows = [jnp.zeros(shape, jnp.float32) for _ in range(n_groups)]
    by_dtype: dict = {}
    for name, value in sq.items():
      value = _norms.as_scaled(value)
      by_dtype.setdefault(value.value.dtype, []).append((name, value))
    buckets = {}
    for items in by_dtype.values():
      stacked = _norms.Scaled(
        jnp.stack([v.value for _, v in items]),
        jnp.stack([v.exponent for _, v in items]),
      )
      rows_of_all = _norms.to_buckets(stacked).astype(jnp.float32)
      for i, (name, _) in enumerate(items):
        buckets[name] = rows_of_all[:, i]
    for name in sq:
      rows[groups[name]] = rows[groups[name]] + buckets[name]
    rows.append(needs[None].astype(jnp.float32))
    # Each piece typed like the probe (under an Explicit mesh a row of
    # zeros is not split like the batch).
    return jnp.concatenate([like(r, probe[: r.shape[0]]) for r in rows])

  @jax.custom_vjp
  def tap(y, x, theta, probe, catchers):
    del x, theta, probe, catchers
    return y

  def fwd(y, x, theta, probe, catchers):
    del catchers
    return y, (x, theta, jnp.zeros((), y.dtype), probe)

  def bwd(res, g):
    x, theta, y0, probe = res
    caught: dict = {}
    if catch == "pe":
      grads = _direct_grads(module_fn, theta, x, y0.dtype, g)
      sq, needs = _direct_sq(grads, exact)
      caught = {CATCH_PE.format(k): v for k, v in grads.items()}
    else:
      sq, needs = _layer_sq_norms(
        kind,
        module_fn,
        theta,
        x,
        jax.ShapeDtypeStruct(g.shape, y0.dtype),
        g,
        exact,
      )
      if catch == "xg":
        caught = {CATCH_X: x.astype(_catch_dtype(x.dtype)), CATCH_G: g}
    return (
      g,
      _zero_cotangent(x),
      jax.tree.map(jnp.zeros_like, theta),
      rows_of(sq, needs, probe),
      caught,
    )

  tap.defvjp(fwd, bwd)
  return tap


def _catch_dtype(dtype):
  # Token ids travel as float32 (exact below 2**24).
  return dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.float32


class _ModuleFn:
  """``theta, x -> y`` of one bound module, as a pure function."""

  def __init__(self, module, n_in=1):
    self.unbound = module.clone(parent=None)
    self.n_in = n_in

  def __call__(self, theta, x):
    return self.unbound.apply({"params": theta}, x)


def _is_catcher(name) -> bool:
  return isinstance(name, str) and name.startswith("__ghost_")


def _split_catch(params: dict):
  """A layer's parameters without the catchers, and the catchers."""
  theta = {k: v for k, v in params.items() if not _is_catcher(k)}
  catchers = {k: v for k, v in params.items() if _is_catcher(k)}
  return theta, catchers


def catch_mode(plan: Plan, path, params: Any) -> str:
  """What book-keeping keeps of a layer: ``"pe"`` (each parameter's
  per-example gradient) for a layer that takes the exact per-example path
  anyway when that is smaller than its input and output (a LayerNorm's
  scale and bias against its ``(T, d)`` input and output), else ``"xg"``.
  """
  if plan.kinds[path] != "direct":
    return "xg"
  x, y, per_call = plan.shapes[path]
  per_example = sum(math.prod(s) for s in per_call.values())
  io = (math.prod(x.shape) + math.prod(y.shape)) // max(x.shape[0], 1)
  return "pe" if per_example <= io else "xg"


def interceptor(
  plan: Plan, probe: jax.Array, n_groups: int, fns: dict, exact: bool = False
):
  """The method interceptor that taps every covered layer call (and keeps,
  in ``fns``, each tapped layer's pure function).
  """

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    path = None if module.path is None else tuple(module.path)
    if (
      context.method_name != "__call__"
      or path not in plan.covered
      or _kind_of(module) is None
    ):
      return next_fun(*args, **kwargs)
    y = next_fun(*args, **kwargs)
    kind = plan.kinds[path]
    x = args[0]
    theta, catchers = _split_catch(dict(module.variables["params"]))
    n_in = 1
    if kind == "dense_general":
      n_in = _dense_general_axes(module, x)
    fn = _ModuleFn(module, n_in or 1)
    fns[path] = fn
    catch = ""
    if CATCH_G in catchers:
      catch = "xg"
    elif catchers:
      catch = "pe"
    tap = _make_tap(kind, fn, plan.covered[path], n_groups, catch, exact)
    return tap(y, x, theta, probe, catchers)

  return intercept


def _get(tree, keys):
  for k in keys:
    tree = tree[k]
  return tree


def _with(tree, keys, extra: dict):
  """A copy of the nested mapping ``tree`` with ``extra`` added to the
  mapping at ``keys`` (dicts and FrozenDicts are rebuilt as they were).
  """
  if not keys:
    out = dict(tree)
    out.update(extra)
  else:
    out = dict(tree)
    out[keys[0]] = _with(tree[keys[0]], keys[1:], extra)
  return out if type(tree) is dict else type(tree)(out)


def can_bookkeep(plan: Plan, params: Any) -> bool:
  """Whether the one-pass (book-keeping) form applies: every parameter is
  covered by a tapped linen layer whose parameters sit in nested dicts.
  """
  if plan.fallback or plan.nnx_groups or not plan.covered:
    return False
  for path, keys in plan.containers.items():
    node = params
    for k in keys:
      if type(node) is not dict and not _is_frozen_dict(node):
        return False
      if k not in node:
        return False
      node = node[k]
    if type(node) is not dict and not _is_frozen_dict(node):
      return False
    if plan.shapes.get(path) is None:
      return False
  return True


def _is_frozen_dict(node) -> bool:
  try:
    from flax.core import FrozenDict
  except ImportError:  # pragma: no cover
    return False
  return isinstance(node, FrozenDict)


def _stack_axes(plan: Plan, params: Any, path) -> tuple:
  """The leading (``nn.scan``) axes of a layer's parameters in the tree."""
  node = _get(params, plan.containers[path])
  name = next(iter(plan.covered[path]))
  per_call = plan.shapes[path][2][name]
  full = np.shape(node[name])
  return tuple(full[: len(full) - len(per_call)])


def with_catchers(plan: Plan, params: Any) -> Any:
  """``params`` with zero catchers next to each covered layer's
  parameters (stacked like them under ``nn.scan``; see ``catch_mode``).
  """
  for path, keys in plan.containers.items():
    x, y, per_call = plan.shapes[path]
    lead = _stack_axes(plan, params, path)
    if catch_mode(plan, path, params) == "pe":
      node = _get(params, keys)
      extra = {
        CATCH_PE.format(k): jnp.zeros(
          lead + (x.shape[0],) + tuple(per_call[k]), node[k].dtype
        )
        for k in plan.covered[path]
      }
    else:
      extra = {
        CATCH_X: jnp.zeros(lead + x.shape, _catch_dtype(x.dtype)),
        CATCH_G: jnp.zeros(lead + y.shape, y.dtype),
      }
    params = _with(params, keys, extra)
  return params


def weighted_grads(
  plan: Plan,
  params: Any,
  caught: Any,
  fns: dict,
  weights: list,
  group_of_leaf: list,
) -> Any:
  """Book-keeping (Bu et al. 2023): the parameters' gradient of
  ``sum_b w_b loss_b`` from each layer's caught input ``x`` and output
  gradient ``g``: the layer's own VJP with the cotangent ``w_b g_b`` (a
  weighted ``A^T G`` for a Dense, a weighted scatter of ``g`` for an Embed),
  no second backward pass through the model.

  Args:
    plan: the plan (``can_bookkeep`` holds).
    params: the parameters, without catchers.
    caught: the cotangent of the parameters with catchers.
    fns: per module path, the layer's pure function (from the forward).
    weights: per group, the ``(B,)`` weights.
    group_of_leaf: per leaf of ``params``, its group.

  Returns:
    The gradient, shaped like ``params``.
  """
  names = [
    _leaf_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
  ]
  by_leaf: dict = {}
  for path, keys in plan.containers.items():
    node = _get(params, keys)
    got = _get(caught, keys)
    if catch_mode(plan, path, params) == "pe":
      lead = _stack_axes(plan, params, path)
      for k, group in plan.covered[path].items():
        per_example = got[CATCH_PE.format(k)]  # lead + (B,) + shape
        acc = jnp.promote_types(per_example.dtype, jnp.float32)
        summed = jnp.tensordot(
          weights[group].astype(acc),
          jnp.moveaxis(per_example, len(lead), 0).astype(acc),
          axes=1,
          precision=_HIGHEST,
        )
        by_leaf[tuple(keys) + (k,)] = summed.astype(node[k].dtype)
      continue
    x_all, g_all = got[CATCH_X], got[CATCH_G]
    x_dtype = plan.shapes[path][0].dtype
    theta = {k: node[k] for k in plan.covered[path]}
    lead = _stack_axes(plan, params, path)
    n = math.prod(lead)
    flat = lambda v, lead=lead, n=n: v.reshape((n,) + v.shape[len(lead) :])
    fn = fns[path]
    for group in sorted(set(plan.covered[path].values())):
      w = weights[group]
      members = [k for k, g in plan.covered[path].items() if g == group]

      def one(th, x, g, w=w, fn=fn, x_dtype=x_dtype):
        x = x.astype(x_dtype)
        wg = (w.reshape((-1,) + (1,) * (g.ndim - 1)) * g).astype(g.dtype)
        return jax.vjp(lambda t: fn(t, x), th)[1](wg)[0]

      if lead:
        grads = jax.vmap(one)(
          jax.tree.map(flat, theta), flat(x_all), flat(g_all)
        )
        grads = jax.tree.map(
          lambda v, lead=lead: v.reshape(lead + v.shape[1:]), grads
        )
      else:
        grads = one(theta, x_all, g_all)
      for k in members:
        by_leaf[tuple(keys) + (k,)] = grads[k]
  leaves = [by_leaf[n_] for n_ in names]
  del group_of_leaf
  return jax.tree.unflatten(jax.tree.structure(params), leaves)


def probe_rows(n_groups: int) -> int:
  """The probe's rows: ``_norms.N_BUCKETS`` per group, one of flags."""
  return n_groups * _norms.N_BUCKETS + 1


def read_rows(rows: jax.Array, n_groups: int) -> tuple[list, jax.Array]:
  """The probe's cotangent read back: per group the ``(B,)`` norms (a
  :class:`~optaxclip._norms.Scaled`), and per example whether some layer's
  fast squares need the exact form (a ``(B,)`` bool).
  """
  buckets = _norms.N_BUCKETS
  norms = [
    _norms.bucket_norms(rows[g * buckets : (g + 1) * buckets])
    for g in range(n_groups)
  ]
  return norms, rows[n_groups * buckets] > 0


def forward(
  apply_loss: Callable,
  params: Any,
  plan: Plan,
  batch_size: int,
  n_groups: int,
  catch: bool = False,
  batch_arg: Optional[jax.Array] = None,
  exact: bool = False,
):
  """One forward pass with the taps in place.

  ``batch_arg``: a leaf of the batch; the probe is split like its leading
  axis (under an Explicit mesh each layer's rows then stay on the devices
  that computed them: no all-gather).

  Returns:
    ``(losses, aux, vjp, fns)``: ``vjp(cotangent)`` with a ``(B,)``
    cotangent returns ``(param_grads, probe_cotangent)``. With a cotangent
    of ones, the probe's is the per-example squared norms of the covered
    parameters, group after group, each as ``_norms.N_BUCKETS`` rows of
    ``_norms.to_buckets``, then one row of flags (:func:`read_rows` reads
    them); with per-example weights, the parameters' is the weighted sum
    of the per-example gradients. ``exact``: the taps compute the exact
    squares (:func:`_layer_sq_norms`), for the rare recompute. Both
    backward passes
    share the forward's activations (under ``jit``, each drops what it does
    not use). With ``catch`` (see ``with_catchers``), the parameters'
    cotangent also holds each layer's input and output gradient at the
    catchers, for :func:`weighted_grads`; ``fns`` the layers' functions.
  """
  probe = jnp.zeros((probe_rows(n_groups), batch_size), jnp.float32)
  if batch_arg is not None:
    probe = batch_like(probe, batch_arg)
  fns: dict = {}
  if catch:
    params = with_catchers(plan, params)

  def run(params_, probe_):
    if nn is None or not (plan.covered or plan.nnx_groups):
      return apply_loss(params_)
    leaf_index = {id(v): i for i, v in enumerate(jax.tree.leaves(params_))}

    def nnx_tap(module, kind, method, original, args, kwargs):
      y = original(module, *args, **kwargs)
      if method != "__call__":
        return y
      theta = _nnx_params(module, kind)
      idx = {n: leaf_index.get(id(v)) for n, v in theta.items()}
      if not idx or any(i not in plan.nnx_groups for i in idx.values()):
        return y
      groups = {n: plan.nnx_groups[i] for n, i in idx.items()}
      tap = _make_tap(kind, None, groups, n_groups, "", exact)
      return tap(y, args[0], theta, probe_, {})

    with (
      nn.intercept_methods(interceptor(plan, probe_, n_groups, fns, exact)),
      _nnx_patched(nnx_tap),
    ):
      return apply_loss(params_)

  losses, vjp, aux = jax.vjp(run, params, probe, has_aux=True)
  return losses, aux, vjp, fns
