"""Step time of ``guard``'s statistics: EMA against exact windows, per leaf.

The rolling window (``window=``) recomputes the mean and standard deviation
over its ``window`` values at every step (no running sums to drift); per
leaf (``scope="leaf"``) that is ``window`` x leaves values. This times a
jitted, donated step (update + apply_updates) of ``guard(adam)`` in several
configurations against the default one (EMA, whole step) on ``--leaves``
leaves of ``--size`` float32 elements. Variants run interleaved, round after
round; each figure is the median over rounds of its time over the default's
in the same round (the machine is shared and noisy).

    python benchmarks/studies/guard_step.py [--leaves 64] [--rounds 15]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import optaxclip


def variants(window):
  guard = lambda **kw: optaxclip.guard(optax.adam(1e-3), spike_z=6.0, **kw)
  return {
    "ema (default)": guard(),
    f"window={window}": guard(window=window),
    f"window={window}, loss": guard(window=window, loss_spike_z=6.0),
    "ema, scope=leaf": guard(scope="leaf"),
    f"window={window}, scope=leaf": guard(window=window, scope="leaf"),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--leaves", type=int, default=64)
  parser.add_argument("--size", type=int, default=16384)
  parser.add_argument("--window", type=int, default=128)
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--steps", type=int, default=20)
  args = parser.parse_args()
  params = {f"w{i}": jnp.ones((args.size,)) for i in range(args.leaves)}
  grads = jax.tree.map(lambda x: 0.01 * x, params)
  runs = {}
  for name, tx in variants(args.window).items():

    def step(p, s, g, tx=tx):
      updates, s = tx.update(g, s, p, value=jnp.float32(1.0))
      return optax.apply_updates(p, updates), s

    step = jax.jit(step, donate_argnums=(0, 1))
    p = jax.tree.map(jnp.copy, params)
    s = tx.init(p)
    p, s = step(p, s, grads)  # compile
    jax.block_until_ready(p)
    runs[name] = [step, p, s]
  ratios = {name: [] for name in runs}
  for _ in range(args.rounds):
    times = {}
    for name, run in runs.items():
      step, p, s = run
      start = time.perf_counter()
      for _ in range(args.steps):
        p, s = step(p, s, grads)
      jax.block_until_ready(p)
      times[name] = time.perf_counter() - start
      run[1], run[2] = p, s
    base = times["ema (default)"]
    for name, t in times.items():
      ratios[name].append(t / base)
  print(
    f"guard(adam) step, {args.leaves} leaves x {args.size} float32, median"
    f" over {args.rounds} rounds of time / default's:"
  )
  for name, r in ratios.items():
    print(f"  {name:28s} {statistics.median(r):.3f}x")


if __name__ == "__main__":
  main()
