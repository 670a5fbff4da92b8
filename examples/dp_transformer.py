"""DP-SGD on a small transformer: ghost clipping, noise, adaptive clip norm.

A small decoder-only transformer (token embedding, learned positions, causal
self-attention, an MLP, LayerNorms; its blocks under ``nn.scan``) learns to
continue synthetic token sequences (each sequence counts up from a random
start, modulo the vocabulary, with some tokens replaced at random). Each step:

1. ``optaxclip.clipped_grad(..., method="ghost")`` returns the sum of the
   per-example gradients, each clipped to the clip norm ``C``, without
   materialising per-example gradients (ghost norms, then one re-weighted
   backward pass);
2. ``optaxclip.dp_noise`` adds Gaussian noise of standard deviation
   ``noise_multiplier * C``, averages, and adapts ``C`` towards the target
   quantile of the per-example norms (Andrew et al. 2021);
3. Adam applies the update.

It prints the loss, the clip norm and the share of clipped examples, and at
the start the compiled temporary memory (XLA's memory analysis) of one
training step with ``method="ghost"`` and with ``method="vmap"``.

    python examples/dp_transformer.py                 # the small size
    python examples/dp_transformer.py --size tiny     # seconds (CI)

This clips and adds noise; it does not account for privacy. The (epsilon,
delta) of a run follows from the noise multiplier, the sampling rate and the
number of steps, e.g. with Google's ``dp_accounting`` library, which assumes
Poisson sampling of batches, not the fixed-size batches used here.
"""

import functools
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import _flags as flags
import optaxclip

SIZES = {  # vocab, sequence length, width, heads, layers
  "tiny": dict(vocab=16, length=8, width=16, heads=2, layers=2),
  "small": dict(vocab=64, length=32, width=64, heads=4, layers=2),
  # Parameters against activations as in real language models (a vocabulary
  # of thousands, width 256): per-example gradients outweigh activations.
  "medium": dict(vocab=4096, length=32, width=256, heads=4, layers=2),
  # DP fine-tuning's shape: short sequences, a wider model (per-example
  # gradients outweigh activations about 16 to 1 here, 4 to 1 in medium).
  "wide": dict(vocab=8192, length=16, width=512, heads=8, layers=2),
}


class Block(nn.Module):
  """Pre-LayerNorm block: causal self-attention and an MLP."""

  width: int
  heads: int

  @nn.compact
  def __call__(self, x, _):
    h = nn.LayerNorm()(x)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(
      h, h, mask=mask
    )
    h = nn.LayerNorm()(x)
    x = x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))
    return x, None


class Transformer(nn.Module):
  """Token and position embeddings, scanned blocks, a LayerNorm and a
  Dense read-out to the vocabulary (or, with ``tied``, the token
  embedding's transpose).
  """

  vocab: int
  length: int
  width: int
  heads: int
  layers: int
  tied: bool = False  # the read-out is the token embedding's transpose

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.vocab, self.width)
    x = embed(tokens)
    x = x + nn.Embed(self.length, self.width, name="positions")(
      jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    )
    blocks = nn.scan(
      Block,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=self.layers,
    )
    x, _ = blocks(self.width, self.heads, name="blocks")(x, None)
    x = nn.LayerNorm()(x)
    if self.tied:
      # Read by attribute: clipped_grad's ghost method puts the embedding
      # on the exact per-example path (its plan says so).
      return x @ embed.embedding.T
    return nn.Dense(self.vocab)(x)


def per_example_loss(model):
  """``(params, tokens) -> (B,)`` next-token cross-entropy per sequence."""

  def loss_fn(params, tokens):
    logits = model.apply(params, tokens[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]
    )
    return losses.mean(axis=1)

  return loss_fn


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def synthetic_tokens(key, n, vocab, length, noise=0.1):
  """Sequences counting up from a random start (mod vocab), some tokens
  replaced at random.
  """
  k_start, k_mask, k_rand = jax.random.split(key, 3)
  start = jax.random.randint(k_start, (n, 1), 0, vocab)
  seq = (start + jnp.arange(length + 1)[None]) % vocab
  replace = jax.random.bernoulli(k_mask, noise, seq.shape)
  return jnp.where(
    replace, jax.random.randint(k_rand, seq.shape, 0, vocab), seq
  )


def temp_bytes(compiled):
  """Compiled temporary memory of a program (XLA's memory analysis)."""
  return getattr(compiled.memory_analysis(), "temp_size_in_bytes", None)


def parse_args(argv=None):
  parser = flags.parser(__doc__)
  parser.add_argument(
    "--size",
    choices=sorted(SIZES),
    default="small",
    help="model and sequence size",
  )
  parser.add_argument(
    "--tied",
    action="store_true",
    help="read out through the token embedding (tied weights)",
  )
  flags.add_count(parser, "--steps", 200, "training steps")
  flags.add_count(parser, "--batch-size", 64, "sequences per step (B)")
  flags.add_dp(parser, noise_multiplier=0.5)
  flags.add_positive(parser, "--learning-rate", 3e-3, "Adam learning rate")
  flags.add_count(parser, "--log-every", 25, "steps between printed lines")
  flags.add_seed(parser, "seeds the data, the model and the noise")
  args = parser.parse_args(argv)
  flags.check_dp(parser, args)
  return args


def main(argv=None):
  args = parse_args(argv)

  size = SIZES[args.size]
  model = Transformer(**size, tied=args.tied)
  key = jax.random.PRNGKey(args.seed)
  k_init, k_data, k_test = jax.random.split(key, 3)
  # Jitted: eagerly, flax's init runs (and compiles) op by op.
  params = jax.jit(model.init)(
    k_init, jnp.zeros((1, size["length"]), jnp.int32)
  )
  loss_fn = per_example_loss(model)
  n_params = sum(x.size for x in jax.tree.leaves(params))

  ghost = optaxclip.clipped_grad(loss_fn, args.l2_clip, method="ghost")
  vmap = optaxclip.clipped_grad(loss_fn, args.l2_clip, method="vmap")
  plan = ghost.plan(
    params, jnp.zeros((args.batch_size, size["length"] + 1), jnp.int32)
  )
  noise = optaxclip.dp_noise(
    args.l2_clip,
    noise_multiplier=args.noise_multiplier,
    target_quantile=args.target_quantile,
    seed=args.seed,
  )
  adam = optax.adam(args.learning_rate)
  noise_state, adam_state = noise.init(params), adam.init(params)

  def train_step(clipped_grad):
    def step(params, noise_state, adam_state, tokens):
      grads, norms = clipped_grad(params, tokens, l2_clip=noise_state.clip_norm)
      grads, noise_state = noise.update(grads, noise_state, example_norms=norms)
      updates, adam_state = adam.update(grads, adam_state, params)
      return optax.apply_updates(params, updates), noise_state, adam_state

    return step

  batch0 = synthetic_tokens(
    k_data, args.batch_size, size["vocab"], size["length"]
  )
  # The training step compiled with each method: the ghost one trains, the
  # vmap one is compiled for its memory only.
  compiled = {
    name: jax.jit(train_step(f))
    .lower(params, noise_state, adam_state, batch0)
    .compile()
    for name, f in (("ghost", ghost), ("vmap", vmap))
  }
  memory = {name: temp_bytes(c) for name, c in compiled.items()}
  print(
    f"{args.size} transformer, {n_params} parameters; batch "
    f"{args.batch_size}; ghost covers {len(plan.ghosted)} parameter "
    f"arrays, exact fallback for {len(plan.fallback)}"
    + (f" ({', '.join(plan.fallback)})" if plan.fallback else "")
  )
  print(
    "compiled temporary memory of one clipped step: ghost "
    f"{memory['ghost'] / 2**20:.1f} MiB, vmap "
    f"{memory['vmap'] / 2**20:.1f} MiB"
  )

  step = compiled["ghost"]
  test = synthetic_tokens(k_test, 256, size["vocab"], size["length"])
  test_loss = jax.jit(lambda p: loss_fn(p, test).mean())
  print(f"step    0  test loss {float(test_loss(params)):.4f}", flush=True)
  start = time.perf_counter()
  for i in range(1, args.steps + 1):
    tokens = synthetic_tokens(
      jax.random.fold_in(k_data, i),
      args.batch_size,
      size["vocab"],
      size["length"],
    )
    params, noise_state, adam_state = step(
      params, noise_state, adam_state, tokens
    )
    if i % args.log_every == 0 or i == args.steps:
      logs = optaxclip.stats(noise_state)
      print(
        f"step {i:4d}  test loss {float(test_loss(params)):.4f}  "
        f"clip norm {float(logs['dp_noise/clip_norm']):.4f}  "
        f"clipped {float(logs['dp_noise/clip_fraction']):.2f}  "
        f"mean example norm {float(logs['dp_noise/norm']):.4f}",
        flush=True,
      )
  print(
    f"{args.steps} steps in {time.perf_counter() - start:.1f} s. "
    "No privacy accounting was done: see the module docstring."
  )


if __name__ == "__main__":
  main()
