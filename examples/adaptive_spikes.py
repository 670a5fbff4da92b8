"""Adaptive clippers on one gradient-norm stream with spikes.

A synthetic gradient (three leaves of different scales) whose global norm
decays from ~2 to ~0.7 with noise, with isolated spikes, a burst of three
spiky steps, a lasting jump, and one NaN step. Each adaptive clipper (and
``guard``) sees the same stream; the script prints, per step of interest, each
one's threshold and clip fraction (guard: whether it skipped), then totals.

    python examples/adaptive_spikes.py [--steps 200] [--png spikes.png]
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import _flags as flags
import optaxclip

SPIKES = {60: 8.0, 61: 1.5, 100: 25.0, 130: 4.0, 131: 6.0, 132: 5.0, 170: 3.0}
NAN_STEP = 150
JUMP_AT, JUMP = 180, 2.5  # from here on, norms are 2.5x larger for good


def norm_stream(steps, seed=0):
  rng = np.random.default_rng(seed)
  t = np.arange(steps)
  norms = (0.7 + 1.3 * np.exp(-t / 40)) * np.exp(
    0.12 * rng.standard_normal(steps)
  )
  for step, k in SPIKES.items():
    if step < steps:
      norms[step] *= k
  norms[t >= JUMP_AT] *= JUMP
  return norms


def gradient(norm, bad=False):
  """A 3-leaf tree with global norm ``norm`` (leaf shares 0.1, 0.3, ~0.95)."""
  shares = np.array([0.1, 0.3, np.sqrt(1 - 0.1**2 - 0.3**2)])
  g = {
    name: jnp.full((n,), norm * s / np.sqrt(n), jnp.float32)
    for name, n, s in zip(("bias", "embed", "kernel"), (4, 16, 64), shares)
  }
  if bad:
    g["kernel"] = g["kernel"].at[0].set(jnp.nan)
  return g


CLIPPERS = {
  "zclip": optaxclip.clip_zscore(),
  "zclip_pct": optaxclip.clip_zscore(mode="percentile"),
  "autoclip": optaxclip.clip_percentile(10.0, history=1024),
  "adagc": optaxclip.clip_relative(warmup_steps=25, warmup_max_norm=5.0),
  "guard": optaxclip.guard(optax.identity(), spike_z=3.0),
}


def run(steps):
  norms = norm_stream(steps)
  records = {name: [] for name in CLIPPERS}
  for name, tx in CLIPPERS.items():
    update = jax.jit(tx.update)
    state = tx.init(gradient(1.0))
    for t, n in enumerate(norms):
      _, state = update(gradient(n, bad=t == NAN_STEP), state)
      s = {
        k.split("/", 1)[1]: float(v) for k, v in optaxclip.stats(state).items()
      }
      if name == "guard":
        s["clip_fraction"] = float(s["consecutive_skips"] > 0)
      records[name].append(s)
  return norms, records


def print_table(norms, records):
  steps = len(norms)
  interesting = sorted(
    set(range(0, steps, 20))
    | {
      t + d
      for t in (*SPIKES, NAN_STEP, JUMP_AT)
      for d in (-1, 0, 1, 2)
      if 0 <= t + d < steps
    }
  )
  names = list(records)
  head = f"{'step':>4} {'norm':>8} | " + " | ".join(
    f"{n + ' thr':>13} {'clip':>4}" for n in names
  )
  print(head)
  print("-" * len(head))
  for t in interesting:
    cells = []
    for n in names:
      r = records[n][t]
      cells.append(f"{r['threshold']:13.3f} {r['clip_fraction']:4.2f}")
    mark = " nan" if t == NAN_STEP else ""
    print(f"{t:4d} {norms[t]:8.3f} | " + " | ".join(cells) + mark)
  print()
  print("clip fraction summed over the run (guard: steps skipped):")
  for n in names:
    total = sum(r["clip_fraction"] for r in records[n])
    print(f"  {n:10s} {total:7.2f} of {steps} steps")


def plot(norms, records, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
  top.semilogy(norms, "k.", label="gradient norm")
  for n, rs in records.items():
    top.semilogy([r["threshold"] for r in rs], label=f"{n} threshold")
    bottom.plot(
      [r["clip_fraction"] for r in rs], label=n, drawstyle="steps-mid"
    )
  top.set_ylabel("norm")
  top.legend(fontsize=8)
  bottom.set_ylabel("clip fraction / skipped")
  bottom.set_xlabel("step")
  bottom.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"wrote {path}")


def parse_args(argv=None):
  parser = flags.parser(__doc__)
  flags.add_count(
    parser,
    "--steps",
    200,
    "length of the norm stream (its spikes, NaN and "
    f"jump are at steps {min(SPIKES)} to {JUMP_AT})",
  )
  parser.add_argument(
    "--png", default=None, help="write a plot here (needs matplotlib)"
  )
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  norms, records = run(args.steps)
  print_table(norms, records)
  if args.png:
    plot(norms, records, args.png)


if __name__ == "__main__":
  main()
