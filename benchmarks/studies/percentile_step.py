"""Step time of ``clip_percentile(scope="leaf")`` on many tiny leaves.

Does keeping the per-leaf window sorted (one removal and one insertion a
step) pay over sorting the whole history (``history`` x leaves) every step?
This times a jitted, donated step
(update + apply_updates) of ``chain(clipper, adam)`` against adam's on
``--leaves`` leaves of 4 float32 elements, for several ``history`` lengths,
and the old rule (a full sort of the window per step, restated here as
``sorting_percentile``) at the first length. Variants run interleaved,
round after round; each figure is the median over rounds of its time over
adam's in the same round (the machine is shared and noisy).

    python benchmarks/studies/percentile_step.py --leaves 300 --histories 1024
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import optaxclip
from optaxclip import _adaptive
from optaxclip import _norms


def sorting_percentile(percentile, history):
  """The old per-leaf rule's cost: a ring buffer sorted in full every step."""

  def init(params):
    n = len(jax.tree.leaves(params))
    return (
      jnp.zeros((), jnp.int32),
      jnp.zeros((), jnp.int32),
      jnp.zeros((history, n), jnp.float32),
    )

  def update(updates, state, params=None):
    del params
    filled, index, buf = state
    leaves, treedef = jax.tree.flatten(updates)
    norms = jnp.stack([n.reshape(()) for n in _norms.unit_norms(leaves)])
    buf = buf.at[index].set(norms)
    filled = jnp.minimum(filled + 1, history)
    threshold = _adaptive.percentile_linear(buf, filled, percentile)
    factor = _norms.clip_factor(norms, threshold)
    out = [x * factor[i] for i, x in enumerate(leaves)]
    return (
      jax.tree.unflatten(treedef, out),
      (filled, (index + 1) % history, buf),
    )

  return optax.GradientTransformation(init, update)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--leaves",
    type=int,
    default=300,
    help="number of leaves of 4 elements (default 300)",
  )
  parser.add_argument(
    "--histories",
    default="1024,256,4096",
    help="history lengths, comma-separated",
  )
  parser.add_argument(
    "--rounds", type=int, default=15, help="interleaved rounds (default 15)"
  )
  parser.add_argument(
    "--steps",
    type=int,
    default=20,
    help="steps per variant per round (default 20)",
  )
  args = parser.parse_args()
  histories = [int(h) for h in args.histories.split(",")]
  adam = optax.adam(1e-3)
  variants = {"adam": adam}
  for h in histories:
    variants[f"clip_percentile leaf, history {h}"] = optax.chain(
      optaxclip.clip_percentile(10.0, history=h, scope="leaf"), adam
    )
  variants[f"old: full sort, history {histories[0]}"] = optax.chain(
    sorting_percentile(10.0, histories[0]), adam
  )

  params = {
    f"w{i}": jnp.full((4,), 0.1 * (i + 1), jnp.float32)
    for i in range(args.leaves)
  }
  grads = jax.tree.map(lambda p: p * 0.01, params)
  runners = {}
  for name, tx in variants.items():

    def step(p, s, g, tx=tx):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    jitted = jax.jit(step, donate_argnums=(0, 1))
    t0 = time.perf_counter()
    p, s = jitted(jax.tree.map(jnp.copy, params), tx.init(params), grads)
    jax.block_until_ready(p)
    print(f"compiled {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    runners[name] = [jitted, p, s]

  ratios = {name: [] for name in variants if name != "adam"}
  times = {name: [] for name in variants}
  for _ in range(args.rounds):
    round_times = {}
    for name, runner in runners.items():
      jitted, p, s = runner
      t0 = time.perf_counter()
      for _ in range(args.steps):
        p, s = jitted(p, s, grads)
      jax.block_until_ready(p)
      round_times[name] = (time.perf_counter() - t0) / args.steps
      runner[1], runner[2] = p, s
    for name, t in round_times.items():
      times[name].append(t)
      if name != "adam":
        ratios[name].append(t / round_times["adam"])
  print(f"\n{args.leaves} leaves of 4 float32, median of {args.rounds} rounds:")
  print(f"  adam: {statistics.median(times['adam']) * 1e3:.2f} ms/step")
  for name, r in ratios.items():
    print(
      f"  {name}: {statistics.median(times[name]) * 1e3:.2f} ms/step, "
      f"{statistics.median(r):.2f}x adam"
    )


if __name__ == "__main__":
  main()
