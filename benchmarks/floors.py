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
* three ways to check the per-leaf norms, to see what loses that overlap:
  every leaf waiting for a tree-wide predicate with no ``lax.cond`` (a
  select: the dependency alone, not a clipper), one ``lax.cond`` per leaf
  (no tree-wide dependency), and an exact norm without any check (two
  passes per leaf: ``max |g|``, then the sum of squares scaled by powers of
  two);
* ``clip_value`` statistics: the element clip alone (as ``optax.clip``), with
  ``max |g|`` only, and with ``max |g|`` and the count of clipped elements
  (what optaxclip records; one two-output reduction).

Usage: ``python benchmarks/floors.py [--rounds N]
[--no-concurrency-scheduler]`` (about 2 minutes on 2 CPU cores). Prints a
markdown table. ``--no-concurrency-scheduler`` compiles every variant with
XLA:CPU's ``xla_cpu_enable_concurrency_optimized_scheduler`` off, the
scheduler that orders the thunks so that independent ones overlap.
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


def _in_range(sum_of_squares):
  # Where a float32 sum of squares is trusted (no overflow, no underflow).
  return (sum_of_squares >= 2.0**-100) & (sum_of_squares <= 2.0**100)


def _two_pass_norm(x):
  """The exact norm without a check: ``max |x|``, then the sum of squares of
  ``x`` scaled by two powers of two that bring that maximum near 1.
  """
  exponent = jnp.frexp(jnp.max(jnp.abs(x)))[1]
  half = jnp.clip(-exponent // 2, -120, 120)
  up = jnp.ldexp(jnp.float32(1), half)
  down = jnp.ldexp(jnp.float32(1), jnp.clip(-exponent - half, -120, 120))
  return jnp.sqrt(jnp.sum(jnp.square(x * up * down))) / up / down


def per_leaf_checked(check: str):
  """Per-leaf norms with a check: ``tree_wide_select``, ``cond_per_leaf`` or
  ``two_pass`` (see the module's docstring).
  """

  def update(updates, state, params=None):
    del state, params
    leaves, treedef = jax.tree.flatten(updates)
    sums = [jnp.sum(jnp.square(x)) for x in leaves]
    if check == "tree_wide_select":
      trusted = jnp.all(jnp.stack([_in_range(s) for s in sums]))
      norms = [jnp.where(trusted, jnp.sqrt(s), 0.0) for s in sums]
    elif check == "cond_per_leaf":
      norms = [
        jax.lax.cond(
          _in_range(s), lambda x, s=s: jnp.sqrt(s), _two_pass_norm, x
        )
        for x, s in zip(leaves, sums)
      ]
    else:
      norms = [_two_pass_norm(x) for x in leaves]
    out = [
      x * jnp.where(n > MAX_LEAF_NORM, MAX_LEAF_NORM / n, 1.0)
      for x, n in zip(leaves, norms)
    ]
    return jax.tree.unflatten(treedef, out), jnp.zeros((), jnp.float32)

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
  "per-leaf norms, each waiting for a tree-wide predicate (no cond)": (
    harness.chained(lambda: per_leaf_checked("tree_wide_select"))
  ),
  "per-leaf norms, one lax.cond per leaf": harness.chained(
    lambda: per_leaf_checked("cond_per_leaf")
  ),
  "per-leaf norms, exact in two passes (no check)": harness.chained(
    lambda: per_leaf_checked("two_pass")
  ),
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
  parser.add_argument(
    "--no-concurrency-scheduler",
    action="store_true",
    help="compile with XLA:CPU's concurrency-optimized scheduler off",
  )
  args = parser.parse_args(argv)
  params, grads = harness.tree_a(parser, args)
  variants = {"adam": (harness.adam, False)}
  variants.update({name: (make, False) for name, make in VARIANTS.items()})
  options = None
  if args.no_concurrency_scheduler:
    options = {"xla_cpu_enable_concurrency_optimized_scheduler": False}
  results = harness.time_variants(
    variants,
    params,
    grads,
    args.rounds,
    budget_s=30.0,
    compiler_options=options,
  )
  command = (
    f"python benchmarks/floors.py --rounds {args.rounds} "
    f"--leaves {args.leaves} --size {args.size}"
    + (" --no-concurrency-scheduler" if args.no_concurrency_scheduler else "")
  )
  print(harness.ratio_report(command, VARIANTS, results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
