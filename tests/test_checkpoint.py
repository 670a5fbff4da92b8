"""An orbax checkpoint of the optimizer state, taken mid-run and restored,
continues bit for bit like the run that never stopped.
"""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import fast_compile
import optaxclip

STEPS, SAVE_AT = 16, 7


def gradient_stream(seed=0):
  """Random gradients with spikes (x30, x50, x8) and one NaN step."""
  rng = np.random.default_rng(seed)
  out = []
  for t in range(STEPS):
    scale = {5: 30.0, 9: 50.0, 13: 8.0}.get(t, 1.0)
    g = {
      "dense": {
        "kernel": rng.standard_normal((4, 3)) * scale,
        "bias": rng.standard_normal(3),
      },
      "scale": rng.standard_normal(()) * 0.1,
    }
    if t == 11:
      g["dense"]["bias"][0] = np.nan
    out.append(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g))
  return out


def test_orbax_round_trip_continues_bit_for_bit(tmp_path):
  # All four adaptive states in one optimizer state: the guard skips the NaN
  # step and the x50 spike (max_norm); the clippers see the other spikes.
  tx = optaxclip.guard(
    optax.chain(
      optaxclip.clip_zscore(warmup_steps=3, scope="leaf"),
      optaxclip.clip_percentile(history=8),
      optaxclip.clip_relative(warmup_steps=3),
      optax.adam(1e-2),
    ),
    max_norm=125.0,
    spike_z=None,
    warmup_steps=3,
  )
  params = {
    "dense": {"kernel": jnp.zeros((4, 3)), "bias": jnp.zeros(3)},
    "scale": jnp.ones(()),
  }

  def step_fn(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  stream = gradient_stream()
  p, s = params, tx.init(params)
  step = fast_compile.compile_fast(jax.jit(step_fn).lower(p, s, stream[0]))
  checkpointer = ocp.StandardCheckpointer()
  acted = {}  # per statistic, its sum over the run
  for t, g in enumerate(stream):
    if t == SAVE_AT:
      checkpointer.save(tmp_path / "ckpt", {"params": p, "opt_state": s})
      checkpointer.wait_until_finished()
    p, s = step(p, s, g)
    for key, value in optaxclip.stats(s).items():
      acted[key] = acted.get(key, 0.0) + float(value)
  uninterrupted = (p, s)
  # Every clipper acted at least once, and the guard skipped two steps.
  for name in ("clip_zscore", "clip_percentile", "clip_relative"):
    assert acted[f"{name}/clip_fraction"] > 0, name
  assert int(s.counts.skipped) == 2 and int(s.counts.nonfinite) == 1

  # A fresh process rebuilds the optimizer and restores into its layout.
  fresh = tx.init(params)
  target = jax.tree.map(
    ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": fresh}
  )
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  checkpointer.close()
  p, s = restored["params"], restored["opt_state"]
  assert list(optaxclip.stats(s)) == list(optaxclip.stats(fresh))
  for g in stream[SAVE_AT:]:
    p, s = step(p, s, g)

  flat_a, tree_a = jax.tree.flatten(uninterrupted)
  flat_b, tree_b = jax.tree.flatten((p, s))
  assert tree_a == tree_b
  for a, b in zip(flat_a, flat_b):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# Checkpoints with every clipper's state mid-run, written by
# tests/data/make_checkpoint_fixture.py (which can write one for any later
# version): checkpoint_0_1_0 by release 0.1.0 (commit ceb6c88, whose states
# were generated at run time by make_state), checkpoint_4e92ede by commit
# 4e92ede, the last layout with GuardState's fields flat.
FIXTURE_DIR = pathlib.Path(__file__).parent / "data"
sys.path.insert(0, str(FIXTURE_DIR))
import make_checkpoint_fixture as fixture  # noqa: E402


@pytest.mark.parametrize("name", ["checkpoint_0_1_0", "checkpoint_4e92ede"])
def test_an_earlier_checkpoint_restores_and_continues(tmp_path, name):
  saved = json.loads((FIXTURE_DIR / name / "stats.json").read_text())
  chained, per_example = fixture.optimizers()
  p = fixture.params()
  target = {
    "params": p,
    "opt_state": chained.init(p),
    "per_example_state": per_example.init(p),
  }
  # States gained fields since 0.1.0 (clip_per_example's `nonfinite`, the
  # adaptive clippers' `restarts`, ...): restore without a target, then into
  # today's layout, the new fields at their initial values.
  checkpointer = ocp.StandardCheckpointer()
  restored = optaxclip.upgrade_state(
    checkpointer.restore(fixture.extract(FIXTURE_DIR / name, tmp_path)),
    target,
  )
  checkpointer.close()
  assert jax.tree.structure(restored) == jax.tree.structure(target)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
  p, state = restored["params"], restored["opt_state"]
  pe_state = restored["per_example_state"]

  # Into today's declared classes, every one of them.
  for cls in (
    optaxclip.GuardState,
    optaxclip.ClipValueState,
    optaxclip.ClipNormState,
    optaxclip.ClipGlobalState,
    optaxclip.ClipBlockRMSState,
    optaxclip.ClipUnitwiseState,
    optaxclip.ClipZscoreState,
    optaxclip.ClipPercentileState,
    optaxclip.ClipRelativeState,
    optaxclip.ClipPerExampleState,
  ):
    found = optax.tree_utils.tree_get_all_with_path(
      (state, pe_state), cls.__name__
    )
    assert len(found) == 1 and isinstance(found[0][1], cls), cls
  logs = {**optaxclip.stats(state), **optaxclip.stats(pe_state)}
  target_logs = {
    **optaxclip.stats(target["opt_state"]),
    **optaxclip.stats(target["per_example_state"]),
  }
  # Every statistic saved is restored (new ones start at their initial value).
  assert set(saved["stats"]) <= set(logs)
  for key, value in saved["stats"].items():
    np.testing.assert_array_equal(np.asarray(logs[key]), value, err_msg=key)
    assert logs[key].dtype == target_logs[key].dtype, key
  for key in set(logs) - set(saved["stats"]):
    np.testing.assert_array_equal(logs[key], target_logs[key], err_msg=key)
  np.testing.assert_array_equal(pe_state.key, saved["per_example_key"])

  # It continues: the counters move on from where they were (the guarded
  # clippers see the steps the guard lets through; no step is NaN).
  before = state
  first = saved["steps"]
  step = fast_compile.compile_fast(
    jax.jit(fixture.make_step()).lower(
      p, state, pe_state, *fixture.gradients(first)
    )
  )
  for t in range(first, first + 3):
    p, state, pe_state = step(p, state, pe_state, *fixture.gradients(t))
  passed = 3 - (int(state.counts.skipped) - int(before.counts.skipped))
  assert int(state.counts.nonfinite) == int(before.counts.nonfinite)
  assert (
    int(state.inner_state[6].index)
    == (int(before.inner_state[6].index) + passed) % 4
  )
  for leaf in jax.tree.leaves(
    (p, optaxclip.stats(state), optaxclip.stats(pe_state))
  ):
    assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
  assert not np.array_equal(pe_state.key, saved["per_example_key"])


def test_upgrade_state_casts_keeps_and_fills():
  template = optax.chain(optaxclip.clip_zscore(), optax.adam(1e-3)).init(
    {"w": jnp.zeros(2)}
  )
  saved = [
    {
      "norm": np.float64(3.0),
      "count": np.int64(4),
      "mean": 1.5,
      "var": 0.25,
      "clipped_norm": 2.0,
    },  # no fraction...
    jax.tree.map(np.asarray, template[1]),
  ]
  state = optaxclip.upgrade_state(saved, template)
  assert jax.tree.structure(state) == jax.tree.structure(template)
  zscore = state[0]
  assert isinstance(zscore, optaxclip.ClipZscoreState)
  assert (float(zscore.norm), int(zscore.count)) == (3.0, 4)
  assert zscore.norm.dtype == jnp.float32 and zscore.count.dtype == jnp.int32
  assert float(zscore.clip_fraction) == float(template[0].clip_fraction)


def test_upgrade_state_names_a_shape_mismatch():
  template = optaxclip.clip_relative().init(
    {"a": jnp.zeros(2), "b": jnp.zeros(2)}
  )
  saved = template._asdict() | {"gamma": np.ones(3)}
  with pytest.raises(
    ValueError,
    match=r"^upgrade_state: the saved value at "
    r"\.gamma must have the template's shape \(2,\); got "
    r"\(3,\)",
  ):
    optaxclip.upgrade_state(saved, template)
