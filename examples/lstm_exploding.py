"""A small Flax LSTM trained with global-norm clipping before Adam.

Placeholder for the full exploding-gradient demo: trains an LSTM on the adding
problem and prints the loss and the pre-clip gradient norm from optaxclip.stats.
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import optaxclip


class Model(nn.Module):
  hidden: int = 32

  @nn.compact
  def __call__(self, x):
    h = nn.RNN(nn.OptimizedLSTMCell(self.hidden))(x)
    return nn.Dense(1)(h[:, -1])[:, 0]


def adding_batch(key, batch, seq_len):
  k1, k2 = jax.random.split(key)
  values = jax.random.uniform(k1, (batch, seq_len))
  idx = jnp.argsort(jax.random.uniform(k2, (batch, seq_len)), axis=1)[:, :2]
  marks = jnp.zeros((batch, seq_len)).at[jnp.arange(batch)[:, None], idx].set(1.0)
  x = jnp.stack([values, marks], axis=-1)
  return x, jnp.sum(values * marks, axis=1)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--seq-len", type=int, default=50)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  key = jax.random.PRNGKey(args.seed)
  model = Model()
  x, _ = adding_batch(key, 2, args.seq_len)
  params = model.init(key, x)
  tx = optax.chain(optaxclip.clip_global(5.0), optax.adam(1e-3))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  @jax.jit
  def step(state, key):
    x, y = adding_batch(key, 64, args.seq_len)

    def loss_fn(p):
      return jnp.mean((state.apply_fn(p, x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  for i in range(args.steps):
    state, loss = step(state, jax.random.fold_in(key, i))
    if i % max(1, args.steps // 10) == 0 or i == args.steps - 1:
      norm = optaxclip.stats(state.opt_state)["clip_global/norm"]
      print(f"step {i:5d}  loss {float(loss):.4f}  pre-clip norm {float(norm):.3f}")


if __name__ == "__main__":
  main()
