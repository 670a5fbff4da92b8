"""What a step costs when the norms leave the direct sum's trusted range.

The norm-based clippers sum ``|g|**p`` directly, in the accumulation dtype,
and trust the sum between a floor and a ceiling (``_norms.trusted_min`` and
``_safe_max``: float32 norms from about 1e-12 to 6e15). A step with a norm
outside that range (an exploding gradient, or a vanishing one) takes the
exact recompute instead: a second pass over the gradients that scales each
unit by a power of two before summing (``_norms`` module docstring). This
script times it on tree (a) of ``benchmarks/run.py`` (64 float32 leaves of
400k), as the other step benchmarks do (``benchmarks/harness.py``: each
variant's step between two adam steps, median of per-round ratios, one
process): ``clip_global`` and ``clip_norm`` (each chained before adam) on
the gradients as they are (N(0, 1e-3), the direct sum), times 1e19 (each
square above the ceiling) and times 1e-14 (each leaf's sum of squares
below the floor). Adam's steps between them take the gradients as they
are. The script checks first that each variant's sums are where its name
says (a direct step on trusted sums, the others on none).

The last column is the median over rounds of the step's time over the same
clipper's direct step in the same round.

Usage: ``python benchmarks/studies/exact_recompute.py [--rounds N]``
(about a minute on 2 CPU cores). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

# This checkout's optaxclip and benchmarks/ (harness), not installed ones:
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp

import harness
import optaxclip
from optaxclip import _norms

# Scales of the gradients (N(0, 1e-3): leaf norms about 0.63, the global
# norm about 5) and what each makes of the sum of squares.
SCALES = {
  "direct": 1.0,
  "above the ceiling": 1e19,
  "below the floor": 1e-14,
}
CLIPPERS = {
  "clip_global": lambda: optaxclip.clip_global(1.0),
  "clip_norm": lambda: optaxclip.clip_norm(0.1),
}


def check_paths(grads) -> None:
  """Raises unless every leaf's float32 sum of squares is trusted at the
  direct scale and at no other (each variant takes the path it names).
  """
  for where, scale in SCALES.items():
    trusted = [
      bool(_norms.trusted_sum(jnp.sum(jnp.square(g * scale))))
      for g in jax.tree.leaves(grads)
    ]
    if trusted != [where == "direct"] * len(trusted):
      raise SystemExit(
        f"exact_recompute.py: the sums at x{scale:g} are not all "
        f"{'trusted' if where == 'direct' else 'untrusted'}: {trusted}"
      )


def variants() -> dict[str, tuple[str, str]]:
  """Variant names to (clipper, scale name), in table order."""
  return {
    f"{clipper}, {where} (x{SCALES[where]:g})": (clipper, where)
    for clipper in CLIPPERS
    for where in SCALES
  }


def report(command: str, results) -> str:
  """The table: each variant's step over adam's, and over its clipper's
  direct step in the same round.
  """
  lines = harness.machine_lines() + [
    f"- Command: `{command}`",
    "",
    "| variant | step / adam (median, IQR) | step / direct step (median) |",
    "|---|---|---|",
  ]
  for name, (clipper, _) in variants().items():
    mine = results[name]
    direct_name = f"{clipper}, direct (x{SCALES['direct']:g})"
    direct = results[direct_name].ratios
    over = [a / b for a, b in zip(mine.ratios, direct)]
    lines.append(
      f"| {name} | {harness.fmt_ratio(mine)} | {statistics.median(over):.3f}x |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  harness.add_tree_a_arguments(parser, rounds=9)
  args = parser.parse_args(argv)
  params, grads = harness.tree_a(parser, args)
  check_paths(grads)
  table = {"adam": (harness.adam, False)}
  grads_of = {}
  for name, (clipper, where) in variants().items():
    table[name] = (harness.chained(CLIPPERS[clipper]), False)
    grads_of[name] = jax.tree.map(lambda g, s=SCALES[where]: g * s, grads)
  results = harness.time_variants(
    table, params, grads, args.rounds, budget_s=30.0, grads_of=grads_of
  )
  command = (
    f"python benchmarks/studies/exact_recompute.py --rounds {args.rounds} "
    f"--leaves {args.leaves} --size {args.size}"
  )
  print(report(command, results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
