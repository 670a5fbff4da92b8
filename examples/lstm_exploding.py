"""Exploding gradients in an LSTM, and where the clipping goes.

"My RNN's gradients may explode: where do I put the clipping, and must I write
my own optimizer?"  In optax, clipping is one more transformation, chained
before the optimizer; it acts after the gradients are computed and before the
optimizer uses them:

    tx = optax.chain(optaxclip.clip_global(1.0), optax.adam(lr))
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)

This script trains the same LSTM (``flax.linen.RNN`` over ``OptimizedLSTMCell``)
on the adding problem (Hochreiter & Schmidhuber, 1997) once per variant -- no
clipping, then each clipper -- with the same initial weights, batches and
learning rate. The recurrent kernel starts at INIT_SCALE times Flax's
orthogonal initialisation, where the first gradients explode to norms of
hundreds to tens of thousands, against ~0.3 once training settles
(``--init-scale 1`` shows the ordinary LSTM, whose gradients do not explode).

Adam does not diverge on such a gradient -- its step is bounded by the
learning rate -- but its second-moment estimate keeps the exploded squares
for thousands of steps (b2 = 0.999), and divides every later step by them:
the unclipped run stalls, at the loss of predicting the mean on most seeds.
Clipped before Adam, the first gradients stay at the scale of the later ones.

The script prints a table read from ``optaxclip.stats()`` and writes a PNG of
the loss and the pre-clip gradient norm of every variant. The unclipped run
logs its norm too: it chains ``clip_global(inf)``, which clips nothing but
records the norm, as ``torch.nn.utils.clip_grad_norm_(params, inf)`` returns
it.

Run: ``python examples/lstm_exploding.py`` (about 80 s on 2 CPU cores);
``--steps 20`` for a smoke test.
"""

import math
import os
import time

import flax.linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from tqdm import tqdm

import _flags as flags
import optaxclip

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HIDDEN = 32
BATCH = 32
INIT_SCALE = 3.75  # times the orthogonal init of the recurrent kernel
# The usual LSTM practice (Gers et al. 2000; Jozefowicz et al. 2015; Keras'
# unit_forget_bias): the forget gate starts open, so the cell remembers.
FORGET_BIAS = 1.0
# Predicting the mean (1.0) of the sum of two U(0, 1) values scores its
# variance, 1/6: a run whose loss stays there has learned nothing.
BASELINE = 1 / 6

# Each variant turns the optimizer into the `tx` of its TrainState.
# clip_norm and clip_global at 1.0, a few times the global norm of ordinary
# steps (~0.3); clip_value at 0.01, where it trims most steps' largest
# elements; the adaptive clippers with their defaults, ZClip with the cap of
# its reference implementation (max_norm=1.0), guard with a 3-sigma bound.
VARIANTS = {
  "none": lambda opt: optax.chain(optaxclip.clip_global(math.inf), opt),
  "clip_value": lambda opt: optax.chain(optaxclip.clip_value(0.01), opt),
  "clip_norm": lambda opt: optax.chain(optaxclip.clip_norm(1.0), opt),
  "clip_global": lambda opt: optax.chain(optaxclip.clip_global(1.0), opt),
  "clip_zscore": lambda opt: optax.chain(
    optaxclip.clip_zscore(max_norm=1.0), opt
  ),
  "clip_percentile": lambda opt: optax.chain(
    optaxclip.clip_percentile(10.0), opt
  ),
  "clip_relative": lambda opt: optax.chain(optaxclip.clip_relative(), opt),
  "guard": lambda opt: optaxclip.guard(opt, spike_z=3.0),
}


class LSTMRegressor(nn.Module):
  """Reads a sequence of (value, mark) pairs and predicts one number."""

  hidden: int = HIDDEN
  init_scale: float = INIT_SCALE

  @nn.compact
  def __call__(self, x):
    cell = nn.OptimizedLSTMCell(
      self.hidden,
      recurrent_kernel_init=nn.initializers.orthogonal(self.init_scale),
    )
    h = nn.RNN(cell)(x)
    return nn.Dense(1)(h[:, -1])[:, 0]


def init_params(model, key, x):
  params = model.init(key, x)
  cell = params["params"]["OptimizedLSTMCell_0"]
  cell["hf"]["bias"] = cell["hf"]["bias"] + FORGET_BIAS
  return params


def adding_batch(key, batch, seq_len):
  """The adding problem: sum the two values whose mark is 1.

  One mark falls in each half of the sequence, so the answer depends on
  inputs ~seq_len / 2 steps apart.
  """
  k_values, k_first, k_second = jax.random.split(key, 3)
  values = jax.random.uniform(k_values, (batch, seq_len))
  first = jax.random.randint(k_first, (batch, 1), 0, seq_len // 2)
  second = jax.random.randint(k_second, (batch, 1), seq_len // 2, seq_len)
  position = jnp.arange(seq_len)
  marks = ((position == first) | (position == second)).astype(jnp.float32)
  return jnp.stack([values, marks], axis=-1), jnp.sum(values * marks, axis=1)


def pre_clip_norm(stats):
  """The gradient norm the variant's clipper measured before clipping."""
  return next(v for k, v in stats.items() if k.endswith("/norm"))


def was_clipped(stats):
  """Whether the clipper changed anything this step (guard: skipped it)."""
  return (
    sum(
      v
      for k, v in stats.items()
      if k.endswith(("/clip_fraction", "/consecutive_skips"))
    )
    > 0
  )


def make_train_chunk(model, batch, seq_len):
  """A jitted function that runs a few steps of every variant side by side.

  Every variant sees the same batch; their forward and backward passes run as
  one vmapped computation, then each TrainState applies its own `tx`.
  """

  def loss_fn(params, x, y):
    return jnp.mean((model.apply(params, x) - y) ** 2)

  grad_fn = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(0, None, None))

  def step(states, key):
    x, y = adding_batch(key, batch, seq_len)
    params = jax.tree.map(lambda *p: jnp.stack(p), *[s.params for s in states])
    losses, grads = grad_fn(params, x, y)
    states = [
      s.apply_gradients(grads=jax.tree.map(lambda g, i=i: g[i], grads))
      for i, s in enumerate(states)
    ]
    all_stats = [optaxclip.stats(s.opt_state) for s in states]
    norms = jnp.stack([pre_clip_norm(st) for st in all_stats])
    clipped = jnp.stack([was_clipped(st) for st in all_stats])
    return states, (losses, norms, clipped)

  @jax.jit
  def train_chunk(states, keys):
    return jax.lax.scan(step, states, keys)

  return train_chunk


def train(names, steps, seq_len, lr, seed, init_scale=INIT_SCALE):
  """Trains every named variant; returns per-step losses, norms, clip flags."""
  key = jax.random.PRNGKey(seed)
  init_key, data_key = jax.random.fold_in(key, 1), jax.random.fold_in(key, 2)
  model = LSTMRegressor(init_scale=init_scale)
  params = init_params(model, init_key, adding_batch(key, 2, seq_len)[0])
  states = [
    train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=VARIANTS[n](optax.adam(lr))
    )
    for n in names
  ]
  train_chunk = make_train_chunk(model, BATCH, seq_len)
  chunk = max(d for d in range(1, 26) if steps % d == 0)
  records = []
  with tqdm(
    total=steps, desc=f"training {len(names)} variants", unit="step"
  ) as bar:
    for start in range(0, steps, chunk):
      keys = jax.vmap(lambda i: jax.random.fold_in(data_key, i))(
        jnp.arange(start, start + chunk)
      )
      states, record = train_chunk(states, keys)
      records.append(jax.device_get(record))
      bar.update(chunk)
  losses, norms, clipped = (np.concatenate(r) for r in zip(*records))
  return losses, norms, clipped


def summarize(names, losses, norms, clipped):
  """One row per variant: the figures of the table."""
  tail = max(1, len(losses) // 10)
  rows = []
  for i, name in enumerate(names):
    loss = losses[:, i]
    final = float(np.mean(loss[-tail:]))
    diverged = not np.all(np.isfinite(loss)) or final > 10 * BASELINE
    rows.append(
      {
        "variant": name,
        "final loss": final,
        "best loss": float(np.nanmin(loss))
        if np.any(np.isfinite(loss))
        else math.nan,
        "max pre-clip norm": float(np.nanmax(norms[:, i])),
        "steps clipped": float(np.mean(clipped[:, i])),
        "diverged": "yes" if diverged else "no",
        "learned": "yes" if final < BASELINE / 10 else "no",
      }
    )
  return rows


def format_table(rows):
  def cell(key, value):
    if key == "steps clipped":
      return f"{100 * value:.0f}%"
    if isinstance(value, float):
      return f"{value:.3g}"
    return str(value)

  keys = list(rows[0])
  cells = [[cell(k, r[k]) for k in keys] for r in rows]
  widths = [
    max(len(k), *(len(c[j]) for c in cells)) for j, k in enumerate(keys)
  ]
  lines = [
    "  ".join(
      k.ljust(w) if j == 0 else k.rjust(w)
      for j, (k, w) in enumerate(zip(keys, widths))
    )
  ]
  lines.append("  ".join("-" * w for w in widths))
  for c in cells:
    lines.append(
      "  ".join(
        v.ljust(w) if j == 0 else v.rjust(w)
        for j, (v, w) in enumerate(zip(c, widths))
      )
    )
  return "\n".join(lines)


def plot(names, losses, norms, path, title):
  """Loss (smoothed) and pre-clip gradient norm of every variant, log scale."""
  smooth = min(20, len(losses))
  kernel = np.ones(smooth) / smooth
  fig, (ax_loss, ax_norm) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
  for i, name in enumerate(names):
    style = (
      {"color": "black", "linewidth": 2.0, "zorder": 3}
      if name == "none"
      else {"linewidth": 1.2}
    )
    loss = np.convolve(losses[:, i], kernel, mode="valid")
    ax_loss.plot(np.arange(smooth - 1, len(losses)), loss, label=name, **style)
    ax_norm.plot(norms[:, i], alpha=0.7, **{**style, "linewidth": 0.8})
  ax_loss.axhline(BASELINE, color="gray", linestyle="--", linewidth=1)
  ax_loss.annotate(
    "predicting the mean",
    (1.0, BASELINE),
    color="gray",
    xycoords=("axes fraction", "data"),
    ha="right",
    va="bottom",
    xytext=(-4, 4),
    textcoords="offset points",
  )
  ax_loss.set(
    yscale="log", ylabel=f"loss (mean of {smooth} steps)", title=title
  )
  ax_norm.set(
    yscale="log",
    xlabel="step",
    ylabel="pre-clip gradient norm\n(clip_value: largest |g|)",
  )
  ax_loss.legend(
    loc="upper left",
    bbox_to_anchor=(1.01, 1.0),
    fontsize="small",
    frameon=False,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def parse_args(argv=None):
  parser = flags.parser(__doc__)
  flags.add_count(parser, "--steps", 1500, "training steps of each variant")
  flags.add_count(
    parser, "--seq-len", 100, "length of the adding problem's sequences", low=2
  )
  flags.add_positive(parser, "--lr", 2e-2, "Adam's learning rate")
  flags.add_seed(
    parser, "seed of the init and the data (the same for every variant)"
  )
  flags.add_positive(
    parser,
    "--init-scale",
    INIT_SCALE,
    "the recurrent kernel's orthogonal init scale; 1 is "
    "Flax's default, where gradients do not explode",
  )
  flags.add_variants(parser, VARIANTS)
  flags.add_out(parser, "lstm_exploding.png", "where to write the PNG")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  names = args.variants

  print(
    f"adding problem, sequence length {args.seq_len}; LSTM({HIDDEN}), "
    f"recurrent init x{args.init_scale}, forget bias {FORGET_BIAS}; Adam "
    f"lr {args.lr}; batch {BATCH}; {args.steps} steps; seed {args.seed}"
  )
  start = time.perf_counter()
  losses, norms, clipped = train(
    names, args.steps, args.seq_len, args.lr, args.seed, args.init_scale
  )
  rows = summarize(names, losses, norms, clipped)
  print()
  print(format_table(rows))
  print(
    f"\nfinal loss: mean of the last 10% of steps. learned: a final loss "
    f"below {BASELINE / 10:.3g}\n(predicting the mean scores "
    f"{BASELINE:.3g}). diverged: a non-finite loss, or a final loss above "
    f"{10 * BASELINE:.3g}.\nclip_value's pre-clip norm is its largest |g|; "
    "guard's clipped steps are the steps it skipped."
  )
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  plot(
    names,
    losses,
    norms,
    args.out,
    f"LSTM on the adding problem (T={args.seq_len}), recurrent init "
    f"x{args.init_scale}, Adam lr {args.lr}, seed {args.seed}",
  )
  print(f"plot: {os.path.abspath(args.out)}")
  print(f"took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
