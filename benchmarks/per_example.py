"""clip_per_example against optax's per-example clipping: numbers, noise, speed.

Prints, for a batch of per-example gradients (B examples, a few leaves):

* the largest difference from ``optax.per_example_global_norm_clip`` and
  ``optax.per_example_layer_norm_clip(uniform=True)`` (sums, no noise);
* the measured standard deviation of the noise over its target
  ``noise_multiplier * l2_clip / B`` (mean);
* the adaptive clip norm after some steps against the target quantile of the
  per-example norms;
* the jitted step time of ``clip_per_example(scope="global", reduce="sum")``
  over optax's, interleaved rounds, median of per-round ratios.

    python benchmarks/per_example.py [--batch 64] [--rounds 15]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optaxclip


def batch_of(rng, batch, shapes, scale=1.0):
  """Per-example gradients; each example scaled by a log-normal factor so
  that the per-example norms spread as real ones do.
  """
  spread = np.exp(0.5 * rng.normal(size=batch))
  return {
    k: jnp.asarray(
      (
        scale * spread.reshape(-1, *[1] * len(s)) * rng.normal(size=(batch, *s))
      ).astype(np.float32)
    )
    for k, s in shapes.items()
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=15)
  args = parser.parse_args()
  shapes = {
    "conv": (3, 3, 32, 64),
    "dense": (512, 256),
    "bias": (256,),
    "out": (256, 10),
    "out_bias": (10,),
  }
  n_params = sum(int(np.prod(s)) for s in shapes.values())
  rng = np.random.default_rng(0)
  grads = batch_of(rng, args.batch, shapes, scale=0.05)
  leaves = jax.tree.leaves(grads)
  norms = np.sqrt(
    sum(
      np.sum(np.asarray(x, np.float64).reshape(args.batch, -1) ** 2, axis=1)
      for x in leaves
    )
  )
  clip = float(np.median(norms))
  print(
    f"B={args.batch} examples of {n_params} parameters in {len(leaves)} "
    f"leaves; clip norm {clip:.4f} (the median per-example norm)"
  )

  for scope, theirs in (
    ("global", lambda g: optax.per_example_global_norm_clip(g, clip)[0]),
    ("layer", lambda g: optax.per_example_layer_norm_clip(g, clip)[0]),
  ):
    tx = optaxclip.clip_per_example(clip, scope=scope, reduce="sum")
    ours = jax.tree.leaves(jax.jit(tx.update)(grads, tx.init(None))[0])
    want = jax.jit(theirs)(leaves)
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(ours, want))
    scale = max(float(jnp.max(jnp.abs(b))) for b in want)
    print(
      f"scope={scope}: max |ours - optax| = {diff:.2e} "
      f"(largest element {scale:.3f})"
    )

  z = 1.1
  tx = optaxclip.clip_per_example(clip, noise_multiplier=z, seed=1)
  clean = optaxclip.clip_per_example(clip)
  noised = jax.jit(tx.update)(grads, tx.init(None))[0]
  plain = jax.jit(clean.update)(grads, clean.init(None))[0]
  noise = np.concatenate(
    [
      np.ravel(np.asarray(a) - np.asarray(b))
      for a, b in zip(jax.tree.leaves(noised), jax.tree.leaves(plain))
    ]
  )
  target = z * clip / args.batch
  print(
    f"noise std {noise.std():.5f} vs noise_multiplier * C / B = "
    f"{target:.5f} (ratio {noise.std() / target:.4f}, {noise.size} values)"
  )

  tx = optaxclip.clip_per_example(clip / 10, target_quantile=0.5)
  step = jax.jit(tx.update)
  state = tx.init(None)
  all_norms = []
  for _ in range(60):
    g = batch_of(rng, args.batch, shapes, scale=0.05)
    _, state = step(g, state)
    all_norms.append(
      np.sqrt(
        sum(
          np.sum(np.asarray(x, np.float64).reshape(args.batch, -1) ** 2, axis=1)
          for x in jax.tree.leaves(g)
        )
      )
    )
  print(
    f"adaptive (target quantile 0.5, no noise, from C/10): after 60 steps "
    f"C = {float(state.clip_norm):.4f}, median per-example norm "
    f"{np.median(np.concatenate(all_norms)):.4f}, last clip fraction "
    f"{float(state.clip_fraction):.2f}"
  )
  for batch, z in ((256, 1.0), (1024, 1.1), (4096, 3.0)):
    from optaxclip import _per_example

    sigma_b = float(_per_example.count_noise_std(batch, z))
    print(
      f"  with noise, B={batch}, z={z}: count noise sigma_b = {sigma_b:g}, "
      "sum noise multiplier "
      f"{float(_per_example.sum_noise_multiplier(z, sigma_b)):.5f}"
    )

  tx = optaxclip.clip_per_example(clip, reduce="sum")
  ours = jax.jit(lambda g: tx.update(g, tx.init(None))[0])
  theirs = jax.jit(
    lambda g: optax.per_example_global_norm_clip(jax.tree.leaves(g), clip)[0]
  )
  for f in (ours, theirs):
    jax.block_until_ready(f(grads))
  ratios = []
  for _ in range(args.rounds):
    times = []
    for f in (ours, theirs):
      start = time.perf_counter()
      for _ in range(5):
        out = f(grads)
      jax.block_until_ready(out)
      times.append(time.perf_counter() - start)
    ratios.append(times[0] / times[1])
  print(
    f"step time clip_per_example / optax.per_example_global_norm_clip: "
    f"median {np.median(ratios):.2f} over {args.rounds} interleaved rounds "
    f"(last optax time {times[1] / 5 * 1e3:.2f} ms)"
  )


if __name__ == "__main__":
  main()
