"""Properties of the ghost method's compiled memory (XLA memory analysis).

The two-pass ghost step holds what a plain ``jax.grad`` holds: on a model
whose logits dominate the activations, its temporary memory stays within a
small share of one logits-sized buffer of the plain gradient's. (Its second
backward pass runs outside the non-finite ``lax.cond``: a branch's operands,
the forward's residuals, are kept whole by XLA for the branch, so the
logits' cotangent could not overwrite the softmax as in a plain
``jax.grad``.)
"""

import functools

import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from example_runner import load_script
from fast_compile import compile_fast
from fast_compile import run_fast
import fuzz_strategies as fz
import optaxclip


class _Readout(nn.Module):
  vocab: int

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.vocab)(nn.gelu(nn.Dense(16)(x)))


# Inputs drawn on the host (jax.random compiles a program per shape).
def _normal(shape, seed):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _temp_bytes(fn, *args):
  # Compiled with the fast options: buffer assignment is an HLO pass, the
  # temporary sizes are those of the default compilation (checked equal on
  # these models), for a fifth of the compile time. The arguments may be
  # shapes (jax.ShapeDtypeStruct): the memory depends on nothing else.
  compiled = compile_fast(jax.jit(fn).lower(*args))
  return compiled.memory_analysis().temp_size_in_bytes


def _param_shapes(net, x):
  # Only their shapes: no init program compiled and run.
  one = jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  return jax.eval_shape(net.init, key, one)


@fz.examples(2, deadline=None)
@hypothesis.given(
  # One size under ci (two programs each); release draws them.
  shape=fz.ci_or(
    st.just((16, 4, 2048)),
    st.tuples(
      st.sampled_from([8, 16]),
      st.sampled_from([4, 8]),
      st.sampled_from([1024, 2048]),
    ),
  )
)
def test_two_pass_ghost_holds_no_extra_logits_buffer(shape):
  batch, length, vocab = shape
  net = _Readout(vocab)
  x = jax.ShapeDtypeStruct((batch, length, 8), jnp.float32)
  y = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  params = _param_shapes(net, x)

  def loss_fn(p, x, y):
    logits = net.apply(p, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(1)

  def plain(p, x, y):
    return jax.grad(lambda p: loss_fn(p, x, y).mean())(p)

  grad_fn = optaxclip.clipped_grad(
    loss_fn, 1.0, batch_argnums=(1, 2), bookkeeping=False
  )
  logits_bytes = batch * length * vocab * 4
  extra = _temp_bytes(
    lambda p, x, y: grad_fn(p, x, y)[0], params, x, y
  ) - _temp_bytes(plain, params, x, y)
  assert extra < 0.25 * logits_bytes, (extra, logits_bytes)


class _NormedBlock(nn.Module):
  norm: bool

  @nn.compact
  def __call__(self, h, _):
    h = nn.Dense(h.shape[-1])(h)
    if self.norm:
      h = nn.LayerNorm()(h)
    return h, None


class _Normed(nn.Module):
  norm: bool
  layers: int = 2

  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(
      _NormedBlock,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=self.layers,
    )
    h, _ = blocks(self.norm)(x, None)
    return nn.Dense(4)(h)


def _host_params(net, x, seed=2):
  # Random parameters of the model's shapes, drawn on the host: no init
  # program compiled (the ghost and vmap paths are compared on any values).
  shapes, treedef = jax.tree.flatten(_param_shapes(net, x))
  rng = np.random.default_rng(seed)
  return jax.tree.unflatten(
    treedef,
    [(0.5 * rng.normal(size=s.shape)).astype(s.dtype) for s in shapes],
  )


@functools.cache
def _normed_case(norm, batch, length, width, shapes_only=False):
  """``(loss_fn, params, x, y)``, one per arguments (a test's programs are
  shared by examples of the same shapes); ``shapes_only``: params, x and y
  as shapes, for the memory analysis.
  """
  net = _Normed(norm)
  if shapes_only:
    x = jax.ShapeDtypeStruct((batch, length, width), jnp.float32)
    y = jax.ShapeDtypeStruct((batch, length, 4), jnp.float32)
    params = _param_shapes(net, x)
  else:
    x, y = _normal((batch, length, width), 0), _normal((batch, length, 4), 1)
    params = _host_params(net, x)

  def loss_fn(p, x, y):
    return ((net.apply(p, x) - y) ** 2).mean(axis=(1, 2))

  return loss_fn, params, x, y


@functools.cache
def _normed_vmap(norm, batch, length, width):
  """The exact vmap path's (clipped sum, norms) on :func:`_normed_case`."""
  loss_fn, params, x, y = _normed_case(norm, batch, length, width)
  ref = optaxclip.clipped_grad(
    loss_fn, 0.05, batch_argnums=(1, 2), method="vmap"
  )
  return run_fast(ref, params, x, y)


def test_bookkeeping_memory_of_scanned_layernorms():
  # Under nn.scan what book-keeping keeps of a layer adds to every layer's
  # residuals. Of a LayerNorm it keeps B x 2 width floats, not its input and
  # output gradient (2 x B x T x width): adding the LayerNorms to the
  # model costs book-keeping about 2 activations more than it costs a plain
  # jax.grad (their inputs, kept for their per-example gradients); keeping
  # the input and output gradient cost 6.
  def temps(norm):
    loss_fn, params, x, y = _normed_case(norm, 16, 32, 64, shapes_only=True)

    def plain(p, x, y):
      return jax.grad(lambda p: loss_fn(p, x, y).mean())(p)

    grad_fn = optaxclip.clipped_grad(
      loss_fn, 1.0, batch_argnums=(1, 2), bookkeeping=True
    )
    one_pass = _temp_bytes(lambda p, x, y: grad_fn(p, x, y)[0], params, x, y)
    return one_pass, _temp_bytes(plain, params, x, y)

  with_norm, without = temps(True), temps(False)
  activation = 16 * 32 * 64 * 4
  extra = (with_norm[0] - without[0]) - (with_norm[1] - without[1])
  assert extra < 3 * activation, (extra, activation)


class _MlpBlock(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return h + nn.Dense(h.shape[-1])(
      nn.gelu(nn.Dense(4 * h.shape[-1])(h))
    ), None


class _Deep(nn.Module):
  layers: int = 4

  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(
      _MlpBlock,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=self.layers,
    )
    h, _ = blocks()(nn.Dense(x.shape[-1])(x), None)
    return nn.Dense(4)(nn.LayerNorm()(h))


def _deep_case(batch, length, width):
  x = jax.ShapeDtypeStruct((batch, length, width), jnp.float32)
  y = jax.ShapeDtypeStruct((batch, length, 4), jnp.float32)
  net = _Deep()
  params = _param_shapes(net, x)

  def loss_fn(p, x, y):
    return ((net.apply(p, x) - y) ** 2).mean(axis=(1, 2))

  return loss_fn, params, x, y


def _assert_same(got, want):
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
  # On the host: a difference of JAX arrays would compile a program per
  # leaf shape (and sharding).
  leaves = [np.asarray(w) for w in jax.tree.leaves(want[0])]
  scale = max(float(np.max(np.abs(w))) for w in leaves)
  for g, w in zip(jax.tree.leaves(got[0]), leaves):
    assert float(np.max(np.abs(np.asarray(g) - w))) <= 1e-5 * scale


@fz.examples(2, deadline=None)
@hypothesis.given(
  # Under ci one layout (its vmap reference compiled once per norm); the
  # release profile draws them.
  shape=fz.ci_or(
    st.just((3, 4, 8)),
    st.tuples(
      st.sampled_from([2, 3]), st.sampled_from([1, 4]), st.sampled_from([3, 8])
    ),
  ),
  bookkeeping=st.booleans(),
  norm=st.booleans(),
  remat=st.booleans(),
)
# Book-keeping keeps a LayerNorm's per-example gradient (not its input and
# output gradient) and sums it with the clip factors: exact.
@hypothesis.example(shape=(3, 4, 8), bookkeeping=True, norm=True, remat=False)
@hypothesis.example(shape=(3, 4, 8), bookkeeping=False, norm=True, remat=True)
def test_ghost_equals_vmap_with_remat_and_bookkeeping(
  shape, bookkeeping, norm, remat
):
  # Rematerialising the scanned blocks recomputes the same operations: the
  # ghost method with remat equals the exact vmap path without it, and
  # every parameter is still ghosted; so does book-keeping over scanned
  # LayerNorms, with or without remat.
  loss_fn, params, x, y = _normed_case(norm, *shape)
  fn = optaxclip.clipped_grad(
    loss_fn,
    0.05,
    batch_argnums=(1, 2),
    bookkeeping=bookkeeping,
    remat=_NormedBlock if remat else None,
  )
  if remat:
    assert not fn.plan(params, x, y).fallback
  _assert_same(run_fast(fn, params, x, y), _normed_vmap(norm, *shape))


def test_remat_ghost_holds_less_than_a_plain_grad():
  # The scanned MLP blocks' intermediates (4x width, gelu's pieces) are most
  # of a plain jax.grad's memory; with the blocks rematerialised, the
  # two-pass ghost step holds less than the plain gradient without.
  loss_fn, params, x, y = _deep_case(8, 16, 32)

  def plain(p, x, y):
    return jax.grad(lambda p: loss_fn(p, x, y).mean())(p)

  def ghost(remat):
    fn = optaxclip.clipped_grad(loss_fn, 1.0, batch_argnums=(1, 2), remat=remat)
    return _temp_bytes(lambda p, x, y: fn(p, x, y)[0], params, x, y)

  assert ghost(_MlpBlock) < 0.8 * _temp_bytes(plain, params, x, y) < ghost(None)


def test_remat_must_be_linen_module_classes():
  loss_fn = _normed_case(False, 2, 1, 3)[0]
  for bad in ("Block", nn.Dense(3), (), (_NormedBlock, int)):
    with pytest.raises(ValueError, match="clipped_grad: remat must be"):
      optaxclip.clipped_grad(loss_fn, 1.0, remat=bad)


# ---------------------------------------------------------------------------
# Exact norms beyond float32's range, without a per-layer choice: every layer
# writes its fast squares, and one top-level branch recomputes the exact ones
# (chunk by chunk of the batch) on the rare step some finite example's fast
# squares overflow. A per-layer choice would keep every layer's input and
# output gradient alive until that layer's choice is made (1163 against 980
# MiB on the example's medium transformer).
# ---------------------------------------------------------------------------


class _HugeBlock(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return nn.LayerNorm()(nn.Dense(h.shape[-1])(h)), None


class _Huge(nn.Module):
  """Every ghost path: an Embed, scanned Dense (Gram form: 3 positions,
  8 -> 8) and LayerNorm (its own per-example gradient) layers, a Dense by
  the direct form (8 -> 2). Without ``embed``, a Dense takes float inputs
  (flax's Embed does not take token ids split over an Explicit mesh).
  """

  embed: bool = True

  @nn.compact
  def __call__(self, tokens):
    h = nn.Embed(16, 8)(tokens) if self.embed else nn.Dense(8)(tokens)
    blocks = nn.scan(
      _HugeBlock,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=2,
    )
    h, _ = blocks()(h, None)
    return nn.Dense(2)(h)


_HUGE_BATCH = 4


@functools.cache
def _huge_case():
  """``params`` and, per variant, ``(params, tokens, scales, padding, clip)
  -> (grads, norms)`` compiled once. Example ``b``'s loss is multiplied by
  ``scales[b]``: its gradient in every layer (the Embed's included) is
  scaled so, the forward stays finite.
  """
  net = _Huge()
  params = _host_params(net, np.zeros((_HUGE_BATCH, 3), np.int32), seed=0)

  def loss(p, tokens, scales):
    out = net.apply(p, tokens)
    return scales * jnp.mean((out - 1.0) ** 2, axis=(1, 2))

  variants = {
    "two_pass": dict(),
    "bookkeeping": dict(bookkeeping=True),
    "microbatch_remat": dict(microbatch_size=2, remat=_HugeBlock),
    "vmap": dict(method="vmap"),
  }
  runners = {}
  for name, kwargs in variants.items():
    fn = optaxclip.clipped_grad(loss, 1.0, batch_argnums=(1, 2), **kwargs)

    def run(p, tokens, scales, padding, clip, fn=fn):
      return fn(p, tokens, scales, is_padding_example=padding, l2_clip=clip)

    runners[name] = fz.FastJit(run)
  return params, runners


def _tree_norm(tree) -> float:
  return float(fz.measure_tree([np.asarray(g) for g in jax.tree.leaves(tree)]))


@fz.examples(4, deadline=None)
@hypothesis.given(
  scales=st.lists(
    st.sampled_from((1e-3, 1.0, 1e20, 1e30, float("nan"))),
    min_size=_HUGE_BATCH,
    max_size=_HUGE_BATCH,
  ),
  variant=st.sampled_from(["two_pass", "bookkeeping", "microbatch_remat"]),
  l2=st.sampled_from((1e-2, 1.0, 1e3)),
  seed=st.integers(0, 2**16),
)
# One example needing the exact squares in the second chunk of two: the
# recomputed norms go back to the examples they belong to.
@hypothesis.example(
  scales=[1.0, 1e30, 1.0, float("nan")],
  variant="microbatch_remat",
  l2=1.0,
  seed=0,
)
def test_one_exact_branch_keeps_every_finite_example_exact(
  scales, variant, l2, seed
):
  """Ghost equals vmap on examples of any finite size (squared norms far
  beyond float32's range) beside non-finite ones, with two passes,
  book-keeping, microbatches and remat: the same per-example norms (Inf or
  NaN where vmap has them) and clipped sum; each finite example alone (the
  others masked as padding) contributes ``min(l2, norm)``, a non-finite one
  nothing.
  """
  params, runners = _huge_case()
  tokens = np.random.default_rng(seed).integers(0, 16, (_HUGE_BATCH, 3))
  tokens = tokens.astype(np.int32)
  scales = np.asarray(scales, np.float32)
  clip = np.float32(l2)
  none = np.zeros(_HUGE_BATCH, bool)
  g_got, n_got = runners[variant](params, tokens, scales, none, clip)
  g_want, n_want = runners["vmap"](params, tokens, scales, none, clip)
  n_got, n_want = np.asarray(n_got), np.asarray(n_want)
  finite = np.isfinite(n_want)
  np.testing.assert_array_equal(np.isfinite(n_got), finite)
  np.testing.assert_allclose(n_got[finite], n_want[finite], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    atol = 1e-5 * _HUGE_BATCH * l2 + fz.flush_atol(np.float32)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)
  for b in range(_HUGE_BATCH):
    alone = np.arange(_HUGE_BATCH) != b
    grads, _ = runners[variant](params, tokens, scales, alone, clip)
    want = min(l2, float(n_want[b])) if finite[b] else 0.0
    assert abs(_tree_norm(grads) - want) <= 1e-4 * want + 1e-30, (b, want)


def test_exact_branch_and_remat_under_a_batch_split_over_devices():
  # The batch split over 8 devices (Auto, then Explicit), the scanned blocks
  # rematerialised, one example's squared norm beyond float32's range: the
  # exact branch recomputes the whole (split) batch and gives one device's
  # numbers (without remat, the split two-pass step is test_clipped_grad's
  # test_batch_split_over_devices_under_jit; the exact branch without remat
  # is test_one_exact_branch_keeps_every_finite_example_exact's).
  net = _Huge(embed=False)
  tokens = _normal((8, 3, 4), 0)
  params = _host_params(net, tokens, seed=0)
  scales = np.ones(8, np.float32)
  scales[5] = 1e30

  def loss(p, tokens, scales):
    out = net.apply(p, tokens)
    return scales * jnp.mean((out - 1.0) ** 2, axis=(1, 2))

  kwargs = dict(batch_argnums=(1, 2))
  want = run_fast(
    optaxclip.clipped_grad(loss, 1.0, method="vmap", **kwargs),
    params,
    tokens,
    scales,
  )
  fn = optaxclip.clipped_grad(loss, 1.0, remat=(_HugeBlock,), **kwargs)
  assert not fn.plan(params, tokens, scales).fallback
  types = jax.sharding.AxisType
  for kind in (types.Auto, types.Explicit):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    ts, ss = jax.device_put(tokens, data), jax.device_put(scales, data)
    with jax.set_mesh(mesh):
      got = run_fast(fn, params, ts, ss)
    assert np.all(np.isfinite(np.asarray(got[1]))), got[1]
    _assert_same(got, want)


def test_exact_norms_cost_no_layer_activations():
  # The example's transformer at a small size (batch 16, vocab 512): the
  # two-pass ghost step holds under 0.6 logits-sized buffers more than a
  # plain jax.grad (0.83 with a per-layer choice between fast and exact
  # squares, 0.42 with one branch after the backward pass).
  transformer = load_script("examples/dp_transformer.py")
  size = dict(vocab=512, length=8, width=32, heads=2, layers=2)
  model = transformer.Transformer(**size)
  tokens = jax.ShapeDtypeStruct((16, size["length"] + 1), jnp.int32)
  params = _param_shapes(model, tokens)
  loss_fn = transformer.per_example_loss(model)
  logits = 16 * size["length"] * size["vocab"] * 4

  def plain(p, t):
    return jax.grad(lambda p: loss_fn(p, t).mean())(p)

  fn = optaxclip.clipped_grad(loss_fn, 1.0)
  extra = _temp_bytes(lambda p, t: fn(p, t)[0], params, tokens)
  extra -= _temp_bytes(plain, params, tokens)
  assert extra < 0.6 * logits, extra / logits
