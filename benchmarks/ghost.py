"""Ghost clipping against the exact per-example path: memory and time.

On the small transformer of ``examples/dp_transformer.py`` (embeddings,
causal attention, MLP, LayerNorms, blocks under ``nn.scan``), prints:

* the compiled temporary memory (XLA's memory analysis) of one clipped step
  at batch ``--batch`` with ``clipped_grad(method="ghost")`` and
  ``method="vmap"``, and their ratio;
* the largest batch (a power of two) whose clipped step fits ``--budget-mib``
  of temporary memory, for both methods;
* the step time of the ghost step, the vmap step and optax's
  ``per_example_global_norm_clip`` (on ``vmap(grad)`` per-example gradients)
  over a plain, non-private ``jax.grad`` of the mean loss: interleaved
  rounds, median of per-round ratios (the machine is noisy: say so when
  quoting them).

    python benchmarks/ghost.py [--size small] [--batch 256] [--rounds 5]
"""

import argparse
import importlib.util
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optaxclip

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_example():
  spec = importlib.util.spec_from_file_location(
    "dp_transformer", ROOT / "examples" / "dp_transformer.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def steps(loss_fn, clip):
  """The four jitted steps: (params, tokens) -> gradients."""
  ghost = optaxclip.clipped_grad(loss_fn, clip, method="ghost")
  vmap = optaxclip.clipped_grad(loss_fn, clip, method="vmap")

  def plain(params, tokens):
    return jax.grad(lambda p: loss_fn(p, tokens).mean())(params)

  def optax_clip(params, tokens):
    per_example = jax.vmap(
      jax.grad(lambda p, t: loss_fn(p, t[None])[0]), in_axes=(None, 0)
    )(params, tokens)
    leaves, treedef = jax.tree.flatten(per_example)
    summed, _ = optax.per_example_global_norm_clip(leaves, clip)
    return jax.tree.unflatten(treedef, summed)

  return {
    "ghost": lambda p, t: ghost(p, t)[0],
    "vmap": lambda p, t: vmap(p, t)[0],
    "plain": plain,
    "optax": optax_clip,
  }


def temp_mib(fn, params, tokens):
  compiled = jax.jit(fn).lower(params, tokens).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**20, compiled


def main():
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument("--size", default="small", help="the example's size")
  parser.add_argument(
    "--batch",
    type=int,
    default=256,
    help="batch of the memory and time comparison",
  )
  parser.add_argument(
    "--budget-mib",
    type=float,
    default=256.0,
    help="temporary memory budget for the largest batch",
  )
  parser.add_argument(
    "--max-batch",
    type=int,
    default=4096,
    help="largest batch tried for the budget",
  )
  parser.add_argument(
    "--rounds", type=int, default=5, help="interleaved timing rounds"
  )
  args = parser.parse_args()
  example = load_example()
  size = example.SIZES[args.size]
  model = example.Transformer(**size)
  params = model.init(
    jax.random.PRNGKey(0), jnp.zeros((1, size["length"]), jnp.int32)
  )
  loss_fn = example.per_example_loss(model)
  fns = steps(loss_fn, 1.0)

  def tokens_of(batch):
    return example.synthetic_tokens(
      jax.random.PRNGKey(1), batch, size["vocab"], size["length"]
    )

  tokens = tokens_of(args.batch)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  plan = optaxclip.clipped_grad(loss_fn, 1.0).plan(params, tokens)
  print(
    f"{args.size} transformer: {n_params} parameters, sequences of "
    f"{size['length']}, batch {args.batch}; ghosted parameter arrays "
    f"{len(plan.ghosted)}, exact fallback {plan.fallback or 'none'}"
  )
  compiled, memory = {}, {}
  for name in fns:
    memory[name], compiled[name] = temp_mib(fns[name], params, tokens)
  print(
    "compiled temporary memory (MiB): "
    + ", ".join(f"{k} {v:.1f}" for k, v in memory.items())
    + f"; ghost / vmap = {memory['ghost'] / memory['vmap']:.3f}"
  )

  for name in ("ghost", "vmap"):
    batch, fits = 8, None
    while batch <= args.max_batch:
      mib, _ = temp_mib(fns[name], params, tokens_of(batch))
      if mib > args.budget_mib:
        break
      fits, batch = (batch, mib), batch * 2
    print(
      f"largest power-of-two batch within {args.budget_mib:g} MiB, "
      f"{name}: "
      + ("none" if fits is None else f"{fits[0]} ({fits[1]:.1f} MiB)")
    )

  for f in compiled.values():
    jax.block_until_ready(f(params, tokens))
  ratios = {k: [] for k in fns if k != "plain"}
  for _ in range(args.rounds):
    times = {}
    for name in np.random.default_rng(len(ratios["ghost"])).permutation(
      list(fns)
    ):
      start = time.perf_counter()
      jax.block_until_ready(compiled[name](params, tokens))
      times[name] = time.perf_counter() - start
    for k in ratios:
      ratios[k].append(times[k] / times["plain"])
  print(
    f"step time over a plain jax.grad of the mean loss "
    f"({times['plain'] * 1e3:.1f} ms last round), median of "
    f"{args.rounds} interleaved rounds: "
    + ", ".join(f"{k} {np.median(v):.2f}x" for k, v in ratios.items())
  )


if __name__ == "__main__":
  main()
