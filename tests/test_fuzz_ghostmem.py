"""Properties of the ghost method's compiled memory (XLA memory analysis).

The two-pass ghost step holds what a plain ``jax.grad`` holds: on a model
whose logits dominate the activations, its temporary memory stays within a
small share of one logits-sized buffer of the plain gradient's. (It used to
hold one more: its second backward pass ran inside the non-finite
``lax.cond``, whose operands, the forward's residuals, XLA keeps whole for
the branch, so the logits' cotangent could not overwrite the softmax as in a
plain ``jax.grad``.)
"""

import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import optax
import pytest

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
  # these models), for a fifth of the compile time.
  compiled = compile_fast(jax.jit(fn).lower(*args))
  return compiled.memory_analysis().temp_size_in_bytes


@fz.examples(2, deadline=None)
@hypothesis.given(
  batch=st.sampled_from([8, 16]),
  length=st.sampled_from([4, 8]),
  vocab=st.sampled_from([1024, 2048]),
)
def test_two_pass_ghost_holds_no_extra_logits_buffer(batch, length, vocab):
  net = _Readout(vocab)
  x = _normal((batch, length, 8), 0)
  y = np.random.default_rng(1).integers(0, vocab, (batch, length), np.int32)
  params = jax.jit(net.init)(jax.random.PRNGKey(2), x[:1])  # one compile

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


def _normed_case(norm, batch, length, width):
  x, y = _normal((batch, length, width), 0), _normal((batch, length, 4), 1)
  net = _Normed(norm)
  params = jax.jit(net.init)(jax.random.PRNGKey(2), x[:1])  # one compile

  def loss_fn(p, x, y):
    return ((net.apply(p, x) - y) ** 2).mean(axis=(1, 2))

  return loss_fn, params, x, y


@fz.examples(2, deadline=None)
@hypothesis.given(
  batch=st.sampled_from([2, 3]),
  length=st.sampled_from([1, 4]),
  width=st.sampled_from([3, 8]),
)
def test_bookkeeping_with_scanned_layernorms_equals_vmap(batch, length, width):
  # Book-keeping keeps a LayerNorm's per-example gradient (not its input
  # and output gradient) and sums it with the clip factors: exact.
  loss_fn, params, x, y = _normed_case(True, batch, length, width)
  out = {}
  for method, bookkeeping in (("ghost", True), ("vmap", False)):
    fn = optaxclip.clipped_grad(
      loss_fn,
      0.05,
      batch_argnums=(1, 2),
      method=method,
      bookkeeping=bookkeeping,
    )
    out[method] = run_fast(fn, params, x, y)
  np.testing.assert_allclose(out["ghost"][1], out["vmap"][1], rtol=1e-5)
  want = jax.tree.leaves(out["vmap"][0])
  scale = max(float(np.max(np.abs(w))) for w in want)
  for got, w in zip(jax.tree.leaves(out["ghost"][0]), want):
    assert float(np.max(np.abs(got - w))) <= 1e-5 * scale


def test_bookkeeping_memory_of_scanned_layernorms():
  # Under nn.scan what book-keeping keeps of a layer adds to every layer's
  # residuals. Of a LayerNorm it keeps B x 2 width floats, not its input and
  # output gradient (2 x B x T x width): adding the LayerNorms to the
  # model costs book-keeping about 2 activations more than it costs a plain
  # jax.grad (their inputs, kept for their per-example gradients); keeping
  # the input and output gradient cost 6.
  def temps(norm):
    loss_fn, params, x, y = _normed_case(norm, 16, 32, 64)

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
  x, y = _normal((batch, length, width), 0), _normal((batch, length, 4), 1)
  net = _Deep()
  params = jax.jit(net.init)(jax.random.PRNGKey(2), x[:1])  # one compile

  def loss_fn(p, x, y):
    return ((net.apply(p, x) - y) ** 2).mean(axis=(1, 2))

  return loss_fn, params, x, y


def _assert_same(got, want):
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
  leaves = jax.tree.leaves(want[0])
  scale = max(float(np.max(np.abs(w))) for w in leaves)
  for g, w in zip(jax.tree.leaves(got[0]), leaves):
    assert float(np.max(np.abs(g - w))) <= 1e-5 * scale


@fz.examples(2, deadline=None)
@hypothesis.given(
  batch=st.sampled_from([2, 3]),
  length=st.sampled_from([1, 4]),
  width=st.sampled_from([3, 8]),
  bookkeeping=st.booleans(),
  norm=st.booleans(),
)
def test_remat_keeps_ghost_exact(batch, length, width, bookkeeping, norm):
  # Rematerialising the scanned blocks recomputes the same operations: the
  # ghost method with remat equals the exact vmap path without it, and
  # every parameter is still ghosted.
  loss_fn, params, x, y = _normed_case(norm, batch, length, width)
  kwargs = dict(batch_argnums=(1, 2))
  fn = optaxclip.clipped_grad(
    loss_fn, 0.05, bookkeeping=bookkeeping, remat=_NormedBlock, **kwargs
  )
  ref = optaxclip.clipped_grad(loss_fn, 0.05, method="vmap", **kwargs)
  assert not fn.plan(params, x, y).fallback
  _assert_same(run_fast(fn, params, x, y), run_fast(ref, params, x, y))


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


def test_remat_under_a_batch_split_over_devices():
  loss_fn, params, x, y = _normed_case(True, 8, 4, 8)
  want = run_fast(
    optaxclip.clipped_grad(loss_fn, 0.05, batch_argnums=(1, 2), method="vmap"),
    params,
    x,
    y,
  )
  fn = optaxclip.clipped_grad(
    loss_fn, 0.05, batch_argnums=(1, 2), remat=(_NormedBlock,)
  )
  types = jax.sharding.AxisType
  for kind in (types.Auto, types.Explicit):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    xs, ys = jax.device_put(x, data), jax.device_put(y, data)
    with jax.set_mesh(mesh):
      _assert_same(run_fast(fn, params, xs, ys), want)


def test_remat_must_be_linen_module_classes():
  loss_fn = _normed_case(False, 2, 1, 3)[0]
  for bad in ("Block", nn.Dense(3), (), (_NormedBlock, int)):
    with pytest.raises(ValueError, match="clipped_grad: remat must be"):
      optaxclip.clipped_grad(loss_fn, 1.0, remat=bad)
