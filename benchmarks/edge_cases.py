"""What the clippers return at the edges, at an earlier commit and now.

One example per edge case the first release got wrong: magnitudes above
2**126, second-order derivatives, float64 beyond float32's range, states a
run never leaves, non-finite gradients, an infinite clip norm, eager calls,
``stats()`` and argument validation. Each runs on the package as it was at
a commit (``--before``, default 04da0db: the code before the edge-case
fixes) and on this checkout; the script prints what each returned, one row
per example, grouped by subject. An example that raised shows the
exception's type and the start of its message. (``clip_value``'s step times
are ``floors.py``'s.)

    python benchmarks/edge_cases.py            # about a minute
    python benchmarks/edge_cases.py --before 04da0db --only magnitude nonfinite

The sharded example needs two devices: the script asks XLA for 8 CPU
devices before JAX starts.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import math
import os
import pathlib
import sys
import tempfile
import time
from typing import Any, NamedTuple

if "jax" not in sys.modules:  # run as a script (a test's JAX has 8 already)
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np
import optax

import versions


def _norm(tree) -> float:
  """The float64 norm of a tree, scaled so that 1e38s do not overflow."""
  flat = np.concatenate(
    [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)]
  )
  scale = np.max(np.abs(flat)) if flat.size else 0.0
  if not np.isfinite(scale) or scale == 0:
    return float(scale)
  return float(np.linalg.norm(flat / scale) * scale)


def _stat(m, state, suffix: str) -> float:
  for key, value in m.stats(state).items():
    if key.endswith(suffix):
      return float(value)
  return math.nan


def _run(tx, grads, steps: int = 1, params=None):
  state = tx.init(params if params is not None else grads)
  update = jax.jit(tx.update)
  out, state = update(grads, state, params)
  for _ in range(steps - 1):
    out, state = update(grads, state, params)
  return out, state


# --- Magnitudes above 2**126 --------------------------------------------------


def clip_norm_1e38(m):
  out, state = _run(m.clip_norm(1.0), {"w": jnp.asarray([1e38, -1e38])})
  return f"out norm {_norm(out):.3g}, norm {_stat(m, state, '/norm'):.3g}"


def clip_relative_warmup_1e38(m):
  out, _ = _run(m.clip_relative(), {"w": jnp.asarray([1e38, 0.0])})
  return f"out norm {_norm(out):.3g} (warm-up limit 1)"


def clip_per_example_1e38(m):
  g = {"w": jnp.asarray([[1e38, 0.0], [0.5, 0.0]])}
  out, _ = _run(m.clip_per_example(1.0, reduce="sum"), g)
  return f"sum's out norm {_norm(out):.3g} (bound 2)"


def clip_global_sharded_1e38(m):
  mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
  x = jax.device_put(
    jnp.asarray([1e38, 1e38, 1.0, 1.0]),
    jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")),
  )
  out, state = _run(m.clip_global(1.0), {"w": x})
  return f"out norm {_norm(out):.3g}, norm {_stat(m, state, '/norm'):.3g}"


def clip_global_tiny_factor(m):
  out, _ = _run(m.clip_global(1e-3), {"w": jnp.asarray([1e37, 1e37])})
  return f"out norm {_norm(out):.3g} (limit 1e-3)"


# --- Second-order derivatives -----------------------------------------------


def hessians(m):
  makers = {
    "clip_global": lambda: m.clip_global(1.0),
    "clip_norm": lambda: m.clip_norm(1.0),
    "clip_value": lambda: m.clip_value(0.5),
    "clip_block_rms": lambda: m.clip_block_rms(1.0),
    "clip_unitwise": lambda: m.clip_unitwise(0.01),
    "clip_zscore": m.clip_zscore,
  }
  w = jnp.asarray([[1.0, -2.0], [0.5, 3.0]])
  failed = []
  for name, make in makers.items():
    tx = make()
    state = tx.init({"w": w})

    def f(s, tx=tx, state=state):
      out, _ = tx.update({"w": s * w}, state, {"w": w})
      return jnp.sum(out["w"] ** 2)

    try:
      jax.hessian(f)(jnp.asarray(2.0))
    except Exception as e:  # noqa: BLE001 (reported, not raised)
      failed.append(f"{name} ({type(e).__name__})")
  return f"{6 - len(failed)} of 6 ok" + (
    "; failed: " + ", ".join(failed) if failed else ""
  )


# --- float64 ------------------------------------------------------------------


def _x64(fn):
  def run(m):
    was = bool(jax.config.read("jax_enable_x64"))
    jax.config.update("jax_enable_x64", True)
    try:
      return fn(m)
    finally:
      jax.config.update("jax_enable_x64", was)

  run.__name__ = fn.__name__
  return run


@_x64
def percentile_and_relative_1e_50(m):
  g = {"w": jnp.asarray([1e-50, -2e-50], jnp.float64)}
  out_p, _ = _run(m.clip_percentile(), g, steps=3)
  out_r, _ = _run(m.clip_relative(), g, steps=3)
  return f"out norms {_norm(out_p):.3g} / {_norm(out_r):.3g} (in: 2.24e-50)"


@_x64
def guard_1e200(m):
  g = {"w": jnp.asarray([1e200, 1e200], jnp.float64)}
  _, state = _run(m.guard(optax.sgd(1.0)), g, steps=2)
  return (
    f"skipped {_stat(m, state, '/skipped'):.0f} of 2, "
    f"nonfinite {_stat(m, state, '/nonfinite'):.0f}"
  )


# --- States a run never leaves ------------------------------------------------


def _history(tx, first, then, n_first, n_then, params=None):
  state = tx.init(params if params is not None else then)
  update = jax.jit(tx.update)
  outs = []
  for i in range(n_first + n_then):
    g = first if i < n_first else then
    out, state = update(g, state, params)
    outs.append(out)
  return outs, state


def guard_after_zero_warmup(m):
  zero, one = {"w": jnp.zeros(2)}, {"w": jnp.ones(2)}
  tx = m.guard(optax.sgd(0.1), spike_z=3.0, warmup_steps=5)
  _, state = _history(tx, zero, one, 5, 200)
  return f"skipped {_stat(m, state, '/skipped'):.0f} of 200"


def zscore_after_zero_warmup(m):
  zero, one = {"w": jnp.zeros(2)}, {"w": jnp.ones(2)}
  outs, _ = _history(m.clip_zscore(warmup_steps=5), zero, one, 5, 50)
  return f"last out norm {_norm(outs[-1]):.3g} of 1.41"


def relative_zero_leaf_once(m):
  first = {"a": jnp.zeros(2), "b": jnp.ones(2)}
  then = {"a": jnp.ones(2), "b": jnp.ones(2)}
  outs, _ = _history(m.clip_relative(warmup_steps=5), first, then, 1, 50)
  return f"leaf a's last out norm {_norm(outs[-1]['a']):.3g} of 1.41"


# --- Non-finite handling ------------------------------------------------------


def clip_global_nan_leaf(m):
  g = {"a": jnp.asarray([jnp.nan]), "b": jnp.asarray([1e6])}
  out, state = _run(m.clip_global(1.0), g)
  return (
    f"b {float(out['b'][0]):.3g}, "
    f"clip_fraction {_stat(m, state, '/clip_fraction'):.3g}"
  )


def per_example_nonfinite_example(m):
  g = {"w": jnp.asarray([[jnp.nan, 1e6], [0.5, 0.0]])}
  out, _ = _run(m.clip_per_example(1.0, reduce="sum"), g)
  return f"sum {np.asarray(out['w']).round(3).tolist()}"


def adaptive_clipped_norm_on_inf(m):
  tx = m.clip_zscore(warmup_steps=2)
  state = tx.init({"w": jnp.ones(2)})
  update = jax.jit(tx.update)
  for _ in range(3):
    _, state = update({"w": jnp.ones(2)}, state)
  out, state = update({"w": jnp.asarray([jnp.inf, 1.0])}, state)
  return (
    f"update NaN: {bool(np.isnan(np.asarray(out['w'])).any())}, "
    f"clipped_norm {_stat(m, state, '/clipped_norm'):.3g}"
  )


# --- Arguments, eager calls, stats(), validation ------------------------------


def per_example_inf_clip(m):
  out, _ = _run(
    m.clip_per_example(math.inf, reduce="sum"),
    {"w": jnp.asarray([[3.0, 4.0]])},
  )
  return f"accepted, out norm {_norm(out):.3g}"


def eager_injected_clip_global(m):
  tx = optax.inject_hyperparams(m.clip_global)(max_norm=1.0)
  g = {"w": jnp.ones(3)}
  state = tx.init(g)
  out, state = tx.update(g, state)  # the first call compiles
  jax.block_until_ready(out)
  start = time.perf_counter()
  for _ in range(5):
    out, state = tx.update(g, state)
  jax.block_until_ready(out)
  return f"{(time.perf_counter() - start) / 5 * 1e3:.1f} ms a call"


class ClipGlobalState(NamedTuple):  # a user's own class, named like ours
  x: Any


def stats_foreign_namedtuple(m):
  tx = m.clip_global(1.0)
  g = {"w": jnp.ones(2)}
  _, state = _run(tx, g)
  return f"keys {sorted(m.stats((state, ClipGlobalState(jnp.ones(())))))}"


def stats_colliding_paths(m):
  tx = optax.named_chain(
    ("x/clip", m.clip_global(1.0)),
    ("x", optax.named_chain(("clip", m.clip_global(2.0)))),
  )
  _, state = _run(tx, {"w": jnp.ones(2)})
  keys = [k for k in m.stats(state) if k.endswith("norm")]
  return f"{len(keys)} norm keys: {keys}"


def stats_time_1000_leaves(m):
  params = {f"l{i}": jnp.ones(4) for i in range(1000)}
  tx = optax.chain(m.clip_global(1.0), optax.adam(1e-3))
  state = tx.init(params)
  m.stats(state)
  start = time.perf_counter()
  for _ in range(5):
    m.stats(state)
  return f"{(time.perf_counter() - start) / 5 * 1e3:.1f} ms a call"


def guard_counter_dtype(m):
  _, state = _run(m.guard(optax.sgd(1.0)), {"w": jnp.ones(2)})
  value = m.stats(state)
  key = next(k for k in value if k.endswith("/skipped"))
  return f"{key} {np.asarray(value[key]).dtype}"


def _construct(make: Callable[[], Any]) -> str:
  try:
    tx = make()
  except Exception as e:  # noqa: BLE001 (the result)
    return f"{type(e).__name__}: {str(e)[:70]}"
  try:
    _run(tx, {"w": jnp.ones(2)})
  except Exception as e:  # noqa: BLE001 (the result)
    return f"accepted; update: {type(e).__name__}: {str(e)[:50]}"
  return "accepted"


def validation(which):
  def check(m):
    return _construct(
      {
        "warmup_steps=2**31": lambda: m.clip_zscore(warmup_steps=2**31),
        'sharded="no"': lambda: m.clip_global(1.0, sharded="no"),
        'axis_name=""': lambda: m.clip_global(1.0, axis_name=""),
        "seed=PRNGKey": lambda: m.clip_per_example(
          1.0, seed=jax.random.PRNGKey(0)
        ),
        "clip_relative(factor=0.5)": lambda: m.clip_relative(factor=0.5),
        "clip_norm(-1.0)": lambda: m.clip_norm(-1.0),
      }[which]
    )

  check.__name__ = which
  return check


REPORTS: list[tuple[str, str, Callable[[Any], str]]] = [
  ("magnitude", "clip_norm(1) of [1e38, -1e38]", clip_norm_1e38),
  (
    "magnitude",
    "clip_relative()'s warm-up of a 1e38 leaf",
    clip_relative_warmup_1e38,
  ),
  ("magnitude", "clip_per_example(1) of a 1e38 example", clip_per_example_1e38),
  (
    "magnitude",
    "clip_global(1) of [1e38, 1e38, 1, 1] on 2 devices",
    clip_global_sharded_1e38,
  ),
  (
    "magnitude",
    "clip_global(1e-3) of a 1.4e37 gradient",
    clip_global_tiny_factor,
  ),
  ("derivative", "jax.hessian through update", hessians),
  (
    "float64",
    "float64 norm 1e-50: clip_percentile / clip_relative",
    percentile_and_relative_1e_50,
  ),
  ("float64", "guard, float64 norm 1.4e200", guard_1e200),
  (
    "stuck",
    "guard(spike_z=3) after 5 zero norms, then 1s",
    guard_after_zero_warmup,
  ),
  (
    "stuck",
    "clip_zscore after 5 zero norms, then 1s",
    zscore_after_zero_warmup,
  ),
  (
    "stuck",
    "clip_relative, leaf a zero on step 0 only",
    relative_zero_leaf_once,
  ),
  ("nonfinite", "clip_global(1) of {a: [nan], b: [1e6]}", clip_global_nan_leaf),
  (
    "nonfinite",
    "clip_per_example(1): example [nan, 1e6] beside [0.5, 0]",
    per_example_nonfinite_example,
  ),
  (
    "nonfinite",
    "clip_zscore on an inf step after warm-up",
    adaptive_clipped_norm_on_inf,
  ),
  ("argument", "clip_per_example(l2_clip=inf)", per_example_inf_clip),
  (
    "eager",
    "eager inject_hyperparams(clip_global) update",
    eager_injected_clip_global,
  ),
  (
    "stats",
    "stats() beside a user's NamedTuple named ClipGlobalState",
    stats_foreign_namedtuple,
  ),
  (
    "stats",
    "stats() of named_chain 'x/clip' beside 'x' > 'clip'",
    stats_colliding_paths,
  ),
  (
    "stats",
    "stats() outside jit, 1000-leaf Adam state",
    stats_time_1000_leaves,
  ),
  (
    "stats",
    "guard's counters in stats() (documented float32 before, int32 now)",
    guard_counter_dtype,
  ),
  *[
    ("validation", which, validation(which))
    for which in (
      "warmup_steps=2**31",
      'sharded="no"',
      'axis_name=""',
      "seed=PRNGKey",
      "clip_relative(factor=0.5)",
      "clip_norm(-1.0)",
    )
  ],
]


def result(fn, module) -> str:
  """What ``fn`` returned on ``module``, or the exception it raised."""
  try:
    return fn(module)
  except Exception as e:  # noqa: BLE001 (the result)
    return f"{type(e).__name__}: {str(e).splitlines()[0][:70]}"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    description="The edge cases on an earlier commit and now."
  )
  parser.add_argument(
    "--before",
    default="04da0db",
    help="the commit to compare with (default: 04da0db, before the fixes)",
  )
  parser.add_argument(
    "--only",
    nargs="+",
    choices=sorted({subject for subject, _, _ in REPORTS}),
    help="subjects to run (default: all)",
  )
  args = parser.parse_args(argv)
  before = versions.import_at(args.before, pathlib.Path(tempfile.mkdtemp()))
  now = versions.import_at(".", pathlib.Path(tempfile.mkdtemp()))
  print(f"| subject | example | {args.before} | now |")
  print("|---|---|---|---|")
  for subject, example, fn in REPORTS:
    if args.only and subject not in args.only:
      continue
    cells = [result(fn, m).replace("|", "/") for m in (before, now)]
    print(f"| {subject} | {example} | {cells[0]} | {cells[1]} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
