"""GuardState's layout: its groups, the stats() keys they keep, the flat
names of the earlier layout (deprecated attributes, checkpoints that
upgrade_state restores).
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxclip

# The earlier flat layout, field by field, and where each value is read now.
FLAT_LAYOUT = {
  "norm": "verdict.norm",
  "threshold": "verdict.threshold",
  "skipped": "counts.skipped",
  "nonfinite": "counts.nonfinite",
  "consecutive_skips": "counts.consecutive_skips",
  "count": "norm_moments.count",
  "mean": "norm_moments.mean",
  "var": "norm_moments.var",
  "inner_state": "inner_state",
  "consecutive_spikes": "norm_moments.consecutive_spikes",
  "restarts": "counts.restarts",
  "step": "step",
  "skipped_nonfinite": "counts.skipped_nonfinite",
  "skipped_max_norm": "counts.skipped_max_norm",
  "skipped_spike": "counts.skipped_spike",
  "z_score": "verdict.z_score",
  "skipped_loss_spike": "counts.skipped_loss_spike",
  "loss": "loss_monitor.value",
  "loss_z_score": "loss_monitor.z_score",
  "loss_moments": "loss_monitor.moments",
  "window": "norm_moments.window",
  "skipped_leaves": "verdict.skipped_leaves",
  "leaf_norms": "leaf_norms",
  "top_leaf_share": "top_leaf_share",
  "top_leaf": "top_leaf",
  "skip_cause": "verdict.skip_cause",
}

STATS_KEYS = [
  "norm",
  "threshold",
  "skipped",
  "nonfinite",
  "consecutive_skips",
  "restarts",
  "skipped_nonfinite",
  "skipped_max_norm",
  "skipped_spike",
  "z_score",
  "skipped_loss_spike",
  "loss",
  "loss_z_score",
  "skipped_leaves",
]


def _read(node, where):
  for name in where.split("."):
    node = None if node is None else getattr(node, name)
  return node


@functools.cache
def _run(scope="global", window=None, steps=8, leaf_stats=False):
  """A loss-aware guard run over a stream with a NaN and a spike."""
  tx = optaxclip.guard(
    optax.adam(0.1),
    spike_z=2.0,
    max_norm=50.0,
    warmup_steps=3,
    loss_spike_z=2.0,
    window=window,
    scope=scope,
    leaf_stats=leaf_stats,
  )
  params = {"a": jnp.zeros(3), "b": jnp.zeros(2)}
  state = tx.init(params)
  rng = np.random.default_rng(0)
  step = jax.jit(tx.update)
  for t in range(steps):
    g = {
      "a": jnp.asarray(rng.normal(size=3), jnp.float32),
      "b": jnp.asarray(rng.normal(size=2), jnp.float32),
    }
    if t == 4:
      g["a"] = g["a"].at[0].set(jnp.nan)
    if t == 6:
      g["b"] = g["b"] * 40.0
    loss = 2.0 + 0.1 * np.sin(t) + (30.0 if t == 7 else 0.0)
    _, state = step(g, state, params, value=loss)
  return tx, params, state


def _flat(state):
  """``state`` written in the earlier flat layout, as orbax restores a
  checkpoint without a target: a dict of arrays (and dicts) by field name.
  """
  to_numpy = lambda tree: jax.tree.map(np.asarray, tree)
  out = {}
  for name, where in FLAT_LAYOUT.items():
    value = _read(state, where)
    if hasattr(value, "_asdict"):
      value = {k: to_numpy(v) for k, v in value._asdict().items()}
    out[name] = to_numpy(value)
  return out


def test_groups_hold_what_their_classes_say():
  _, _, state = _run()
  assert isinstance(state.verdict, optaxclip.GuardVerdict)
  assert isinstance(state.counts, optaxclip.GuardCounts)
  assert isinstance(state.norm_moments, optaxclip.Moments)
  assert isinstance(state.loss_monitor, optaxclip.LossMonitor)
  assert isinstance(state.loss_monitor.moments, optaxclip.Moments)
  counts = state.counts
  causes = (
    counts.skipped_nonfinite
    + counts.skipped_max_norm
    + counts.skipped_spike
    + counts.skipped_loss_spike
  )
  assert int(counts.skipped) == int(causes) >= 2
  without_loss = optaxclip.guard(optax.sgd(1.0)).init({"w": jnp.zeros(2)})
  assert without_loss.loss_monitor is None
  assert without_loss.verdict.skipped_leaves is None


def test_stats_keys_are_the_flat_names():
  _, _, state = _run()
  logs = optaxclip.stats(state)
  guard_keys = [k.split("/", 1)[1] for k in logs if k.startswith("guard/")]
  assert guard_keys == [k for k in STATS_KEYS if k != "skipped_leaves"]
  for key in guard_keys:
    np.testing.assert_array_equal(
      logs[f"guard/{key}"], _read(state, FLAT_LAYOUT[key]), err_msg=key
    )
  _, _, leaf_state = _run(scope="leaf")
  assert "guard/skipped_leaves" in optaxclip.stats(leaf_state)


@pytest.mark.parametrize(
  "name", [n for n in FLAT_LAYOUT if FLAT_LAYOUT[n] != n]
)
def test_a_flat_attribute_reads_its_value_with_a_warning(name):
  _, _, state = _run(window=4, scope="leaf", leaf_stats=True)
  with pytest.warns(DeprecationWarning, match=rf"^GuardState\.{name} is "):
    value = getattr(state, name)
  want = _read(state, FLAT_LAYOUT[name])
  assert jax.tree.structure(value) == jax.tree.structure(want)
  for got, expected in zip(jax.tree.leaves(value), jax.tree.leaves(want)):
    np.testing.assert_array_equal(got, expected)


def test_flat_attributes_of_unused_groups_read_none():
  state = optaxclip.guard(optax.sgd(1.0)).init({"w": jnp.zeros(2)})
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    assert state.loss is None and state.loss_moments is None


def test_the_old_class_name_is_an_alias_with_a_warning():
  with pytest.warns(DeprecationWarning, match="use optaxclip.Moments"):
    assert optaxclip.LossMoments is optaxclip.Moments
  with pytest.raises(AttributeError, match="no attribute 'LossMoment'"):
    optaxclip.LossMoment  # noqa: B018


@pytest.mark.parametrize(
  "scope,window", [("global", None), ("global", 4), ("leaf", None)]
)
def test_upgrade_state_restores_the_flat_layout(scope, window):
  tx, params, state = _run(scope=scope, window=window)
  restored = optaxclip.upgrade_state(_flat(state), tx.init(params))
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_upgrade_state_keeps_todays_layout_and_fills_missing_fields():
  tx, params, state = _run()
  template = tx.init(params)
  as_saved = jax.tree.map(np.asarray, state)
  restored = optaxclip.upgrade_state(as_saved, template)
  chex_equal = np.testing.assert_array_equal
  jax.tree.map(chex_equal, restored, state)
  # A flat checkpoint from before the loss was watched: the loss's group
  # starts at its initial value, the rest is kept.
  flat = _flat(state)
  for name in ("loss", "loss_z_score", "loss_moments", "skip_cause"):
    del flat[name]
  restored = optaxclip.upgrade_state(flat, template)
  jax.tree.map(chex_equal, restored.loss_monitor, template.loss_monitor)
  jax.tree.map(chex_equal, restored.counts, state.counts)
  assert int(restored.verdict.skip_cause) == 0


def test_upgraded_state_continues_like_the_original():
  tx, params, state = _run(window=4)
  restored = optaxclip.upgrade_state(_flat(state), tx.init(params))
  g = {"a": jnp.ones(3), "b": jnp.ones(2)}
  a = tx.update(g, state, params, value=2.0)
  b = tx.update(g, restored, params, value=2.0)
  jax.tree.map(np.testing.assert_array_equal, a, b)
