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

  def test_linen_train_state_with_the_loss_aware_guard(self):
    """The pattern of the README and docs/spikes.md: apply_gradients passes
    no value=, so a loss-aware guard behind it fails when traced; calling
    tx.update with value=loss and building the state with .replace is
    apply_gradients step for step, and skips the bad batch.
    """
    x, y = _data()
    model = _Mlp()
    params = model.init(jax.random.key(0), x)

    def loss_fn(params, x, y):
      return jnp.mean((model.apply(params, x) - y) ** 2)

    def manual_step(state, x, y):
      loss, grads = jax.value_and_grad(loss_fn)(state.params, x, y)
      updates, opt_state = state.tx.update(
        grads, state.opt_state, state.params, value=loss
      )
      return state.replace(
        step=state.step + 1,
        params=optax.apply_updates(state.params, updates),
        opt_state=opt_state,
      )

    def builtin_step(state, x, y):
      grads = jax.grad(loss_fn)(state.params, x, y)
      return state.apply_gradients(grads=grads)

    guarded = optaxclip.guard(
      optax.chain(optaxclip.clip_global(MAX_NORM), optax.adam(1e-3)),
      loss_spike_z=3.0,
      warmup_steps=3,
    )
    state = train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=guarded
    )
    with self.assertRaisesRegex(
      ValueError, r"^guard: value must be passed to update when loss_spike_z"
    ):
      jax.jit(builtin_step)(state, x, y)

    # The same as apply_gradients where the update takes no value: a guard
    # without loss_spike_z ignores it.
    plain = optaxclip.guard(
      optax.chain(optaxclip.clip_global(MAX_NORM), optax.adam(1e-3))
    )
    want = got = train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=plain
    )
    for _ in range(3):
      want = jax.jit(builtin_step)(want, x, y)
      got = jax.jit(manual_step)(got, x, y)
    np.testing.assert_array_equal(int(got.step), int(want.step))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)

    step = jax.jit(manual_step)
    skipped = []
    for t in range(6):
      before = state.params
      state = step(state, x, 100.0 * y if t == 4 else y)
      skipped.append(int(state.opt_state.counts.skipped_loss_spike))
      if t == 4:  # the bad batch: parameters unchanged
        unchanged = jax.tree.map(np.array_equal, state.params, before)
        self.assertTrue(all(jax.tree.leaves(unchanged)))
    self.assertEqual(skipped, [0, 0, 0, 0, 1, 1])
    self.assertEqual(int(state.step), 6)

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
