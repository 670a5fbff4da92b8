"""clipped_grad: ghost norms against the exact per-example path, and the DP
surface (padding, per-layer clip norms, automatic clipping, non-finite
examples, sensitivity, dp_noise).
"""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from example_runner import load_script
from fast_compile import compile_fast
from fast_compile import run_fast
import np_refs
import optaxclip

ROOT = pathlib.Path(__file__).resolve().parents[1]
dp_transformer = load_script("examples/dp_transformer.py")


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(nn.tanh(nn.Dense(16)(nn.tanh(nn.Dense(8)(x)))))[..., 0]


class Misc(nn.Module):
  """Conv, RMSNorm, DenseGeneral over two axes, Einsum, a tied embedding
  (``attend``: falls back) and a bare ``self.param`` (falls back).
  """

  @nn.compact
  def __call__(self, tokens, image):
    embed = nn.Embed(12, 6)
    h = embed(tokens)  # (B, T, 6)
    h = nn.RMSNorm()(h)
    h = h.reshape(h.shape[0], h.shape[1], 2, 3)
    h = nn.DenseGeneral(5, axis=(-2, -1))(h)  # (B, T, 5)
    h = nn.Einsum((5, 6), "btd,de->bte")(h)
    logits = embed.attend(h).mean(axis=(1, 2))
    c = nn.Conv(3, (3, 3))(image).mean(axis=(1, 2, 3))
    w = self.param("w", nn.initializers.normal(), (1,))
    return logits * w[0] + c


def _mlp_case():
  model = MLP()
  x = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
  y = np.linspace(-1, 1, 8).astype(np.float32)
  params = model.init(jax.random.PRNGKey(0), x)

  def loss(p, x, y):
    return (model.apply(p, x) - y) ** 2

  return loss, params, (x, y)


def _transformer_case():
  size = dp_transformer.SIZES["tiny"]
  model = dp_transformer.Transformer(**size)
  # Made in two cheap compiles (eagerly, op by op, they took 15 s).
  tokens = run_fast(
    lambda key: dp_transformer.synthetic_tokens(
      key, 8, size["vocab"], size["length"]
    ),
    jax.random.PRNGKey(1),
  )
  params = run_fast(model.init, jax.random.PRNGKey(0), tokens[:, :-1])
  return dp_transformer.per_example_loss(model), params, (tokens,)


def _misc_case():
  model = Misc()
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 12, size=(6, 4))
  image = rng.normal(size=(6, 5, 5, 2)).astype(np.float32)
  params = run_fast(model.init, jax.random.PRNGKey(0), tokens, image)

  def loss(p, tokens, image):
    return model.apply(p, tokens, image) ** 2

  return loss, params, (tokens, image)


def _nnx_case():
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(10, 6, rngs=rngs)
      self.norm = nnx.LayerNorm(6, rngs=rngs)  # not ghosted: exact path
      self.out = nnx.Linear(6, 1, rngs=rngs)

    def __call__(self, tokens):
      return self.out(jnp.tanh(self.norm(self.embed(tokens))))[..., 0].sum(1)

  graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
  tokens = np.random.default_rng(2).integers(0, 10, size=(6, 4))

  def loss(p, tokens):
    return nnx.merge(graphdef, p)(tokens) ** 2

  return loss, params, (tokens,)


CASES = {
  "nnx": _nnx_case,
  "mlp": _mlp_case,
  "transformer": _transformer_case,
  "misc": _misc_case,
}


def _per_example_grads(loss, params, batch):
  """Per-example gradients by vmap(grad) in the test (float64 leaves)."""

  def one(*example):
    ex = [e[None] for e in example]
    return jax.grad(lambda p: loss(p, *ex)[0])(params)

  per_example = run_fast(jax.vmap(one), *batch)
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(per_example)]


def _oracle(
  loss, params, batch, clip, normalize=False, gamma=0.01, leaves=None
):
  """Per-example gradients (``leaves``, else computed), clipped in NumPy.
  Pass ``leaves`` to clip one batch's gradients at several norms without
  compiling the vmap(grad) program again.
  """
  if leaves is None:
    leaves = _per_example_grads(loss, params, batch)
  b = leaves[0].shape[0]
  norms = np.sqrt(sum(np.sum(x.reshape(b, -1) ** 2, axis=1) for x in leaves))
  if normalize:
    factor = clip / (norms + gamma)
  else:
    factor = np.minimum(1.0, clip / np.maximum(norms, 1e-300))
  sums = [np.tensordot(factor, x, axes=1) for x in leaves]
  return sums, norms, leaves


def _close(got, want, rtol=1e-5):
  """Each element within ``rtol`` of the largest element of the whole sum
  (a leaf whose gradient is zero in theory, such as attention's key bias,
  holds rounding noise only).
  """
  got = jax.tree.leaves(got)
  assert len(got) == len(want)
  scale = max(np.max(np.abs(w)) for w in want)
  for g, w in zip(got, want):
    err = np.max(np.abs(np.asarray(g, np.float64) - w))
    assert err <= rtol * scale, (err, scale)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_ghost_equals_vmap_and_the_oracle(case):
  loss, params, batch = CASES[case]()
  _, norms0, leaves = _oracle(loss, params, batch, 1.0)
  clip = float(np.median(norms0))  # about half the examples clipped
  want, want_norms, _ = _oracle(loss, params, batch, clip, leaves=leaves)
  # The oracle is itself a vmap reference: the transformer (the slowest to
  # compile) checks the ghost method (two passes, and book-keeping's one)
  # against it only.
  methods = [("ghost", False), ("ghost", True)]
  if case != "transformer":
    methods.append(("vmap", False))
  for method, bookkeeping in methods:
    fn = optaxclip.clipped_grad(
      loss,
      clip,
      batch_argnums=tuple(range(1, 1 + len(batch))),
      method=method,
      bookkeeping=bookkeeping,
    )
    grads, norms = run_fast(fn, params, *batch)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
    _close(grads, want)


def test_ghost_plan_names_what_falls_back():
  loss, params, batch = _misc_case()
  plan = optaxclip.clipped_grad(loss, 1.0, batch_argnums=(1, 2)).plan(
    params, *batch
  )
  assert sorted(plan.fallback) == [
    "['params']['Embed_0']['embedding']",  # tied: also used by attend
    "['params']['w']",  # a bare self.param
  ]
  assert "['params']['Conv_0']['kernel']" in plan.ghosted
  assert "['params']['DenseGeneral_0']['kernel']" in plan.ghosted
  assert "['params']['Einsum_0']['kernel']" in plan.ghosted
  assert "['params']['RMSNorm_0']['scale']" in plan.ghosted
  loss, params, batch = _transformer_case()
  plan = optaxclip.clipped_grad(loss, 1.0).plan(params, *batch)
  assert plan.fallback == []  # embeddings, attention, MLP, LayerNorm, scan
  loss, params, batch = _nnx_case()
  plan = optaxclip.clipped_grad(loss, 1.0).plan(params, *batch)
  assert sorted(plan.fallback) == [
    "['norm']['bias'].value",
    "['norm']['scale'].value",
  ]
  assert len(plan.ghosted) == 3  # nnx.Embed and nnx.Linear


@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_padding_nonfinite_per_layer_and_normalize(method):
  loss, params, (x, y) = _mlp_case()
  x = x.copy()
  x[2] = np.nan  # a non-finite example: left out, reported NaN
  pad = np.zeros(8, bool)
  pad[5] = True
  keep = np.array([i not in (2, 5) for i in range(8)])
  kept = (x[keep], y[keep])

  fn = optaxclip.clipped_grad(
    loss, 0.5, batch_argnums=(1, 2), method=method, microbatch_size=4
  )
  grads, norms = run_fast(
    lambda p, x, y, pad: fn(p, x, y, is_padding_example=pad), params, x, y, pad
  )
  want, want_norms, leaves = _oracle(loss, params, kept, 0.5)
  _close(grads, want)
  assert np.isnan(norms[2]) and norms[5] == 0
  np.testing.assert_allclose(norms[keep], want_norms, rtol=1e-5)

  # Automatic clipping (Bu et al. 2022): C / (|g| + gamma) for every example.
  fn = optaxclip.clipped_grad(
    loss, 0.5, batch_argnums=(1, 2), method=method, normalize=True, gamma=0.1
  )
  grads, _ = run_fast(
    lambda p, x, y, pad: fn(p, x, y, is_padding_example=pad), params, x, y, pad
  )
  want, _, _ = _oracle(
    loss, params, kept, 0.5, normalize=True, gamma=0.1, leaves=leaves
  )
  _close(grads, want)

  # Per-layer clip norms: a pytree prefix of the parameters.
  clips = {"params": {"Dense_0": 0.1, "Dense_1": 0.2, "Dense_2": 0.3}}
  fn = optaxclip.clipped_grad(loss, clips, batch_argnums=(1, 2), method=method)
  grads, _ = run_fast(fn, params, *kept)
  names = [
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
  ]
  b = leaves[0].shape[0]
  want = [None] * len(leaves)
  for layer, c in clips["params"].items():
    idx = [i for i, n in enumerate(names) if f"'{layer}'" in n]
    n = np.sqrt(sum(np.sum(leaves[i].reshape(b, -1) ** 2, 1) for i in idx))
    f = np.minimum(1.0, c / n)
    for i in idx:
      want[i] = np.tensordot(f, leaves[i], axes=1)
  _close(grads, want)
  assert fn.sensitivity.add_remove == pytest.approx(np.sqrt(0.14))
  assert fn.sensitivity.replace_one == pytest.approx(2 * np.sqrt(0.14))


def test_jit_traces_once_and_reduce_mean_and_aux():
  loss, params, (x, y) = _mlp_case()
  traces = []

  def loss_aux(p, x, y):
    traces.append(1)
    losses = loss(p, x, y)
    return losses, {"mean_loss": losses.mean()}

  fn = optaxclip.clipped_grad(
    loss_aux, 1.0, batch_argnums=(1, 2), reduce="mean", has_aux=True
  )
  step = jax.jit(fn)
  grads, norms, aux = step(params, x, y)
  n = len(traces)
  for s in (1, 2):
    step(params, x * s, y)
  assert len(traces) == n  # no retrace
  want, _, _ = _oracle(loss, params, (x, y), 1.0)
  _close(grads, [w / 8 for w in want])
  np.testing.assert_allclose(
    aux["mean_loss"], loss(params, x, y).mean(), rtol=1e-6
  )
  assert fn.sensitivity.divided_by_batch_size
  assert norms.shape == (8,)


def test_dp_noise_is_clip_per_example_on_the_clipped_sum():
  # One implementation of noise and the adaptive clip norm: dp_noise on
  # clipped_grad's sum equals clip_per_example on the per-example gradients.
  loss, params, batch = _mlp_case()
  kwargs = dict(noise_multiplier=0.3, target_quantile=0.5, seed=4)
  _, _, leaves = _oracle(loss, params, batch, 1.0)
  per_example = jax.tree.unflatten(
    jax.tree.structure(params), [x.astype(np.float32) for x in leaves]
  )
  ref = optaxclip.clip_per_example(0.2, **kwargs)
  tx = optaxclip.dp_noise(0.2, **kwargs)
  grad_fn = optaxclip.clipped_grad(loss, 0.2, batch_argnums=(1, 2))

  def both(params, per_example, *batch):
    # One program (compiled cheaply) rather than thousands of eager ops.
    sums, norms = grad_fn(params, *batch)
    return (
      ref.update(per_example, ref.init(params)),
      tx.update(sums, tx.init(params), example_norms=norms),
    )

  (want, ref_state), (got, state) = run_fast(both, params, per_example, *batch)
  _close(
    got, [np.asarray(w, np.float64) for w in jax.tree.leaves(want)], rtol=1e-4
  )
  for field in ("norm", "clipped_norm", "clip_fraction", "clip_norm"):
    np.testing.assert_allclose(
      getattr(state, field), getattr(ref_state, field), rtol=1e-5
    )
  assert set(optaxclip.stats(state)) == {
    "dp_noise/" + f for f in np_refs.PER_EXAMPLE_STAT_FIELDS
  }


def test_bad_arguments():
  loss, params, (x, y) = _mlp_case()
  with pytest.raises(ValueError, match="clipped_grad: l2_clip"):
    optaxclip.clipped_grad(loss, -1.0)
  with pytest.raises(ValueError, match="clipped_grad: method"):
    optaxclip.clipped_grad(loss, 1.0, method="fast")
  with pytest.raises(ValueError, match="batch_argnums"):
    optaxclip.clipped_grad(loss, 1.0, batch_argnums=0)
  fn = optaxclip.clipped_grad(
    loss, 1.0, batch_argnums=(1, 2), microbatch_size=3, method="vmap"
  )
  with pytest.raises(ValueError, match="microbatch_size must divide"):
    fn(params, x, y)
  fn = optaxclip.clipped_grad(loss, 1.0, batch_argnums=(1, 2))
  with pytest.raises(ValueError, match="leading axes differ"):
    fn(params, x, y[:4])
  with pytest.raises(ValueError, match="dp_noise: l2_clip must be finite"):
    optaxclip.dp_noise(float("inf"), noise_multiplier=1.0)


def test_batch_split_over_devices_under_jit():
  # The batch split over a "data" axis (Auto, then Explicit): the same
  # numbers as one device, and no activation is gathered (the only
  # all-gathers are of B values: the per-example squared norms, or which
  # example to pick in the rare non-finite branch).
  loss, params, (x, y) = _mlp_case()
  x = np.tile(x[:, None], (1, 3, 1))  # sequences (B, T, d)
  fn = optaxclip.clipped_grad(
    lambda p, x, y: loss(p, x, y[:, None]).mean(-1),
    0.5,
    batch_argnums=(1, 2),
  )
  want = run_fast(fn, params, x, y)
  types = jax.sharding.AxisType
  for kind in (types.Auto, types.Explicit):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("data")
    )
    xs, ys = jax.device_put(x, sharding), jax.device_put(y, sharding)
    with jax.set_mesh(mesh):
      compiled = compile_fast(jax.jit(fn).lower(params, xs, ys))
      got = compiled(params, xs, ys)
    for line in compiled.as_text().splitlines():
      if " all-gather(" in line:
        dims = line.split("=")[1].split("[")[1].split("]")[0]
        size = np.prod([int(d) for d in dims.split(",") if d])
        assert size <= 8, line  # B flags or per-example norms, no more
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    _close(
      got[0], [np.asarray(w, np.float64) for w in jax.tree.leaves(want[0])]
    )
