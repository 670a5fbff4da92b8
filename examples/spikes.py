"""Loss spikes from bad batches, and what each defence does about them.

A small Flax transformer learns to continue synthetic sequences (a random
pattern of ``PERIOD`` tokens, repeated). At three known steps a burst of
``BURST`` bad batches arrives: their inputs scaled by ``--bad-scale`` (the
embeddings, before the positions are added), their labels replaced by random
tokens, or both. Every variant trains from the same initial weights on the
same batches:

* ``adam``: no defence;
* ``clip_global``: the global norm clipped to 1 before Adam;
* ``clip_zscore``: ZClip before Adam;
* ``guard``: the whole step skipped when the gradient norm spikes (z > 3);
* ``guard_loss``: skipped when the loss spikes (z > 3 over an exact window
  of the last 32 accepted losses; the loss is passed as ``value=``);
* ``guard_leaf``: ``scope="leaf"``, only the tensors whose gradient spikes
  are skipped;
* ``spam``, ``stable_spam``: the spike-aware Adam variants.

The loss-aware and per-tensor guards need a ``guard`` with ``loss_spike_z``,
``window`` and ``scope``; with an older one they are left out (the script
says so).

The script prints a table -- the final loss on a fixed clean batch; the
steps each variant needs, from the first bad batch of a burst, to come back
within 5% of the loss before it (the worst over the bursts, ``never`` if it
does not before the next burst or the end); the steps skipped; the time of a
step over Adam's (the median of per-round ratios, the variants timed in turn
in each round; noisy on a shared machine) -- and writes a PNG of the
clean-batch loss, the bad batches marked.

Run: ``python examples/spikes.py`` (a few minutes on 2 CPU cores);
``--steps 12 --layers 1`` for a smoke test.
"""

import inspect
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax

import _flags as flags
import optaxclip

matplotlib.use("Agg")
import matplotlib.pyplot as plt

VOCAB = 16
PERIOD = 3  # the pattern's length: the first PERIOD targets are guesses
RECOVERY = 1.05  # back within 5% of the loss before the bad batch
BURST = 2  # bad batches in a row


class Block(nn.Module):
  dim: int
  heads: int

  @nn.compact
  def __call__(self, x):
    causal = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    y = nn.SelfAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=causal)
    x = x + y
    y = nn.Dense(4 * self.dim)(nn.LayerNorm()(x))
    return x + nn.Dense(self.dim)(nn.gelu(y))


class Transformer(nn.Module):
  dim: int
  heads: int
  layers: int
  length: int

  @nn.compact
  def __call__(self, tokens, input_scale=1.0):
    x = nn.Embed(VOCAB, self.dim)(tokens) * input_scale
    pos = self.param(
      "pos", nn.initializers.normal(0.02), (self.length, self.dim)
    )
    x = x + pos[: tokens.shape[1]]
    for _ in range(self.layers):
      x = Block(self.dim, self.heads)(x)
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def batch(rng, size, length):
  """Inputs and next-token targets of repeated random patterns."""
  pattern = rng.integers(0, VOCAB, size=(size, PERIOD))
  reps = -(-(length + 1) // PERIOD)
  seq = np.tile(pattern, (1, reps))[:, : length + 1]
  return jnp.asarray(seq[:, :-1]), jnp.asarray(seq[:, 1:])


def bad_steps(steps):
  """First step -> (kind, inputs scaled, labels corrupted) of each burst of
  BURST bad batches.
  """
  return {
    int(steps * 0.3): ("scaled", True, False),
    int(steps * 0.5): ("labels", False, True),
    int(steps * 0.7): ("both", True, True),
  }


def _has_guard_options():
  """Whether this optaxclip's guard is loss-aware and per tensor."""
  names = inspect.signature(optaxclip.guard).parameters
  return all(n in names for n in ("loss_spike_z", "window", "scope"))


# Name -> (optimizer from the learning rate, whether its update takes the
# loss as value=, whether it needs guard's loss_spike_z, window and scope).
VARIANTS = {
  "adam": (optax.adam, False, False),
  "clip_global": (
    lambda lr: optax.chain(optaxclip.clip_global(1.0), optax.adam(lr)),
    False,
    False,
  ),
  "clip_zscore": (
    lambda lr: optax.chain(optaxclip.clip_zscore(), optax.adam(lr)),
    False,
    False,
  ),
  "guard": (
    lambda lr: optaxclip.guard(optax.adam(lr), spike_z=3.0),
    False,
    False,
  ),
  "guard_loss": (
    lambda lr: optaxclip.guard(optax.adam(lr), loss_spike_z=3.0, window=32),
    True,
    True,
  ),
  "guard_leaf": (
    lambda lr: optaxclip.guard(optax.adam(lr), spike_z=3.0, scope="leaf"),
    False,
    True,
  ),
  "spam": (
    lambda lr: optaxclip.spam(lr, reset_interval=100, warmup_steps=10),
    False,
    False,
  ),
  "stable_spam": (
    lambda lr: optaxclip.stable_spam(lr, reset_interval=100),
    False,
    False,
  ),
}


def train(model, params, tx, takes_loss, data, clean_loss):
  """The clean-batch loss after each step, and (step, params, state)."""

  @jax.jit
  def step(params, opt_state, tokens, targets, scale):
    def loss_fn(p):
      logits = model.apply({"params": p}, tokens, scale)
      return optax.softmax_cross_entropy_with_integer_labels(
        logits, targets
      ).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    extra = {"value": loss} if takes_loss else {}
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  losses = []
  for tokens, targets, scale in data:
    params, opt_state = step(params, opt_state, tokens, targets, scale)
    losses.append(float(clean_loss(params)))
  return np.array(losses), (step, params, opt_state)


def recovery(losses, bad):
  """The worst, over the bursts, of the steps from a burst's first bad batch
  until the clean loss is back within 5% of its value before the burst, to
  stay there until the next burst (0: it never left; None: not back before
  the next burst or the end).
  """
  starts = sorted(bad)
  worst = 0
  for i, b in enumerate(starts):
    end = starts[i + 1] if i + 1 < len(starts) else len(losses)
    limit = RECOVERY * losses[b - 1]
    above = [k for k in range(end - b) if losses[b + k] > limit]
    if above and above[-1] == end - b - 1:
      return None
    worst = max(worst, above[-1] + 1 if above else 0)
  return worst


def relative_cost(steps, data, rounds=15, repeat=3):
  """Each variant's step time over Adam's: the median, over rounds in which
  every variant runs ``repeat`` steps in turn, of the per-round ratio (the
  machine's load changes between runs, much less within a round).
  """
  tokens, targets, scale = data[0]
  ratios = {name: [] for name in steps}
  for _ in range(rounds):
    times = {}
    for name, (step, params, opt_state) in steps.items():
      start = time.perf_counter()
      for _ in range(repeat):
        out = step(params, opt_state, tokens, targets, scale)
      jax.block_until_ready(out)
      times[name] = time.perf_counter() - start
    for name in steps:
      ratios[name].append(times[name] / times["adam"])
  return {name: float(np.median(r)) for name, r in ratios.items()}


def skipped(opt_state):
  logs = optaxclip.stats(opt_state)
  return int(logs["guard/skipped"]) if "guard/skipped" in logs else 0


def parse_args(argv=None):
  parser = flags.parser(__doc__)
  flags.add_count(
    parser,
    "--steps",
    400,
    "training steps of each variant (bad batches at 30, 50 and 70%%)",
    low=10,
  )
  flags.add_count(parser, "--batch", 32, "sequences per batch")
  flags.add_count(parser, "--seq-len", 24, "tokens per sequence", PERIOD + 1)
  flags.add_count(parser, "--dim", 32, "the model's width")
  flags.add_count(parser, "--heads", 2, "attention heads")
  flags.add_count(parser, "--layers", 2, "transformer blocks")
  flags.add_positive(parser, "--lr", 1e-2, "the learning rate of every variant")
  flags.add_positive(
    parser, "--bad-scale", 100.0, "factor on a bad batch's input embeddings"
  )
  flags.add_seed(
    parser, "seed of the init and the data (the same for every variant)"
  )
  parser.add_argument(
    "--out", default="spikes.png", help="the PNG of the loss curves"
  )
  flags.add_variants(
    parser, VARIANTS, " (adam always runs: the baseline of the cost column)"
  )
  args = parser.parse_args(argv)
  if args.dim % args.heads:
    parser.error(
      f"argument --dim: must be a multiple of --heads; got {args.dim}"
    )
  return args


def main():
  args = parse_args()
  rng = np.random.default_rng(args.seed)
  model = Transformer(args.dim, args.heads, args.layers, args.seq_len)
  tokens, _ = batch(rng, args.batch, args.seq_len)
  params = model.init(jax.random.PRNGKey(args.seed), tokens)["params"]
  evaluation = batch(rng, 256, args.seq_len)

  @jax.jit
  def clean_loss(params):
    tokens, targets = evaluation
    logits = model.apply({"params": params}, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, targets
    ).mean()

  bad = bad_steps(args.steps)
  data = []
  in_burst = {b + k: bad[b] for b in bad for k in range(BURST)}
  for t in range(args.steps):
    tokens, targets = batch(rng, args.batch, args.seq_len)
    scale = 1.0
    if t in in_burst:
      _, scaled, corrupt = in_burst[t]
      scale = args.bad_scale if scaled else 1.0
      if corrupt:
        targets = jnp.asarray(rng.integers(0, VOCAB, size=targets.shape))
    data.append((tokens, targets, jnp.float32(scale)))

  names = ["adam"] + [n for n in args.variants if n != "adam"]
  left_out = [n for n in names if VARIANTS[n][2] and not _has_guard_options()]
  if left_out:
    print(
      f"left out: {', '.join(left_out)} (this optaxclip's guard has no "
      "loss_spike_z, window or scope)"
    )
  chosen = {
    n: (VARIANTS[n][0](args.lr), VARIANTS[n][1])
    for n in names
    if n not in left_out
  }
  results = {}
  for name, (tx, takes_loss) in chosen.items():
    results[name] = train(model, params, tx, takes_loss, data, clean_loss)
  cost = relative_cost({n: r[1] for n, r in results.items()}, data)

  starts = ", ".join(f"{b + 1} ({bad[b][0]})" for b in bad)
  print(f"bad batches ({BURST} in a row) from steps {starts}")
  header = (
    f"{'variant':<12} {'final loss':>10} {'recover':>8} {'skipped':>8} "
    f"{'cost':>6}"
  )
  print(header)
  for name, (losses, (_, _, opt_state)) in results.items():
    steps_back = recovery(losses, bad)
    print(
      f"{name:<12} {losses[-1]:>10.4f} "
      f"{'never' if steps_back is None else steps_back:>8} "
      f"{skipped(opt_state):>8} {cost[name]:>5.2f}x"
    )

  fig, ax = plt.subplots(figsize=(8, 4.5))
  for name, (losses, _) in results.items():
    ax.plot(np.arange(1, args.steps + 1), losses, label=name, lw=1)
  for b, (kind, _, _) in bad.items():
    ax.axvspan(b + 0.5, b + BURST + 0.5, color="0.85", lw=0)
    ax.annotate(kind, (b + 1, 1.0), xycoords=("data", "axes fraction"))
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel("loss on a clean batch")
  ax.legend(fontsize=8, ncol=2)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  fig.savefig(args.out, dpi=100)
  print(f"plot: {args.out}")


if __name__ == "__main__":
  main()
