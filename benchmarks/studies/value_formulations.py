"""clip_value's statistics: formulations of max |g| and the clip count.

How cheaply can ``chain(clip_value, adam)`` keep statistics that say how
much was clipped (the target: within 1.10x of adam)? Each variant below is
the element clip chained before adam on tree (a) of run.py (64 float32
leaves of 400k), timed as ``benchmarks/harness.py`` times (median of
per-round ratios, one process, variants interleaved). The clip does not
wait for the statistics unless said; ``per-element policy`` turns an inf
into NaN element by element instead of making the whole leaf NaN (which
needs a full pass before the clip).

Usage: ``python benchmarks/studies/value_formulations.py [--rounds N]``
(about 3 minutes on 2 CPU cores). Prints a markdown table; the figures are
in FLOORS.md.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

# This checkout's optaxclip and benchmarks/ (harness), not installed ones:
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import optax

import harness
import optaxclip
from optaxclip import _norms

MAX_DELTA = 1e-3  # the gradients are N(0, 1e-3): about a third is clipped
STRIDE = 257  # clip_value's sample stride (_norms.SAMPLE_STRIDE)


def _stateless(update):
  return optax.GradientTransformation(
    lambda params: jnp.zeros((), jnp.float32), update
  )


def _float_largest_and_count(x):
  """``(max |x|, count of |x| > MAX_DELTA)`` as one two-output
  reduction of floats whose max keeps NaN by a select in its merge
  (XLA:CPU does not vectorise it).
  """
  a = jnp.abs(x)
  zero = jnp.zeros((), jnp.float32)

  def merge(u, v):
    top = jax.lax.select(jnp.isnan(u[0]) | (u[0] > v[0]), u[0], v[0])
    return top, u[1] + v[1]

  return jax.lax.reduce(
    (a, (a > MAX_DELTA).astype(jnp.float32)),
    (zero, zero),
    merge,
    tuple(range(x.ndim)),
  )


def element_clip(stats: str, wait: bool = False):
  """The element clip with the statistics ``stats`` (see VARIANTS)."""

  def update(updates, state, params=None):
    del state, params
    out, total = [], jnp.zeros((), jnp.float32)
    for x in jax.tree.leaves(updates):
      a = jnp.abs(x)
      count = largest = jnp.zeros((), jnp.float32)
      if stats == "max":
        largest = jnp.max(a)
      elif stats == "max+where":
        largest = jnp.max(a)
        count = jnp.sum(jnp.where(a > MAX_DELTA, 1.0, 0.0))
      elif stats == "where":  # the count alone, as a sum of a comparison
        count = jnp.sum(jnp.where(a > MAX_DELTA, 1.0, 0.0))
      elif stats == "sign":  # ... of max(sign(|g| - d), 0): NaN stays NaN
        count = jnp.sum(jnp.maximum(jnp.sign(a - MAX_DELTA), 0.0))
      elif stats == "clamped":  # ... of a clamped, scaled difference
        steep = 2.0**25 / MAX_DELTA  # 1 at one float32 ulp above d
        count = jnp.sum(jnp.clip((a - MAX_DELTA) * steep, 0.0, 1.0))
      elif stats == "fusable":
        # Only ops XLA:CPU's YNNPACK reductions fuse (abs, sign, max, mul,
        # sub, add; no compare or select), behind a barrier so that the two
        # reductions stay apart: sign(max(|g| - d, 0)) is 1 above d, else 0,
        # and sign(g) * 0 is NaN at a NaN alone (the count carries it).
        largest = jnp.max(a)
        b = jnp.abs(jax.lax.optimization_barrier(x))
        count = jnp.sum(
          jnp.sign(jnp.maximum(b - MAX_DELTA, 0.0)) + jnp.sign(b) * 0
        )
      elif stats == "two-output":  # of floats, with NaN-keeping merges
        largest, count = _float_largest_and_count(x)
      elif stats == "integer":  # of the magnitudes' bits (clip_value's)
        largest, count = _norms.largest_and_count_above(x, MAX_DELTA)
      else:  # "sampled": every STRIDE-th element, per-element policy
        sample = jnp.abs(x[::STRIDE])
        largest = jnp.max(sample)
        count = jnp.sum(sample > MAX_DELTA, dtype=jnp.float32)
      limit = MAX_DELTA + (0 * (largest + count) if wait else 0.0)
      y = jnp.clip(x, -limit, limit)
      if stats == "sampled":
        y = jnp.where(a == jnp.inf, jnp.nan, y)
      out.append(y)
      total = total + largest + count
    return jax.tree.unflatten(jax.tree.structure(updates), out), total

  return _stateless(update)


VARIANTS = {
  "optaxclip.clip_value": harness.chained(
    lambda: optaxclip.clip_value(MAX_DELTA)
  ),
  "clip + max(abs(g))": harness.chained(lambda: element_clip("max")),
  "clip + max(abs(g)) + sum(where(abs(g) > d, 1, 0))": harness.chained(
    lambda: element_clip("max+where")
  ),
  "clip waiting for sum(where(abs(g) > d, 1, 0)) alone": harness.chained(
    lambda: element_clip("where", wait=True)
  ),
  "clip waiting for sum(max(sign(abs(g) - d), 0)) alone": harness.chained(
    lambda: element_clip("sign", wait=True)
  ),
  "clip waiting for sum(clip((abs(g) - d) * 2**25 / d, 0, 1)) alone": (
    harness.chained(lambda: element_clip("clamped", wait=True))
  ),
  "clip waiting for max(abs(g)) + sum(sign(max(abs(g) - d, 0)))": (
    harness.chained(lambda: element_clip("fusable", wait=True))
  ),
  "clip waiting for a two-output reduce of floats (max, count)": (
    harness.chained(lambda: element_clip("two-output", wait=True))
  ),
  "clip waiting for a two-output reduce of the bits (max, count)": (
    harness.chained(lambda: element_clip("integer", wait=True))
  ),
  "clip waiting for max(abs(g)) + sum(where)": harness.chained(
    lambda: element_clip("max+where", wait=True)
  ),
  "per-element policy, max and count of every 257th": harness.chained(
    lambda: element_clip("sampled")
  ),
  'optaxclip.clip_value(stats="sampled")': harness.chained(
    lambda: optaxclip.clip_value(MAX_DELTA, stats="sampled")
  ),
  "optax.clip": harness.chained(lambda: optax.clip(MAX_DELTA)),
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=9, help="timing rounds")
  args = parser.parse_args(argv)
  if args.rounds < 1:
    parser.error(f"--rounds must be at least 1; got {args.rounds}")
  shapes = harness.many_leaves(64, 400_000)
  params = harness.make_arrays(shapes, jnp.float32, 0.02, seed=0)
  grads = harness.make_arrays(shapes, jnp.float32, harness.GRAD_SCALE, seed=1)
  variants = {"adam": (harness.adam, False)}
  variants.update({name: (make, False) for name, make in VARIANTS.items()})
  results = harness.time_variants(
    variants, params, grads, args.rounds, budget_s=40.0
  )
  command = (
    f"python benchmarks/studies/value_formulations.py --rounds {args.rounds}"
  )
  print(harness.ratio_report(command, VARIANTS, results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
