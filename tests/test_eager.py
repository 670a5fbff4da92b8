"""Called outside jit, an update compiles once per transformation.

Every clipper's update runs under its own ``jax.jit`` (optaxclip/_compiled.py):
inside a user's jitted step that is inlined; called eagerly, the second call
must reuse the compiled program rather than trace and compile the norms'
``lax.cond`` branches again.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxclip

GRADS = {"w": jnp.array([[3.0, -4.0], [0.5, 2.0]]), "b": jnp.array([0.1, -0.2])}

TRANSFORMATIONS = {
  "clip_value": lambda: optaxclip.clip_value(0.5),
  "clip_norm": lambda: optaxclip.clip_norm(1.0),
  "clip_global": lambda: optaxclip.clip_global(1.0),
  "clip_block_rms": lambda: optaxclip.clip_block_rms(0.3),
  "clip_unitwise": lambda: optaxclip.clip_unitwise(0.1),
  "clip_zscore": lambda: optaxclip.clip_zscore(warmup_steps=1),
  "clip_percentile": lambda: optaxclip.clip_percentile(10.0),
  "clip_relative": optaxclip.clip_relative,
  "guard": lambda: optaxclip.guard(optax.adam(1e-2)),
  "clipped": lambda: optaxclip.clipped(optax.adam(1e-2), global_clipnorm=1.0),
  "clip_per_example": lambda: optaxclip.clip_per_example(
    1.0, noise_multiplier=0.2, target_quantile=0.5
  ),
}


def _gradients(name, scale):
  grads = jax.tree.map(lambda x: x * scale, GRADS)
  if name == "clip_per_example":  # a batch of 3 examples along axis 0
    return jax.tree.map(lambda x: jnp.stack([x, -x, 2 * x]), grads)
  return grads


def _compile_messages(records):
  return [
    r.getMessage() for r in records if r.getMessage().startswith("Compiling")
  ]


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_second_eager_update_does_not_compile(name, caplog):
  tx = TRANSFORMATIONS[name]()
  state = tx.init(GRADS)
  later = [_gradients(name, scale) for scale in (2.0, 0.5)]
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    first, state = tx.update(_gradients(name, 1.0), state, GRADS)
    # The log does show compilations: the first call has some.
    assert _compile_messages(caplog.records)
    caplog.clear()
    for grads in later:
      updates, state = tx.update(grads, state, GRADS)
      jax.block_until_ready(updates)
  assert not _compile_messages(caplog.records), _compile_messages(
    caplog.records
  )
  assert jax.tree.structure(updates) == jax.tree.structure(first)
  for leaf in jax.tree.leaves(updates):
    assert np.all(np.isfinite(np.asarray(leaf)))


def test_eager_and_jitted_updates_agree():
  tx = optaxclip.clip_global(1.0)
  state = tx.init(GRADS)
  eager, eager_state = tx.update(GRADS, state)
  jitted, jitted_state = jax.jit(tx.update)(GRADS, state)
  np.testing.assert_allclose(eager["w"], jitted["w"], rtol=1e-6)
  assert float(eager_state.norm) == pytest.approx(float(jitted_state.norm))


def test_eager_update_with_a_function_in_extra_args():
  """Extra arguments may hold functions (optax's line searches take
  ``value_fn``); jit cannot take those, so such a call runs as written.
  """
  calls = []

  def value_fn(params):
    calls.append(1)
    return jnp.sum(params["w"] ** 2)

  inner = optax.GradientTransformationExtraArgs(
    lambda params: optax.EmptyState(),
    lambda updates, state, params=None, *, value_fn=None, **_: (
      jax.tree.map(lambda g: g * value_fn(params), updates),
      state,
    ),
  )
  tx = optaxclip.guard(inner)
  state = tx.init(GRADS)
  updates, state = tx.update(GRADS, state, GRADS, value_fn=value_fn)
  expected = float(jnp.sum(GRADS["w"] ** 2))
  np.testing.assert_allclose(updates["b"], GRADS["b"] * expected, rtol=1e-6)
  assert calls


# optax.inject_hyperparams builds the transformation again at every update,
# with the hyperparameters as fresh arrays: the compiled update must be
# shared between those builds (it recompiled at every call: 120-300 ms).
INJECTED = {
  "clip_value": (optaxclip.clip_value, {"max_delta": 0.5}, ()),
  "clip_norm": (optaxclip.clip_norm, {"max_norm": 1.0}, ()),
  "clip_global": (optaxclip.clip_global, {"max_norm": 1.0}, ()),
  "clip_block_rms": (optaxclip.clip_block_rms, {"threshold": 0.3}, ()),
  "clip_unitwise": (
    optaxclip.clip_unitwise,
    {"clipping": 0.1, "eps": 1e-3},
    (),
  ),
  "clip_zscore": (
    optaxclip.clip_zscore,
    {"warmup_steps": 1, "spike_z": 2.0},
    (),
  ),
  "clip_percentile": (
    optaxclip.clip_percentile,
    {"percentile": 10.0, "history": 4},
    ("history",),
  ),
  "clip_relative": (
    optaxclip.clip_relative,
    {"factor": 1.5, "warmup_steps": 1},
    (),
  ),
  "guard": (optaxclip.guard, {"inner": optax.sgd(1e-2), "max_norm": 10.0}, ()),
  "clip_per_example": (
    optaxclip.clip_per_example,
    {"l2_clip": 1.0, "noise_multiplier": 0.2, "target_quantile": 0.5},
    (),
  ),
}


@pytest.mark.parametrize("name", sorted(INJECTED))
def test_second_eager_injected_update_does_not_compile(name, caplog):
  factory, hyperparams, static_args = INJECTED[name]
  tx = optax.inject_hyperparams(factory, static_args=static_args)(**hyperparams)
  state = tx.init(GRADS)
  later = [_gradients(name, scale) for scale in (2.0, 0.5)]
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    _, state = tx.update(_gradients(name, 1.0), state, GRADS)
    caplog.clear()
    for grads in later:
      updates, state = tx.update(grads, state, GRADS)
      jax.block_until_ready(updates)
  assert not _compile_messages(caplog.records), _compile_messages(
    caplog.records
  )
  for leaf in jax.tree.leaves(updates):
    assert np.all(np.isfinite(np.asarray(leaf)))


def test_injected_hyperparameter_change_takes_effect_without_compiling(caplog):
  tx = optax.inject_hyperparams(optaxclip.clip_global)(max_norm=1.0)
  state = tx.init(GRADS)
  _, state = tx.update(GRADS, state)
  state.hyperparams["max_norm"] = jnp.full_like(
    state.hyperparams["max_norm"], 2.0
  )
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    updates, state = tx.update(GRADS, state)
  assert not _compile_messages(caplog.records)
  np.testing.assert_allclose(float(optax.tree.norm(updates)), 2.0, rtol=1e-6)


def test_equal_configurations_share_one_compiled_update(caplog):
  """Two transformations built alike compile once between them; a different
  static argument compiles its own.
  """
  grads = {"w": jnp.arange(3.0)}
  optaxclip.clip_norm(0.25, ord=1).update(grads, None)
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    optaxclip.clip_norm(0.25, ord=1).update(grads, None)
    assert not _compile_messages(caplog.records)
    optaxclip.clip_norm(0.25, ord=3).update(grads, None)
    assert _compile_messages(caplog.records)
