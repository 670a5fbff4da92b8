"""The benchmarks' harness: trees, floor transformations, timing, compiling.

``run.py`` (the report) and ``floors.py`` (the ablations) build on it:

* trees: :func:`many_leaves`, :func:`transformer` (shapes), turned into
  arrays by :func:`make_arrays`; tree (a) from a script's command line
  (:func:`add_tree_a_arguments`, :func:`tree_a`);
* floors: :func:`read_only` (one float32 sum-of-squares pass over the
  gradients, not used) and :func:`scale_only` (every leaf times a factor from
  the state), each chained before adam by :func:`chained`;
* step time: :func:`time_variants` compiles one jitted, donating step per
  variant (:class:`Stepper`), then times the variants against adam in
  rounds: each round runs ``adam, v1, adam, v2, ..., adam`` (one step each,
  the variants in a new random order) and records each variant's step over
  the mean of the two adam steps around it, so that load that comes and goes
  on a shared machine hits both sides of a ratio alike;
* compile time: :func:`compile_seconds` (trace + lower, then XLA), and
  :func:`cold_compile_seconds` (the same from cold caches);
* :func:`torch_reference`: ``clip_grad_norm_`` + Adam over Adam in PyTorch,
  timed the same way, when torch is importable;
* report helpers: :func:`machine_lines`, :func:`fmt_ratio`, :func:`fmt_mb`.

All variants share one set of params and one Adam state (handed from one
variant to the next), so the memory needed does not grow with the number of
variants. Steps donate params and optimizer state, as a training loop does:
without donation every step allocates fresh output buffers, and that cost
(page faults) hides the optimizer's own.
"""

from __future__ import annotations

from collections.abc import Callable
import concurrent.futures
import dataclasses
import datetime
import functools
import importlib.util
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax

import optaxclip

LEARNING_RATE = 1e-3
GRAD_SCALE = 1e-3  # gradients ~ N(0, 1e-3): every clipper below is active


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Trees
# --------------------------------------------------------------------------


def many_leaves(n: int, size: int) -> dict[str, tuple[int, ...]]:
  """``n`` vectors of ``size`` elements."""
  return {f"leaf_{i:04d}": (size,) for i in range(n)}


def transformer(
  blocks: int, width: int, vocab: int, context: int
) -> dict[str, Any]:
  """Shapes of a GPT-style decoder: embeddings, attention, MLP, layer norms."""

  def dense(n_in, n_out):
    return {"kernel": (n_in, n_out), "bias": (n_out,)}

  def norm():
    return {"scale": (width,), "bias": (width,)}

  tree = {"embed": {"tokens": (vocab, width), "positions": (context, width)}}
  for b in range(blocks):
    tree[f"block_{b:02d}"] = {
      "ln_1": norm(),
      "attn": {
        name: dense(width, width) for name in ("query", "key", "value", "out")
      },
      "ln_2": norm(),
      "mlp": {"up": dense(width, 4 * width), "down": dense(4 * width, width)},
    }
  tree["ln_f"] = norm()
  return tree


def _is_shape(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def make_arrays(shapes, dtype, scale: float, seed: int, ones_for=None):
  """Random N(0, scale) arrays of the given shapes (``ones_for(path)``: 1)."""
  with_path, treedef = jax.tree_util.tree_flatten_with_path(
    shapes, is_leaf=_is_shape
  )
  keys = jax.random.split(jax.random.PRNGKey(seed), max(len(with_path), 1))
  out = []
  for key, (path, shape) in zip(keys, with_path):
    if ones_for and ones_for(jax.tree_util.keystr(path)):
      out.append(jnp.ones(shape, dtype))
    else:
      out.append(
        (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
      )
  return jax.tree.unflatten(treedef, out)


def add_tree_a_arguments(parser, rounds: int) -> None:
  """``--rounds`` (default ``rounds``), ``--leaves`` and ``--size``: the
  command line of a script timed on tree (a) of run.py (64 float32
  leaves of 400k by default). :func:`tree_a` checks and builds it.
  """
  parser.add_argument(
    "--rounds",
    type=int,
    default=rounds,
    help=f"timing rounds (default: {rounds})",
  )
  parser.add_argument(
    "--leaves",
    type=int,
    default=64,
    help="float32 leaves in the tree (default: 64)",
  )
  parser.add_argument(
    "--size",
    type=int,
    default=400_000,
    help="elements per leaf (default: 400000)",
  )


def tree_a(parser, args) -> tuple[Any, Any]:
  """``(params, grads)`` of the tree :func:`add_tree_a_arguments` asks
  for (params N(0, 0.02), gradients N(0, GRAD_SCALE)); a count below 1 is
  the parser's error.
  """
  for name in ("rounds", "leaves", "size"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be at least 1; got {getattr(args, name)}")
  shapes = many_leaves(args.leaves, args.size)
  params = make_arrays(shapes, jnp.float32, 0.02, seed=0)
  grads = make_arrays(shapes, jnp.float32, GRAD_SCALE, seed=1)
  return params, grads


def count_params(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


# --------------------------------------------------------------------------
# Transformations: adam and the floors
# --------------------------------------------------------------------------


def adam() -> optax.GradientTransformation:
  return optax.adam(LEARNING_RATE)


def chained(make_clipper):
  """``make_clipper`` chained before adam, as a factory."""
  return lambda: optax.chain(make_clipper(), adam())


def _sum_of_squares(tree) -> jax.Array:
  # The barrier keeps XLA from merging x * x with adam's own g * g (which it
  # would then write out in full): this is one read of the gradients.
  return sum(
    (
      jnp.sum(jnp.square(jax.lax.optimization_barrier(x).astype(jnp.float32)))
      for x in jax.tree.leaves(tree)
    ),
    jnp.zeros((), jnp.float32),
  )


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
      lambda x: (
        x * state.astype(jnp.promote_types(x.dtype, jnp.float32))
      ).astype(x.dtype),
      updates,
    )
    return scaled, state * 0.999

  return optax.GradientTransformation(init_fn, update_fn)


def read_pass_fn(grads) -> Callable[[], None]:
  """One jitted float32 sum of squares over all leaves, on its own."""
  fn = jax.jit(_sum_of_squares)
  jax.block_until_ready(fn(grads))
  return lambda: jax.block_until_ready(fn(grads))


# --------------------------------------------------------------------------
# Step time
# --------------------------------------------------------------------------


def _is_adam_state(x) -> bool:
  return isinstance(x, optax.ScaleByAdamState)


def _take_adam(state) -> optax.ScaleByAdamState:
  found = [
    x
    for x in jax.tree.leaves(state, is_leaf=_is_adam_state)
    if _is_adam_state(x)
  ]
  if len(found) != 1:
    raise ValueError(
      f"a timed variant must hold one adam state; got {len(found)}"
    )
  return found[0]


# Stands for the Adam state in a variant's state between steps.
_NO_ADAM = optax.ScaleByAdamState(count=None, mu=None, nu=None)


def _put_adam(state, adam_state):
  return jax.tree.map(
    lambda x: adam_state if _is_adam_state(x) else x,
    state,
    is_leaf=_is_adam_state,
  )


def temp_bytes(compiled) -> int:
  """The compiled program's temporary buffers, in bytes."""
  return int(compiled.memory_analysis().temp_size_in_bytes)


class Stepper:
  """A jitted, donating step of one variant, sharing params and Adam state."""

  def __init__(
    self, tx, params, grads, with_stats=False, compiler_options=None
  ):
    def step(p, s, g):
      u, s = tx.update(g, s, p)
      p = optax.apply_updates(p, u)
      if with_stats:
        return p, s, optaxclip.stats(s)
      return p, s

    # Distinct buffers: a state whose fields share one array cannot be donated.
    state = jax.tree.map(jnp.copy, tx.init(params))
    _take_adam(state)
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads)
    # Each step runs on the shared Adam state: this variant's own goes now
    # (twice the parameters' size per variant: 15 GB for 20 variants of a
    # 92M-parameter tree).
    self.state = _put_adam(state, _NO_ADAM)
    del state
    self.compiled = lowered.compile(compiler_options)
    self.temp_bytes = temp_bytes(self.compiled)

  def step(self, shared, grads) -> None:
    """One step from the shared params and Adam state, which it updates."""
    state = _put_adam(self.state, shared["adam"])
    out = self.compiled(shared["params"], state, grads)
    jax.block_until_ready(out)
    shared["params"], self.state = out[0], out[1]
    shared["adam"] = _take_adam(self.state)


@dataclasses.dataclass
class Result:
  """One variant's timings: per-round ratios to adam, step milliseconds."""

  ratios: list[float]
  ms: list[float]
  temp_bytes: Optional[int] = None

  def median(self) -> float:
    return statistics.median(self.ratios) if self.ratios else math.nan


def time_variants(
  variants: dict[str, tuple[Callable[[], Any], bool]],
  params,
  grads,
  rounds: Optional[int],
  budget_s: float,
  extra: Optional[dict[str, Callable[[], None]]] = None,
  log=log,
  seed: int = 0,
  compiler_options=None,
  grads_of: Optional[dict[str, Any]] = None,
) -> dict[str, Result]:
  """Step time of each variant over ``adam``'s, between two adam steps.

  Args:
    variants: names to ``(make_tx, with_stats)``; ``"adam"`` must be one of
      them (the baseline). ``with_stats``: the step returns
      ``optaxclip.stats(state)`` too.
    params: the parameters (copied: the steps donate their buffers).
    grads: the gradients every step applies.
    rounds: timing rounds, or None to fit them (5 to 15) to ``budget_s``
      seconds of timed steps.
    budget_s: see ``rounds``.
    extra: names to argument-less callables (blocking inside) timed like
      the variants.
    log: where progress goes.
    seed: the seed of the per-round shuffles.
    compiler_options: XLA options for every variant's step.
    grads_of: names to the gradients their steps apply instead of
      ``grads`` (of the same structure and shapes).

  Returns:
    Per name (adam's with ratio 1 each round), the per-round ratios of its
    step to the mean of the two adam steps around it (each round runs
    ``adam, v1, adam, v2, ..., adam``, the variants in a new random order)
    and its step times.
  """
  shared = {"params": jax.tree.map(jnp.copy, params)}
  shared["adam"] = _take_adam(adam().init(shared["params"]))

  def own_grads(name):
    return (grads_of or {}).get(name, grads)

  def build(item):
    name, (make_tx, with_stats) = item
    return name, Stepper(
      make_tx(), shared["params"], own_grads(name), with_stats, compiler_options
    )

  # Two at a time: XLA compiles outside the GIL, tracing does not.
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    steppers = dict(pool.map(build, variants.items()))
  log(f"  compiled {len(steppers)} steps")
  results = {
    name: Result([], [], stepper.temp_bytes)
    for name, stepper in steppers.items()
  }
  runners = {
    name: functools.partial(stepper.step, shared, own_grads(name))
    for name, stepper in steppers.items()
  }
  for name, fn in (extra or {}).items():
    runners[name] = fn
    results[name] = Result([], [])
  base = runners.pop("adam")
  for fn in runners.values():  # warm-up, outside the clock
    fn()
    fn()
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
    t = [time.perf_counter()]
    base()
    t.append(time.perf_counter())
    for name in order:
      for step in (runners[name], base):
        step()
        t.append(time.perf_counter())
    # t[2i]..t[2i+1]: adam; t[2i+1]..t[2i+2]: variant i; then adam again.
    for i, name in enumerate(order):
      before = t[2 * i + 1] - t[2 * i]
      mine = t[2 * i + 2] - t[2 * i + 1]
      after = t[2 * i + 3] - t[2 * i + 2]
      results[name].ratios.append(2 * mine / (before + after))
      results[name].ms.append(mine * 1e3)
    results["adam"].ms.extend(
      (t[2 * i + 1] - t[2 * i]) * 1e3 for i in range(len(order) + 1)
    )
    results["adam"].ratios.append(1.0)
  return results


def torch_reference(params, grads, rounds: int) -> tuple[float, float, str]:
  """``clip_grad_norm_(foreach)`` + Adam over Adam, in PyTorch.

  Timed as :func:`time_variants` times a variant: each round runs Adam,
  the clipped step, Adam.

  Returns:
    The median ratio, Adam's median step in ms and torch's version.
  """
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
    for fn in (plain, clipped, plain):
      fn()
      t.append(time.perf_counter())
    before, mine, after = t[1] - t[0], t[2] - t[1], t[3] - t[2]
    ratios.append(2 * mine / (before + after))
    ms.append((before + after) / 2 * 1e3)
  return statistics.median(ratios), statistics.median(ms), torch.__version__


# --------------------------------------------------------------------------
# Compile time
# --------------------------------------------------------------------------


def lower_step(tx, params, state, grads):
  """The jitted step ``apply_updates(p, tx.update(g, s, p))``, params and
  state donated as a training loop does, lowered for these arguments.
  """

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads)


def compile_seconds(make_tx, params, grads) -> tuple[float, float, int]:
  """Trace+lower seconds, XLA compile seconds and temp bytes of one step."""
  tx = make_tx()
  state = tx.init(params)
  t0 = time.perf_counter()
  lowered = lower_step(tx, params, state, grads)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return t1 - t0, t2 - t1, temp_bytes(compiled)


def cold_compile_seconds(make_tx, params, grads, clock: str = "wall") -> float:
  """Seconds to trace, lower and compile one step of ``make_tx()`` (see
  :func:`compile_seconds`) from cold caches, as after a restart: no trace
  kept from an earlier compile (a factory of optaxclip shares its jitted
  update across instances).

  ``clock``: ``"wall"`` (trace, lower and compile on the clock) or
  ``"cpu"`` (this process's CPU seconds, all threads, the optimizer's
  ``init`` included: less sensitive to other processes on a loaded
  machine).
  """
  if clock not in ("wall", "cpu"):
    raise ValueError(f"clock must be 'wall' or 'cpu'; got {clock!r}")
  jax.clear_caches()
  start = time.process_time()
  lower, compile_, _ = compile_seconds(make_tx, params, grads)
  if clock == "cpu":
    return time.process_time() - start
  return lower + compile_


# --------------------------------------------------------------------------
# Report helpers
# --------------------------------------------------------------------------


def fmt_ratio(res: Optional[Result]) -> str:
  """``median x (first quartile-third quartile)``, or a dash."""
  if res is None or not res.ratios:
    return "–"
  q1, q3 = np.percentile(res.ratios, [25, 75])
  return f"{res.median():.3f}x ({q1:.2f}–{q3:.2f})"


def fmt_mb(nbytes: Optional[int]) -> str:
  return "–" if nbytes is None else f"{nbytes / 2**20:.2f}"


def ratio_report(command: str, names, results) -> str:
  """The report of a script's interleaved run: the machine lines, the
  command, and a table of each variant's step over adam's and its temporary
  memory, in the order of ``names``.
  """
  lines = [*machine_lines(), f"- Command: `{command}`", ""]
  lines += [
    "| variant | step / adam (median, IQR) | temp MiB |",
    "|---|---|---|",
  ]
  for name in names:
    res = results[name]
    lines.append(f"| {name} | {fmt_ratio(res)} | {fmt_mb(res.temp_bytes)} |")
  return "\n".join(lines)


def machine_lines() -> list[str]:
  """Markdown bullets: the machine, the versions, the date and the load."""
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          model = line.split(":", 1)[1].strip()
          break
  except OSError:  # not Linux
    pass
  devices = ", ".join(
    sorted({f"{d.platform}:{d.device_kind}" for d in jax.devices()})
  )
  versions = (
    f"python {platform.python_version()}, jax {jax.__version__}, "
    f"jaxlib {jaxlib.__version__}, optax {optax.__version__}, "
    f"optaxclip {optaxclip.__version__}, numpy {np.__version__}"
  )
  if importlib.util.find_spec("torch") is not None:
    import torch

    versions += f", torch {torch.__version__}"
  load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
  return [
    (
      f"- Machine: {os.cpu_count()} cores, {model} ({platform.system()} "
      f"{platform.release()}); devices: {len(jax.devices())} x {devices}"
    ),
    f"- Versions: {versions}",
    (
      f"- Date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; "
      f"load average at the start: {load}"
    ),
  ]
