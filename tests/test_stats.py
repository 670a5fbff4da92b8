"""stats(): every clipper's statistics from any nesting of optax states."""

from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

import np_refs
import optaxclip

FIELDS = ("norm", "clipped_norm", "clip_fraction")


def _keys(prefix):
  return [f"{prefix}/{f}" for f in FIELDS]


class StatsTest(parameterized.TestCase):

  def test_chain_reports_every_clipper_against_numpy(self):
    g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([[12.0, -0.5]])}
    tx = optax.chain(optaxclip.clip_value(10.0), optaxclip.clip_norm(6.0),
                     optaxclip.clip_global(5.0), optax.sgd(1.0))
    _, state = jax.jit(tx.update)(g, tx.init(g))
    logs = optaxclip.stats(state)
    self.assertEqual(list(logs), _keys("clip_value") + _keys("clip_norm")
                     + _keys("clip_global"))
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(g)]
    after_value = [np.clip(x, -10, 10) for x in leaves]
    after_norm = [np_refs.tf_clip_by_norm(x, 6.0) for x in after_value]
    after_global, global_norm = np_refs.tf_clip_by_global_norm(after_norm, 5.0)
    flat = np.concatenate([np.abs(x).ravel() for x in leaves])
    expected = {
        "clip_value/norm": 12.0, "clip_value/clipped_norm": 10.0,
        "clip_value/clip_fraction": np.mean(flat > 10),
        "clip_norm/norm": np_refs.tree_norm(after_value),
        "clip_norm/clipped_norm": np_refs.tree_norm(after_norm),
        "clip_norm/clip_fraction": 0.5,
        "clip_global/norm": global_norm,
        "clip_global/clipped_norm": np_refs.tree_norm(after_global),
        "clip_global/clip_fraction": 1.0,
    }
    for key, value in logs.items():
      self.assertEqual(value.dtype, jnp.float32)
      self.assertEqual(value.shape, ())
      np.testing.assert_allclose(value, expected[key], rtol=1e-5, err_msg=key)

  def test_two_clippers_of_a_kind_get_unique_keys(self):
    g = {"a": jnp.array([6.0, 8.0])}
    tx = optax.chain(optaxclip.clip_global(5.0), optax.scale(2.0),
                     optaxclip.clip_global(4.0), optaxclip.clip_norm(100.0))
    _, state = tx.update(g, tx.init(g))
    logs = optaxclip.stats(state)
    self.assertEqual(list(logs), _keys("0/clip_global") + _keys("2/clip_global")
                     + _keys("clip_norm"))
    self.assertEqual(float(logs["0/clip_global/norm"]), 10.0)
    self.assertEqual(float(logs["2/clip_global/norm"]), 10.0)  # 5 * 2
    self.assertEqual(float(logs["2/clip_global/clipped_norm"]), 4.0)
    self.assertEqual(float(logs["clip_norm/norm"]), 4.0)

  def test_masked_inject_hyperparams_and_multi_transform(self):
    g = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([30.0, 40.0])}
    mask = {"w": True, "b": False}
    tx = optax.chain(
        optax.masked(optaxclip.clip_global(1.0), mask),
        optax.inject_hyperparams(optaxclip.clip_global)(max_norm=100.0),
        optax.multi_transform(
            {"x": optaxclip.clip_norm(1.0),
             "y": optax.inject_hyperparams(optaxclip.clip_norm)(max_norm=2.0)},
            {"w": "x", "b": "y"}),
        optax.adam(1e-3))
    _, state = jax.jit(tx.update)(g, tx.init(g))
    logs = optaxclip.stats(state)
    # The masked clipper sees w only; the injected one sees w clipped to 1
    # and b untouched.
    self.assertEqual(len(logs), 4 * len(FIELDS))
    self.assertEqual(len(set(logs)), len(logs))
    by_norm = {k: float(v) for k, v in logs.items() if k.endswith("/norm")}
    glob = sorted(k for k in by_norm if "clip_global" in k)
    norms = sorted(k for k in by_norm if "clip_norm" in k)
    self.assertLen(glob, 2)
    self.assertLen(norms, 2)
    np.testing.assert_allclose(by_norm[glob[0]], 5.0, rtol=1e-6)
    np.testing.assert_allclose(by_norm[glob[1]], np.sqrt(1 + 2500), rtol=1e-6)
    np.testing.assert_allclose(sorted(by_norm[k] for k in norms), [1.0, 50.0],
                               rtol=1e-6)
    for key in logs:
      self.assertTrue(key.endswith(FIELDS), key)

  def test_inject_hyperparams_alone_keeps_the_short_key(self):
    tx = optax.inject_hyperparams(optaxclip.clip_block_rms)(threshold=1.0)
    g = {"w": jnp.full(4, 2.0)}
    _, state = tx.update(g, tx.init(g))
    logs = optaxclip.stats(state)
    self.assertEqual(list(logs), _keys("clip_block_rms"))
    self.assertEqual(float(logs["clip_block_rms/norm"]), 4.0)

  def test_order_follows_the_chain(self):
    txs = [optax.identity() for _ in range(12)]
    txs[2] = optaxclip.clip_global(1.0)
    txs[10] = optaxclip.clip_global(2.0)
    tx = optax.chain(*txs)
    logs = optaxclip.stats(tx.init({"w": jnp.ones(2)}))
    self.assertEqual(list(logs),
                     _keys("2/clip_global") + _keys("10/clip_global"))

  def test_no_clipper_no_stats(self):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    self.assertEqual(optaxclip.stats(tx.init({"w": jnp.ones(2)})), {})
    self.assertEqual(optaxclip.stats(None), {})
    self.assertEqual(optaxclip.stats(()), {})

  def test_inside_jit_without_transfer(self):
    tx = optax.chain(optaxclip.clip_unitwise(0.1), optaxclip.clip_global(1.0),
                     optax.sgd(0.1))
    params = {"w": jnp.ones((3, 2))}
    traces = []

    @jax.jit
    def step(params, state, g):
      traces.append(1)
      updates, state = tx.update(g, state, params)
      return optax.apply_updates(params, updates), state, optaxclip.stats(state)

    state = tx.init(params)
    grads = [{"w": jnp.full((3, 2), s)} for s in (1.0, 0.01)]
    jax.block_until_ready(grads)
    with jax.transfer_guard("disallow"):
      for g in grads:
        params, state, logs = step(params, state, g)
    self.assertLen(traces, 1)
    # (A dict returned from jit comes back with its keys sorted.)
    self.assertEqual(sorted(logs),
                     sorted(_keys("clip_unitwise") + _keys("clip_global")))
    # Second step: each column (unit) of 0.01s has norm 0.01*sqrt(3), below
    # its limit 0.1 * ||w column||; nothing is clipped.
    self.assertEqual(float(logs["clip_unitwise/clip_fraction"]), 0.0)
    np.testing.assert_allclose(logs["clip_unitwise/norm"], 0.01 * np.sqrt(6),
                               rtol=1e-5)
