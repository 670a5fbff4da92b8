"""Gradient clipping with ``flax.nnx``: chain a clipper before the optimizer.

A small LSTM (``nnx.RNN`` over ``nnx.OptimizedLSTMCell``) learns the adding
problem; ``nnx.Optimizer`` gets ``optax.chain(clipper, optax.adam(lr))`` as its
``tx`` -- no custom optimizer -- and ``optaxclip.stats(optimizer.opt_state)``
reads the gradient norm the clipper saw before clipping.

Run: ``python examples/nnx_quickstart.py`` (well under a minute on a CPU).
"""

from flax import nnx
import jax
import jax.numpy as jnp
import optax

import _flags as flags
import optaxclip


class LSTMRegressor(nnx.Module):
  """Reads a sequence of (value, mark) pairs and predicts one number."""

  def __init__(self, hidden: int, *, rngs: nnx.Rngs):
    self.rnn = nnx.RNN(nnx.OptimizedLSTMCell(2, hidden, rngs=rngs), rngs=rngs)
    self.head = nnx.Linear(hidden, 1, rngs=rngs)

  def __call__(self, x):
    return self.head(self.rnn(x)[:, -1])[:, 0]


def adding_batch(key, batch, seq_len):
  """The adding problem: sum the two values whose mark is 1."""
  k_values, k_first, k_second = jax.random.split(key, 3)
  values = jax.random.uniform(k_values, (batch, seq_len))
  first = jax.random.randint(k_first, (batch, 1), 0, seq_len // 2)
  second = jax.random.randint(k_second, (batch, 1), seq_len // 2, seq_len)
  position = jnp.arange(seq_len)
  marks = ((position == first) | (position == second)).astype(jnp.float32)
  return jnp.stack([values, marks], axis=-1), jnp.sum(values * marks, axis=1)


@nnx.jit
def train_step(model, optimizer, x, y):
  def loss_fn(model):
    return jnp.mean((model(x) - y) ** 2)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)  # clips, then Adam
  return loss, optaxclip.stats(optimizer.opt_state)


def parse_args(argv=None):
  parser = flags.parser(__doc__)
  flags.add_count(parser, "--steps", 300, "training steps")
  flags.add_count(
    parser, "--seq-len", 50, "length of the adding problem's sequences", low=2
  )
  flags.add_positive(parser, "--lr", 1e-2, "Adam's learning rate")
  flags.add_seed(parser)
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)

  model = LSTMRegressor(32, rngs=nnx.Rngs(args.seed))
  tx = optax.chain(optaxclip.clip_global(1.0), optax.adam(args.lr))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  key = jax.random.key(args.seed)
  every = max(1, args.steps // 10)
  for step in range(args.steps):
    x, y = adding_batch(jax.random.fold_in(key, step), 32, args.seq_len)
    loss, stats = train_step(model, optimizer, x, y)
    if step % every == 0 or step == args.steps - 1:
      print(
        f"step {step:4d}  loss {float(loss):.4f}  pre-clip norm "
        f"{float(stats['clip_global/norm']):7.3f}  clipped "
        f"{'yes' if stats['clip_global/clip_fraction'] > 0 else 'no'}"
      )


if __name__ == "__main__":
  main()
