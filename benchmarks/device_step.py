"""Step time on an accelerator: clippers, guard and stable_adamw against
adamw, with optax's equivalents, on a bfloat16 transformer tree.

One jitted, donating step (update + apply_updates) per variant, on a tree of
GPT-style shapes (``harness.transformer``) of about ``--params`` bfloat16
parameters (1e9 by default) and gradients N(0, 1e-3). Every variant keeps
its own optimizer state; the parameters are shared (each step hands them to
the next). Each round runs every variant once, in a new random order, with
an adamw step before each, and records its step over the mean of the adamw
steps around it; the table gives the median over rounds, the quartiles and
the median step in milliseconds.

The norm pass: ``optaxclip.global_norm`` of the gradients alone, jitted (one
read of the tree), and ``optax.global_norm``; their bytes read over their
time is the achieved bandwidth, given against ``--peak-gbs`` (the device's
peak memory bandwidth in GB/s, e.g. 3350 for an H100 SXM, 4800 for an H200)
when it is given.

Sized for one 8-minute run on one GPU at 1e9 parameters (about 45 GB of
states: adamw's moments are bfloat16, stable_adamw's float32 with a
bfloat16 Kahan compensation); it runs anywhere at a tiny size:

    python benchmarks/device_step.py [--params 1e9] [--width 2048]
        [--rounds 5] [--peak-gbs 3350] [--out results.md]
    python benchmarks/device_step.py --params 2e5 --width 32 --rounds 2
"""

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import harness
import optaxclip

LR = 1e-4
MAX_NORM = 1.0  # gradients N(0, 1e-3) over 1e9 elements: norm ~ 30, clipped


def variants():
  """Name -> (factory, optax's equivalent or None)."""
  adamw = lambda: optax.adamw(LR)
  return {
    "adamw": (adamw, None),
    "chain(clip_global, adamw)": (
      lambda: optax.chain(optaxclip.clip_global(MAX_NORM), adamw()),
      "chain(optax.clip_by_global_norm, adamw)",
    ),
    "chain(optax.clip_by_global_norm, adamw)": (
      lambda: optax.chain(optax.clip_by_global_norm(MAX_NORM), adamw()),
      None,
    ),
    "chain(clip_norm, adamw)": (
      lambda: optax.chain(optaxclip.clip_norm(MAX_NORM), adamw()),
      None,
    ),
    "guard(adamw)": (
      lambda: optaxclip.guard(adamw()),
      "optax.apply_if_finite(adamw)",
    ),
    "optax.apply_if_finite(adamw)": (
      lambda: optax.apply_if_finite(adamw(), 10),
      None,
    ),
    "stable_adamw": (lambda: optaxclip.stable_adamw(LR), None),
    "chain(clip_global, adamw, watch)": (
      lambda: optax.chain(
        optaxclip.clip_global(MAX_NORM), adamw(), optaxclip.watch()
      ),
      None,
    ),
  }


def tree_shapes(params: float, width: int, vocab: int, context: int):
  """A transformer's shapes of about ``params`` parameters: the embeddings
  and as many blocks of ``width`` as it takes (at least one).
  """
  per_block = 12 * width * width + 13 * width
  fixed = (vocab + context) * width + 2 * width
  blocks = max(1, round((params - fixed) / per_block))
  return harness.transformer(blocks, width, vocab, context), blocks


class Step:
  """One variant's jitted, donating step and its optimizer state."""

  def __init__(self, tx, params, grads):
    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    self.state = jax.tree.map(jnp.copy, tx.init(params))
    started = time.perf_counter()
    self.fn = (
      jax.jit(step, donate_argnums=(0, 1))
      .lower(params, self.state, grads)
      .compile()
    )
    self.compile_s = time.perf_counter() - started

  def __call__(self, shared, grads) -> float:
    started = time.perf_counter()
    shared["params"], self.state = self.fn(shared["params"], self.state, grads)
    jax.block_until_ready(shared["params"])
    return time.perf_counter() - started


def time_steps(steps, shared, grads, rounds, seed=0):
  """Per variant but adamw: per-round ratios to the adamw steps around it,
  and every variant's step times (seconds).
  """
  base = steps["adamw"]
  others = [name for name in steps if name != "adamw"]
  for name in steps:  # warm-up
    steps[name](shared, grads)
  ratios = {name: [] for name in others}
  times = {name: [] for name in steps}
  rng = np.random.default_rng(seed)
  for _ in range(rounds):
    rng.shuffle(others)
    before = base(shared, grads)
    times["adamw"].append(before)
    for name in others:
      mine = steps[name](shared, grads)
      after = base(shared, grads)
      times[name].append(mine)
      times["adamw"].append(after)
      ratios[name].append(2 * mine / (before + after))
      before = after
  return ratios, times


def norm_bandwidth(grads, repeats: int) -> dict[str, tuple[float, float]]:
  """Name -> (seconds, GB/s) of one jitted norm of the gradients."""
  nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(grads))
  out = {}
  for name, fn in (
    ("optaxclip.global_norm", optaxclip.global_norm),
    ("optax.global_norm", optax.global_norm),
  ):
    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(grads))
    seconds = []
    for _ in range(repeats):
      started = time.perf_counter()
      jax.block_until_ready(jitted(grads))
      seconds.append(time.perf_counter() - started)
    best = min(seconds)
    out[name] = (statistics.median(seconds), nbytes / best / 1e9)
  return out


def _quartiles(values):
  q1, q3 = np.percentile(values, [25, 75])
  return f"{statistics.median(values):.3f}x ({q1:.2f}–{q3:.2f})"


def report(args, n_params, blocks, compile_s, ratios, times, norms) -> str:
  device = jax.devices()[0]
  lines = [
    *harness.machine_lines(),
    f"- Device: {device.device_kind} ({device.platform})",
    f"- Command: `python benchmarks/device_step.py {' '.join(args.argv)}`",
    (
      f"- Tree: {n_params / 1e6:.1f}M bfloat16 parameters ({blocks} blocks "
      f"of width {args.width}), {args.rounds} interleaved rounds"
    ),
    "",
    (
      "| variant | step / adamw (median, IQR) | ms (median) | compile s |"
      " optax's equivalent / adamw |"
    ),
    "|---|---|---|---|---|",
  ]
  table = variants()
  for name, (_, twin) in table.items():
    ratio = "1" if name == "adamw" else _quartiles(ratios[name])
    twin_cell = "–" if twin is None else _quartiles(ratios[twin])
    lines.append(
      f"| {name} | {ratio} | {1e3 * statistics.median(times[name]):.2f} |"
      f" {compile_s[name]:.1f} | {twin_cell} |"
    )
  lines += [
    "",
    (
      "| norm pass (one read of the gradients) | ms (median) | GB/s (best) |"
      " of peak |"
    ),
    "|---|---|---|---|",
  ]
  for name, (seconds, gbs) in norms.items():
    peak = "–" if not args.peak_gbs else f"{gbs / args.peak_gbs:.0%}"
    lines.append(f"| {name} | {1e3 * seconds:.2f} | {gbs:.3g} | {peak} |")
  return "\n".join(lines)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--params", type=float, default=1e9)
  parser.add_argument("--width", type=int, default=2048)
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--context", type=int, default=2048)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--norm-repeats", type=int, default=10)
  parser.add_argument("--peak-gbs", type=float, default=None)
  parser.add_argument("--out", default=None, help="also write the report")
  args = parser.parse_args(argv)
  args.argv = argv
  for name in ("params", "width", "vocab", "context", "rounds"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be at least 1")
  shapes, blocks = tree_shapes(
    args.params, args.width, args.vocab, args.context
  )
  params = harness.make_arrays(shapes, jnp.bfloat16, 0.02, seed=0)
  grads = harness.make_arrays(shapes, jnp.bfloat16, harness.GRAD_SCALE, seed=1)
  n_params = harness.count_params(params)
  harness.log(f"{n_params / 1e6:.1f}M parameters in {blocks} blocks")
  shared = {"params": params}
  steps, compile_s = {}, {}
  for name, (make, _) in variants().items():
    steps[name] = Step(make(), shared["params"], grads)
    compile_s[name] = steps[name].compile_s
    harness.log(f"  compiled {name} in {compile_s[name]:.1f} s")
  ratios, times = time_steps(steps, shared, grads, args.rounds)
  norms = norm_bandwidth(grads, args.norm_repeats)
  text = report(args, n_params, blocks, compile_s, ratios, times, norms)
  print(text)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(text + "\n")
  return text


if __name__ == "__main__":
  main()
