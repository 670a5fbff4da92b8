"""clip_per_example: per-example clipping, noise, adaptive clip (DP-SGD)."""

import functools
import math

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from fast_compile import compile_fast
from fast_compile import run_fast
import np_refs
import optaxclip
from optaxclip import _per_example

SHAPES = {"w": (3, 2), "b": (2,), "s": ()}


def _batch(seed, batch=6, scale=1.0, shapes=SHAPES):
  rng = np.random.default_rng(seed)
  tree = {
    k: (scale * rng.normal(size=(batch, *s))).astype(np.float32)
    for k, s in shapes.items()
  }
  return tree


def _np_example_norms(tree):
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
  batch = leaves[0].shape[0]
  return np.sqrt(sum(np.sum(x.reshape(batch, -1) ** 2, axis=1) for x in leaves))


def _np_clip(tree, clip, scope):
  """Reference: the sum of the clipped examples, and per-example flags."""
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
  batch, k = leaves[0].shape[0], len(leaves)
  if scope == "global":
    norms = _np_example_norms(tree)
    factor = np.minimum(1.0, clip / np.maximum(norms, 1e-300))
    factors = [factor] * k
  else:
    limit = clip / math.sqrt(k)
    factors = []
    for x in leaves:
      n = np.sqrt(np.sum(x.reshape(batch, -1) ** 2, axis=1))
      factors.append(np.minimum(1.0, limit / np.maximum(n, 1e-300)))
  sums = [np.tensordot(f, x, axes=1) for f, x in zip(factors, leaves)]
  clipped = np.any([f < 1 for f in factors], axis=0)
  treedef = jax.tree.structure(tree)
  return jax.tree.unflatten(treedef, sums), clipped


def _state(tx, tree):
  return tx.init(jax.tree.map(lambda x: x[0], tree))


def _clip_and_sum(tree, clip, scope, reduce):
  tx = optaxclip.clip_per_example(clip, scope=scope, reduce=reduce)
  return tx.update(tree, _state(tx, tree))


class NumbersTest(chex.TestCase):
  # One compiled program per (scope, reduce): the data and the clip norm are
  # arguments, so the examples do not recompile.
  @chex.variants(with_jit=True, without_jit=True)
  @hypothesis.settings(max_examples=6)
  @hypothesis.given(
    seed=st.integers(0, 2**16),
    clip=st.sampled_from([0.0, 0.3, 1.0, 2.5, 1e6]),
    scope=st.sampled_from(["global", "leaf"]),
    reduce=st.sampled_from(["mean", "sum"]),
  )
  def test_matches_numpy(self, seed, clip, scope, reduce):
    tree = _batch(seed)
    run = self.variant(_clip_and_sum, static_argnames=("scope", "reduce"))
    out, state = run(tree, np.float32(clip), scope=scope, reduce=reduce)
    want, clipped = _np_clip(tree, clip, scope)
    batch = 6
    if reduce == "mean":
      want = jax.tree.map(lambda x: x / batch, want)
    chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal_shapes(out, jax.tree.map(lambda x: x[0], tree))
    norms = _np_example_norms(tree)
    np.testing.assert_allclose(state.norm, norms.mean(), rtol=1e-5)
    np.testing.assert_allclose(state.clip_fraction, clipped.mean(), rtol=1e-6)
    np.testing.assert_allclose(state.clip_norm, clip, rtol=1e-6)
    if scope == "global":
      np.testing.assert_allclose(
        state.clipped_norm, np.minimum(norms, clip).mean(), rtol=1e-5
      )


def test_matches_optax():
  tree = _batch(1, batch=8, scale=2.0)
  leaves = jax.tree.leaves(tree)

  @jax.jit
  def both(clip):
    ours = {
      scope: _clip_and_sum(tree, clip, scope, "sum")
      for scope in ("global", "leaf")
    }
    theirs = {
      "global": optax.per_example_global_norm_clip(leaves, clip),
      "leaf": optax.per_example_layer_norm_clip(leaves, clip),
    }
    return ours, theirs

  for clip in (0.5, 2.0, 10.0):
    ours, theirs = both(np.float32(clip))
    for scope in ours:
      chex.assert_trees_all_close(
        jax.tree.leaves(ours[scope][0]), theirs[scope][0], rtol=1e-5, atol=1e-6
      )
    np.testing.assert_allclose(
      ours["global"][1].clip_fraction * 8, theirs["global"][1]
    )


def test_low_precision_leaves_and_huge_gradients():
  tree = {
    "w": jnp.full((4, 300), 3.0, jnp.bfloat16),
    "b": jnp.full((4, 2), 1e30, jnp.float32),
  }
  tx = optaxclip.clip_per_example(1.0, reduce="sum")
  out, state = jax.jit(tx.update)(tree, _state(tx, tree))
  assert out["w"].dtype == jnp.bfloat16 and out["b"].dtype == jnp.float32
  # Every example is dominated by b = (1e30, 1e30): clipped to (1, 1)/sqrt(2).
  np.testing.assert_allclose(out["b"], np.full(2, 4 / math.sqrt(2)), rtol=1e-5)
  np.testing.assert_allclose(state.norm, 1e30 * math.sqrt(2), rtol=1e-5)
  assert np.all(np.isfinite(np.asarray(out["w"], np.float32)))


def test_gradient_through_update_is_finite_at_zero_and_on_the_limit():
  @jax.jit
  @jax.grad
  def grad(tree):
    tx = optaxclip.clip_per_example(5.0)
    out, _ = tx.update(tree, _state(tx, tree))
    return jnp.sum(out["w"])

  for w in ([[0.0, 0.0], [3.0, 4.0]], [[3.0, 4.0], [30.0, 40.0]]):
    g = grad({"w": jnp.array(w)})
    assert np.all(np.isfinite(g["w"])), w


# ------------------------------------------------------------------- noise


def test_noise_std_is_noise_multiplier_times_clip():
  rng = np.random.default_rng(0)
  tree = {"w": rng.normal(size=(4, 20000)).astype(np.float32)}
  clean, _ = _np_clip(tree, 0.5, "global")

  @jax.jit
  def noised(tree):
    out = {}
    for reduce in ("sum", "mean"):
      tx = optaxclip.clip_per_example(
        0.5, reduce=reduce, noise_multiplier=1.5, seed=3
      )
      out[reduce] = tx.update(tree, _state(tx, tree))[0]["w"]
    return out

  out = noised(tree)
  for reduce, divisor in (("sum", 1), ("mean", 4)):
    noise = np.asarray(out[reduce], np.float64) - clean["w"] / divisor
    np.testing.assert_allclose(noise.std(), 1.5 * 0.5 / divisor, rtol=0.03)
    assert abs(noise.mean()) < 4 * 0.75 / divisor / math.sqrt(20000)


def test_noise_is_fresh_each_step_and_follows_the_seed():
  tree = _batch(0)
  make = functools.partial(
    optaxclip.clip_per_example, 1.0, noise_multiplier=1.0
  )
  step = jax.jit(make().update)  # the seed only sets the initial state.

  def two_steps(seed):
    state = _state(make(seed=seed), tree)
    a, state = step(tree, state)
    b, _ = step(tree, state)
    return a, b

  a, b = two_steps(0)
  a2, _ = two_steps(0)
  c, _ = two_steps(1)
  chex.assert_trees_all_equal(a, a2)
  assert not np.allclose(a["w"], b["w"])
  assert not np.allclose(a["w"], c["w"])


# ---------------------------------------------------------------- adaptive


def test_adaptive_clip_norm_follows_the_geometric_rule():
  trees = [_batch(s, batch=10, scale=1.0 + s) for s in range(4)]
  tx = optaxclip.clip_per_example(2.0, target_quantile=0.7, quantile_lr=0.3)
  step = jax.jit(tx.update)
  state = _state(tx, trees[0])
  clip = 2.0
  for tree in trees:
    out, state = step(tree, state)
    want, clipped = _np_clip(tree, clip, "global")
    chex.assert_trees_all_close(
      out, jax.tree.map(lambda x: x / 10, want), rtol=1e-5, atol=1e-6
    )
    unclipped = 1.0 - clipped.mean()
    clip = clip * math.exp(-0.3 * (unclipped - 0.7))
    np.testing.assert_allclose(state.clip_norm, clip, rtol=1e-5)
    np.testing.assert_allclose(state.clip_fraction, clipped.mean())


def test_adaptive_clip_norm_tracks_the_target_quantile():
  tx = optaxclip.clip_per_example(0.2, target_quantile=0.3, quantile_lr=0.5)
  step = jax.jit(tx.update)
  batches = [_batch(s, batch=64) for s in range(80)]
  state = _state(tx, batches[0])
  for tree in batches:
    _, state = step(tree, state)
  # From 0.2, C climbs to the 30th percentile of the per-example norms.
  norms = np.concatenate([_np_example_norms(t) for t in batches])
  np.testing.assert_allclose(state.clip_norm, np.quantile(norms, 0.3), rtol=0.1)


def test_noise_split_between_count_and_sum():
  # Andrew et al. 2021, Theorem 1: z**-2 = z_sum**-2 + (2 sigma_b)**-2.
  for batch, z in ((100, 1.0), (256, 0.7), (4096, 3.0)):
    sigma_b = float(_per_example.count_noise_std(batch, z))
    z_sum = float(_per_example.sum_noise_multiplier(z, sigma_b))
    np.testing.assert_allclose(sigma_b, batch / 20, rtol=1e-6)
    np.testing.assert_allclose(
      z_sum**-2 + (2 * sigma_b) ** -2, z**-2, rtol=1e-5
    )
    assert z_sum > z
  assert float(_per_example.sum_noise_multiplier(0.0, 0.0)) == 0.0


def test_adaptive_noise_on_count_and_sum():
  batch, z, clip = 40, 2.0, 1.0
  # Half the examples (norm 0.5) unclipped, half (norm 3) clipped: b = 0.5.
  w = np.zeros((batch, 500), np.float32)
  w[: batch // 2, 0] = 0.5
  w[batch // 2 :, 0] = 3.0
  tree = {"w": w}
  tx = optaxclip.clip_per_example(
    clip, reduce="sum", noise_multiplier=z, target_quantile=0.5, quantile_lr=0.2
  )
  state = _state(tx, tree)
  keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(300))
  states = jax.vmap(lambda k: state._replace(key=k))(keys)
  outs, new = run_fast(jax.vmap(tx.update, in_axes=(None, 0)), tree, states)
  # Noised unclipped share b = 0.5 - log(C'/C) / lr: its noise has standard
  # deviation sigma_b / B = 1/20.
  shares = 0.5 - np.log(np.asarray(new.clip_norm) / clip) / 0.2
  np.testing.assert_allclose(shares.mean(), 0.5, atol=0.015)
  np.testing.assert_allclose(shares.std(), 1 / 20, rtol=0.12)
  sigma_b = batch / 20
  z_sum = (z**-2 - (2 * sigma_b) ** -2) ** -0.5
  sum_noise = np.asarray(outs["w"])[:, 1:]  # the clean sum is 0 there.
  np.testing.assert_allclose(sum_noise.std(), z_sum * clip, rtol=0.02)


# ---------------------------------------------------------------- axis_name


def test_data_parallel_axis_equals_one_device():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  tree = _batch(5, batch=32, scale=0.3)
  kwargs = dict(noise_multiplier=0.8, seed=7, target_quantile=0.6)

  def two_steps(tree, axis_name=None):
    out = {}
    for scope in ("global", "leaf"):
      tx = optaxclip.clip_per_example(
        1.0, scope=scope, axis_name=axis_name, **kwargs
      )
      state = _state(tx, tree)
      first, state = tx.update(tree, state)
      second, state = tx.update(jax.tree.map(lambda x: -2 * x, tree), state)
      out[scope] = (first, second, state)
    return out

  want = run_fast(two_steps, tree)
  specs = jax.tree.map(lambda _: P("data"), tree)
  sharded = jax.tree.map(
    lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))), tree
  )
  got = run_fast(
    jax.shard_map(
      functools.partial(two_steps, axis_name="data"),
      mesh=mesh,
      in_specs=(specs,),
      out_specs=P(),
    ),
    sharded,
  )
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  for scope in want:  # the clipping and the adaptation did something.
    assert float(want[scope][2].clip_fraction) > 0, scope
    assert float(want[scope][2].clip_norm) != 1.0, scope


def test_batch_sharded_under_jit_equals_one_device():
  # No shard_map: per-example gradients whose batch axis is split over a
  # "data" mesh axis and whose kernel is also split over "fsdp" (Auto, then
  # Explicit axis types), under plain jit; XLA reduces across devices and
  # gathers nothing.
  types = jax.sharding.AxisType
  meshes = [
    jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(t, t))
    for t in (types.Auto, types.Explicit)
  ]
  tree = _batch(2, batch=32, scale=0.5, shapes={"w": (8, 2), "b": (2,)})
  specs = {"w": P("data", "fsdp"), "b": P("data")}
  tx = optaxclip.clip_per_example(
    1.0, scope="leaf", noise_multiplier=0.5, target_quantile=0.5
  )
  state = _state(tx, tree)
  want = run_fast(tx.update, tree, state)
  for mesh in meshes:
    sharded = jax.tree.map(
      lambda x, s, mesh=mesh: jax.device_put(x, NamedSharding(mesh, s)),
      tree,
      specs,
    )
    with jax.set_mesh(mesh):
      compiled = compile_fast(jax.jit(tx.update).lower(sharded, state))
      got = compiled(sharded, state)
    assert " all-gather" not in compiled.as_text()
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


# -------------------------------------------------------- jit, chain, stats


def test_chained_with_adam_jitted_without_retrace_or_host_transfer():
  params = jax.tree.map(lambda x: jnp.zeros(x.shape[1:]), _batch(0))
  tx = optax.chain(
    optaxclip.clip_per_example(1.0, noise_multiplier=0.5, target_quantile=0.5),
    optax.adam(1e-2),
  )
  traces = []

  @jax.jit
  def step(params, state, grads):
    traces.append(1)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  grads = [jax.device_put(_batch(s)) for s in range(3)]
  params, state = step(params, state, grads[0])
  with jax.transfer_guard("disallow"):
    for g in grads[1:]:
      params, state = step(params, state, g)
  assert len(traces) == 1
  keys = set(optaxclip.stats(state))
  assert keys == {
    "clip_per_example/" + f for f in np_refs.PER_EXAMPLE_STAT_FIELDS
  }
  chex.assert_trees_all_equal_shapes(
    params, jax.tree.map(lambda x: jnp.zeros(x.shape[1:]), _batch(0))
  )


def test_empty_tree_passes_through():
  tx = optaxclip.clip_per_example(1.0)
  out, state = tx.update({}, tx.init({}))
  assert out == {} and float(state.clip_norm) == 1.0


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(l2_clip=-1.0), ValueError, "l2_clip"),
    (dict(l2_clip=1.0, scope="tensor"), ValueError, "scope"),
    (dict(l2_clip=1.0, reduce="max"), ValueError, "reduce"),
    (dict(l2_clip=1.0, noise_multiplier=-0.1), ValueError, "noise_multiplier"),
    (
      dict(l2_clip=1.0, noise_multiplier=float("nan")),
      ValueError,
      "noise_multiplier",
    ),
    (dict(l2_clip=1.0, target_quantile=1.5), ValueError, "target_quantile"),
    (dict(l2_clip=1.0, quantile_lr=-1.0), ValueError, "quantile_lr"),
    (dict(l2_clip=1.0, seed=1.5), TypeError, "seed"),
    (dict(l2_clip=1.0, axis_name=0), TypeError, "axis_name"),
  ],
)
def test_bad_hyperparameters_fail_at_construction(kwargs, error, match):
  with pytest.raises(error, match=match):
    optaxclip.clip_per_example(**kwargs)


def test_bad_trees_fail_naming_the_leaf():
  tx = optaxclip.clip_per_example(1.0)
  state = tx.init(None)
  with pytest.raises(ValueError, match=r"\['s'\].*batch axis"):
    tx.update({"w": jnp.ones((4, 2)), "s": jnp.ones(())}, state)
  with pytest.raises(ValueError, match=r"\['b'\]: 3"):
    tx.update({"w": jnp.ones((4, 2)), "b": jnp.ones((3,))}, state)
  with pytest.raises(TypeError, match=r"\['i'\]"):
    tx.update({"i": jnp.ones((4, 2), jnp.int32)}, state)
  tx = optaxclip.clip_per_example(
    1.0, noise_multiplier=2.0, target_quantile=0.5
  )
  with pytest.raises(ValueError, match="too small"):
    tx.update({"w": jnp.ones((16, 2))}, tx.init(None))


# ------------------------------------------------- non-finite, inf, edges


@pytest.mark.parametrize("scope", ["global", "leaf"])
def test_nonfinite_example_is_zeroed_and_counted(scope):
  tx = optaxclip.clip_per_example(1.0, scope=scope, reduce="sum")
  step = jax.jit(tx.update)
  for bad in (float("nan"), float("inf"), -float("inf")):
    tree = _batch(3, batch=5)
    tree["w"][1, 0, 0] = bad
    tree["b"][1] = 1e6  # must not leak into the sum through the other leaf
    out, state = step(tree, _state(tx, tree))
    rest = jax.tree.map(lambda x: np.delete(x, 1, axis=0), tree)
    want, clipped = _np_clip(rest, 1.0, scope)
    chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)
    assert float(state.nonfinite) == 1.0
    np.testing.assert_allclose(state.clip_fraction, (clipped.sum() + 1) / 5)
    assert np.isfinite(float(state.norm)) and np.isfinite(
      float(state.clipped_norm)
    )
    assert optaxclip.stats(state)["clip_per_example/nonfinite"] == 1.0


def test_nonfinite_examples_under_noise_and_adaptation_stay_finite():
  tree = _batch(4, batch=32)
  tree["w"][:3] = np.nan
  tx = optaxclip.clip_per_example(
    1.0, noise_multiplier=0.5, target_quantile=0.5
  )
  out, state = jax.jit(tx.update)(tree, _state(tx, tree))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out))
  assert float(state.nonfinite) == 3.0 and np.isfinite(float(state.clip_norm))


def test_infinite_clip_norm_means_no_clipping():
  tree = _batch(5, batch=4, scale=100.0)
  for scope in ("global", "leaf"):
    tx = optaxclip.clip_per_example(float("inf"), scope=scope, reduce="sum")
    out, state = jax.jit(tx.update)(tree, _state(tx, tree))
    chex.assert_trees_all_close(
      out, jax.tree.map(lambda x: x.sum(0), tree), rtol=1e-5
    )
    assert float(state.clip_fraction) == 0.0
    np.testing.assert_allclose(state.clipped_norm, state.norm, rtol=1e-6)
  with pytest.raises(ValueError, match="l2_clip must be finite"):
    optaxclip.clip_per_example(float("inf"), noise_multiplier=1.0)
  # A traced zero noise multiplier with an infinite clip: no 0 * inf = NaN.
  inject = optax.inject_hyperparams(optaxclip.clip_per_example)(
    l2_clip=float("inf"), noise_multiplier=0.0
  )
  out, _ = jax.jit(inject.update)(
    tree, inject.init(jax.tree.map(lambda x: x[0], tree))
  )
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out))


@pytest.mark.parametrize("scope", ["global", "leaf"])
def test_huge_examples_are_clipped_along_their_direction(scope):
  # Clip factors near or below 2**-126 would flush to zero: the example
  # must still enter the sum at norm C, along its own direction.
  tx = optaxclip.clip_per_example(1e-3, scope=scope, reduce="sum")
  step = jax.jit(tx.update)
  for big in (3e37, 1e30, 1e20):
    tree = {
      "w": np.array([[big, -big], [0.3, 0.4]], np.float32),
      "b": np.array([[0.0], [0.0]], np.float32),
    }
    out, state = step(tree, _state(tx, tree))
    limit = 1e-3 if scope == "global" else 1e-3 / math.sqrt(2)
    want = (
      np.array([1.0, -1.0]) / math.sqrt(2) * limit
      + np.array([0.3, 0.4]) * limit / 0.5
    )
    np.testing.assert_allclose(out["w"], want, rtol=1e-5)
    assert float(state.clip_fraction) == 1.0
