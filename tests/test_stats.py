"""stats(): every clipper's statistics from any nesting of optax states."""

from typing import NamedTuple

from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

import np_refs
import optaxclip

CLIP_FIELDS = ("norm", "clipped_norm", "clip_fraction")
# A fixed-threshold clipper also reports its threshold (a schedule's value).
FIELDS = (*CLIP_FIELDS, "threshold")


def _keys(prefix):
  return [f"{prefix}/{f}" for f in FIELDS]


class StatsTest(parameterized.TestCase):
  def test_chain_reports_every_clipper_against_numpy(self):
    g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([[12.0, -0.5]])}
    tx = optax.chain(
      optaxclip.clip_value(10.0),
      optaxclip.clip_norm(6.0),
      optaxclip.clip_global(5.0),
      optax.sgd(1.0),
    )
    _, state = jax.jit(tx.update)(g, tx.init(g))
    logs = optaxclip.stats(state)
    self.assertEqual(
      list(logs),
      _keys("clip_value") + _keys("clip_norm") + _keys("clip_global"),
    )
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(g)]
    after_value = [np.clip(x, -10, 10) for x in leaves]
    after_norm = [np_refs.tf_clip_by_norm(x, 6.0) for x in after_value]
    after_global, global_norm = np_refs.tf_clip_by_global_norm(after_norm, 5.0)
    flat = np.concatenate([np.abs(x).ravel() for x in leaves])
    expected = {
      "clip_value/norm": 12.0,
      "clip_value/clipped_norm": 10.0,
      "clip_value/clip_fraction": np.mean(flat > 10),
      "clip_norm/norm": np_refs.tree_norm(after_value),
      "clip_norm/clipped_norm": np_refs.tree_norm(after_norm),
      "clip_norm/clip_fraction": 0.5,
      "clip_global/norm": global_norm,
      "clip_global/clipped_norm": np_refs.tree_norm(after_global),
      "clip_global/clip_fraction": 1.0,
      "clip_value/threshold": 10.0,
      "clip_norm/threshold": 6.0,
      "clip_global/threshold": 5.0,
    }
    for key, value in logs.items():
      self.assertEqual(value.dtype, jnp.float32)
      self.assertEqual(value.shape, ())
      np.testing.assert_allclose(value, expected[key], rtol=1e-5, err_msg=key)

  def test_two_clippers_of_a_kind_get_unique_keys(self):
    g = {"a": jnp.array([6.0, 8.0])}
    tx = optax.chain(
      optaxclip.clip_global(5.0),
      optax.scale(2.0),
      optaxclip.clip_global(4.0),
      optaxclip.clip_norm(100.0),
    )
    _, state = tx.update(g, tx.init(g))
    logs = optaxclip.stats(state)
    self.assertEqual(
      list(logs),
      _keys("0/clip_global") + _keys("2/clip_global") + _keys("clip_norm"),
    )
    self.assertEqual(float(logs["0/clip_global/norm"]), 10.0)
    self.assertEqual(float(logs["2/clip_global/norm"]), 10.0)  # 5 * 2
    self.assertEqual(float(logs["2/clip_global/clipped_norm"]), 4.0)
    self.assertEqual(float(logs["clip_norm/norm"]), 4.0)

  def test_masked_inject_hyperparams_and_multi_transform(self):
    g = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([30.0, 40.0])}
    mask = {"w": True, "b": False}
    tx = optax.chain(
      optax.masked(optaxclip.clip_global(1.0), mask),
      optax.inject_hyperparams(optaxclip.clip_global)(max_norm=100.0),
      optax.multi_transform(
        {
          "x": optaxclip.clip_norm(1.0),
          "y": optax.inject_hyperparams(optaxclip.clip_norm)(max_norm=2.0),
        },
        {"w": "x", "b": "y"},
      ),
      optax.adam(1e-3),
    )
    _, state = jax.jit(tx.update)(g, tx.init(g))
    logs = optaxclip.stats(state)
    # The masked clipper sees w only; the injected one sees w clipped to 1
    # and b untouched.
    self.assertEqual(len(logs), 4 * len(FIELDS))
    self.assertEqual(len(set(logs)), len(logs))
    by_norm = {k: float(v) for k, v in logs.items() if k.endswith("/norm")}
    glob = sorted(k for k in by_norm if "clip_global" in k)
    norms = sorted(k for k in by_norm if "clip_norm" in k)
    self.assertLen(glob, 2)
    self.assertLen(norms, 2)
    np.testing.assert_allclose(by_norm[glob[0]], 5.0, rtol=1e-6)
    np.testing.assert_allclose(by_norm[glob[1]], np.sqrt(1 + 2500), rtol=1e-6)
    np.testing.assert_allclose(
      sorted(by_norm[k] for k in norms), [1.0, 50.0], rtol=1e-6
    )
    for key in logs:
      self.assertTrue(key.endswith(FIELDS), key)

  def test_inject_hyperparams_alone_keeps_the_short_key(self):
    tx = optax.inject_hyperparams(optaxclip.clip_block_rms)(threshold=1.0)
    g = {"w": jnp.full(4, 2.0)}
    _, state = tx.update(g, tx.init(g))
    logs = optaxclip.stats(state)
    self.assertEqual(list(logs), _keys("clip_block_rms"))
    self.assertEqual(float(logs["clip_block_rms/norm"]), 4.0)

  def test_order_follows_the_chain(self):
    txs = [optax.identity() for _ in range(12)]
    txs[2] = optaxclip.clip_global(1.0)
    txs[10] = optaxclip.clip_global(2.0)
    tx = optax.chain(*txs)
    logs = optaxclip.stats(tx.init({"w": jnp.ones(2)}))
    self.assertEqual(
      list(logs), _keys("2/clip_global") + _keys("10/clip_global")
    )

  def test_no_clipper_no_stats(self):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    self.assertEqual(optaxclip.stats(tx.init({"w": jnp.ones(2)})), {})
    self.assertEqual(optaxclip.stats(None), {})
    self.assertEqual(optaxclip.stats(()), {})

  def test_inside_jit_without_transfer(self):
    tx = optax.chain(
      optaxclip.clip_unitwise(0.1), optaxclip.clip_global(1.0), optax.sgd(0.1)
    )
    params = {"w": jnp.ones((3, 2))}
    traces = []

    @jax.jit
    def step(params, state, g):
      traces.append(1)
      updates, state = tx.update(g, state, params)
      return optax.apply_updates(params, updates), state, optaxclip.stats(state)

    state = tx.init(params)
    grads = [{"w": jnp.full((3, 2), s)} for s in (1.0, 0.01)]
    jax.block_until_ready(grads)
    with jax.transfer_guard("disallow"):
      for g in grads:
        params, state, logs = step(params, state, g)
    self.assertLen(traces, 1)
    # (A dict returned from jit comes back with its keys sorted.)
    self.assertEqual(
      sorted(logs), sorted(_keys("clip_unitwise") + _keys("clip_global"))
    )
    # Second step: each column (unit) of 0.01s has norm 0.01*sqrt(3), below
    # its limit 0.1 * ||w column||; nothing is clipped.
    self.assertEqual(float(logs["clip_unitwise/clip_fraction"]), 0.0)
    np.testing.assert_allclose(
      logs["clip_unitwise/norm"], 0.01 * np.sqrt(6), rtol=1e-5
    )


class _Counted:
  """A pytree node that counts how often it is flattened."""

  flattens = 0

  def __init__(self, children):
    self.children = children


def _flatten_counted(node):
  _Counted.flattens += 1
  return (
    (jax.tree_util.SequenceKey(i), c) for i, c in enumerate(node.children)
  ), None


jax.tree_util.register_pytree_with_keys(
  _Counted, _flatten_counted, lambda _, children: _Counted(list(children))
)


class _Pair:
  """A pytree node whose two children's keys render alike (0 and "0")."""

  def __init__(self, a, b):
    self.a, self.b = a, b


jax.tree_util.register_pytree_with_keys(
  _Pair,
  lambda p: (
    ((jax.tree_util.DictKey(0), p.a), (jax.tree_util.DictKey("0"), p.b)),
    None,
  ),
  lambda _, children: _Pair(*children),
)


class ClipGlobalState(NamedTuple):  # named like optaxclip's, but foreign.
  norm: jax.Array


class StatsByTypeTest(parameterized.TestCase):
  def test_foreign_namedtuple_and_dict_key_named_like_a_state(self):
    tx = optax.chain(optaxclip.clip_global(1.0), optax.sgd(0.1))
    ours = tx.init({"w": jnp.ones(2)})
    state = {
      "ClipGlobalState": jnp.ones(()),
      "opt": ours,
      "foreign": ClipGlobalState(norm=jnp.ones(())),
      "ClipNormState": {"norm": 1.0},
    }
    self.assertEqual(list(optaxclip.stats(state)), _keys("clip_global"))

  def test_a_slash_in_a_named_chain_name_does_not_overwrite(self):
    g = {"w": jnp.array([3.0, 4.0])}
    tx = optax.named_chain(
      ("a/0", optaxclip.clip_global(1.0)),
      ("a", optax.chain(optaxclip.clip_global(2.0))),
    )
    _, state = tx.update(g, tx.init(g))
    logs = optaxclip.stats(state)
    self.assertEqual(
      sorted(logs),
      sorted(_keys("a%2F0/clip_global") + _keys("a/0/clip_global")),
    )
    self.assertEqual(float(logs["a%2F0/clip_global/clipped_norm"]), 1.0)
    self.assertEqual(float(logs["a/0/clip_global/clipped_norm"]), 1.0)
    self.assertEqual(float(logs["a/0/clip_global/norm"]), 1.0)  # after "a/0"

  def test_paths_that_render_alike_fall_back_to_the_full_path(self):
    tx = optaxclip.clip_norm(1.0)
    state = _Pair(tx.init({}), tx.init({}))
    logs = optaxclip.stats(state)
    self.assertLen(logs, 2 * len(FIELDS))
    self.assertEqual(
      sorted(logs), sorted(_keys("[0]/clip_norm") + _keys("['0']/clip_norm"))
    )

  def test_guard_and_the_clippers_it_guards(self):
    tx = optaxclip.guard(
      optax.chain(
        optaxclip.clip_global(1.0),
        optaxclip.clip_global(2.0),
        optaxclip.clip_zscore(),
        optax.adam(1e-3),
      ),
      spike_z=3.0,
    )
    logs = optaxclip.stats(tx.init({"w": jnp.ones(2)}))
    self.assertEqual(
      list(logs),
      [
        f"guard/{f}"
        for f in (
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
        )
      ]
      + _keys("inner_state/0/clip_global")
      + _keys("inner_state/1/clip_global")
      + [f"clip_zscore/{f}" for f in (*CLIP_FIELDS, "threshold", "restarts")],
    )

  def test_one_walk_of_the_state_whatever_the_number_of_state_classes(self):
    params = _Counted([jnp.ones(3) for _ in range(20)])
    tx = optax.chain(optaxclip.clip_global(1.0), optax.adam(1e-3))
    state = tx.init(params)  # adam's mu and nu hold a _Counted each.
    _Counted.flattens = 0
    logs = optaxclip.stats(state)
    self.assertEqual(list(logs), _keys("clip_global"))
    self.assertEqual(_Counted.flattens, 2)  # mu's and nu's, once each.

  def test_documented_dtypes(self):
    g = {"w": jnp.array([3.0, 4.0])}
    tx = optaxclip.guard(
      optax.chain(
        optaxclip.clip_value(1.0),
        optaxclip.clip_norm(1.0),
        optaxclip.clip_global(1.0),
        optaxclip.clip_block_rms(1.0),
        optaxclip.clip_unitwise(1.0),
        optaxclip.clip_zscore(),
        optaxclip.clip_percentile(),
        optaxclip.clip_relative(),
      )
    )
    # The dtypes after an update (traced: they are known without running).
    _, state = jax.eval_shape(tx.update, g, tx.init(g), g)
    pe = optaxclip.clip_per_example(1.0)
    _, pe_state = jax.eval_shape(pe.update, {"w": jnp.ones((2, 2))}, pe.init(g))
    logs = {**optaxclip.stats(state), **optaxclip.stats(pe_state)}
    # guard 11, five static clippers 4, the adaptive ones 4 (+ restarts for
    # clip_zscore and clip_relative), clip_per_example 6.
    self.assertLen(logs, 11 + 5 * 4 + 3 * 4 + 2 + 6)
    counters = (
      "skipped",
      "nonfinite",
      "consecutive_skips",
      "restarts",
      "skipped_max_norm",
      "skipped_spike",
      "skipped_loss_spike",
    )
    for key, value in logs.items():
      want = jnp.int32 if key.endswith(counters) else jnp.float32
      self.assertEqual((key, value.dtype, value.shape), (key, want, ()))
