"""Step time of the adaptive clippers chained before Adam, relative to Adam.

A jitted optimizer step (update + apply_updates) on float32 parameters split
into ``--leaves`` leaves. Variants run interleaved, round after round; the
figure reported for each is the median over rounds of its time divided by
Adam's time in the same round (timings on a shared machine are noisy).

    python benchmarks/adaptive_step_time.py [--params 6400000] [--leaves 64]

Leaves of at most 65536 elements (``_norms.SMALL_LEAF_SIZE``) are copied into
one buffer for the global norm; the default puts 100,000 in each.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import optaxclip


def variants():
  adam = optax.adam(1e-3)
  return {
      "adam": adam,
      "clip_global": optax.chain(optaxclip.clip_global(1.0), adam),
      "clip_zscore": optax.chain(optaxclip.clip_zscore(), adam),
      "clip_zscore leaf": optax.chain(optaxclip.clip_zscore(scope="leaf"),
                                      adam),
      "clip_percentile": optax.chain(optaxclip.clip_percentile(), adam),
      "clip_percentile leaf": optax.chain(
          optaxclip.clip_percentile(scope="leaf"), adam),
      "clip_relative": optax.chain(optaxclip.clip_relative(), adam),
      "guard(adam)": optaxclip.guard(adam, spike_z=3.0, max_norm=100.0),
      "optax.apply_if_finite": optax.apply_if_finite(adam, 10),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--params", type=int, default=6_400_000)
  parser.add_argument("--leaves", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=10)
  args = parser.parse_args()

  size = args.params // args.leaves
  key = jax.random.PRNGKey(0)
  params = {f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (size,))
            for i in range(args.leaves)}
  grads = jax.tree.map(lambda p: 0.01 * p, params)

  runs = {}
  for name, tx in variants().items():
    def step(params, state, grads, tx=tx):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
    step = jax.jit(step, donate_argnums=(0, 1))
    p = jax.tree.map(jnp.copy, params)
    state = tx.init(p)
    t0 = time.perf_counter()
    p, state = jax.block_until_ready(step(p, state, grads))
    runs[name] = [step, p, state]
    print(f"compiled {name:22s} {time.perf_counter() - t0:6.2f} s", flush=True)

  ratios = {name: [] for name in runs}
  for _ in range(args.rounds):
    times = {}
    for name, run in runs.items():
      step, p, state = run
      t0 = time.perf_counter()
      for _ in range(args.steps):
        p, state = step(p, state, grads)
      jax.block_until_ready(p)
      times[name] = (time.perf_counter() - t0) / args.steps
      run[1], run[2] = p, state
    for name, t in times.items():
      ratios[name].append(t / times["adam"])
  adam_ms = 1e3 * times["adam"]
  print(f"\n{args.params:,} float32 params in {args.leaves} leaves; adam "
        f"~{adam_ms:.1f} ms/step (last round); median of {args.rounds} rounds:")
  for name, r in ratios.items():
    print(f"  {name:22s} {statistics.median(r):5.2f}x adam")


if __name__ == "__main__":
  main()
