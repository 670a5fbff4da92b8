"""Flax: a linen TrainState and an nnx.Optimizer with
``optax.chain(clip_global(5.0), optax.adam(1e-3))``; stats() reports the true
pre-clip norm of the gradients.
"""

from absl.testing import absltest
from flax import linen as nn
from flax import nnx
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax

import np_refs
import optaxclip

MAX_NORM = 5.0


def _data():
  rng = np.random.default_rng(40)
  x = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((16, 1)) * 100, jnp.float32)
  return x, y  # large targets: gradients well above the limit at first.


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(nn.tanh(nn.Dense(8)(x)))


class _NnxMlp(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(4, 8, rngs=rngs)
    self.out = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.hidden(x)))


def _check_logs(test, logs, grads):
  true_norm = np_refs.tree_norm([np.asarray(g) for g in jax.tree.leaves(grads)])
  test.assertGreater(true_norm, MAX_NORM)
  np.testing.assert_allclose(logs["clip_global/norm"], true_norm, rtol=1e-5)
  np.testing.assert_allclose(
    logs["clip_global/clipped_norm"], MAX_NORM, rtol=1e-5
  )
  test.assertEqual(float(logs["clip_global/clip_fraction"]), 1.0)


class FlaxTest(absltest.TestCase):
  def test_linen_train_state(self):
    x, y = _data()
    model = _Mlp()
    params = model.init(jax.random.key(0), x)
    tx = optax.chain(optaxclip.clip_global(MAX_NORM), optax.adam(1e-3))
    state = train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx
    )
    traces = []

    @jax.jit
    def train_step(state, x, y):
      traces.append(1)

      def loss_fn(params):
        return jnp.mean((state.apply_fn(params, x) - y) ** 2)

      loss, grads = jax.value_and_grad(loss_fn)(state.params)
      state = state.apply_gradients(grads=grads)
      return state, loss, grads, optaxclip.stats(state)

    for _ in range(3):
      old_params = state.params
      state, loss, grads, logs = train_step(state, x, y)
      _check_logs(self, logs, grads)
      # stats() also takes the TrainState or its opt_state directly.
      for source in (state, state.opt_state):
        for k, v in optaxclip.stats(source).items():
          np.testing.assert_array_equal(v, logs[k])
      # adam moved every parameter by about its learning rate.
      delta = jax.tree.map(
        lambda a, b: np.max(np.abs(a - b)), state.params, old_params
      )
      self.assertTrue(all(0 < d <= 1.1e-3 for d in jax.tree.leaves(delta)))
    self.assertTrue(np.isfinite(float(loss)))
    self.assertLen(traces, 1)

  def test_nnx_optimizer(self):
    x, y = _data()
    model = _NnxMlp(nnx.Rngs(0))
    tx = optax.chain(optaxclip.clip_global(MAX_NORM), optax.adam(1e-3))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
      def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

      loss, grads = nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)
      return loss, grads, optaxclip.stats(optimizer.opt_state)

    for _ in range(3):
      loss, grads, logs = train_step(model, optimizer, x, y)
      _check_logs(self, logs, grads)
      # Outside jit, on the Optimizer object or its state.
      for source in (optimizer, optimizer.opt_state):
        outside = optaxclip.stats(source)
        self.assertEqual(sorted(outside), sorted(logs))
        for k, v in outside.items():
          self.assertIsInstance(v, jax.Array)
          np.testing.assert_array_equal(v, logs[k])
    self.assertTrue(np.isfinite(float(loss)))


if __name__ == "__main__":
  absltest.main()
