"""Benchmarks: what clipping costs on top of Adam, against optax's clippers.

One command measures, on whatever ``jax.devices()`` offers, and writes a
markdown report:

* step time (sections ``a``, ``b``, ``c``): the jitted step
  ``optax.apply_updates(p, chain(clipper, adam).update(g, s, p))`` over
  ``adam``'s own step, with optax's built-in equivalents side by side, on
  (a) 64 leaves of 400k float32, (b) a transformer-shaped tree (12 blocks of
  width 768) in float32 and (c) in bfloat16. Each figure is the median over
  rounds of the step's time over the mean of the two adam steps around it
  (``benchmarks/harness.py`` says how);
* the floors in each step table: one float32 reduction pass over the
  gradients (``adam + read``: what any norm-based clipper must pay) and
  scaling every leaf by a factor from the state (``adam + scale``);
* ``stats()``: the clip_global step returning ``optaxclip.stats(state)`` too;
* memory: each compiled step's temporary buffers
  (``compiled.memory_analysis().temp_size_in_bytes``) next to adam's;
* compile time (section ``compile``): ``chain(clip_global, adam)`` on 1000
  leaves of 100 float32 elements against ``adam`` alone (and optax's
  ``clip_by_global_norm``);
* compile time of every per-tensor clipper (section ``leaves``):
  ``chain(clipper, adam)`` on 300 and 1000 small leaves of mixed shapes,
  against adam's (``benchmarks/compile_time.py``);
* per-leaf telemetry (section ``telemetry``): ``clip_global`` and
  ``clip_norm`` with ``leaf_stats=True`` over the same clipper without it,
  step time on (a) and (b) (paired per round) and compile time on the
  1000 leaves;
* when PyTorch is importable: ``torch.nn.utils.clip_grad_norm_(foreach=True)``
  before ``torch.optim.Adam(foreach=True)`` over torch's Adam step alone.

Usage::

  python benchmarks/run.py                 # every section: see --help
  python benchmarks/run.py --quick         # tiny sizes: checks that it runs
  python benchmarks/run.py --only a compile

Only a full run (every section, full sizes) writes ``benchmarks/RESULTS.md``
(its part before ``## Other benchmarks``, where the other scripts' latest
runs are kept); ``--quick`` and ``--only`` runs write
``benchmarks/out/RESULTS.md`` (``--out`` to change either). At full sizes
each section runs in a fresh process: XLA's CPU allocator keeps what a
section used, and (a) to (c) in one process need more than 24 GB.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import concurrent.futures
import dataclasses
import functools
import importlib.util
import math
import multiprocessing
import pathlib
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

# This checkout's optaxclip and harness, not installed ones:
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import optax

import compile_time
import harness
import optaxclip

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SCRATCH = ROOT / "benchmarks" / "out" / "RESULTS.md"
# RESULTS.md's heading of the other scripts' latest runs, which a full run
# keeps as they are (it rewrites what comes before).
OTHER_SCRIPTS = "## Other benchmarks"
# The committed report's opening paragraph.
INTRO = (
  "The latest run of each benchmark script, with the command that "
  "reproduces it. Earlier runs are\nin this file's git history; what the "
  "figures mean, and what bounds them, is in\n`docs/performance.md`. Down "
  'to "Other benchmarks", this file is what a full\n`python '
  "benchmarks/run.py` writes (it keeps the rest as it is)."
)
SECTIONS = ("a", "b", "c", "compile", "leaves")
# Run only when asked for (--only telemetry): not part of a full run.
EXTRA_SECTIONS = ("telemetry",)
ADAPTIVE_TARGET = 1.12
# --help quotes them. Idle 2-core CPU: sections a to c and compile took 9
# minutes in the last quiet run; leaves adds about 14 at today's per-leaf
# compile times (17 s a clipper on 300 leaves, 105 s on 1000). Quick: 45-55 s
# of CPU time measured.
FULL_MINUTES = 8
QUICK_SECONDS = 60


@dataclasses.dataclass
class Sizes:
  """Problem sizes of a run (full or --quick)."""

  many_leaves: int = 64
  many_size: int = 400_000
  blocks: int = 12
  width: int = 768
  vocab: int = 8192
  context: int = 1024
  compile_leaves: int = 1000
  compile_size: int = 100
  rounds: Optional[int] = None  # None: fitted to the time budget (5 to 15)
  budget_s: float = 40.0  # seconds of timed steps per tree
  # XLA options for the timed steps; quick runs compile cheaply (the figures
  # of a quick run only check that everything runs).
  compiler_options: Optional[dict[str, Any]] = None
  compile_repeats: int = 2
  optax_compile: bool = True
  leaf_counts: tuple[int, ...] = (300, 1000)  # section "leaves"
  leaf_rounds: int = 1  # section "leaves": interleaved compile rounds

  @classmethod
  def quick(cls) -> Sizes:
    return cls(
      many_leaves=4,
      many_size=1024,
      blocks=0,
      width=32,
      vocab=64,
      context=16,
      compile_leaves=20,
      compile_size=100,
      rounds=3,
      budget_s=2.0,
      compile_repeats=1,
      leaf_counts=(10,),
      compiler_options={
        "xla_backend_optimization_level": 0,
        "xla_llvm_disable_expensive_passes": True,
      },
    )


# --------------------------------------------------------------------------
# The rows of the step tables
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
  """One line of the step table: an optaxclip variant and its optax twin."""

  name: str
  ours: Callable[[], optax.GradientTransformation]
  theirs: Optional[Callable[[], optax.GradientTransformation]] = None
  theirs_name: str = ""
  target: Optional[float] = None
  with_stats: bool = False
  note: str = ""


def step_rows() -> list[Row]:
  """The variants timed on each tree; hyperparameters keep every clipper on."""
  chained = harness.chained
  adam = harness.adam
  return [
    Row(
      "adam + read (floor)",
      chained(harness.read_only),
      note="one f32 sum-of-squares pass over the gradients, not used",
    ),
    Row(
      "adam + scale (floor)",
      chained(harness.scale_only),
      note="every leaf times a factor from the state, no norm",
    ),
    Row(
      "clip_global",
      chained(lambda: optaxclip.clip_global(1.0)),
      chained(lambda: optax.clip_by_global_norm(1.0)),
      "optax.clip_by_global_norm",
      1.08,
    ),
    Row(
      "clip_global + stats()",
      chained(lambda: optaxclip.clip_global(1.0)),
      with_stats=True,
      note="the step also returns optaxclip.stats(state)",
    ),
    Row("clip_norm", chained(lambda: optaxclip.clip_norm(0.1)), target=1.10),
    Row(
      "clip_value",
      chained(lambda: optaxclip.clip_value(1e-3)),
      chained(lambda: optax.clip(1e-3)),
      "optax.clip",
      1.10,
    ),
    Row(
      "clip_block_rms",
      chained(lambda: optaxclip.clip_block_rms(5e-4)),
      chained(lambda: optax.clip_by_block_rms(5e-4)),
      "optax.clip_by_block_rms",
      1.10,
    ),
    Row(
      "clip_unitwise",
      chained(lambda: optaxclip.clip_unitwise(0.01)),
      chained(lambda: optax.adaptive_grad_clip(0.01)),
      "optax.adaptive_grad_clip",
      1.10,
    ),
    Row("clip_zscore", chained(optaxclip.clip_zscore), target=ADAPTIVE_TARGET),
    Row(
      "clip_zscore(scope=leaf)",
      chained(lambda: optaxclip.clip_zscore(scope="leaf")),
    ),
    Row(
      "clip_percentile",
      chained(optaxclip.clip_percentile),
      target=ADAPTIVE_TARGET,
    ),
    Row(
      "clip_percentile(scope=leaf)",
      chained(lambda: optaxclip.clip_percentile(scope="leaf")),
    ),
    Row(
      "clip_relative", chained(optaxclip.clip_relative), target=ADAPTIVE_TARGET
    ),
    Row(
      "guard(adam)",
      lambda: optaxclip.guard(adam()),
      lambda: optax.apply_if_finite(adam(), 10),
      "optax.apply_if_finite",
      ADAPTIVE_TARGET,
    ),
    Row(
      "guard(adam, scope=leaf)",
      lambda: optaxclip.guard(adam(), scope="leaf"),
      note="skips leaf by leaf: inner's state selected per leaf",
    ),
  ]


# --------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------


def verdict(value: float, target: Optional[float]) -> str:
  if target is None or math.isnan(value):
    return ""
  return "yes" if value <= target else "**no**"


def step_table(
  title: str,
  params,
  rows: list[Row],
  results: dict[str, harness.Result],
  floor: harness.Result,
  torch_line: Optional[str],
) -> list[str]:
  """The markdown table of one tree."""
  adam_res = results["adam"]
  rounds = len(adam_res.ratios)
  lines = [
    f"### {title}",
    "",
    (
      f"{harness.count_params(params) / 1e6:.1f}M parameters in "
      f"{len(jax.tree.leaves(params))} leaves; adam's step: "
      f"{statistics.median(adam_res.ms):.1f} ms (median); {rounds} rounds; "
      f"adam's temporaries: {harness.fmt_mb(adam_res.temp_bytes)} MiB."
    ),
    "",
    (
      "| variant | optaxclip / adam | target | met | optax equivalent | "
      "optax / adam | temp MiB (optaxclip / optax) |"
    ),
    "|---|---|---|---|---|---|---|",
    (
      f"| one read pass alone (jitted sum of squares) | "
      f"{1 + floor.median():.3f}x | | | | | |"
    ),
  ]
  for row in rows:
    ours = results[row.name]
    theirs = results["optax:" + row.name] if row.theirs else None
    name = row.name if not row.note else f"{row.name} <sub>{row.note}</sub>"
    temps = (
      f"{harness.fmt_mb(ours.temp_bytes)} / "
      f"{harness.fmt_mb(theirs.temp_bytes) if theirs else '–'}"
    )
    target = "" if row.target is None else f"<= {row.target:.2f}x"
    lines.append(
      f"| {name} | {harness.fmt_ratio(ours)} | {target} | "
      f"{verdict(ours.median(), row.target)} | {row.theirs_name or '–'} | "
      f"{harness.fmt_ratio(theirs)} | {temps} |"
    )
  if torch_line:
    lines.append(torch_line)
  lines.append("")
  return lines


def run_tree(title: str, shapes, dtype, sizes: Sizes) -> list[str]:
  """Times every row on one tree; returns the table's lines."""
  params = harness.make_arrays(
    shapes, dtype, 0.02, seed=0, ones_for=lambda name: "scale" in name
  )
  grads = harness.make_arrays(shapes, dtype, harness.GRAD_SCALE, seed=1)
  rows = step_rows()
  variants = {"adam": (harness.adam, False)}
  for row in rows:
    variants[row.name] = (row.ours, row.with_stats)
    if row.theirs:
      variants["optax:" + row.name] = (row.theirs, False)
  harness.log(
    f"{title}: {harness.count_params(params) / 1e6:.1f}M params, "
    f"{len(jax.tree.leaves(params))} leaves, {len(variants)} "
    "variants"
  )
  t0 = time.perf_counter()
  results = harness.time_variants(
    variants,
    params,
    grads,
    sizes.rounds,
    sizes.budget_s,
    extra={"read": harness.read_pass_fn(grads)},
    compiler_options=sizes.compiler_options,
  )
  torch_line = None
  if importlib.util.find_spec("torch") is not None:
    ratio, ms, version = harness.torch_reference(
      params, grads, max(sizes.rounds or 0, 5)
    )
    torch_line = (
      f"| torch {version}: clip_grad_norm_(foreach=True) + "
      f"Adam(foreach=True) / Adam ({ms:.1f} ms) | "
      f"{ratio:.3f}x | | | | | |"
    )
  harness.log(f"  done in {time.perf_counter() - t0:.0f} s")
  floor = results.pop("read")
  return step_table(title, params, rows, results, floor, torch_line)


def run_compile(sizes: Sizes) -> list[str]:
  """Compile time of clip_global (and optax's) before adam, on many leaves."""
  shapes = harness.many_leaves(sizes.compile_leaves, sizes.compile_size)
  params = harness.make_arrays(shapes, jnp.float32, 0.02, seed=0)
  grads = harness.make_arrays(shapes, jnp.float32, harness.GRAD_SCALE, seed=1)
  variants = {
    "adam": harness.adam,
    "chain(clip_global, adam)": harness.chained(
      lambda: optaxclip.clip_global(1.0)
    ),
  }
  if sizes.optax_compile:
    variants["chain(optax.clip_by_global_norm, adam)"] = harness.chained(
      lambda: optax.clip_by_global_norm(1.0)
    )
  measured = {name: [] for name in variants}
  for rep in range(sizes.compile_repeats):
    for name, make_tx in variants.items():
      if rep and name.startswith("chain(optax"):
        continue  # once is enough for the reference
      measured[name].append(harness.compile_seconds(make_tx, params, grads))
      harness.log(
        f"  compile {name} #{rep + 1}: lower "
        f"{measured[name][-1][0]:.1f} s, compile "
        f"{measured[name][-1][1]:.1f} s"
      )
  lines = [
    (
      f"### Compile time: {sizes.compile_leaves} leaves of "
      f"{sizes.compile_size} float32"
    ),
    "",
    (
      "| step | trace + lower s | XLA compile s | total / adam | target "
      "| met | temp KiB |"
    ),
    "|---|---|---|---|---|---|---|",
  ]
  adam_total = statistics.median(m[0] + m[1] for m in measured["adam"])
  for name, runs in measured.items():
    low = statistics.median(m[0] for m in runs)
    comp = statistics.median(m[1] for m in runs)
    ratio = (low + comp) / adam_total
    target = 1.5 if name == "chain(clip_global, adam)" else None
    lines.append(
      f"| {name} ({len(runs)} run{'s' if len(runs) > 1 else ''}) | "
      f"{low:.2f} | {comp:.2f} | {ratio:.2f}x | "
      f"{'' if target is None else f'<= {target:.1f}x'} | "
      f"{verdict(ratio, target)} | {runs[0][2] / 1024:.1f} |"
    )
  lines.append("")
  return lines


def run_leaves(sizes: Sizes) -> list[str]:
  """Compile time of every per-tensor clipper on many small leaves."""
  results = {
    n: compile_time.measure(
      compile_time.CLIPPERS, n, sizes.leaf_rounds, log=harness.log
    )
    for n in sizes.leaf_counts
  }
  rounds = sizes.leaf_rounds
  return [
    "### Compile time of each clipper on many small leaves",
    "",
    (
      f"{rounds} interleaved round{'s' if rounds > 1 else ''} "
      "(--leaf-rounds), wall seconds."
    ),
    "",
    *compile_time.table(results, "mixed"),
    "",
  ]


# Clippers timed with and without leaf_stats=True (section "telemetry").
TELEMETRY_CLIPPERS = {
  "clip_global": lambda **kw: optaxclip.clip_global(1.0, **kw),
  "clip_norm": lambda **kw: optaxclip.clip_norm(0.1, **kw),
}
TELEMETRY_STEP_TARGET = 1.03
TELEMETRY_COMPILE_TARGET = 1.10


def _paired(results, on: str, off: str) -> tuple[float, float, float]:
  """Median and quartiles of per-round ratios ``on / off`` (both timed in
  the same rounds, each against the adam steps around it).
  """
  ratios = sorted(
    a / b for a, b in zip(results[on].ratios, results[off].ratios)
  )
  q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
  return statistics.median(ratios), q[0], q[-1]


def run_telemetry(sizes: Sizes) -> list[str]:
  """leaf_stats=True against the same clipper without it: step time on
  trees (a) and (b), compile time on many leaves.
  """
  trees = {
    f"(a) {sizes.many_leaves} x {sizes.many_size} float32": harness.many_leaves(
      sizes.many_leaves, sizes.many_size
    ),
    f"(b) transformer, {sizes.blocks} blocks of width {sizes.width}": (
      harness.transformer(sizes.blocks, sizes.width, sizes.vocab, sizes.context)
    ),
  }
  lines = [
    "### Per-leaf telemetry: leaf_stats=True over the same clipper without",
    "",
    (
      "Each figure is the median over rounds of (step with leaf_stats=True "
      "/ step without), both timed in the same round between adam steps "
      "(interquartile range in parentheses); compile: median over pairs "
      "of the ratio of trace+lower+compile (wall clock), the pairs in the "
      "orders AB, BA, BA, AB, ... after one untimed compile (the first "
      "compile in a process runs faster than the later ones)."
    ),
    "",
    "| clipper | tree | with / without | target | met |",
    "|---|---|---|---|---|",
  ]
  for title, shapes in trees.items():
    params = harness.make_arrays(shapes, jnp.float32, 0.02, seed=0)
    grads = harness.make_arrays(shapes, jnp.float32, harness.GRAD_SCALE, seed=1)
    variants = {"adam": (harness.adam, False)}
    for name, make in TELEMETRY_CLIPPERS.items():
      variants[name] = (harness.chained(make), False)
      variants[name + "+leaf"] = (
        harness.chained(functools.partial(make, leaf_stats=True)),
        False,
      )
    harness.log(f"telemetry {title}: {len(variants)} variants")
    results = harness.time_variants(
      variants,
      params,
      grads,
      sizes.rounds,
      sizes.budget_s,
      compiler_options=sizes.compiler_options,
    )
    for name in TELEMETRY_CLIPPERS:
      mid, lo, hi = _paired(results, name + "+leaf", name)
      lines.append(
        f"| {name} | {title} | {mid:.3f}x ({lo:.2f}–{hi:.2f}) | "
        f"<= {TELEMETRY_STEP_TARGET:.2f}x | "
        f"{verdict(mid, TELEMETRY_STEP_TARGET)} |"
      )
  shapes = harness.many_leaves(sizes.compile_leaves, sizes.compile_size)
  params = harness.make_arrays(shapes, jnp.float32, 0.02, seed=0)
  grads = harness.make_arrays(shapes, jnp.float32, harness.GRAD_SCALE, seed=1)
  # Compile time for clip_global only: each compile of the 1000-leaf step
  # takes a minute or more on a loaded 2-core machine.
  for name, make in list(TELEMETRY_CLIPPERS.items())[:1]:
    # One compile first, not timed: the first compile in a process runs
    # faster than the later ones, which favoured whichever variant came
    # first. Then pairs in the orders AB, BA, BA, AB, ... (balanced).
    harness.compile_seconds(harness.chained(make), params, grads)
    ratios = []
    for rep in range(2 * sizes.compile_repeats):
      pair = {}
      for on in (False, True) if rep % 4 in (0, 3) else (True, False):
        kw = {"leaf_stats": True} if on else {}
        low, comp, _ = harness.compile_seconds(
          harness.chained(functools.partial(make, **kw)), params, grads
        )
        pair[on] = low + comp
        harness.log(f"  compile {name} leaf_stats={on}: {low + comp:.1f} s")
      ratios.append(pair[True] / pair[False])
    mid = statistics.median(ratios)
    lines.append(
      f"| {name} | compile, {sizes.compile_leaves} leaves of "
      f"{sizes.compile_size} | {mid:.3f}x ({min(ratios):.2f}–"
      f"{max(ratios):.2f}) | <= {TELEMETRY_COMPILE_TARGET:.2f}x | "
      f"{verdict(mid, TELEMETRY_COMPILE_TARGET)} |"
    )
  lines.append("")
  return lines


def run_section(key: str, sizes: Sizes) -> list[str]:
  """The table lines of one section: a tree (a, b, c), compile, leaves or
  telemetry.
  """
  if key == "compile":
    return run_compile(sizes)
  if key == "telemetry":
    return run_telemetry(sizes)
  if key == "leaves":
    return run_leaves(sizes)
  if key == "a":
    title = f"(a) {sizes.many_leaves} x {sizes.many_size} float32"
    return run_tree(
      title,
      harness.many_leaves(sizes.many_leaves, sizes.many_size),
      jnp.float32,
      sizes,
    )
  dtype = jnp.float32 if key == "b" else jnp.bfloat16
  title = (
    f"({key}) transformer, {sizes.blocks} blocks of width "
    f"{sizes.width}, {jnp.dtype(dtype).name}"
  )
  shapes = harness.transformer(
    sizes.blocks, sizes.width, sizes.vocab, sizes.context
  )
  return run_tree(title, shapes, dtype, sizes)


# --------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------

METHOD = (
  "Each step ratio is the median over rounds of (the variant's step time "
  "/ the mean of the two adam steps around it: each round runs adam, v1, "
  "adam, v2, adam, ... with the variants in a new random order); the "
  "interquartile range is in parentheses. Steps donate params and state, "
  "as a training loop does. Floors: `one read pass alone` is a jitted "
  "float32 sum of squares of the gradients on its own (1 + its time over "
  "adam's); `adam + read` adds that pass to adam's step (no norm-based "
  "clipper can cost less); `adam + scale` multiplies every leaf by a "
  "factor from the state (what scaling the update costs). Temp is the "
  "compiled step's temporary memory "
  "(`memory_analysis().temp_size_in_bytes`); adam's own is in each "
  "table's heading. Rows without a target (scope=leaf) are for reference."
)


def commit() -> str:
  """The checkout's commit, marked when files differ from it."""

  def git(*args):
    return subprocess.run(
      ["git", *args], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()

  head = git("rev-parse", "--short=12", "HEAD")
  if not head:
    return "unknown (not a git checkout)"
  changed = git("status", "--porcelain", "--untracked-files=no")
  return head + (" with uncommitted changes" if changed else "")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=(__doc__ or "").split("\n\n")[0],
    epilog=(
      f"A full run takes about {FULL_MINUTES} minutes on 2 idle CPU "
      "cores (the transformer sections b and c about two minutes each), "
      "and two to three times that on a loaded "
      f"machine; --quick about {QUICK_SECONDS} s (most of it "
      "compiling)."
    ),
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help=f"tiny sizes, about {QUICK_SECONDS} s: checks that it runs (the "
    "figures mean nothing)",
  )
  parser.add_argument(
    "--only",
    nargs="+",
    choices=SECTIONS + EXTRA_SECTIONS,
    default=list(SECTIONS),
    metavar="SECTION",
    help="the sections to run, of: a (64 leaves of 400k float32), b "
    "(transformer, float32), c (transformer, bfloat16), compile "
    "(clip_global on 1000 leaves), leaves (every clipper's compile time on "
    "300 and 1000 leaves), telemetry (leaf_stats=True over the same "
    "clipper, on a, b and 1000 leaves; only when named); default: all but "
    "telemetry",
  )
  parser.add_argument(
    "--leaf-counts",
    type=int,
    nargs="+",
    default=None,
    metavar="N",
    help="the tree sizes of section leaves (default: 300 1000; --quick: 10)",
  )
  parser.add_argument(
    "--leaf-rounds",
    type=int,
    default=1,
    metavar="N",
    help="interleaved compile rounds of section leaves (default: 1; "
    "--rounds does not apply to compile times)",
  )
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    default=None,
    help="where to write the markdown report (default: "
    "benchmarks/RESULTS.md for a full run, benchmarks/out/RESULTS.md for "
    "--quick or --only)",
  )
  parser.add_argument(
    "--rounds",
    type=int,
    default=None,
    help="timing rounds per tree (default: fitted to about 40 s of timed "
    "steps per tree, 5 to 15; --quick: 3)",
  )
  parser.add_argument(
    "--note",
    default="",
    help="a line for the report's heading (how the machine was used)",
  )
  parser.add_argument(
    "--no-optax-compile",
    action="store_true",
    help="skip optax.clip_by_global_norm's compile time in the compile "
    "section (23 s on 2 idle cores)",
  )
  args = parser.parse_args(argv)
  if args.rounds is not None and args.rounds < 1:
    parser.error(f"--rounds must be at least 1; got {args.rounds}")
  if args.leaf_rounds < 1:
    parser.error(f"--leaf-rounds must be at least 1; got {args.leaf_rounds}")
  if args.leaf_counts is not None and min(args.leaf_counts) < 1:
    parser.error(f"--leaf-counts must be at least 1; got {args.leaf_counts}")
  if args.out is None:
    full = (
      not args.quick
      and set(args.only) == set(SECTIONS)
      and args.leaf_counts is None
    )
    args.out = RESULTS if full else SCRATCH
  return args


def kept_part(out: pathlib.Path) -> str:
  """What a run writing ``out`` keeps of it: RESULTS.md from
  ``OTHER_SCRIPTS`` on (the other scripts' runs), else nothing.
  """
  if out != RESULTS or not out.exists():
    return ""
  text = out.read_text(encoding="utf-8")
  at = text.find(f"\n{OTHER_SCRIPTS}\n")
  return "" if at < 0 else "\n" + text[at + 1 :].rstrip("\n") + "\n"


def main(argv: Optional[list[str]] = None) -> int:
  args = parse_args(argv)
  sizes = Sizes.quick() if args.quick else Sizes()
  if args.rounds:
    sizes.rounds = args.rounds
  if args.no_optax_compile:
    sizes.optax_compile = False
  if args.leaf_counts:
    sizes.leaf_counts = tuple(args.leaf_counts)
  sizes.leaf_rounds = args.leaf_rounds

  command = shlex.join(["python", "benchmarks/run.py", *(argv or sys.argv[1:])])
  lines = [
    "# optaxclip benchmarks",
    "",
    *([] if args.out != RESULTS else [INTRO, ""]),
    *harness.machine_lines(),
    f"- Command: `{command}`"
    + (" (quick sizes: not for quoting)" if args.quick else ""),
    f"- Commit: {commit()}",
    *([f"- Note: {args.note}"] if args.note else []),
    "",
    METHOD,
    "",
  ]
  out = args.out
  out.parent.mkdir(parents=True, exist_ok=True)
  kept = kept_part(out)
  spawn = multiprocessing.get_context("spawn")
  heading = None
  for key in SECTIONS + EXTRA_SECTIONS:
    if key not in args.only:
      continue
    wanted = (
      "## Step time over adam's own step"
      if key in ("a", "b", "c")
      else "## Per-leaf telemetry"
      if key == "telemetry"
      else "## Compile time"
    )
    if heading != wanted:
      lines += [wanted, ""]
      heading = wanted
    if args.quick:  # small: one process is enough, and starts faster
      lines += run_section(key, sizes)
    else:
      with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        lines += pool.submit(run_section, key, sizes).result()
    # A crash or a kill late in the run keeps the tables so far.
    out.write_text(
      "\n".join([*lines, "(run in progress)"]) + "\n" + kept,
      encoding="utf-8",
    )
  if importlib.util.find_spec("torch") is None:
    lines.append("PyTorch is not installed: no cross-framework row.")
  text = "\n".join(lines).rstrip() + "\n"
  print(text)
  out.write_text(text + kept, encoding="utf-8")
  harness.log(f"written to {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
