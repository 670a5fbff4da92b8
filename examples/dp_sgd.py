"""DP-SGD on synthetic data: per-example clipping, noise, adaptive clip norm.

A two-layer Flax MLP learns a noisy nonlinear regression task (targets from a
random "teacher" network plus noise). Each step takes per-example gradients
(``jax.vmap`` over ``jax.grad``), and ``optaxclip.clip_per_example`` clips
each example, averages the batch, adds Gaussian noise and adapts the clip norm
towards the median per-example gradient norm (Andrew et al. 2021) before SGD
with momentum. Each epoch prints the held-out loss and the clip statistics.

    python examples/dp_sgd.py                      # 8 epochs, seconds
    python examples/dp_sgd.py --epochs 1 --examples 512

This clips and adds noise; it does not account for privacy. The (epsilon,
delta) of a run follows from the noise multiplier, the sampling rate
(batch size / examples) and the number of steps, e.g. with Google's
``dp_accounting`` library (RDP or PLD accountant), which assumes Poisson
sampling of batches, not the shuffled fixed-size batches used here for brevity.
"""

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import _flags as flags
import optaxclip


class MLP(nn.Module):
  hidden: int = 32

  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(nn.tanh(nn.Dense(self.hidden)(x)))[..., 0]


def teacher(key, dim):
  """A fixed random two-layer network that labels the data."""
  k_w, k_v = jax.random.split(key)
  return (
    jax.random.normal(k_w, (dim, 8)) / jnp.sqrt(dim),
    jax.random.normal(k_v, (8,)),
  )


def synthetic_data(key, n, teacher_weights, noise=0.3):
  """Inputs with the teacher's outputs plus Gaussian noise as targets."""
  w, v = teacher_weights
  k_x, k_noise = jax.random.split(key)
  x = jax.random.normal(k_x, (n, w.shape[0]))
  y = jnp.tanh(2 * x @ w) @ v
  return x, y + noise * jax.random.normal(k_noise, (n,))


def parse_args(argv=None):
  parser = flags.parser(__doc__)
  flags.add_count(parser, "--epochs", 8, "passes over the training examples")
  flags.add_count(
    parser, "--examples", 8192, "training examples (at least one batch)"
  )
  flags.add_count(parser, "--batch-size", 256, "examples per step (B)")
  flags.add_count(parser, "--dim", 16, "input dimension of the synthetic data")
  flags.add_dp(parser, noise_multiplier=1.0)
  flags.add_positive(
    parser, "--learning-rate", 0.1, "SGD learning rate (momentum 0.9)"
  )
  flags.add_seed(parser, "seeds the data, the model and the noise")
  args = parser.parse_args(argv)
  if args.examples < args.batch_size:
    parser.error(
      f"--examples ({args.examples}) must be at least one batch "
      f"(--batch-size {args.batch_size}): an epoch takes "
      "examples // batch-size steps"
    )
  flags.check_dp(parser, args)
  return args


def main(argv=None):
  args = parse_args(argv)

  key = jax.random.PRNGKey(args.seed)
  k_teacher, k_data, k_test, k_init, k_shuffle = jax.random.split(key, 5)
  labeller = teacher(k_teacher, args.dim)
  x, y = synthetic_data(k_data, args.examples, labeller)
  x_test, y_test = synthetic_data(k_test, 2048, labeller)
  model = MLP()
  params = model.init(k_init, x[:1])

  def loss_fn(params, x, y):
    return optax.l2_loss(model.apply(params, x), y).mean()

  # Per-example gradients: the leading axis of every leaf is the batch.
  per_example_grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))
  tx = optax.chain(
    optaxclip.clip_per_example(
      args.l2_clip,
      noise_multiplier=args.noise_multiplier,
      target_quantile=args.target_quantile,
      seed=args.seed,
    ),
    optax.sgd(args.learning_rate, momentum=0.9),
  )
  opt_state = tx.init(params)

  steps = args.examples // args.batch_size

  @jax.jit
  def epoch(params, opt_state, key):
    order = jax.random.permutation(key, args.examples)[
      : steps * args.batch_size
    ]
    batches = order.reshape(steps, args.batch_size)

    def step(carry, idx):
      params, opt_state = carry
      grads = per_example_grads(params, x[idx], y[idx])
      updates, opt_state = tx.update(grads, opt_state, params)
      stats = optaxclip.stats(opt_state)
      return (optax.apply_updates(params, updates), opt_state), stats

    (params, opt_state), stats = jax.lax.scan(
      step, (params, opt_state), batches
    )
    metrics = {
      "loss": loss_fn(params, x_test, y_test),
      "clip_norm": stats["clip_per_example/clip_norm"][-1],
      "clip_fraction": stats["clip_per_example/clip_fraction"].mean(),
      "norm": stats["clip_per_example/norm"].mean(),
      "nonfinite": stats["clip_per_example/nonfinite"].sum(),
    }
    return params, opt_state, metrics

  print(
    f"{args.examples} examples, batches of {args.batch_size}, "
    f"noise multiplier {args.noise_multiplier}, target quantile "
    f"{args.target_quantile}, clip norm starts at {args.l2_clip}"
  )
  start = time.perf_counter()
  for i, k in enumerate(jax.random.split(k_shuffle, args.epochs)):
    params, opt_state, m = epoch(params, opt_state, k)
    print(
      f"epoch {i + 1:2d}  test loss {float(m['loss']):.4f}  "
      f"clip norm {float(m['clip_norm']):.4f}  "
      f"clipped {float(m['clip_fraction']):.2f}"
      f"  mean example norm {float(m['norm']):.4f}  non-finite examples "
      f"{int(m['nonfinite'])}",
      flush=True,
    )
  print(
    f"{args.epochs * steps} steps in {time.perf_counter() - start:.1f} s. "
    "No privacy accounting was done: see the module docstring."
  )


if __name__ == "__main__":
  main()
