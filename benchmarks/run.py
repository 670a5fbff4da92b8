"""Benchmarks: what clipping costs on top of Adam, against optax's clippers.

One command measures, on whatever ``jax.devices()`` offers:

* step time: the jitted step
  ``optax.apply_updates(p, chain(clipper, adam).update(g, s, p))`` over
  ``adam``'s own step, as the median of per-round ratios (every variant runs
  once per round, interleaved, so load on a shared machine hits all alike),
  with optax's built-in equivalents side by side, on (a) 64 leaves of 400k
  float32, (b) a transformer-shaped tree (12 blocks of width 768) in float32
  and (c) in bfloat16;
* the floor: the same ratio for one reduction pass over the gradients
  (``adam + read``: a transformation that only sums the squares of the
  gradients into its state), which is what any norm-based clipper must pay;
* ``stats()``: the clip_global step returning ``optaxclip.stats(state)`` too;
* peak memory: the compiled step's temporary buffers
  (``compiled.memory_analysis().temp_size_in_bytes``) next to adam's;
* compile time of ``chain(clip_global, adam)`` on 1000 leaves of 100 float32
  elements against ``adam`` alone (and optax's ``clip_by_global_norm``);
* when PyTorch is importable: ``torch.nn.utils.clip_grad_norm_(foreach=True)``
  before ``torch.optim.Adam(foreach=True)`` over torch's Adam step alone.

The step donates params and optimizer state, as a training loop does: without
donation every step allocates fresh output buffers, and that cost (page
faults) hides the optimizer's own. All variants share one set of params and
one Adam state (passed from one variant to the next), so the memory needed
does not grow with the number of variants.

Usage::

  python benchmarks/run.py            # ~9 min on 2 CPU cores, up to 19 GB
  python benchmarks/run.py --quick    # tiny sizes, seconds: checks it runs

It prints a markdown report and writes it to ``benchmarks/RESULTS.md``
(``--out`` to change).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import concurrent.futures
import dataclasses
import datetime
import functools
import importlib.util
import math
import multiprocessing
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Optional

# This checkout's optaxclip, not an installed one:
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optaxclip

ROOT = pathlib.Path(__file__).resolve().parents[1]
LEARNING_RATE = 1e-3
GRAD_SCALE = 1e-3  # gradients ~ N(0, 1e-3): every clipper below is active
ADAPTIVE = ("clip_zscore", "clip_percentile", "clip_relative", "guard")


# --------------------------------------------------------------------------
# Trees
# --------------------------------------------------------------------------

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
  # XLA options for the timed steps; quick runs compile cheaply (the figures
  # of a quick run only check that everything runs).
  compiler_options: Optional[dict[str, Any]] = None
  compile_repeats: int = 2
  optax_compile: bool = True

  @classmethod
  def quick(cls) -> Sizes:
    return cls(many_leaves=4, many_size=1024, blocks=1, width=32, vocab=64,
               context=16, compile_leaves=20, compile_size=100, rounds=3,
               compile_repeats=1, optax_compile=True,
               compiler_options={"xla_backend_optimization_level": 0,
                                 "xla_llvm_disable_expensive_passes": True})


def many_leaves(n: int, size: int) -> dict[str, tuple[int, ...]]:
  return {f"leaf_{i:04d}": (size,) for i in range(n)}


def transformer(blocks: int, width: int, vocab: int,
                context: int) -> dict[str, Any]:
  """Shapes of a GPT-style decoder: embeddings, attention, MLP, layer norms."""
  def dense(n_in, n_out):
    return {"kernel": (n_in, n_out), "bias": (n_out,)}
  def norm():
    return {"scale": (width,), "bias": (width,)}
  tree = {"embed": {"tokens": (vocab, width), "positions": (context, width)}}
  for b in range(blocks):
    tree[f"block_{b:02d}"] = {
        "ln_1": norm(),
        "attn": {name: dense(width, width)
                 for name in ("query", "key", "value", "out")},
        "ln_2": norm(),
        "mlp": {"up": dense(width, 4 * width), "down": dense(4 * width, width)},
    }
  tree["ln_f"] = norm()
  return tree


def is_shape(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def make_arrays(shapes, dtype, scale: float, seed: int, ones_for=None):
  """Random N(0, scale) arrays of the given shapes (norm scales: ones)."""
  with_path, treedef = jax.tree_util.tree_flatten_with_path(
      shapes, is_leaf=is_shape)
  keys = jax.random.split(jax.random.PRNGKey(seed), max(len(with_path), 1))
  out = []
  for key, (path, shape) in zip(keys, with_path):
    name = jax.tree_util.keystr(path)
    if ones_for and ones_for(name):
      out.append(jnp.ones(shape, dtype))
    else:
      out.append((scale * jax.random.normal(key, shape, jnp.float32)
                  ).astype(dtype))
  return jax.tree.unflatten(treedef, out)


def count_params(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


# --------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------

def adam() -> optax.GradientTransformation:
  return optax.adam(LEARNING_RATE)


def _sum_of_squares(tree) -> jax.Array:
  # The barrier keeps XLA from merging x * x with adam's own g * g (which it
  # would then write out in full): this is one read of the gradients.
  return sum((jnp.sum(jnp.square(
      jax.lax.optimization_barrier(x).astype(jnp.float32)))
              for x in jax.tree.leaves(tree)), jnp.zeros((), jnp.float32))


def read_only() -> optax.GradientTransformation:
  """Sums the squares of the gradients into its state; updates unchanged.

  ``chain(read_only(), adam)`` is adam plus one reduction pass over the
  gradients: the floor for any clipper that needs a norm.
  """
  def init_fn(params):
    del params
    return jnp.zeros((), jnp.float32)

  def update_fn(updates, state, params=None):
    del state, params
    return updates, _sum_of_squares(updates)

  return optax.GradientTransformation(init_fn, update_fn)


def scale_only() -> optax.GradientTransformation:
  """Multiplies every leaf by a factor kept in its state; no norm.

  ``chain(scale_only(), adam)`` is the floor for scaling the gradients, the
  other thing a norm clipper does.
  """
  def init_fn(params):
    del params
    return jnp.ones((), jnp.float32)

  def update_fn(updates, state, params=None):
    del params
    scaled = jax.tree.map(
        lambda x: (x * state.astype(jnp.promote_types(x.dtype, jnp.float32))
                   ).astype(x.dtype), updates)
    return scaled, state * 0.999

  return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass
class Row:
  """One line of the step table: an optaxclip variant and its optax twin."""
  name: str
  ours: Optional[Callable[[], optax.GradientTransformation]]
  theirs: Optional[Callable[[], optax.GradientTransformation]] = None
  theirs_name: str = ""
  target: Optional[float] = None
  with_stats: bool = False
  note: str = ""


def chained(make_clipper):
  return lambda: optax.chain(make_clipper(), adam())


def adaptive_row(name: str) -> Row:
  if name == "guard":
    return Row("guard(adam)", lambda: optaxclip.guard(adam()),
               lambda: optax.apply_if_finite(adam(), 10),
               "optax.apply_if_finite", 1.12)
  return Row(name, chained(getattr(optaxclip, name)), target=1.12)


def step_rows(bf16: bool) -> list[Row]:
  """The variants timed on each tree; hyperparameters keep every clipper on."""
  del bf16
  rows = [
      Row("adam + read (floor)", chained(read_only),
          note="one f32 sum-of-squares pass over the gradients, not used"),
      Row("adam + scale (floor)", chained(scale_only),
          note="every leaf times a factor from the state, no norm"),
      Row("clip_global", chained(lambda: optaxclip.clip_global(1.0)),
          chained(lambda: optax.clip_by_global_norm(1.0)),
          "optax.clip_by_global_norm", 1.08),
      Row("clip_global + stats()",
          chained(lambda: optaxclip.clip_global(1.0)), with_stats=True,
          note="the step also returns optaxclip.stats(state)"),
      Row("clip_norm", chained(lambda: optaxclip.clip_norm(0.1)),
          target=1.10),
      Row("clip_value", chained(lambda: optaxclip.clip_value(1e-3)),
          chained(lambda: optax.clip(1e-3)), "optax.clip", 1.10),
      Row("clip_block_rms", chained(lambda: optaxclip.clip_block_rms(5e-4)),
          chained(lambda: optax.clip_by_block_rms(5e-4)),
          "optax.clip_by_block_rms", 1.10),
      Row("clip_unitwise", chained(lambda: optaxclip.clip_unitwise(0.01)),
          chained(lambda: optax.adaptive_grad_clip(0.01)),
          "optax.adaptive_grad_clip", 1.10),
  ]
  rows.extend(adaptive_row(n) for n in ADAPTIVE if hasattr(optaxclip, n))
  return rows


# --------------------------------------------------------------------------
# Timing machinery
# --------------------------------------------------------------------------

def _is_adam_state(x) -> bool:
  return isinstance(x, optax.ScaleByAdamState)


def _take_adam(state):
  found = [x for x in jax.tree.leaves(state, is_leaf=_is_adam_state)
           if _is_adam_state(x)]
  return found[0] if len(found) == 1 else None


def _put_adam(state, adam_state):
  return jax.tree.map(lambda x: adam_state if _is_adam_state(x) else x,
                      state, is_leaf=_is_adam_state)


class Stepper:
  """A jitted, donating step of one variant, sharing params and Adam state."""

  def __init__(self, tx, params, grads, with_stats=False,
               compiler_options=None):
    def step(p, s, g):
      u, s = tx.update(g, s, p)
      p = optax.apply_updates(p, u)
      if with_stats:
        return p, s, optaxclip.stats(s)
      return p, s

    # Distinct buffers: a state whose fields share one array cannot be donated.
    self.state = jax.tree.map(jnp.copy, tx.init(params))
    self.shares_adam = _take_adam(self.state) is not None
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(
        params, self.state, grads)
    self.compiled = lowered.compile(compiler_options)
    self.temp_bytes = _temp_bytes(self.compiled)

  def run(self, shared, grads, iters: int) -> None:
    state = (_put_adam(self.state, shared["adam"]) if self.shares_adam
             else self.state)
    params = shared["params"]
    for _ in range(iters):
      out = self.compiled(params, state, grads)
      params, state = out[0], out[1]
    jax.block_until_ready((params, state))
    shared["params"] = params
    if self.shares_adam:
      shared["adam"] = _take_adam(state)
    self.state = state


def _temp_bytes(compiled) -> Optional[int]:
  try:
    return int(compiled.memory_analysis().temp_size_in_bytes)
  except Exception:  # noqa: BLE001
    return None


@dataclasses.dataclass
class Result:
  ratios: list[float]
  ms: list[float]
  temp_bytes: Optional[int] = None
  error: str = ""

  def median(self) -> float:
    return statistics.median(self.ratios) if self.ratios else math.nan


def time_variants(variants: dict[str, Callable[[], Any]], params, grads,
                  rounds: Optional[int], budget_s: float,
                  extra: Optional[dict[str, Callable[[], None]]] = None,
                  log=print, seed: int = 0,
                  compiler_options=None) -> dict[str, Result]:
  """Step time of each variant over ``adam``'s, in adjacent pairs.

  ``variants`` maps names to ``(make_tx, with_stats)``; ``adam`` must be one
  of them. ``extra`` maps names to argument-less callables timed the same way
  (blocking inside). Each round visits the variants in a new random order,
  and times two steps of each variant between two adam steps (adam, variant,
  variant, adam): the ratio of the two sums is that round's figure, so load
  that comes and goes on a shared machine hits both sides of a ratio alike.
  ``rounds=None`` fits the rounds (3 to 15) to ``budget_s`` seconds of timed
  steps.
  """
  shared = {"params": jax.tree.map(jnp.copy, params)}
  shared["adam"] = _take_adam(adam().init(shared["params"]))
  steppers, results = {}, {}

  def build(item):
    name, (make_tx, with_stats) = item
    try:
      return name, Stepper(make_tx(), shared["params"], grads, with_stats,
                           compiler_options), ""
    except Exception as err:  # noqa: BLE001
      return name, None, f"{type(err).__name__}: {err}"

  # Two at a time: XLA compiles outside the GIL, tracing does not.
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    for name, stepper, error in pool.map(build, variants.items()):
      if stepper is None:
        results[name] = Result([], [], None, error)
        log(f"  {name}: failed to build: {error[:200]}")
      else:
        steppers[name] = stepper
        results[name] = Result([], [], stepper.temp_bytes)
  runners = {name: functools.partial(stepper.run, shared, grads, 1)
             for name, stepper in steppers.items()}
  for name, fn in (extra or {}).items():
    runners[name] = fn
    results[name] = Result([], [])
  base = runners.pop("adam")
  for name, fn in list(runners.items()):  # warm-up, outside the clock
    try:
      fn()
      fn()
    except Exception as err:  # noqa: BLE001
      results[name].error = f"{type(err).__name__}: {err}"
      log(f"  {name}: failed to run: {results[name].error[:200]}")
      del runners[name]
  base()
  t0 = time.perf_counter()
  base()
  one = time.perf_counter() - t0
  if rounds is None:
    rounds = int(min(15, max(5, budget_s / (2 * one * max(len(runners), 1)))))
  order = list(runners)
  rng = np.random.default_rng(seed)
  for _ in range(rounds):
    rng.shuffle(order)
    # adam, v1, adam, v2, adam, ...: each variant's step against the mean of
    # the two adam steps around it, so that load that comes and goes on a
    # shared machine hits both sides of a ratio alike.
    t = [time.perf_counter()]
    base()
    t.append(time.perf_counter())
    for name in order:
      for step in (runners[name], base):
        step()
        t.append(time.perf_counter())
    for i, name in enumerate(order):
      before, mine, after = (t[2 * i + 1] - t[2 * i],
                             t[2 * i + 2] - t[2 * i + 1],
                             t[2 * i + 3] - t[2 * i + 2])
      results[name].ratios.append(2 * mine / (before + after))
      results[name].ms.append(mine * 1e3)
    results["adam"].ms.extend((t[2 * i + 1] - t[2 * i]) * 1e3
                              for i in range(len(order) + 1))
    results["adam"].ratios.append(1.0)
  return results


def read_pass_fn(grads) -> Callable[[], None]:
  """One jitted f32 sum of squares over all leaves, on its own."""
  fn = jax.jit(_sum_of_squares)
  jax.block_until_ready(fn(grads))
  return lambda: jax.block_until_ready(fn(grads))


# --------------------------------------------------------------------------
# PyTorch reference (optional)
# --------------------------------------------------------------------------

def torch_reference(params, grads, rounds: int):
  """Median ratio of clip_grad_norm_(foreach) + Adam over Adam, in torch."""
  import torch

  leaves = jax.tree.leaves(params)
  bf16 = leaves[0].dtype == jnp.bfloat16

  def to_torch(x):
    t = torch.from_numpy(np.array(jax.device_get(x.astype(jnp.float32))))
    return t.to(torch.bfloat16) if bf16 else t

  tp = [torch.nn.Parameter(to_torch(x)) for x in leaves]
  for p, g in zip(tp, jax.tree.leaves(grads)):
    p.grad = to_torch(g)
  opt = torch.optim.Adam(tp, lr=LEARNING_RATE, foreach=True)

  def plain():
    opt.step()

  def clipped():
    # torch multiplies by the clamped coefficient whether or not it clips; a
    # limit above the norm keeps the stored gradients from shrinking towards
    # subnormals over the rounds (same work).
    torch.nn.utils.clip_grad_norm_(tp, 1e9, foreach=True)
    opt.step()

  for fn in (plain, clipped, plain, clipped):  # warm-up
    fn()
  ratios, ms = [], []
  for _ in range(rounds):
    t = [time.perf_counter()]
    for fn in (plain, clipped, clipped, plain):  # as for the jax variants
      fn()
      t.append(time.perf_counter())
    t_plain = (t[1] - t[0]) + (t[4] - t[3])
    ratios.append((t[3] - t[1]) / t_plain)
    ms.append(t_plain / 2 * 1e3)
  return statistics.median(ratios), statistics.median(ms), torch.__version__


# --------------------------------------------------------------------------
# Compile time
# --------------------------------------------------------------------------

def compile_seconds(make_tx, params, grads) -> tuple[float, float, int]:
  """Trace+lower seconds, XLA compile seconds and temp bytes of one step."""
  tx = make_tx()

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  state = tx.init(params)
  t0 = time.perf_counter()
  lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return t1 - t0, t2 - t1, _temp_bytes(compiled) or 0


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------

def fmt_ratio(res: Optional[Result]) -> str:
  if res is None:
    return "–"
  if res.error:
    return "error"
  if not res.ratios:
    return "–"
  qs = (np.percentile(res.ratios, [25, 75]) if len(res.ratios) > 1
        else (res.ratios[0], res.ratios[0]))
  return f"{res.median():.3f}x ({qs[0]:.2f}–{qs[1]:.2f})"


def fmt_mb(nbytes: Optional[int]) -> str:
  return "–" if nbytes is None else f"{nbytes / 2**20:.2f}"


def verdict(value: float, target: Optional[float]) -> str:
  if target is None or math.isnan(value):
    return ""
  return "yes" if value <= target else "**no**"


def machine_lines() -> list[str]:
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          model = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  devices = ", ".join(sorted({f"{d.platform}:{d.device_kind}"
                              for d in jax.devices()}))
  import jaxlib
  versions = (f"python {platform.python_version()}, jax {jax.__version__}, "
              f"jaxlib {jaxlib.__version__}, optax {optax.__version__}, "
              f"optaxclip {optaxclip.__version__}, numpy {np.__version__}")
  if importlib.util.find_spec("torch") is not None:
    import torch
    versions += f", torch {torch.__version__}"
  try:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
  except OSError:
    load = "?"
  return [
      (f"- Machine: {os.cpu_count()} cores, {model} ({platform.system()} "
       f"{platform.release()}); devices: {len(jax.devices())} x {devices}"),
      f"- Versions: {versions}",
      (f"- Date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; "
       f"load average at the start: {load}"),
  ]


def step_table(title: str, n_params: int, n_leaves: int, rows: list[Row],
               results: dict[str, Result], floor: Result,
               torch_line: Optional[str]) -> list[str]:
  adam_res = results["adam"]
  adam_ms = statistics.median(adam_res.ms)
  rounds = max((len(r.ratios) for n, r in results.items() if n != "adam"),
               default=0)
  lines = [
      f"### {title}",
      "",
      (f"{n_params / 1e6:.1f}M parameters in {n_leaves} leaves; adam's step: "
       f"{adam_ms:.1f} ms (median); {rounds} rounds; adam's temporaries: "
       f"{fmt_mb(adam_res.temp_bytes)} MiB."),
      "",
      ("| variant | optaxclip / adam | target | met | optax equivalent | "
       "optax / adam | temp MiB (optaxclip / optax) |"),
      "|---|---|---|---|---|---|---|",
  ]
  floor_read = 1 + floor.median() if floor.ratios else math.nan
  lines.append(f"| one read pass alone (jitted sum of squares) | "
               f"{floor_read:.3f}x | | | | | |")
  for row in rows:
    ours = results.get(row.name)
    theirs = results.get("optax:" + row.name) if row.theirs else None
    value = ours.median() if ours else math.nan
    name = row.name if not row.note else f"{row.name} <sub>{row.note}</sub>"
    temps = (f"{fmt_mb(ours.temp_bytes) if ours else '–'} / "
             f"{fmt_mb(theirs.temp_bytes) if theirs else '–'}")
    lines.append(
        f"| {name} | {fmt_ratio(ours)} | "
        f"{'' if row.target is None else f'<= {row.target:.2f}x'} | "
        f"{verdict(value, row.target)} | {row.theirs_name or '–'} | "
        f"{fmt_ratio(theirs)} | {temps} |")
  if torch_line:
    lines.append(torch_line)
  lines.append("")
  return lines


def run_tree(title, shapes, dtype, sizes: Sizes, budget_s: float, log):
  """Times every row on one tree; returns the table lines and the results."""
  bf16 = dtype == jnp.bfloat16
  params = make_arrays(shapes, dtype, 0.02, seed=0,
                       ones_for=lambda name: "scale" in name)
  grads = make_arrays(shapes, dtype, GRAD_SCALE, seed=1)
  rows = step_rows(bf16)
  variants = {"adam": (adam, False)}
  for row in rows:
    variants[row.name] = (row.ours, row.with_stats)
    if row.theirs:
      variants["optax:" + row.name] = (row.theirs, False)
  log(f"{title}: {count_params(params) / 1e6:.1f}M params, "
      f"{len(jax.tree.leaves(params))} leaves, {len(variants)} variants")
  t0 = time.perf_counter()
  results = time_variants(variants, params, grads, sizes.rounds, budget_s,
                          extra={"read": read_pass_fn(grads)}, log=log,
                          compiler_options=sizes.compiler_options)
  torch_line = None
  if importlib.util.find_spec("torch") is not None:
    try:
      ratio, ms, version = torch_reference(params, grads,
                                           max(sizes.rounds or 0, 5))
      torch_line = (f"| torch {version}: clip_grad_norm_(foreach=True) + "
                    f"Adam(foreach=True) / Adam ({ms:.1f} ms) | "
                    f"{ratio:.3f}x | | | | | |")
    except Exception as err:  # noqa: BLE001 (the row says it failed)
      torch_line = (f"| torch reference | failed: {type(err).__name__} "
                    "| | | | | |")
  log(f"  done in {time.perf_counter() - t0:.0f} s")
  lines = step_table(title, count_params(params), len(jax.tree.leaves(params)),
                     rows, results, results.pop("read"), torch_line)
  return lines, results


def run_compile(sizes: Sizes, log) -> tuple[list[str], dict[str, Any]]:
  shapes = many_leaves(sizes.compile_leaves, sizes.compile_size)
  params = make_arrays(shapes, jnp.float32, 0.02, seed=0)
  grads = make_arrays(shapes, jnp.float32, GRAD_SCALE, seed=1)
  variants = {
      "adam": adam,
      "chain(clip_global, adam)": chained(lambda: optaxclip.clip_global(1.0)),
  }
  measured = {name: [] for name in variants}
  for rep in range(sizes.compile_repeats):
    for name, make_tx in variants.items():
      measured[name].append(compile_seconds(make_tx, params, grads))
      log(f"  compile {name} #{rep + 1}: lower {measured[name][-1][0]:.1f} s, "
          f"compile {measured[name][-1][1]:.1f} s")
  if sizes.optax_compile:
    name = "chain(optax.clip_by_global_norm, adam)"
    measured[name] = [compile_seconds(
        chained(lambda: optax.clip_by_global_norm(1.0)), params, grads)]
    log(f"  compile {name}: lower {measured[name][-1][0]:.1f} s, "
        f"compile {measured[name][-1][1]:.1f} s")
  med = {name: (statistics.median(m[0] for m in ms),
                statistics.median(m[1] for m in ms), ms[0][2])
         for name, ms in measured.items()}
  base = med["adam"][0] + med["adam"][1]
  lines = [
      (f"### Compile time: {sizes.compile_leaves} leaves of "
       f"{sizes.compile_size} float32"),
      "",
      ("| step | trace + lower s | XLA compile s | total / adam | target "
       "| met | temp KiB |"),
      "|---|---|---|---|---|---|---|",
  ]
  summary = {}
  for name, (low, comp, temp) in med.items():
    ratio = (low + comp) / base
    target = 1.5 if name == "chain(clip_global, adam)" else None
    summary[name] = ratio
    reps = len(measured[name])
    lines.append(
        f"| {name} ({reps} run{'s' if reps > 1 else ''}) | {low:.2f} | "
        f"{comp:.2f} | {ratio:.2f}x | "
        f"{'' if target is None else f'<= {target:.1f}x'} | "
        f"{verdict(ratio, target)} | {temp / 1024:.1f} |")
  lines.append("")
  return lines, summary


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def run_section(key: str, sizes: Sizes, budget: float) -> list[str]:
  """The table lines of one section: a tree (a, b, c) or compile."""
  if key == "compile":
    return run_compile(sizes, log)[0]
  if key == "a":
    title = f"(a) {sizes.many_leaves} x {sizes.many_size} float32"
    shapes, dtype = many_leaves(sizes.many_leaves, sizes.many_size), jnp.float32
  else:
    dtype = jnp.float32 if key == "b" else jnp.bfloat16
    title = (f"({key}) transformer, {sizes.blocks} blocks of width "
             f"{sizes.width}, {jnp.dtype(dtype).name}")
    shapes = transformer(sizes.blocks, sizes.width, sizes.vocab,
                         sizes.context)
  return run_tree(title, shapes, dtype, sizes, budget, log)[0]


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes, a few seconds: checks that it runs")
  parser.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"),
                      help="where to write the markdown report")
  parser.add_argument("--rounds", type=int, default=None,
                      help="timing rounds per tree (default: fitted to about "
                      "40 s of timed steps per tree, 5 to 15; quick 3)")
  parser.add_argument("--only", default="a,b,c,compile",
                      help="comma-separated sections: a, b, c, compile")
  parser.add_argument("--no-optax-compile", action="store_true",
                      help="skip optax.clip_by_global_norm's compile time "
                      "(about 100 s on 2 cores)")
  args = parser.parse_args(argv)
  sizes = Sizes.quick() if args.quick else Sizes()
  if args.rounds:
    sizes.rounds = args.rounds
  if args.no_optax_compile:
    sizes.optax_compile = False
  sections = set(args.only.split(","))
  budget = 2.0 if args.quick else 40.0  # seconds of timed steps per tree

  command = "python benchmarks/run.py" + (" --quick" if args.quick else "")
  lines = [
      "# optaxclip benchmarks", "", *machine_lines(),
      f"- Command: `{command}`" + (" (quick sizes: not for quoting)"
                                   if args.quick else ""),
      "",
      ("Each step ratio is the median over rounds of (the variant's step time "
       "/ the mean of the two adam steps around it: each round runs adam, v1, "
       "adam, v2, adam, ... with the variants in a new random order); the "
       "interquartile range is in "
       "parentheses. Steps donate params and state, as a training loop does. "
       "Floors: `one read pass alone` is a jitted float32 sum of squares of "
       "the gradients on its own (1 + its time over adam's); `adam + read` "
       "adds that pass to adam's step (no norm-based clipper can cost less); "
       "`adam + scale` multiplies every leaf by a factor from the state (what "
       "scaling the update costs). Temp is the compiled step's temporary "
       "memory (`memory_analysis().temp_size_in_bytes`); adam's own is in "
       "each table's heading."),
      "",
      "## Step time over adam's own step",
      "",
  ]
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  # Each section runs in a fresh process: XLA's CPU allocator keeps what a
  # section used, and (a) to (c) in one process need more memory than 24 GB.
  spawn = multiprocessing.get_context("spawn")
  for key in ("a", "b", "c", "compile"):
    if key not in sections:
      continue
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
      lines += pool.submit(run_section, key, sizes, budget).result()
    # A crash or a kill late in the run keeps the tables so far.
    out.write_text("\n".join([*lines, "(run in progress)"]) + "\n",
                   encoding="utf-8")
  missing = [n for n in ADAPTIVE if not hasattr(optaxclip, n)]
  if missing:
    lines.append(f"Not in this checkout (rows appear once they exist): "
                 f"{', '.join(missing)}.")
  if importlib.util.find_spec("torch") is None:
    lines.append("PyTorch is not installed: no cross-framework row.")
  text = "\n".join(lines).rstrip() + "\n"
  print(text)
  out.write_text(text, encoding="utf-8")
  log(f"written to {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
