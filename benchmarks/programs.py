"""Fingerprints of the programs that ``run.py``'s step tables time.

For every row of the step tables (``run.step_rows()``) on trees (a), (b)
and (c), the jitted step is lowered (traced, not compiled: seconds per row)
and its StableHLO, source locations left out, is hashed; the count of each
op is kept beside the hash. Two checkouts whose fingerprints are equal time
the same program, so a refactor that keeps them equal cannot move a step
figure beyond the machine's noise. Equal op counts with another hash mean
the same ops in another order (a state's fields regrouped, say).

Usage, from a checkout of each revision (``PYTHONPATH`` picks the package,
whose path the run prints)::

  PYTHONPATH=<old checkout> python benchmarks/programs.py --out old.json
  python benchmarks/programs.py --out new.json
  python benchmarks/programs.py --compare old.json new.json

``--tiny`` lowers trees of a few small leaves instead (a check that it
runs); fingerprints are comparable only between runs of the same size.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import pathlib
import re
import sys
from typing import Optional

# Lowered for the CPU wherever it runs, so that fingerprints compare.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

import harness
import optaxclip
import run

LOCATION = re.compile(r"loc\([^\n]*?\)")
OP = re.compile(r'= "?([a-z_]+\.[a-z_.]+)')


def trees(tiny: bool) -> dict[str, tuple[dict, jnp.dtype]]:
  """The trees of the step tables, by section key."""
  if tiny:
    decoder = harness.transformer(1, 8, 16, 4)
    many = harness.many_leaves(4, 10)
  else:
    decoder = harness.transformer(12, 768, 50257, 1024)
    many = harness.many_leaves(64, 400000)
  return {
    "a": (many, jnp.float32),
    "b": (decoder, jnp.float32),
    "c": (decoder, jnp.bfloat16),
  }


def fingerprint(text: str) -> dict:
  """A program's hash (locations left out) and its op counts."""
  text = LOCATION.sub("", text)
  return {
    "hash": hashlib.sha256(text.encode()).hexdigest()[:16],
    "ops": dict(sorted(collections.Counter(OP.findall(text)).items())),
  }


def fingerprints(tiny: bool = False) -> dict[str, dict]:
  """``{"<tree>/<row>": fingerprint}`` for every row of every tree."""
  out = {}
  for key, (shapes, dtype) in trees(tiny).items():
    params = jax.tree.map(
      lambda s, dtype=dtype: jax.ShapeDtypeStruct(s, dtype),
      shapes,
      is_leaf=harness._is_shape,
    )
    for row in run.step_rows():
      tx = row.ours()
      state = jax.eval_shape(tx.init, params)
      lowered = harness.lower_step(tx, params, state, params)
      out[f"{key}/{row.name}"] = fingerprint(lowered.as_text())
  return out


def compare(old: dict[str, dict], new: dict[str, dict]) -> list[str]:
  """A markdown table: per program, whether it is the same."""
  lines = ["| step | program |", "|---|---|"]
  for name in sorted(set(old) | set(new), key=list({**old, **new}).index):
    if name not in old or name not in new:
      verdict = "only in " + ("the new run" if name in new else "the old run")
    elif old[name]["hash"] == new[name]["hash"]:
      verdict = "same"
    elif old[name]["ops"] == new[name]["ops"]:
      verdict = "same ops, another order"
    else:
      verdict = "changed"
    lines.append(f"| {name} | {verdict} |")
  return lines


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
  parser.add_argument("--out", type=pathlib.Path, help="write a JSON here")
  parser.add_argument("--tiny", action="store_true", help="tiny trees")
  parser.add_argument(
    "--compare",
    nargs=2,
    type=pathlib.Path,
    metavar=("OLD", "NEW"),
    help="compare two JSON files written by --out",
  )
  args = parser.parse_args(argv)
  if args.compare:
    old, new = (json.loads(p.read_text()) for p in args.compare)
    print("\n".join(compare(old, new)))
    return 0
  if args.out is None:
    parser.error("give --out FILE, or --compare OLD NEW")
  args.out.write_text(json.dumps(fingerprints(args.tiny), indent=1) + "\n")
  print(f"the programs of {optaxclip.__file__} written to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
