"""Every clipper traces under ``jax_numpy_dtype_promotion="strict"``.

The strict lattice refuses implicit promotions (bfloat16 with float32, a
Python float with an int32 array, a complex leaf times a real factor): a
cheap audit that every dtype change in optaxclip is written out, as the
package promises (statistics in float32 or wider, each leaf keeps its dtype).
The whole suite cannot run strict: optax's own adam raises there (its bias
correction is ``decay ** count`` with an int32 count), so these tests chain
no optax optimizer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxclip


def _tree(dtypes, seed=0):
  rng = np.random.default_rng(seed)
  shapes = ((3, 4), (5,), (2, 2), ())
  return {
    f"x{i}": jnp.asarray(rng.normal(size=shapes[i % len(shapes)]) * 3, dtype)
    for i, dtype in enumerate(dtypes)
  }


REAL = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float32)
COMPLEX = (jnp.complex64, jnp.float32)

CLIPPERS = {
  "clip_value": lambda: optaxclip.clip_value(0.5),
  "clip_norm": lambda: optaxclip.clip_norm(0.5),
  "clip_norm_l1": lambda: optaxclip.clip_norm(0.5, ord=1),
  "clip_global": lambda: optaxclip.clip_global(0.5),
  "clip_global_inf": lambda: optaxclip.clip_global(0.5, ord="inf"),
  "clip_block_rms": lambda: optaxclip.clip_block_rms(0.5),
  "clip_unitwise": lambda: optaxclip.clip_unitwise(0.01),
  "clip_zscore": optaxclip.clip_zscore,
  "clip_zscore_leaf": lambda: optaxclip.clip_zscore(scope="leaf"),
  "clip_percentile": lambda: optaxclip.clip_percentile(history=8),
  "clip_percentile_leaf": lambda: optaxclip.clip_percentile(
    history=8, scope="leaf"
  ),
  "clip_relative": lambda: optaxclip.clip_relative(warmup_steps=1),
  "guard": lambda: optaxclip.guard(
    optax.identity(), spike_z=3.0, max_norm=100.0
  ),
  "clipped": lambda: optaxclip.clipped(optax.sgd(0.1), clipnorm=0.5),
  "clip_spikes": lambda: optaxclip.clip_spikes(reset_interval=2),
  "clip_spikes_adaptive": lambda: optaxclip.clip_spikes_adaptive(
    reset_interval=2
  ),
  "scale_by_norm_ema": optaxclip.scale_by_norm_ema,
  "spam": lambda: optaxclip.spam(0.1, weight_decay=0.1, reset_interval=2),
  "stable_spam": lambda: optaxclip.stable_spam(
    0.1, weight_decay=0.1, total_steps=4, reset_interval=2
  ),
}
COMPLEX_OK = ("clip_value", "clip_norm", "clip_global", "clip_block_rms")


def _run(make, dtypes):
  tx = make()
  params = _tree(dtypes, seed=0)
  # Each update runs under its own jit, traced here (the promotion mode is
  # part of jit's cache key).
  with jax.numpy_dtype_promotion("strict"):
    state = tx.init(params)
    for seed in (1, 2):
      updates, state = tx.update(_tree(dtypes, seed), state, params)
  return params, updates, state


@pytest.mark.parametrize("name", sorted(CLIPPERS))
def test_real_leaves_of_every_width(name):
  params, updates, state = _run(CLIPPERS[name], REAL)
  for key in params:
    assert updates[key].dtype == params[key].dtype, key
  logs = optaxclip.stats(state)
  assert logs, name
  for key, value in logs.items():  # thresholds are +inf during warm-up
    assert not np.isnan(np.asarray(value, np.float64)).any(), key


@pytest.mark.parametrize("name", COMPLEX_OK)
def test_complex_leaves(name):
  params, updates, _ = _run(CLIPPERS[name], COMPLEX)
  for key in params:
    assert updates[key].dtype == params[key].dtype, key


def test_per_example_clipping():
  tx = optaxclip.clip_per_example(
    1.0, noise_multiplier=0.5, target_quantile=0.5
  )
  rng = np.random.default_rng(0)
  grads = {
    "w": jnp.asarray(rng.normal(size=(12, 3, 2)), jnp.bfloat16),
    "b": jnp.asarray(rng.normal(size=(12, 2)), jnp.float32),
  }
  params = {
    "w": jnp.zeros((3, 2), jnp.bfloat16),
    "b": jnp.zeros((2,), jnp.float32),
  }
  with jax.numpy_dtype_promotion("strict"):
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
  assert updates["w"].dtype == jnp.bfloat16
  assert updates["b"].dtype == jnp.float32
