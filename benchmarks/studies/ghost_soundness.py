"""Does the ghost method keep each example within ``l2_clip`` on models whose
parameters are applied more than once per example?

For a batch of one and ``l2_clip=1``, prints per model the ghost method's
norm against the exact (vmap) one and the norm of each method's clipped
gradient (at most 1 when the bound holds): a tied embedding read by
attribute (linen and nnx), a Dense shared by the steps of ``nn.scan``
(``variable_broadcast``), ``nn.RNN(nn.SimpleCell)``, and ``nn.vmap`` over a
Dense with shared parameters. Run it against another version of the package
with ``PYTHONPATH`` at that version's checkout.

    python benchmarks/studies/ghost_soundness.py
"""

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import optaxclip


def _norm(tree) -> float:
  return float(
    np.sqrt(
      sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree))
    )
  )


def report(name, loss, params, batch):
  out = {}
  for method in ("ghost", "vmap"):
    fn = jax.jit(optaxclip.clipped_grad(loss, 1.0, method=method))
    grads, norms = fn(params, *batch)
    out[method] = (float(norms[0]), _norm(grads))
  error = abs(out["ghost"][0] - out["vmap"][0]) / out["vmap"][0]
  print(
    f"| {name} | {out['ghost'][0]:.4g} | {out['vmap'][0]:.4g} | "
    f"{error:.2%} | {out['ghost'][1]:.4f} | {out['vmap'][1]:.4f} |"
  )


class Tied(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    emb = nn.Embed(11, 8, name="emb")
    h = nn.Dense(8)(jnp.tanh(emb(tokens)))
    return jnp.sum((h @ emb.embedding.T) ** 2, axis=(1, 2))


class TiedNnx(nnx.Module):
  def __init__(self, rngs):
    self.emb = nnx.Embed(11, 8, rngs=rngs)
    self.dense = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, tokens):
    h = self.dense(jnp.tanh(self.emb(tokens)))
    return jnp.sum((h @ self.emb.embedding[...].T) ** 2, axis=(1, 2))


class Step(nn.Module):
  @nn.compact
  def __call__(self, c, x_t):
    c = jnp.tanh(nn.Dense(4)(c) + x_t)
    return c, c


class ScanBroadcast(nn.Module):
  @nn.compact
  def __call__(self, x):
    scan = nn.scan(
      Step,
      variable_broadcast="params",
      split_rngs={"params": False},
      in_axes=1,
      out_axes=1,
    )
    _, ys = scan()(jnp.zeros((x.shape[0], 4)), x)
    return jnp.sum(ys**2, axis=(1, 2))


class VmapShared(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = nn.vmap(
      nn.Dense,
      variable_axes={"params": None},
      split_rngs={"params": False},
      in_axes=1,
      out_axes=1,
    )(3)
    return jnp.sum(dense(x) ** 2, axis=(1, 2))


def main():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 11, (1, 5))
  x = (3 * rng.normal(size=(1, 6, 4))).astype(np.float32)
  print(f"optaxclip from {optaxclip.__file__}; batch of one, l2_clip = 1")
  print(
    "| model | ghost norm | exact norm | error | ghost clipped | vmap clipped |"
  )
  print("|---|---|---|---|---|---|")
  tied = Tied()
  report(
    "tied embedding, linen",
    tied.apply,
    tied.init(jax.random.PRNGKey(0), tokens),
    (tokens,),
  )
  graphdef, params = nnx.split(TiedNnx(nnx.Rngs(0)), nnx.Param)
  report(
    "tied embedding, nnx",
    lambda p, t: nnx.merge(graphdef, p)(t),
    params,
    (tokens,),
  )
  scan = ScanBroadcast()
  report(
    "nn.scan, broadcast", scan.apply, scan.init(jax.random.PRNGKey(1), x), (x,)
  )
  rnn = nn.RNN(nn.SimpleCell(5))
  report(
    "nn.RNN(SimpleCell)",
    lambda p, x: jnp.sum(rnn.apply(p, x) ** 2, axis=(1, 2)),
    rnn.init(jax.random.PRNGKey(2), x),
    (x,),
  )
  vmap = VmapShared()
  report(
    "nn.vmap, shared", vmap.apply, vmap.init(jax.random.PRNGKey(3), x), (x,)
  )


if __name__ == "__main__":
  main()
