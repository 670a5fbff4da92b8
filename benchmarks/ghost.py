"""Ghost clipping against the exact per-example path: memory and time.

On the transformers of ``examples/dp_transformer.py`` (embeddings, causal
attention, MLP, LayerNorms, blocks under ``nn.scan``), per size:

* the parameters ``P``, the per-example gradients' ``B*P`` floats and the
  activations (the temporary memory of a plain ``jax.grad``): the ghost
  method cannot go below the activations, so ``ghost / vmap`` is small only
  where ``B*P`` dominates them (``--size small`` has 110k parameters and is
  activation-dominated; ``medium``, vocabulary 4096 and width 256, is not;
  ``wide``, sequences of 16 and width 512, the shape of DP fine-tuning,
  even less);
* the compiled temporary memory (XLA's memory analysis) of one clipped step
  at batch ``--batch`` with ``clipped_grad(method="ghost",
  bookkeeping=True)`` (``ghost_bk``: book-keeping, one backward pass), the
  same with ``bookkeeping=False`` (``ghost_2pass``, the default),
  ``method="vmap"``, optax's
  ``per_example_global_norm_clip`` on
  ``vmap(grad)`` per-example gradients and the plain ``jax.grad``; and
  with the example's ``Block`` rematerialised (``remat=Block``, the
  ``*_remat`` rows): the two-pass ghost step, the vmap path and the plain
  ``jax.grad`` (its loss rerouted as ``remat=Block`` does: the blocks under
  ``flax.linen.remat``), so that each method is compared with and without
  remat;
* the largest batch (a power of two) whose step fits ``--budget-mib`` of
  temporary memory, for both methods (predicted from the two compiled
  batches, temporary memory being affine in the batch, then compiled at the
  prediction and at twice it to check);
* step times at batch ``--time-batch`` over the plain ``jax.grad`` of the
  mean loss: interleaved rounds, median of per-round ratios (the machine is
  noisy: say so when quoting them).

    python benchmarks/ghost.py [--size small] [--batch 256] [--rounds 5]
        [--tied] [--no-largest-batch]
"""

import argparse
import importlib.util
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optaxclip
from optaxclip import _remat

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_example():
  """examples/dp_transformer.py as a module (examples/ on ``sys.path`` while
  it loads, for its ``_flags``).
  """
  spec = importlib.util.spec_from_file_location(
    "dp_transformer", ROOT / "examples" / "dp_transformer.py"
  )
  module = importlib.util.module_from_spec(spec)
  saved = list(sys.path)
  sys.path.insert(0, str(ROOT / "examples"))
  try:
    spec.loader.exec_module(module)
  finally:
    sys.path[:] = saved
  return module


def steps(loss_fn, clip, block):
  """The steps compared: (params, tokens) -> gradients; ``block``: the
  module class the ``*_remat`` steps rematerialise.
  """
  one_pass = optaxclip.clipped_grad(
    loss_fn, clip, method="ghost", bookkeeping=True
  )
  two_pass = optaxclip.clipped_grad(
    loss_fn, clip, method="ghost", bookkeeping=False
  )
  vmap = optaxclip.clipped_grad(loss_fn, clip, method="vmap")
  two_pass_remat = optaxclip.clipped_grad(
    loss_fn, clip, method="ghost", bookkeeping=False, remat=block
  )
  vmap_remat = optaxclip.clipped_grad(loss_fn, clip, method="vmap", remat=block)
  remat_loss = _remat.rematerialised(loss_fn, (block,))

  def plain(params, tokens):
    return jax.grad(lambda p: loss_fn(p, tokens).mean())(params)

  def plain_remat(params, tokens):
    return jax.grad(lambda p: remat_loss(p, tokens).mean())(params)

  def optax_clip(params, tokens):
    per_example = jax.vmap(
      jax.grad(lambda p, t: loss_fn(p, t[None])[0]), in_axes=(None, 0)
    )(params, tokens)
    leaves, treedef = jax.tree.flatten(per_example)
    summed, _ = optax.per_example_global_norm_clip(leaves, clip)
    return jax.tree.unflatten(treedef, summed)

  return {
    "ghost_bk": lambda p, t: one_pass(p, t)[0],
    "ghost_2pass": lambda p, t: two_pass(p, t)[0],
    "vmap": lambda p, t: vmap(p, t)[0],
    "plain": plain,
    "optax": optax_clip,
    "ghost_2pass_remat": lambda p, t: two_pass_remat(p, t)[0],
    "vmap_remat": lambda p, t: vmap_remat(p, t)[0],
    "plain_remat": plain_remat,
  }


def temp_mib(fn, params, tokens):
  compiled = jax.jit(fn).lower(params, tokens).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**20, compiled


def largest_batch(fn, params, tokens_of, measured, budget):
  """The largest power-of-two batch within ``budget`` MiB: predicted from
  the temporary memory at two batches (``measured``: {batch: MiB}), then
  checked by compiling at the prediction and at twice it.
  """
  (b0, m0), (b1, m1) = sorted(measured.items())
  slope = (m1 - m0) / (b1 - b0)
  guess = (budget - (m0 - slope * b0)) / slope if slope > 0 else 2**20
  batch = 2 ** max(0, int(np.floor(np.log2(max(guess, 1)))))
  mib = {}
  for _ in range(6):
    for b in (batch, 2 * batch):
      if b not in mib:
        mib[b] = temp_mib(fn, params, tokens_of(b))[0]
    if mib[batch] > budget and batch > 1:
      batch //= 2
    elif mib[2 * batch] <= budget:
      batch *= 2
    else:
      return batch, mib[batch]
  return batch, mib.get(batch)


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
    help="batch of the memory comparison",
  )
  parser.add_argument(
    "--time-batch", type=int, default=32, help="batch of the timings"
  )
  parser.add_argument(
    "--budget-mib",
    type=float,
    default=1024.0,
    help="temporary memory budget for the largest batch",
  )
  parser.add_argument(
    "--rounds", type=int, default=5, help="interleaved timing rounds"
  )
  parser.add_argument(
    "--tied",
    action="store_true",
    help="the read-out tied to the token embedding (read by attribute: "
    "the embedding takes the exact per-example path)",
  )
  parser.add_argument(
    "--no-largest-batch",
    action="store_true",
    help="skip the search for the largest batch within --budget-mib",
  )
  args = parser.parse_args()
  example = load_example()
  size = example.SIZES[args.size]
  model = example.Transformer(**size, tied=args.tied)
  params = model.init(
    jax.random.PRNGKey(0), jnp.zeros((1, size["length"]), jnp.int32)
  )
  loss_fn = example.per_example_loss(model)
  fns = steps(loss_fn, 1.0, example.Block)

  def tokens_of(batch):
    return example.synthetic_tokens(
      jax.random.PRNGKey(1), batch, size["vocab"], size["length"]
    )

  tokens = tokens_of(args.batch)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  plan = optaxclip.clipped_grad(loss_fn, 1.0).plan(params, tokens)
  print(
    f"{args.size} transformer {size}"
    f"{' (tied read-out)' if args.tied else ''}: P = {n_params} parameters; "
    "ghosted "
    f"parameter arrays {len(plan.ghosted)}, exact fallback "
    f"{plan.fallback or 'none'}"
  )
  memory = {}
  for name in fns:
    memory[name] = temp_mib(fns[name], params, tokens)[0]
  print(
    f"batch {args.batch}: per-example gradients B*P = "
    f"{args.batch * n_params * 4 / 2**20:.1f} MiB (float32); compiled "
    "temporary memory (MiB): "
    + ", ".join(f"{k} {v:.1f}" for k, v in memory.items())
  )
  print(
    ", ".join(
      f"{g} / {ref} = {memory[g] / memory[ref]:.3f}"
      for g in ("ghost_bk", "ghost_2pass", "ghost_2pass_remat")
      for ref in ("vmap", "vmap_remat", "optax", "plain", "plain_remat")
    )
  )

  time_tokens = tokens_of(args.time_batch)
  compiled, small = {}, {}
  for name in fns:
    small[name], compiled[name] = temp_mib(fns[name], params, time_tokens)
  for name in ("ghost_bk", "ghost_2pass", "ghost_2pass_remat", "vmap"):
    if args.no_largest_batch:
      break
    batch, mib = largest_batch(
      fns[name],
      params,
      tokens_of,
      {args.time_batch: small[name], args.batch: memory[name]},
      args.budget_mib,
    )
    print(
      f"largest power-of-two batch within {args.budget_mib:g} MiB, "
      f"{name}: {batch} ({mib:.1f} MiB)"
    )

  for f in compiled.values():
    jax.block_until_ready(f(params, time_tokens))
  ratios = {k: [] for k in fns if k != "plain"}
  over_ghost = []  # ghost_2pass_remat / ghost_2pass
  times = {}
  for r in range(args.rounds):
    for name in np.random.default_rng(r).permutation(list(fns)):
      start = time.perf_counter()
      jax.block_until_ready(compiled[name](params, time_tokens))
      times[name] = time.perf_counter() - start
    for k in ratios:
      ratios[k].append(times[k] / times["plain"])
    over_ghost.append(times["ghost_2pass_remat"] / times["ghost_2pass"])
  print(
    f"batch {args.time_batch}: step time over a plain jax.grad of the mean "
    f"loss ({times['plain'] * 1e3:.1f} ms last round), median of "
    f"{args.rounds} interleaved rounds: "
    + ", ".join(f"{k} {_median_iqr(v)}" for k, v in ratios.items())
  )
  print(f"ghost_2pass_remat / ghost_2pass: {_median_iqr(over_ghost)}")


def _median_iqr(values):
  q1, med, q3 = np.percentile(values, [25, 50, 75])
  return f"{med:.2f}x (IQR {q1:.2f}-{q3:.2f})"


if __name__ == "__main__":
  main()
