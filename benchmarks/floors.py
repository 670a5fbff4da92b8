"""What the clippers' step times are made of: floors and ablations.

``benchmarks/run.py`` compares each clipper with adam; this script explains
the gaps to the targets, on tree (a) of run.py (64 float32 leaves of 400k),
timed the same way (``benchmarks/harness.py``: each variant's step between
two adam steps, median of per-round ratios, one process). Each ablation is
written here, in plain JAX, as the same clipper without one of its parts:

* ``read``: adam plus one float32 sum-of-squares pass over the gradients
  whose result is not used (the cost of reading the gradients once);
* ``global, no overflow check``: the global-norm clip as one plain pass,
  ``g * min(1, c / sqrt(sum g**2))``, without optaxclip's overflow/underflow
  check (a ``lax.cond`` that recomputes the norm exactly when the fast sum
  is not finite or too small): the price of that safety;
* ``per-leaf norms, no check``: the same for ``clip_norm``. Without the check,
  each leaf's clip waits only for its own reduction and XLA overlaps it with
  the other leaves' adam arithmetic, so the read pass disappears; with the
  check (one ``lax.cond`` for the tree), every leaf waits for all;
* ``clip_value`` statistics: the element clip alone (as ``optax.clip``), with
  ``max |g|`` only, and with ``max |g|`` and the count of clipped elements
  (what optaxclip records; one two-output reduction).

Usage: ``python benchmarks/floors.py [--rounds N]`` (about 2 minutes on 2
CPU cores). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

# This checkout's optaxclip and benchmarks, not installed ones:
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import optax

import harness
import optaxclip

MAX_NORM = 1.0  # the global norm of the gradients below is ~5: always clipped
MAX_LEAF_NORM = 0.1  # each leaf's norm is ~0.63
MAX_DELTA = 1e-3  # the gradients are N(0, 1e-3): about a third is clipped


def _stateless(update):
  return optax.GradientTransformation(
    lambda params: jnp.zeros((), jnp.float32), update
  )


def global_without_check():
  def update(updates, state, params=None):
    del state, params
    leaves = jax.tree.leaves(updates)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in leaves))
    factor = jnp.where(norm > MAX_NORM, MAX_NORM / norm, 1.0)
    return jax.tree.map(lambda x: x * factor, updates), norm

  return _stateless(update)


def per_leaf_without_check():
  def update(updates, state, params=None):
    del state, params

    def clip(x):
      norm = jnp.sqrt(jnp.sum(jnp.square(x)))
      return x * jnp.where(norm > MAX_LEAF_NORM, MAX_LEAF_NORM / norm, 1.0)

    return jax.tree.map(clip, updates), jnp.zeros((), jnp.float32)

  return _stateless(update)


def value_clip(stats: str):
  """The element clip with no statistics, ``max |g|``, or max and count."""

  def update(updates, state, params=None):
    del state, params
    leaves = jax.tree.leaves(updates)
    largest = jnp.zeros((), jnp.float32)
    count = jnp.zeros((), jnp.float32)
    for x in leaves:
      if stats == "max":
        largest = jnp.maximum(largest, jnp.max(jnp.abs(x)))
      elif stats == "max+count":
        biggest, over = optaxclip._norms.largest_and_count_above(x, MAX_DELTA)
        largest, count = jnp.maximum(largest, biggest), count + over
    clipped = jax.tree.map(
      lambda x: jnp.clip(x, -MAX_DELTA, MAX_DELTA), updates
    )
    return clipped, largest + count

  return _stateless(update)


VARIANTS = {
  "adam + read (floor)": harness.chained(harness.read_only),
  "global, no overflow check": harness.chained(global_without_check),
  "optaxclip.clip_global": harness.chained(
    lambda: optaxclip.clip_global(MAX_NORM)
  ),
  "per-leaf norms, no check": harness.chained(per_leaf_without_check),
  "optaxclip.clip_norm": harness.chained(
    lambda: optaxclip.clip_norm(MAX_LEAF_NORM)
  ),
  "element clip, no statistics": harness.chained(lambda: value_clip("none")),
  "element clip + max(abs(g))": harness.chained(lambda: value_clip("max")),
  "element clip + max(abs(g)) + count": harness.chained(
    lambda: value_clip("max+count")
  ),
  "optaxclip.clip_value": harness.chained(
    lambda: optaxclip.clip_value(MAX_DELTA)
  ),
  "optax.clip": harness.chained(lambda: optax.clip(MAX_DELTA)),
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  harness.add_tree_a_arguments(parser, rounds=11)
  args = parser.parse_args(argv)
  params, grads = harness.tree_a(parser, args)
  variants = {"adam": (harness.adam, False)}
  variants.update({name: (make, False) for name, make in VARIANTS.items()})
  results = harness.time_variants(
    variants, params, grads, args.rounds, budget_s=30.0
  )
  command = (
    f"python benchmarks/floors.py --rounds {args.rounds} "
    f"--leaves {args.leaves} --size {args.size}"
  )
  print(harness.ratio_report(command, VARIANTS, results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
