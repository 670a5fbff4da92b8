"""leaf_stats= and layer_axis=: per-leaf and per-layer norms in the states,
top_leaf_share / top_leaf, and their stats() keys.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fast_compile
import np_refs
import optaxclip

TOL = 1e-5


def _tree():
  rng = np.random.default_rng(0)
  return {
    "blocks": {
      "kernel": jnp.asarray(rng.normal(size=(4, 3, 5)), jnp.float32),
      "bias": jnp.asarray(rng.normal(size=(4, 5)), jnp.float32),
    },
    "head": jnp.asarray(3.0 * rng.normal(size=(5, 2)), jnp.float32),
    "scale": jnp.asarray(rng.normal(size=(5,)), jnp.float32),
    "tiny": jnp.asarray(rng.normal(size=(5,)), jnp.bfloat16),
  }


def _params():
  return jax.tree.map(lambda x: jnp.ones_like(x) * 2, _tree())


# name -> (factory(**kwargs), ord of its leaf norms, its kwargs, whether the
# norm it reports is the global one). All take leaf_stats= and layer_axis=.
CLIPPERS = {
  "clip_global": (optaxclip.clip_global, 2.0, {"max_norm": 1.0}),
  "clip_global_ord1": (
    optaxclip.clip_global,
    1.0,
    {"max_norm": 1.0, "ord": 1},
  ),
  "clip_global_inf": (
    optaxclip.clip_global,
    np.inf,
    {"max_norm": 1.0, "ord": np.inf},
  ),
  "clip_norm": (optaxclip.clip_norm, 2.0, {"max_norm": 1.0}),
  "clip_norm_axis": (
    optaxclip.clip_norm,
    3.0,
    {"max_norm": 1.0, "ord": 3, "axis": -1},
  ),
  "clip_block_rms": (optaxclip.clip_block_rms, 2.0, {"threshold": 0.5}),
  "clip_unitwise": (optaxclip.clip_unitwise, 2.0, {"clipping": 0.1}),
  "clip_zscore": (
    optaxclip.clip_zscore,
    2.0,
    {"warmup_steps": 1, "max_norm": 1.0},
  ),
  "clip_zscore_leaf": (
    optaxclip.clip_zscore,
    2.0,
    {"warmup_steps": 1, "max_norm": 1.0, "scope": "leaf"},
  ),
  "clip_percentile": (optaxclip.clip_percentile, 2.0, {"history": 4}),
  "clip_relative": (optaxclip.clip_relative, 2.0, {"warmup_steps": 1}),
  "guard": (
    lambda **kw: optaxclip.guard(optax.sgd(1.0), **kw),
    2.0,
    {"max_norm": 100.0},
  ),
}

LAYERS = {"blocks": 0, "head": None, "scale": None, "tiny": None}


def _expected(tree, ord, layers=None):
  leaves = jax.tree.leaves(tree)
  axes = None
  if layers is not None:
    axes = optaxclip._telemetry.layer_axes("test", tree, layers)
  return np_refs.leaf_norms(leaves, ord, axes)


def _flat_norms(state):
  return np.concatenate(
    [np.ravel(np.asarray(x)) for x in jax.tree.leaves(state.leaf_norms.tree())]
  )


def _check_against_numpy(test, state, g, ord_, layers):
  expected = _expected(g, ord_, layers)
  got = _flat_norms(state)
  test.assertEqual(got.dtype, np.float32)
  # bfloat16 leaves are measured in float32 from their bfloat16 values.
  np.testing.assert_allclose(got, expected, rtol=1e-5)
  share, index = np_refs.top_leaf(expected, ord_)
  np.testing.assert_allclose(state.top_leaf_share, share, rtol=1e-5)
  test.assertEqual(int(state.top_leaf), index)
  test.assertEqual(state.top_leaf.dtype, jnp.int32)


def _norm(state):
  """The norm a clipper or guard measured this step."""
  if isinstance(state, optaxclip.GuardState):
    return state.verdict.norm
  return state.norm


class LeafNormsTest(chex.TestCase, parameterized.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(("leaf", None), ("layer", LAYERS))
  def test_clip_global_leaf_norms_match_numpy(self, layers):
    tx = optaxclip.clip_global(1.0, leaf_stats=True, layer_axis=layers)
    plain = optaxclip.clip_global(1.0)
    g = _tree()
    out, state = self.variant(tx.update)(g, tx.init(g))
    want_out, want_state = plain.update(g, plain.init(g))
    chex.assert_trees_all_close(out, want_out, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(state.norm, want_state.norm, rtol=TOL)
    _check_against_numpy(self, state, g, 2.0, layers)
    if layers:
      self.assertEqual(state.leaf_norms.tree()["blocks"]["kernel"].shape, (4,))
      self.assertEqual(state.leaf_norms.tree()["head"].shape, ())

  @pytest.mark.slow
  def test_every_clipper_matches_numpy_and_clips_as_without(self):
    g, p = _tree(), _params()
    names = sorted(CLIPPERS)

    def run(g, p):
      out = {}
      for name in names:
        make, _, kwargs = CLIPPERS[name]
        with_stats = make(**kwargs, leaf_stats=True, layer_axis=LAYERS)
        plain = make(**kwargs)
        out[name] = (
          with_stats.update(g, with_stats.init(p), p),
          plain.update(g, plain.init(p), p),
        )
      return out

    results = fast_compile.compile_fast(jax.jit(run).lower(g, p))(g, p)
    for name in names:
      (out, state), (want_out, want_state) = results[name]
      chex.assert_trees_all_close(
        out, want_out, rtol=TOL, atol=TOL, custom_message=name
      )
      np.testing.assert_allclose(
        _norm(state), _norm(want_state), rtol=TOL, err_msg=name
      )
      _check_against_numpy(self, state, g, CLIPPERS[name][1], LAYERS)
      # Telemetry off: the fields are None.
      self.assertIsNone(want_state.leaf_norms, name)
      self.assertIsNone(want_state.top_leaf_share, name)
      self.assertIsNone(want_state.top_leaf, name)

  def test_second_step_does_not_retrace_nor_transfer(self):
    tx = optax.chain(
      *[
        make(**kwargs, leaf_stats=True, layer_axis=LAYERS)
        for name, (make, _, kwargs) in CLIPPERS.items()
        if name in ("clip_norm", "clip_relative", "guard")
      ],
      optax.sgd(0.1),
    )
    traces = []

    @jax.jit
    def step(p, s, g):
      traces.append(1)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s, optaxclip.stats(s)

    p, g = _params(), _tree()
    s = tx.init(p)
    p, s, _ = step(p, s, g)
    with jax.transfer_guard("disallow"):
      p, s, logs = step(p, s, g)
    self.assertLen(traces, 1)
    for name in ("clip_norm", "clip_relative", "guard"):
      self.assertTrue(
        any(k.endswith(f"{name}/leaf_norm/blocks/kernel/3") for k in logs),
        name,
      )


class StatsKeysTest(absltest.TestCase):
  def test_keys_paths_layers_and_prefix(self):
    g = _tree()
    tx = optax.chain(
      optaxclip.clip_global(1.0, leaf_stats=True, layer_axis=LAYERS),
      optax.sgd(1.0),
    )
    _, state = tx.update(g, tx.init(g), g)
    logs = optaxclip.stats(state, prefix="train/")
    leaf_keys = [k for k in logs if "/leaf_norm/" in k]
    self.assertEqual(
      leaf_keys,
      [f"train/clip_global/leaf_norm/blocks/bias/{k}" for k in range(4)]
      + [f"train/clip_global/leaf_norm/blocks/kernel/{k}" for k in range(4)]
      + [
        "train/clip_global/leaf_norm/head",
        "train/clip_global/leaf_norm/scale",
        "train/clip_global/leaf_norm/tiny",
      ],
    )
    self.assertIn("train/clip_global/top_leaf_share", logs)
    self.assertNotIn("train/clip_global/top_leaf", logs)
    for value in logs.values():
      self.assertEqual(np.shape(value), ())
    names, values = optaxclip.leaf_norm_table(state, prefix="train")
    self.assertEqual(names, leaf_keys)
    self.assertEqual(values.shape, (len(names),))
    np.testing.assert_array_equal(values, [logs[k] for k in names])

  def test_nested_clippers_keep_their_prefixes(self):
    g = {"w": jnp.array([3.0, 4.0])}
    tx = optaxclip.guard(
      optax.chain(
        optaxclip.clip_global(1.0, leaf_stats=True),
        optaxclip.clip_global(10.0, leaf_stats=True),
      ),
      max_norm=100.0,
    )
    _, state = tx.update(g, tx.init(g))
    logs = optaxclip.stats(state)
    self.assertIn("inner_state/0/clip_global/leaf_norm/w", logs)
    np.testing.assert_allclose(
      logs["inner_state/1/clip_global/leaf_norm/w"], 1.0
    )
    names, values = optaxclip.leaf_norm_table(state)
    self.assertLen(names, 2)
    np.testing.assert_allclose(values, [5.0, 1.0], rtol=1e-6)

  def test_no_leaf_norms_gives_an_empty_table(self):
    tx = optaxclip.clip_global(1.0)
    g = {"w": jnp.ones(2)}
    names, values = optaxclip.leaf_norm_table(tx.update(g, tx.init(g))[1])
    self.assertEqual((names, values.shape), ([], (0,)))

  def test_prefix_must_be_a_string(self):
    with self.assertRaisesRegex(TypeError, r"^stats: prefix must be a str"):
      optaxclip.stats({}, prefix=3)


class LayerAxisTest(parameterized.TestCase):
  def test_callable_prefix_and_int_agree(self):
    g = {"a": jnp.ones((3, 2)), "b": jnp.arange(6.0).reshape(3, 2)}
    by_int = optaxclip.clip_global(1.0, leaf_stats=True, layer_axis=0)
    by_prefix = optaxclip.clip_global(
      1.0, leaf_stats=True, layer_axis={"a": 0, "b": 0}
    )
    by_fn = optaxclip.clip_global(
      1.0, leaf_stats=True, layer_axis=lambda path, leaf: 0
    )
    states = [tx.update(g, tx.init(g))[1] for tx in (by_int, by_prefix, by_fn)]
    for s in states[1:]:
      chex.assert_trees_all_equal(s.leaf_norms, states[0].leaf_norms)
    np.testing.assert_allclose(
      states[0].leaf_norms.tree()["b"],
      np.linalg.norm(np.arange(6.0).reshape(3, 2), axis=1),
      rtol=1e-6,
    )

  @parameterized.parameters(
    (
      {"a": 2},
      ValueError,
      r"^clip_global: layer_axis must be an axis of the leaf \['a'\]",
    ),
    (
      {"b": 0},
      ValueError,
      r"^clip_global: layer_axis must be a pytree prefix of the updates",
    ),
    ({"a": "x"}, TypeError, r"^clip_global: layer_axis must be an int or None"),
    (1.5, TypeError, r"^clip_global: layer_axis must be an int or None"),
    (True, TypeError, r"^clip_global: layer_axis must be an int or None"),
  )
  def test_bad_layer_axis(self, layer_axis, error, message):
    g = {"a": jnp.ones((3, 2))}
    with self.assertRaisesRegex(error, message):
      tx = optaxclip.clip_global(1.0, leaf_stats=True, layer_axis=layer_axis)
      tx.update(g, tx.init(g))

  def test_layer_axis_needs_leaf_stats(self):
    with self.assertRaisesRegex(
      ValueError, r"^clip_global: layer_axis must come with leaf_stats=True"
    ):
      optaxclip.clip_global(1.0, layer_axis=0)
    with self.assertRaisesRegex(
      TypeError, r"^clip_global: leaf_stats must be a bool; got 1"
    ):
      optaxclip.clip_global(1.0, leaf_stats=1)


class NumericsTest(absltest.TestCase):
  def test_a_leaf_norm_beyond_float32_reads_inf_and_the_clip_stays_exact(self):
    g = {"big": jnp.full((4,), 3e38, jnp.float32), "small": jnp.ones(3)}
    tx = optaxclip.clip_global(1.0, leaf_stats=True)
    out, state = tx.update(g, tx.init(g))
    self.assertEqual(float(state.leaf_norms.tree()["big"]), np.inf)
    np.testing.assert_allclose(
      state.leaf_norms.tree()["small"], np.sqrt(3), rtol=1e-6
    )
    np.testing.assert_allclose(out["big"], 0.5, rtol=1e-6)
    self.assertEqual(int(state.top_leaf), 0)
    np.testing.assert_allclose(state.top_leaf_share, 1.0, rtol=1e-6)

  def test_nan_leaf_is_the_top_leaf(self):
    g = {"a": jnp.ones(2), "b": jnp.array([jnp.nan, 1.0])}
    tx = optaxclip.clip_global(1.0, leaf_stats=True)
    _, state = tx.update(g, tx.init(g))
    self.assertEqual(int(state.top_leaf), 1)
    self.assertTrue(np.isnan(state.top_leaf_share))
    self.assertTrue(np.isnan(state.leaf_norms.tree()["b"]))

  def test_zero_update(self):
    g = {"a": jnp.zeros(2), "b": jnp.zeros((2, 2))}
    tx = optaxclip.clip_global(1.0, leaf_stats=True, layer_axis=0)
    _, state = tx.update(g, tx.init(g))
    self.assertEqual(float(state.top_leaf_share), 0.0)
    np.testing.assert_array_equal(_flat_norms(state), np.zeros(4))

  def test_gradient_through_update_is_finite_at_zero(self):
    tx = optaxclip.clip_global(1.0, leaf_stats=True, layer_axis={"a": 0})
    g = {"a": jnp.zeros((2, 3))}
    s = tx.init(g)
    grad = jax.grad(lambda g: jnp.sum(tx.update(g, s)[0]["a"]))(g)
    self.assertTrue(np.all(np.isfinite(grad["a"])))


def test_old_checkpoint_upgrades_into_a_leaf_stats_state():
  g = {"w": jnp.ones((2, 3))}
  template = optaxclip.clip_global(1.0, leaf_stats=True, layer_axis=0).init(g)
  saved = {"norm": 2.0, "clipped_norm": 1.0, "clip_fraction": 1.0}
  state = optaxclip.upgrade_state(saved, template)
  assert isinstance(state, optaxclip.ClipGlobalState)
  assert float(state.norm) == 2.0
  assert state.leaf_norms.tree()["w"].shape == (2,)
  assert state.top_leaf.dtype == jnp.int32


def test_flax_serialization_round_trips_a_leaf_stats_state():
  from flax import serialization

  g = {"a": jnp.ones((3,)), "b": jnp.full((2, 4), 2.0)}
  tx = optax.chain(
    optaxclip.clip_global(1.0, leaf_stats=True, layer_axis={"a": None, "b": 0}),
    optax.adam(1e-3),
  )
  _, state = tx.update(g, tx.init(g), g)
  restored = serialization.from_bytes(tx.init(g), serialization.to_bytes(state))
  assert restored[0].leaf_norms.names() == ["a", "b/0", "b/1"]
  np.testing.assert_allclose(
    restored[0].leaf_norms.values, [np.sqrt(3), 4.0, 4.0], rtol=1e-6
  )
  chex.assert_trees_all_close(restored, state)


SHARD_CLIPPERS = {
  "clip_global": lambda **kw: optaxclip.clip_global(1.0, **kw),
  "clip_norm": lambda **kw: optaxclip.clip_norm(1.0, **kw),
  "clip_zscore": lambda **kw: optaxclip.clip_zscore(max_norm=1.0, **kw),
  "clip_relative": lambda **kw: optaxclip.clip_relative(warmup_steps=1, **kw),
  "guard": lambda **kw: optaxclip.guard(optax.sgd(1.0), max_norm=1.0, **kw),
}


@pytest.mark.parametrize("name", sorted(SHARD_CLIPPERS))
def test_sharded_leaf_norms_equal_one_device(name):
  P = jax.sharding.PartitionSpec
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
  rng = np.random.default_rng(1)
  g = {
    "stack": jnp.asarray(rng.normal(size=(3, 16, 4)), jnp.float32),
    "w": jnp.asarray(rng.normal(size=(8, 2)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
  }
  specs = {"stack": P(None, "d"), "w": P("d"), "b": P()}
  layers = {"stack": 0, "w": None, "b": None}
  make = SHARD_CLIPPERS[name]

  def run(g, mapped):
    kw = {"axis_name": "d", "sharded": specs} if mapped else {}
    tx = make(leaf_stats=True, layer_axis=layers, **kw)
    return tx.update(g, tx.init(g), g)[1]

  want = jax.jit(functools.partial(run, mapped=False))(g)
  mapped = jax.shard_map(
    functools.partial(run, mapped=True),
    mesh=mesh,
    in_specs=(specs,),
    out_specs=P(),
  )
  got = jax.jit(mapped)(g)
  chex.assert_trees_all_close(got.leaf_norms, want.leaf_norms, rtol=TOL)
  np.testing.assert_allclose(got.top_leaf_share, want.top_leaf_share, rtol=TOL)
  assert int(got.top_leaf) == int(want.top_leaf)
  np.testing.assert_allclose(_norm(got), _norm(want), rtol=TOL)


if __name__ == "__main__":
  absltest.main()
