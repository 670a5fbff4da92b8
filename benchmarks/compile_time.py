"""Compile time of ``chain(clipper, adam)`` on trees of many tiny leaves.

A model written without ``scan`` has hundreds to thousands of leaves, and a
per-tensor clipper that unrolls its statistics per leaf pays for it at every
restart. This measures, for each clipper, the seconds to trace, lower and
XLA-compile one jitted step ``apply_updates(p, chain(clipper, adam).update(g,
s, p))`` (params and state donated), next to ``adam`` alone; for the
whole optimizers (``guard`` around adam, ``spam``, ``stable_spam``) the step
of the optimizer itself.

Variants run interleaved, in a shifted order each round, in one process (the
machine is noisy and shared: load hits all of them alike); the table gives the
median seconds and the median of per-round ratios to adam. Each compile starts
from cold caches (``jax.clear_caches``), as after a restart: without it a
later round reused the trace of optaxclip's shared jitted updates.

    python benchmarks/compile_time.py --leaves 300 1000 --rounds 1
    python benchmarks/compile_time.py --quick     # 30 leaves: checks it runs
    python benchmarks/compile_time.py --leaves 5 300 --only clip_relative \
      --kernels      # and what each compiled step holds

``--kernels`` adds, per clipper, the compiled step's HLO instructions, fused
computations and distinct fused computations. XLA:CPU compiles one kernel
per distinct body (the leaves of one shape share theirs), and its backend's
time follows that number: a count that barely moves from 5 leaves to 300 is
a fixed cost, paid once per program.

``measure`` and ``table`` are meant to be called from a benchmark harness.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import pathlib
import re
import statistics
import sys

# This checkout's optaxclip and harness, not installed ones.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np
import optax

import harness
import optaxclip

# The target: every clipper compiles within this factor of adam.
TARGET = 2.0

CLIPPERS: dict[str, Callable[[], optax.GradientTransformation]] = {
  "adam": optax.identity,
  "clip_global": lambda: optaxclip.clip_global(1.0),
  "clip_value": lambda: optaxclip.clip_value(0.01),
  "clip_value(stats=sampled)": lambda: optaxclip.clip_value(
    0.01, stats="sampled"
  ),
  "clip_norm": lambda: optaxclip.clip_norm(1.0),
  "clip_block_rms": lambda: optaxclip.clip_block_rms(1.0),
  "clip_unitwise": lambda: optaxclip.clip_unitwise(0.01),
  "clip_zscore(scope=leaf)": lambda: optaxclip.clip_zscore(scope="leaf"),
  "clip_percentile(scope=leaf)": lambda: optaxclip.clip_percentile(
    scope="leaf"
  ),
  "clip_relative": optaxclip.clip_relative,
  # SPAM's and Stable-SPAM's clipping parts, chained before adam here.
  "clip_spikes": optaxclip.clip_spikes,
  "clip_spikes_adaptive": optaxclip.clip_spikes_adaptive,
  "scale_by_norm_ema": optaxclip.scale_by_norm_ema,
}

# Whole optimizers, compiled as they are (not chained before adam): the
# wrapper around adam, and the optimizers that own their Adam moments.
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
  "guard(adam)": lambda: optaxclip.guard(harness.adam()),
  "guard(adam, scope=leaf)": lambda: optaxclip.guard(
    harness.adam(), scope="leaf"
  ),
  "spam": lambda: optaxclip.spam(harness.LEARNING_RATE),
  "stable_spam": lambda: optaxclip.stable_spam(harness.LEARNING_RATE),
}
CLIPPERS.update(OPTIMIZERS)

# Leaf shapes, cycled: vectors (biases, scales) and small kernels, as in a
# network of tiny layers; "vectors" is benchmarks/run.py's compile tree.
TREES = {
  "mixed": ((100,), (16, 8), (8,), (3, 3, 4, 8), (7, 9)),
  "vectors": ((100,),),
}


def make_tree(
  n_leaves: int, tree: str = "mixed", seed: int = 0, scale: float = 1.0
) -> dict[str, jax.Array]:
  shapes = TREES[tree]
  rng = np.random.default_rng(seed)
  return {
    f"leaf_{i:04d}": jnp.asarray(
      scale * rng.normal(size=shapes[i % len(shapes)]), jnp.float32
    )
    for i in range(n_leaves)
  }


# "wall" (seconds on the clock) or "cpu" (this process's CPU seconds, all
# threads: less sensitive to other processes on a loaded machine).
CLOCK = {"clock": "wall"}


def compile_seconds(make_clipper, params, grads) -> float:
  """Seconds to trace, lower and compile one step of chain(clipper, adam),
  or of the optimizer itself for those of OPTIMIZERS, from cold caches
  (:func:`harness.cold_compile_seconds`, on ``CLOCK``'s clock).
  """
  return harness.cold_compile_seconds(
    _step_factory(make_clipper),
    params,
    grads,
    clock=CLOCK["clock"],
  )


def _step_factory(make_clipper):
  whole = any(make_clipper is make for make in OPTIMIZERS.values())
  return make_clipper if whole else harness.chained(make_clipper)


# A fused computation's body with names and metadata left out: XLA:CPU
# compiles one kernel per distinct body (leaves of one shape share theirs).
_FUSED = re.compile(r"^%fused_computation\S* .*?\{\n(.*?)\n\}", re.M | re.S)
_NAMES = re.compile(r"%[\w.-]+")
_METADATA = re.compile(r", metadata=\{[^}]*\}")


def kernel_counts(make_clipper, params, grads) -> dict[str, int]:
  """What the compiled step holds: HLO ``instructions`` (XLA's passes take
  time with their number), ``fusions`` (fused computations, one kernel
  launch each) and ``distinct`` fusion bodies (the kernels XLA:CPU's backend
  compiles: its time follows their number, not the leaves').
  """
  tx = _step_factory(make_clipper)()
  lowered = harness.lower_step(tx, params, tx.init(params), grads)
  text = lowered.compile().as_text()
  bodies = [
    _NAMES.sub("%", _METADATA.sub("", m.group(1)))
    for m in _FUSED.finditer(text)
  ]
  return {
    "instructions": len(re.findall(r"^\s+(?:ROOT )?%\S+ = ", text, re.M)),
    "fusions": len(bodies),
    "distinct": len(set(bodies)),
  }


def kernel_table(names, sizes, tree: str = "mixed") -> list[str]:
  """Markdown rows of :func:`kernel_counts` per clipper and tree size."""
  names = ["adam"] + [n for n in names if n != "adam"]
  head = " | ".join(f"{n} leaves" for n in sizes)
  lines = [
    (
      "HLO instructions / fused computations / distinct kernels of the "
      f"compiled step, tree {tree!r}."
    ),
    "",
    f"| clipper | {head} |",
    "|---|" + "---|" * len(sizes),
  ]
  trees = {
    n: (
      make_tree(n, tree, seed=0, scale=0.02),
      make_tree(n, tree, seed=1),
    )
    for n in sizes
  }
  for name in names:
    cells = []
    for n in sizes:
      c = kernel_counts(CLIPPERS[name], *trees[n])
      cells.append(f"{c['instructions']} / {c['fusions']} / {c['distinct']}")
    lines.append(f"| {name} | {' | '.join(cells)} |")
  return lines


def measure(
  names, n_leaves: int, rounds: int = 1, tree: str = "mixed", log=None
) -> dict[str, list[float]]:
  """Per variant, the compile seconds of each round (adam always included)."""
  names = ["adam"] + [n for n in names if n != "adam"]
  params = make_tree(n_leaves, tree, seed=0, scale=0.02)
  grads = make_tree(n_leaves, tree, seed=1)
  compile_seconds(CLIPPERS["adam"], *(make_tree(3, tree),) * 2)  # warm-up
  seconds = {n: [] for n in names}
  for r in range(rounds):
    order = names[r % len(names) :] + names[: r % len(names)]
    for name in order:
      seconds[name].append(compile_seconds(CLIPPERS[name], params, grads))
      if log:
        log(
          f"  {n_leaves} leaves, round {r + 1}: {name} "
          f"{seconds[name][-1]:.1f} s"
        )
  return seconds


def table(results: dict[int, dict[str, list[float]]], tree: str) -> list[str]:
  """Markdown rows: seconds and the median per-round ratio to adam."""
  sizes = sorted(results)
  head = " | ".join(f"{n} leaves: s (x adam)" for n in sizes)
  lines = [
    (
      f"Compile time of chain(clipper, adam) (of the optimizer itself for "
      f"{', '.join(OPTIMIZERS)}), tree {tree!r} (shapes {TREES[tree]} "
      f"cycled); target <= {TARGET:.0f}x adam."
    ),
    "",
    f"| clipper | {head} | met |",
    "|---|" + "---|" * len(sizes) + "---|",
  ]
  names = list(results[sizes[0]])
  for name in names:
    cells, met = [], True
    for n in sizes:
      s = results[n][name]
      ratio = statistics.median(a / b for a, b in zip(s, results[n]["adam"]))
      met &= ratio <= TARGET
      cells.append(f"{statistics.median(s):.2f} ({ratio:.2f}x)")
    lines.append(
      f"| {name} | {' | '.join(cells)} | "
      f"{'' if name == 'adam' else ('yes' if met else 'no')} |"
    )
  return lines


def main():
  parser = argparse.ArgumentParser(
    description="Compile time of chain(clipper, adam) on many tiny leaves."
  )
  parser.add_argument(
    "--leaves",
    type=int,
    nargs="+",
    default=[300, 1000],
    help="tree sizes in leaves (default: 300 1000)",
  )
  parser.add_argument(
    "--rounds",
    type=int,
    default=1,
    help="interleaved rounds per size (default: 1)",
  )
  parser.add_argument(
    "--tree",
    choices=sorted(TREES),
    default="mixed",
    help="leaf shapes (default: mixed)",
  )
  parser.add_argument(
    "--only",
    nargs="+",
    choices=sorted(CLIPPERS),
    default=sorted(CLIPPERS),
    help="clippers to measure (adam is always measured)",
  )
  parser.add_argument(
    "--clock",
    choices=["wall", "cpu"],
    default="wall",
    help="wall-clock seconds, or this process's CPU seconds (default: wall)",
  )
  parser.add_argument(
    "--kernels",
    action="store_true",
    help="also count each compiled step's HLO instructions, fused "
    "computations and distinct kernels (one untimed compile each)",
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help="30 leaves, one round: checks that it runs",
  )
  args = parser.parse_args()
  if args.quick:
    args.leaves, args.rounds = [30], 1
  CLOCK["clock"] = args.clock
  if args.rounds < 1 or min(args.leaves) < 1:
    parser.error("--rounds and --leaves must be positive")
  log = lambda msg: print(msg, file=sys.stderr, flush=True)
  results = {
    n: measure(args.only, n, args.rounds, args.tree, log) for n in args.leaves
  }
  print(
    f"jax {jax.__version__}, {jax.devices()[0].platform}, "
    f"{args.rounds} round(s), interleaved, {args.clock} seconds; a shared "
    "machine: noisy."
  )
  print("\n".join(table(results, args.tree)))
  if args.kernels:
    print()
    print("\n".join(kernel_table(args.only, args.leaves, args.tree)))


if __name__ == "__main__":
  main()
