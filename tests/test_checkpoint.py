"""An orbax checkpoint of the optimizer state, taken mid-run and restored,
continues bit for bit like the run that never stopped."""

import numpy as np
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest

import optaxclip

STEPS, SAVE_AT = 24, 11

MAKERS = {
    "clip_zscore": lambda: optaxclip.clip_zscore(warmup_steps=5,
                                                 scope="leaf"),
    "clip_percentile": lambda: optaxclip.clip_percentile(history=8),
    "clip_relative": lambda: optaxclip.clip_relative(warmup_steps=5),
    "guard": lambda: optaxclip.guard(optax.adam(1e-2), spike_z=2.0,
                                     warmup_steps=5),
}


def gradient_stream(seed=0):
  """Random gradients with a few spikes and one NaN step."""
  rng = np.random.default_rng(seed)
  out = []
  for t in range(STEPS):
    scale = {7: 30.0, 13: 50.0, 17: 8.0}.get(t, 1.0)
    g = {"dense": {"kernel": rng.standard_normal((4, 3)) * scale,
                   "bias": rng.standard_normal(3)},
         "scale": rng.standard_normal(()) * 0.1}
    if t == 15:
      g["dense"]["bias"][0] = np.nan
    out.append(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g))
  return out


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_orbax_round_trip_continues_bit_for_bit(name, tmp_path):
  clipper = MAKERS[name]()
  tx = clipper if name == "guard" else optax.chain(clipper, optax.adam(1e-2))
  params = {"dense": {"kernel": jnp.zeros((4, 3)), "bias": jnp.zeros(3)},
            "scale": jnp.ones(())}

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  stream = gradient_stream()
  p, s = params, tx.init(params)
  checkpointer = ocp.StandardCheckpointer()
  key = "guard/skipped" if name == "guard" else f"{name}/clip_fraction"
  acted = 0.0  # steps skipped, or clipping units scaled down, over the run
  for t, g in enumerate(stream):
    if t == SAVE_AT:
      checkpointer.save(tmp_path / "ckpt", {"params": p, "opt_state": s})
      checkpointer.wait_until_finished()
    p, s = step(p, s, g)
    acted += 1.0 if name == "guard" else float(optaxclip.stats(s)[key])
  if name == "guard":
    acted = float(s.skipped)
  assert acted >= 1, acted  # the clipper was exercised
  uninterrupted = (p, s)

  # A fresh process would rebuild the optimizer and restore into its layout.
  fresh = tx.init(params)
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                        {"params": params, "opt_state": fresh})
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  checkpointer.close()
  p, s = restored["params"], restored["opt_state"]
  assert type(s) is type(fresh)
  for g in stream[SAVE_AT:]:
    p, s = step(p, s, g)

  flat_a, tree_a = jax.tree.flatten(uninterrupted)
  flat_b, tree_b = jax.tree.flatten((p, s))
  assert tree_a == tree_b
  for a, b in zip(flat_a, flat_b):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
