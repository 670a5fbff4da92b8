"""watch(): the update's and the parameters' norms and their ratio, against
float64 NumPy; the update passes through untouched.
"""

import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import fuzz_strategies as fz
import optaxclip


def _tree(seed, dtype=jnp.float32, scale=1.0):
  rng = np.random.default_rng(seed)
  tree = {
    "dense": {"kernel": rng.normal(size=(4, 3)), "bias": rng.normal(size=3)},
    "blocks": rng.normal(size=(5, 2, 3)),  # 5 stacked layers
  }
  return jax.tree.map(lambda x: jnp.asarray(x * scale, dtype), tree)


def _norm(tree):
  return float(
    np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in tree))
  )


def _leaves(tree):
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


class WatchTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_norms_and_ratio_and_identity(self):
    tx = optaxclip.watch()
    updates, params = _tree(0, scale=1e-3), _tree(1)
    out, state = self.variant(tx.update)(updates, tx.init(params), params)
    chex.assert_trees_all_equal(out, updates)
    u, p = _norm(_leaves(updates)), _norm(_leaves(params))
    np.testing.assert_allclose(float(state.update_norm), u, rtol=1e-6)
    np.testing.assert_allclose(float(state.param_norm), p, rtol=1e-6)
    np.testing.assert_allclose(float(state.update_to_param), u / p, rtol=1e-6)
    self.assertEqual(
      list(optaxclip.stats(state)),
      ["watch/update_norm", "watch/param_norm", "watch/update_to_param"],
    )

  @chex.variants(with_jit=True, without_jit=True)
  def test_leaf_stats_per_leaf_and_per_layer(self):
    tx = optaxclip.watch(
      leaf_stats=True, layer_axis={"blocks": 0, "dense": None}
    )
    updates, params = _tree(2, scale=1e-2), _tree(3)
    _, state = self.variant(tx.update)(updates, tx.init(params), params)
    logs = optaxclip.stats(state)
    u, p = updates, params
    want = {
      "blocks/0": (u["blocks"][0], p["blocks"][0]),
      "blocks/4": (u["blocks"][4], p["blocks"][4]),
      "dense/bias": (u["dense"]["bias"], p["dense"]["bias"]),
      "dense/kernel": (u["dense"]["kernel"], p["dense"]["kernel"]),
    }
    for name, (a, b) in want.items():
      ratio = _norm([a]) / _norm([b])
      np.testing.assert_allclose(
        float(logs[f"watch/update_to_param/{name}"]), ratio, rtol=2e-6
      )
      np.testing.assert_allclose(
        float(logs[f"watch/leaf_norm/{name}"]), _norm([a]), rtol=2e-6
      )
    ratios = [k for k in logs if k.startswith("watch/update_to_param/")]
    self.assertLen(ratios, 5 + 2)
    np.testing.assert_allclose(
      float(logs["watch/update_norm"]), _norm(_leaves(u)), rtol=2e-6
    )
    np.testing.assert_allclose(
      float(logs["watch/param_norm"]), _norm(_leaves(p)), rtol=2e-6
    )


def test_bfloat16_norms_accumulate_in_float32():
  shapes = {f"w{i}": (257,) for i in range(300)}
  rng = np.random.default_rng(0)
  params = {
    k: jnp.asarray(rng.normal(size=s), jnp.bfloat16) for k, s in shapes.items()
  }
  updates = jax.tree.map(lambda x: x * jnp.bfloat16(1e-3), params)
  tx = optaxclip.watch()
  _, state = jax.jit(tx.update)(updates, tx.init(params), params)
  np.testing.assert_allclose(
    float(state.param_norm), _norm(_leaves(params)), rtol=1e-5
  )
  np.testing.assert_allclose(
    float(state.update_norm), _norm(_leaves(updates)), rtol=1e-5
  )


def test_zero_params_and_non_finite_updates():
  tx = optaxclip.watch()
  zeros = {"w": jnp.zeros(3)}
  _, state = tx.update({"w": jnp.ones(3)}, tx.init(zeros), zeros)
  assert float(state.update_to_param) == np.inf
  _, state = tx.update(zeros, tx.init(zeros), zeros)
  assert float(state.update_to_param) == 0.0
  params = {"w": jnp.ones(3)}
  _, state = tx.update({"w": jnp.array([1.0, np.nan, 0.0])}, None, params)
  assert np.isnan(float(state.update_norm))
  assert np.isnan(float(state.update_to_param))
  _, state = tx.update({"w": jnp.array([1e30, 1e30, 0.0])}, None, params)
  np.testing.assert_allclose(float(state.update_norm), 1.41421356e30, 1e-6)


def test_overflow_safe_norms():
  tx = optaxclip.watch()
  big = {"w": jnp.full(4, 3e38)}
  _, state = tx.update({"w": jnp.full(4, 1e20)}, tx.init(big), big)
  assert float(state.param_norm) == np.inf  # 6e38: beyond float32
  np.testing.assert_allclose(float(state.update_norm), 2e20, rtol=1e-6)
  np.testing.assert_allclose(float(state.update_to_param), 2e20 / 6e38, 1e-5)


def test_at_the_end_of_a_chain_with_clippers():
  tx = optax.chain(
    optaxclip.clip_global(1.0), optax.adam(1e-2), optaxclip.watch()
  )
  params, grads = _tree(4), _tree(5, scale=10.0)
  updates, state = tx.update(grads, tx.init(params), params)
  logs = optaxclip.stats(state)
  assert set(logs) >= {"clip_global/norm", "watch/update_norm"}
  np.testing.assert_allclose(
    float(logs["watch/update_norm"]), _norm(_leaves(updates)), rtol=1e-6
  )
  sentences = optaxclip.explain(state)
  assert sentences[-1].startswith("watch saw an update of norm ")


def test_inside_shard_map_matches_one_device():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
  rng = np.random.default_rng(0)
  params = {
    "split": jnp.asarray(rng.normal(size=(16, 3)), jnp.float32),
    "whole": jnp.asarray(rng.normal(size=(5,)), jnp.float32),
  }
  updates = jax.tree.map(lambda x: 1e-3 * x + 1e-4, params)
  specs = {"split": P("d"), "whole": P()}
  for leaf_stats in (False, True):
    tx = optaxclip.watch(axis_name="d", sharded=specs, leaf_stats=leaf_stats)
    plain = optaxclip.watch(leaf_stats=leaf_stats)
    _, want = plain.update(updates, plain.init(params), params)

    def run(u, p, tx=tx):
      return tx.update(u, tx.init(p), p)[1]

    state_specs = jax.tree.map(lambda _: P(), tx.init(params))
    got = jax.jit(
      jax.shard_map(
        run, mesh=mesh, in_specs=(specs, specs), out_specs=state_specs
      )
    )(updates, params)
    for field in ("update_norm", "param_norm", "update_to_param"):
      np.testing.assert_allclose(
        float(getattr(got, field)), float(getattr(want, field)), rtol=1e-6
      )
    if leaf_stats:
      np.testing.assert_allclose(
        np.asarray(got.leaf_update_to_param.values),
        np.asarray(want.leaf_update_to_param.values),
        rtol=1e-6,
      )


def test_no_retrace_on_the_second_step():
  tx = optax.chain(optax.adam(1e-3), optaxclip.watch(leaf_stats=True))
  params, traces = _tree(6), []

  @jax.jit
  def step(p, s, g):
    traces.append(1)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, optaxclip.stats(s)

  state = tx.init(params)
  for seed in range(3):
    params, state, _ = step(params, state, _tree(seed))
  assert len(traces) == 1


def test_params_required_and_bad_arguments():
  tx = optaxclip.watch()
  g = {"w": jnp.ones(2)}
  with pytest.raises(ValueError, match=r"^watch: params must be passed"):
    tx.update(g, tx.init(g))
  with pytest.raises(TypeError, match=r"^watch: leaf_stats must be a bool"):
    optaxclip.watch(leaf_stats="yes")
  with pytest.raises(ValueError, match=r"^watch: layer_axis must come with"):
    optaxclip.watch(layer_axis=0)
  with pytest.raises(ValueError, match=r"^watch: axis_name must"):
    optaxclip.watch(axis_name="")


_WATCH = jax.jit(optaxclip.watch().update)


@hypothesis.given(
  data=st.data(),
  magnitude=st.sampled_from(["ordinary", "extreme"]),
)
@fz.examples(20)
def test_norms_match_float64_at_every_magnitude(data, magnitude):
  """Every finite float32 tree: the norms are the float64 ones (inf where
  they exceed float32's range; to the flush of subnormals), the ratio
  theirs.
  """
  dtype = np.dtype(np.float32)
  shapes = {"a": (3, 4), "b": (5,), "c": ()}
  draw = lambda: {
    k: data.draw(fz.arrays(dtype, s, magnitudes=magnitude))
    for k, s in shapes.items()
  }
  updates, params = draw(), draw()
  _, state = _WATCH(fz.to_jax(updates), None, fz.to_jax(params))
  tiny = float(np.finfo(np.float32).tiny)
  # XLA:CPU reads subnormal elements as 0 (flush to zero).
  flushed = lambda t: [np.where(np.abs(x) < tiny, 0, x) for x in t.values()]
  u, p = _norm(flushed(updates)), _norm(flushed(params))
  f32_max = float(np.finfo(np.float32).max)
  for got, want in ((state.update_norm, u), (state.param_norm, p)):
    if want > f32_max * (1 + 1e-6):
      assert float(got) == np.inf
    elif want > f32_max:  # rounds to the largest float32, or beyond
      assert float(got) >= f32_max
    else:
      np.testing.assert_allclose(float(got), want, rtol=1e-5, atol=1e-38)
  if tiny < u <= f32_max and tiny < p <= f32_max:
    want = u / p
    if 1e-37 < want < 1e37:
      np.testing.assert_allclose(float(state.update_to_param), want, 1e-5)


def test_state_round_trips_through_flax_serialization():
  from flax import serialization

  tx = optaxclip.watch(leaf_stats=True, layer_axis={"blocks": 0, "dense": None})
  params = _tree(7)
  _, state = tx.update(_tree(8, scale=1e-3), tx.init(params), params)
  restored = serialization.from_bytes(
    tx.init(params), serialization.to_bytes(state)
  )
  chex.assert_trees_all_equal(restored, state)
  assert optaxclip.stats(restored).keys() == optaxclip.stats(state).keys()
