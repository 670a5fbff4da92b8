"""clipped(): Keras 3's clipvalue, clipnorm and global_clipnorm for optax."""

import itertools

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import np_refs
import optaxclip


def _grads():
  rng = np.random.default_rng(30)
  return {
    "kernel": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
    "bias": jnp.asarray(rng.standard_normal(3) * 0.1, jnp.float32),
  }


class ClippedTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_keras_formulas(self):
    g = _grads()
    params = jax.tree.map(jnp.zeros_like, g)
    lr = 0.1
    kinds = {"clipvalue": 0.3, "clipnorm": 0.5, "global_clipnorm": 1.0}
    txs = {
      k: optaxclip.clipped(optax.sgd(lr), **{k: v}) for k, v in kinds.items()
    }
    results = self.variant(
      lambda g: {
        k: tx.update(g, tx.init(params), params) for k, tx in txs.items()
      }
    )(g)
    leaves = [np.asarray(x) for x in jax.tree.leaves(g)]
    expected = {
      "clipvalue": np_refs.keras_clipvalue(leaves, 0.3),
      "clipnorm": np_refs.keras_clipnorm(leaves, 0.5),
      "global_clipnorm": np_refs.keras_global_clipnorm(leaves, 1.0),
    }
    for kind, (updates, state) in results.items():
      for u, e in zip(jax.tree.leaves(updates), expected[kind], strict=True):
        np.testing.assert_allclose(u, -lr * e, rtol=1e-5, atol=1e-7)
      logs = optaxclip.stats(state)
      name = {
        "clipvalue": "clip_value",
        "clipnorm": "clip_norm",
        "global_clipnorm": "clip_global",
      }[kind]
      self.assertEqual(
        sorted(logs),
        sorted(
          f"{name}/{f}"
          for f in ("norm", "clipped_norm", "clip_fraction", "threshold")
        ),
      )
      self.assertGreater(float(logs[f"{name}/clip_fraction"]), 0)
    np.testing.assert_allclose(
      results["global_clipnorm"][1][0].norm,
      np_refs.tree_norm(leaves),
      rtol=1e-5,
    )

  @parameterized.parameters(
    *[
      dict(zip(kinds, (1.0,) * len(kinds)))
      for n in (2, 3)
      for kinds in itertools.combinations(
        ("clipvalue", "clipnorm", "global_clipnorm"), n
      )
    ]
  )
  def test_more_than_one_kind_is_a_value_error(self, **kinds):
    with pytest.raises(ValueError, match="at most one") as info:
      optaxclip.clipped(optax.adam(1e-3), **kinds)
    for name in kinds:
      self.assertIn(name, str(info.value))

  def test_none_returns_inner_unchanged(self):
    inner = optax.adam(1e-3)
    self.assertIs(optaxclip.clipped(inner), inner)

  def test_zero_is_a_limit_not_none(self):
    tx = optaxclip.clipped(optax.sgd(1.0), clipvalue=0.0)
    g = _grads()
    updates, _ = tx.update(g, tx.init(g))
    for u in jax.tree.leaves(updates):
      np.testing.assert_array_equal(u, 0.0)

  @parameterized.parameters(
    ("clipvalue", -1.0, ValueError),
    ("clipnorm", float("nan"), ValueError),
    ("global_clipnorm", "5", TypeError),
    ("clipnorm", True, TypeError),
  )
  def test_bad_value_names_the_argument(self, kind, value, error):
    with pytest.raises(error, match=kind):
      optaxclip.clipped(optax.sgd(1.0), **{kind: value})

  def test_inner_must_be_a_transformation(self):
    with pytest.raises(TypeError, match="inner"):
      optaxclip.clipped(optax.sgd, global_clipnorm=1.0)
    with pytest.raises(TypeError, match="inner"):
      optaxclip.clipped(1e-3, clipnorm=1.0)

  def test_jitted_training_loop_no_transfer_no_retrace(self):
    tx = optaxclip.clipped(optax.adam(1e-2), global_clipnorm=1.0)
    params = {"w": jnp.ones(3)}
    traces = []

    @jax.jit
    def step(params, state, g):
      traces.append(1)
      updates, state = tx.update(g, state, params)
      return optax.apply_updates(params, updates), state

    state = tx.init(params)
    grads = [{"w": jnp.full(3, s)} for s in (10.0, 0.1, 0.0)]
    jax.block_until_ready(grads)
    with jax.transfer_guard("disallow"):
      for g in grads:
        params, state = step(params, state, g)
    self.assertLen(traces, 1)
    self.assertEqual(float(state[0].norm), 0.0)
    self.assertTrue(np.all(np.isfinite(params["w"])))
