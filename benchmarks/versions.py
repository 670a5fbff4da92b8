r"""One clipper at several commits, measured interleaved in one process.

On a shared, noisy machine two runs taken minutes apart cannot tell a
regression from a change of load; this script imports optaxclip as it was
at each given commit (``git archive`` into a temporary folder, the package
renamed ``optaxclip_<commit>``) next to this checkout's, and times them in
the same rounds:

* ``step``: the step of ``chain(clipper, adam)`` over adam's on tree (a)
  (64 x 400000 float32), (b) (the transformer, ``--blocks`` of width 768)
  or (c) (the transformer in bfloat16),
  with :func:`harness.time_variants` (median of per-round ratios);
* ``whole``: the step of a whole optimizer (``--clipper "spam(1e-3)"``)
  over adam's, each with its own state (:func:`run_whole`);
* ``compile``: the CPU seconds (this process, all threads) to trace, lower
  and XLA-compile ``chain(clipper, adam)`` (with ``--whole``, the optimizer
  itself: ``--clipper "guard(optax.adam(1e-3), scope='leaf')"``) on
  ``--leaves`` tiny leaves of compile_time.py's 'mixed' tree, over adam's,
  rounds interleaved, each from cold caches (``jax.clear_caches``).

    python benchmarks/versions.py step --tree b --commits 6d75cb1 \
        --clipper "clip_unitwise(0.01)" --rounds 7
    python benchmarks/versions.py compile --leaves 1000 --commits 6d75cb1 \
        --clipper "clip_global(1.0)" --rounds 2

``--clipper`` is a call on the package (evaluated with each version's);
``.`` in ``--commits`` is this checkout's working tree.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np
import optax

import compile_time
import harness

ROOT = pathlib.Path(__file__).resolve().parents[1]


def import_at(commit: str, where: pathlib.Path):
  """The package as of ``commit`` (``.``: this checkout), as a module."""
  if commit == ".":
    return importlib.import_module("optaxclip")
  sha = subprocess.run(
    ["git", "-C", str(ROOT), "rev-parse", "--short=8", commit],
    check=True,
    capture_output=True,
    text=True,
  ).stdout.strip()
  name = f"optaxclip_{sha}"
  archive = subprocess.run(
    ["git", "-C", str(ROOT), "archive", sha, "optaxclip"],
    check=True,
    capture_output=True,
  ).stdout
  subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
  package = where / name
  (where / "optaxclip").rename(package)
  for path in package.glob("*.py"):
    text = re.sub(
      r"^(\s*)from optaxclip([. ])",
      rf"\1from {name}\2",
      path.read_text(),
      flags=re.M,
    )
    text = re.sub(
      r"^(\s*)import optaxclip$",
      rf"\1import {name} as optaxclip",
      text,
      flags=re.M,
    )
    path.write_text(text)
  if str(where) not in sys.path:
    sys.path.insert(0, str(where))
  return importlib.import_module(name)


def step_tree(args):
  """``(params, grads)`` of ``--tree`` (and ``--blocks``)."""
  if args.tree == "a":
    shapes = harness.many_leaves(64, 400_000)
  else:
    shapes = harness.transformer(args.blocks, 768, 8192, 1024)
  dtype = "bfloat16" if args.tree == "c" else "float32"
  params = harness.make_arrays(shapes, dtype, 1.0, 0)
  grads = harness.make_arrays(shapes, dtype, harness.GRAD_SCALE, 1)
  return params, grads


def _maker(module, clipper: str):
  """A factory of ``module.<clipper>`` (``optax`` in scope for arguments)."""
  return lambda: eval(f"m.{clipper}", {"m": module, "optax": optax})


def run_step(args, versions) -> None:
  params, grads = step_tree(args)
  variants = {"adam": (harness.adam, False)}
  for label, module in versions.items():
    variants[label] = (harness.chained(_maker(module, args.clipper)), False)
  results = harness.time_variants(variants, params, grads, args.rounds, 40.0)
  print(f"adam's step: {statistics.median(results['adam'].ms):.1f} ms")
  print("| version | step / adam (median, IQR) | temp MiB |")
  print("|---|---|---|")
  for label in versions:
    r = results[label]
    q1, q3 = np.percentile(r.ratios, [25, 75])
    print(
      f"| {label} | {r.median():.3f}x ({q1:.2f}-{q3:.2f}) | "
      f"{r.temp_bytes / 2**20:.2f} |"
    )


def run_whole(args, versions) -> None:
  """``whole``: ``--clipper`` is a whole optimizer (spam, stable_spam,
  guard(...)), whose state holds no adam state for the harness to share:
  each version keeps its own state, and each round times ``--steps``
  donated steps of adam, then of each version in a new random order with
  adam again after each; a ratio is over the mean of the adam runs around
  it.
  """
  params, grads = step_tree(args)
  makers = {"adam": lambda: optax.adam(1e-3)}
  for label, module in versions.items():
    makers[label] = _maker(module, args.clipper)
  runs = {}
  for label, make in makers.items():
    tx = make()

    def step(p, s, g, tx=tx):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    jitted = jax.jit(step, donate_argnums=(0, 1))
    p = jax.tree.map(jnp.copy, params)
    p, s = jitted(p, tx.init(p), grads)  # compile
    jax.block_until_ready(p)
    temp = harness.temp_bytes(
      jitted.lower(p, s, grads).compile()  # a cache hit
    )
    runs[label] = [jitted, p, s, temp]

  def timed(label) -> float:
    jitted, p, s, _ = runs[label]
    start = time.perf_counter()
    for _ in range(args.steps):
      p, s = jitted(p, s, grads)
    jax.block_until_ready((p, s))
    runs[label][1:3] = [p, s]
    return (time.perf_counter() - start) / args.steps

  ratios = {label: [] for label in versions}
  adam_ms = []
  rng = np.random.default_rng(0)
  for _ in range(args.rounds):
    order = list(versions)
    rng.shuffle(order)
    before = timed("adam")
    for label in order:
      t = timed(label)
      after = timed("adam")
      ratios[label].append(t / ((before + after) / 2))
      adam_ms.append(1e3 * after)
      before = after
  print(f"adam's step: {statistics.median(adam_ms):.1f} ms")
  print("| version | step / adam (median, IQR) | temp MiB |")
  print("|---|---|---|")
  for label in versions:
    q1, q3 = np.percentile(ratios[label], [25, 75])
    print(
      f"| {label} | {statistics.median(ratios[label]):.3f}x "
      f"({q1:.2f}-{q3:.2f}) | {runs[label][3] / 2**20:.2f} |"
    )


def compile_seconds(make_tx, tree, whole: bool = False) -> float:
  """CPU seconds to trace, lower and compile a step of ``chain(make_tx(),
  adam)`` (of ``make_tx()`` itself with ``whole``), from cold caches
  (:func:`harness.cold_compile_seconds`).
  """
  make = make_tx if whole else harness.chained(make_tx)
  return harness.cold_compile_seconds(make, tree, tree, clock="cpu")


def run_compile(args, versions) -> None:
  tree = compile_time.make_tree(args.leaves)
  makers = {
    "adam": (lambda: optax.adam(1e-3)) if args.whole else optax.identity
  }
  for label, module in versions.items():
    makers[label] = _maker(module, args.clipper)
  seconds = {label: [] for label in makers}
  ratios = {label: [] for label in makers}
  order = list(makers)
  for k in range(args.rounds):
    shifted = order[k % len(order) :] + order[: k % len(order)]
    this = {
      label: compile_seconds(makers[label], tree, args.whole)
      for label in shifted
    }
    for label, s in this.items():
      seconds[label].append(s)
      ratios[label].append(s / this["adam"])
  print(f"{args.leaves} leaves, CPU seconds, {args.rounds} round(s)")
  print("| version | CPU s | / adam (median of rounds) |")
  print("|---|---|---|")
  for label in makers:
    print(
      f"| {label} | {statistics.median(seconds[label]):.2f} | "
      f"{statistics.median(ratios[label]):.2f}x |"
    )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("what", choices=["step", "whole", "compile"])
  parser.add_argument(
    "--commits", nargs="+", default=[], help="commits to compare with '.'"
  )
  parser.add_argument(
    "--clipper", default="clip_unitwise(0.01)", help="a call on the package"
  )
  parser.add_argument(
    "--tree",
    choices=["a", "b", "c"],
    default="b",
    help="(a) 64 x 400000 float32, (b) the transformer, (c) it in bfloat16",
  )
  parser.add_argument(
    "--blocks", type=int, default=12, help="trees (b) and (c): depth"
  )
  parser.add_argument("--leaves", type=int, default=300, help="compile tree")
  parser.add_argument(
    "--whole",
    action="store_true",
    help="compile: --clipper is a whole optimizer (not chained before adam)",
  )
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument(
    "--steps", type=int, default=5, help="whole: steps timed per run"
  )
  args = parser.parse_args()
  print(f"load average at the start: {os.getloadavg()}")
  with tempfile.TemporaryDirectory() as where:
    versions = {
      c: import_at(c, pathlib.Path(where)) for c in [*args.commits, "."]
    }
    if args.what == "step":
      run_step(args, versions)
    elif args.what == "whole":
      run_whole(args, versions)
    else:
      run_compile(args, versions)
  print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
  main()
