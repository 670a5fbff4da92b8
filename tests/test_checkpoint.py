"""An orbax checkpoint of the optimizer state, taken mid-run and restored,
continues bit for bit like the run that never stopped.
"""

import collections
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import optaxclip

STEPS, SAVE_AT = 16, 7


def gradient_stream(seed=0):
  """Random gradients with spikes (x30, x50, x8) and one NaN step."""
  rng = np.random.default_rng(seed)
  out = []
  for t in range(STEPS):
    scale = {5: 30.0, 9: 50.0, 13: 8.0}.get(t, 1.0)
    g = {"dense": {"kernel": rng.standard_normal((4, 3)) * scale,
                   "bias": rng.standard_normal(3)},
         "scale": rng.standard_normal(()) * 0.1}
    if t == 11:
      g["dense"]["bias"][0] = np.nan
    out.append(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g))
  return out


def test_orbax_round_trip_continues_bit_for_bit(tmp_path):
  # All four adaptive states in one optimizer state: the guard skips the NaN
  # step and the x50 spike (max_norm); the clippers see the other spikes.
  tx = optaxclip.guard(
      optax.chain(optaxclip.clip_zscore(warmup_steps=3, scope="leaf"),
                  optaxclip.clip_percentile(history=8),
                  optaxclip.clip_relative(warmup_steps=3),
                  optax.adam(1e-2)),
      max_norm=125.0, spike_z=None, warmup_steps=3)
  params = {"dense": {"kernel": jnp.zeros((4, 3)), "bias": jnp.zeros(3)},
            "scale": jnp.ones(())}

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  stream = gradient_stream()
  p, s = params, tx.init(params)
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
  assert int(s.skipped) == 2 and int(s.nonfinite) == 1

  # A fresh process rebuilds the optimizer and restores into its layout.
  fresh = tx.init(params)
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                        {"params": params, "opt_state": fresh})
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


# A checkpoint written by release 0.1.0 (commit ceb6c88, whose states were
# generated at run time by make_state) with every clipper's state mid-run:
# tests/data/make_checkpoint_fixture.py wrote it and can write one for any
# later version.
FIXTURE_DIR = pathlib.Path(__file__).parent / "data"
sys.path.insert(0, str(FIXTURE_DIR))
import make_checkpoint_fixture as fixture  # noqa: E402


def test_a_release_0_1_0_checkpoint_restores_and_continues(tmp_path):
  saved = json.loads((FIXTURE_DIR / "checkpoint_0_1_0" / "stats.json")
                     .read_text())
  chained, per_example = fixture.optimizers()
  p = fixture.params()
  # ClipPerExampleState gained its last field, nonfinite, after 0.1.0: the
  # old state restores into the five older fields and upgrades.
  new_pe = per_example.init(p)
  legacy = collections.namedtuple("ClipPerExampleState", new_pe._fields[:-1])
  target = {"params": p, "opt_state": chained.init(p),
            "per_example_state": legacy(*new_pe[:-1])}
  # Fields added to the adaptive states and guard since 0.1.0 are not in the
  # checkpoint: they take their fresh values from `target` (orbax's fallback
  # transform).
  added = {rf".*\b{field}$": ocp.Transform(use_fallback=True) for field in (
      "consecutive_spikes", "consecutive_clips", "restarts", "ordered")}
  checkpointer = ocp.PyTreeCheckpointer()
  restored = checkpointer.restore(
      fixture.extract(FIXTURE_DIR / "checkpoint_0_1_0", tmp_path),
      args=ocp.args.PyTreeRestore(
          item=target, transforms=added,
          restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
  checkpointer.close()
  p, state = restored["params"], restored["opt_state"]
  pe_state = optaxclip.ClipPerExampleState(*restored["per_example_state"])
  assert int(pe_state.nonfinite) == 0

  # Into today's declared classes, every one of them.
  for cls in (optaxclip.GuardState, optaxclip.ClipValueState,
              optaxclip.ClipNormState, optaxclip.ClipGlobalState,
              optaxclip.ClipBlockRMSState, optaxclip.ClipUnitwiseState,
              optaxclip.ClipZscoreState, optaxclip.ClipPercentileState,
              optaxclip.ClipRelativeState, optaxclip.ClipPerExampleState):
    found = optax.tree_utils.tree_get_all_with_path((state, pe_state),
                                                    cls.__name__)
    assert len(found) == 1 and isinstance(found[0][1], cls), cls
  logs = {**optaxclip.stats(state), **optaxclip.stats(pe_state)}
  assert logs.pop("clip_per_example/nonfinite") == 0
  # The same statistics, and the counters added since, at zero.
  assert [k for k in logs if k in saved["stats"]] == list(saved["stats"])
  for key, value in logs.items():
    np.testing.assert_array_equal(np.asarray(value),
                                  saved["stats"].get(key, 0), err_msg=key)
  assert {k.split("/")[-1] for k in logs if k not in saved["stats"]} == {
      "restarts"}
  np.testing.assert_array_equal(pe_state.key, saved["per_example_key"])

  # It continues: the counters move on from where they were (the guarded
  # clippers see the steps the guard lets through; no step is NaN).
  before = state
  p, state, pe_state = fixture.run(3, p, state, pe_state,
                                   first_step=saved["steps"])
  passed = 3 - (int(state.skipped) - int(before.skipped))
  assert int(state.nonfinite) == int(before.nonfinite)
  assert int(state.inner_state[6].index) == (
      int(before.inner_state[6].index) + passed) % 4
  for leaf in jax.tree.leaves((p, optaxclip.stats(state),
                               optaxclip.stats(pe_state))):
    assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
  assert not np.array_equal(pe_state.key, saved["per_example_key"])
