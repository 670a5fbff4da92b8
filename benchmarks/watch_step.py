"""Step time of ``watch()`` at the end of ``chain(clip_global, adam)``.

Times a jitted, donated step (update + apply_updates) of
``chain(clip_global(1.0), adam)`` with and without ``watch()`` (and with
``watch(leaf_stats=True)``, and with the floor of any watch: a
transformation that keeps the plain-JAX norm of the update) at its end,
interleaved with adam's step round after round (``harness.time_variants``).
Each figure is the median over rounds of the step's time with watch over its
time without, in the same round (the machine is shared and noisy), with the
quartiles.

    python benchmarks/watch_step.py [--rounds 40] [--leaves 64] [--size 400000]
"""

import argparse
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import harness
import optaxclip


def update_norm_floor() -> optax.GradientTransformation:
  """The floor of any watch: a transformation that keeps the plain-JAX
  ``sqrt(sum(u * u))`` of the update in its state and returns the update.
  """

  def update(updates, state, params=None):
    del state, params
    squares = [jnp.sum(jnp.square(x)) for x in jax.tree.leaves(updates)]
    return updates, jnp.sqrt(sum(squares))

  return optax.GradientTransformation(
    lambda params: jnp.zeros((), jnp.float32), update
  )


def variants():
  clip = lambda: optaxclip.clip_global(1.0)
  return {
    "adam": (harness.adam, False),
    "clip_global": (lambda: optax.chain(clip(), harness.adam()), False),
    "clip_global + watch": (
      lambda: optax.chain(clip(), harness.adam(), optaxclip.watch()),
      False,
    ),
    "clip_global + plain update norm (floor)": (
      lambda: optax.chain(clip(), harness.adam(), update_norm_floor()),
      False,
    ),
    "clip_global + watch(leaf_stats)": (
      lambda: optax.chain(
        clip(), harness.adam(), optaxclip.watch(leaf_stats=True)
      ),
      False,
    ),
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  harness.add_tree_a_arguments(parser, rounds=40)
  args = parser.parse_args(argv)
  params, grads = harness.tree_a(parser, args)
  results = harness.time_variants(
    variants(), params, grads, rounds=args.rounds, budget_s=60.0
  )
  base = results["clip_global"]
  lines = [
    *harness.machine_lines(),
    f"- Command: `python benchmarks/watch_step.py {' '.join(sys.argv[1:])}`",
    (
      f"- Tree: {args.leaves} float32 leaves of {args.size} elements, "
      f"{args.rounds} interleaved rounds"
    ),
    "",
    "| step | over chain(clip_global, adam) (median, IQR) | over adam |",
    "|---|---|---|",
  ]
  for name in (
    "clip_global + plain update norm (floor)",
    "clip_global + watch",
    "clip_global + watch(leaf_stats)",
  ):
    ratios = [a / b for a, b in zip(results[name].ratios, base.ratios)]
    q1, q3 = np.percentile(ratios, [25, 75])
    lines.append(
      f"| {name} | {statistics.median(ratios):.3f}x ({q1:.3f}–{q3:.3f}) | "
      f"{harness.fmt_ratio(results[name])} |"
    )
  lines.append(f"| clip_global | 1 | {harness.fmt_ratio(base)} |")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
