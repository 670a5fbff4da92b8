"""The static clippers: parity with TF / Keras / PyTorch formulas and optax,
dtypes, overflow, meta-gradients, trees, hyperparameter checks, jit.
"""

import functools
import math

from absl.testing import parameterized
import chex
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fast_compile import run_fast
import np_refs
import optaxclip

RTOL = 1e-5
ATOL = 1e-6


def _tree(seed):
  """A small float32 tree of three leaves of ranks 1, 2 and 4."""
  rng = np.random.default_rng(seed)
  tree = {
    "dense": {
      "kernel": rng.standard_normal((4, 3)),
      "bias": rng.standard_normal(3),
    },
    "conv": rng.standard_normal((2, 2, 3, 2)),
  }
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def _np(tree):
  """Device arrays to NumPy in one go (eager indexing would dispatch each)."""
  return jax.tree.map(np.asarray, tree)


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _close(actual, expected, rtol=RTOL, atol=ATOL):
  np.testing.assert_allclose(
    np.asarray(actual, np.float64)
    if not np.iscomplexobj(actual)
    else np.asarray(actual),
    expected,
    rtol=rtol,
    atol=atol,
  )


def _close_leaves(tree, expected_leaves, rtol=RTOL, atol=ATOL):
  for a, e in zip(jax.tree.leaves(tree), expected_leaves, strict=True):
    _close(a, e, rtol, atol)


# --- Parity -------------------------------------------------------------------
#
# Hyperparameters are passed as traced arrays and mapped over with jax.vmap,
# so that each test compiles (or, without jit, traces) its clippers once.


class ParityTest(parameterized.TestCase):
  """Same numbers as the documented formulas of TF, Keras, torch and optax.

  Jitted only: ClipperTest runs every clipper with and without jit; eager
  dispatch of these many shapes and orders would dominate the suite's time.
  """

  def test_clip_value_matches_tf_torch_optax(self):
    g = _tree(1)
    limits = np.array([0.0, 0.5, 1.5, 100.0], np.float32)

    def run(g, limit):
      tx = optaxclip.clip_value(limit)
      out, state = tx.update(g, tx.init(g))
      return out, state, optax.clip(limit).update(g, optax.EmptyState())[0]

    outs, states, optax_outs = _np(jax.jit(jax.vmap(run, (None, 0)))(g, limits))
    leaves = _leaves(g)
    flat = np.concatenate([np.abs(x).ravel() for x in leaves])
    for i, limit in enumerate(limits.astype(np.float64)):
      out = jax.tree.map(lambda x, i=i: x[i], outs)
      _close_leaves(
        out, [np_refs.tf_clip_by_value(x, -limit, limit) for x in leaves]
      )
      _close_leaves(out, np_refs.torch_clip_grad_value(leaves, limit))
      _close_leaves(out, np_refs.keras_clipvalue(leaves, limit))
      chex.assert_trees_all_close(
        out, jax.tree.map(lambda x, i=i: x[i], optax_outs), rtol=RTOL, atol=ATOL
      )
      _close(states.norm[i], flat.max())
      _close(states.clipped_norm[i], min(flat.max(), limit))
      _close(states.clip_fraction[i], np.mean(flat > limit))

  def test_clip_norm_matches_tf_clip_by_norm_with_axes(self):
    rng = np.random.default_rng(2)
    g = {
      "a": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
      "b": jnp.asarray(rng.standard_normal((5, 3)) * 0.3, jnp.float32),
    }
    all_axes = (None, 0, -1, (0, 1))
    max_norms = np.array([0.4, 1.0, 3.0], np.float32)

    def run(g, max_norm):
      return [
        optaxclip.clip_norm(max_norm, axis=axis).update(g, None)
        for axis in all_axes
      ]

    results = _np(jax.jit(jax.vmap(run, (None, 0)))(g, max_norms))
    leaves = _leaves(g)
    for axis, (outs, states) in zip(all_axes, results):
      for i, max_norm in enumerate(max_norms.astype(np.float64)):
        expected = [
          np_refs.tf_clip_by_norm(x, max_norm, axes=axis) for x in leaves
        ]
        _close_leaves(jax.tree.map(lambda x, i=i: x[i], outs), expected)
        if axis is None:  # Keras' clipnorm is tf.clip_by_norm per variable.
          _close_leaves(
            jax.tree.map(lambda x, i=i: x[i], outs),
            np_refs.keras_clipnorm(leaves, max_norm),
          )
        _close(states.norm[i], np_refs.tree_norm(leaves))
        _close(states.clipped_norm[i], np_refs.tree_norm(expected))
        slice_norms = np.concatenate(
          [
            np.sqrt(np.sum(np_refs.f64(x) ** 2, axis=axis)).ravel()
            for x in leaves
          ]
        )
        _close(states.clip_fraction[i], np.mean(slice_norms > max_norm))

  def test_clip_global_and_clip_norm_match_tf_torch_optax_by_order(self):
    g = _tree(4)
    orders = (1, 2, 3, math.inf)
    max_norms = np.array([0.7, 2.0, 50.0], np.float32)

    def run(g, max_norm):
      return (
        [
          optaxclip.clip_global(max_norm, ord=p).update(g, None) for p in orders
        ],
        [optaxclip.clip_norm(max_norm, ord=p).update(g, None) for p in orders],
        optax.clip_by_global_norm(max_norm).update(g, optax.EmptyState())[0],
      )

    global_results, norm_results, optax_outs = _np(
      jax.jit(jax.vmap(run, (None, 0)))(g, max_norms)
    )
    leaves = _leaves(g)
    for ord_, (outs, states), (n_outs, n_states) in zip(
      orders, global_results, norm_results
    ):
      p = math.inf if ord_ == "inf" else float(ord_)
      for i, max_norm in enumerate(max_norms.astype(np.float64)):
        out = jax.tree.map(lambda x, i=i: x[i], outs)
        # torch.nn.utils.clip_grad_norm_(norm_type=p) and its total norm;
        # torch divides by total + 1e-6: with totals of order 1-10 that is a
        # relative difference below 1e-6, inside the tolerance.
        expected, total = np_refs.torch_clip_grad_norm(leaves, max_norm, p)
        _close_leaves(out, expected)
        _close(states.norm[i], total)
        _close(states.clipped_norm[i], min(total, max_norm))
        _close(states.clip_fraction[i], float(total > max_norm))
        if p == 2:
          tf_out, tf_norm = np_refs.tf_clip_by_global_norm(leaves, max_norm)
          _close_leaves(out, tf_out)
          _close(states.norm[i], tf_norm)  # TF's second output.
          _close_leaves(out, np_refs.keras_global_clipnorm(leaves, max_norm))
          chex.assert_trees_all_close(
            out,
            jax.tree.map(lambda x, i=i: x[i], optax_outs),
            rtol=RTOL,
            atol=ATOL,
          )
        # clip_norm: each leaf on its own, in the same order.
        norms = [np_refs.pnorm(x, p) for x in leaves]
        expected = [
          np_refs.f64(x) * min(1.0, max_norm / n) for x, n in zip(leaves, norms)
        ]
        _close_leaves(jax.tree.map(lambda x, i=i: x[i], n_outs), expected)
        _close(n_states.norm[i], np_refs.tree_norm(leaves, p))
        _close(n_states.clipped_norm[i], np_refs.tree_norm(expected, p))
        _close(n_states.clip_fraction[i], np.mean(np.array(norms) > max_norm))

  def test_clip_block_rms_matches_optax(self):
    g = _tree(7)
    thresholds = np.array([0.0, 0.1, 0.8, 10.0], np.float32)

    def run(g, threshold):
      tx = optaxclip.clip_block_rms(threshold)
      out, state = tx.update(g, tx.init(g))
      ref, _ = optax.clip_by_block_rms(threshold).update(g, optax.EmptyState())
      return out, state, ref

    outs, states, refs = _np(jax.jit(jax.vmap(run, (None, 0)))(g, thresholds))
    leaves = _leaves(g)
    rms = np.array([np.sqrt(np.mean(np_refs.f64(x) ** 2)) for x in leaves])
    for i, threshold in enumerate(thresholds.astype(np.float64)):
      out = jax.tree.map(lambda x, i=i: x[i], outs)
      expected = [np_refs.block_rms(x, threshold) for x in leaves]
      _close_leaves(out, expected)
      if threshold > 0:  # optax divides by a zero threshold: inf / NaN.
        chex.assert_trees_all_close(
          out, jax.tree.map(lambda x, i=i: x[i], refs), rtol=RTOL, atol=ATOL
        )
      _close(states.norm[i], np_refs.tree_norm(leaves))
      _close(states.clipped_norm[i], np_refs.tree_norm(expected))
      _close(states.clip_fraction[i], np.mean(rms > threshold))

  def test_clip_unitwise_matches_optax_by_rank_and_axis(self):
    rng = np.random.default_rng(8)
    shapes = {
      "scalar": (),
      "row": (1, 5),
      "vec": (6,),
      "dense": (4, 3),
      "heads": (4, 2, 3),
      "conv": (3, 3, 2, 4),
      "conv3d": (2, 2, 2, 2, 3),
    }
    g = {
      k: jnp.asarray(rng.standard_normal(s), jnp.float32)
      for k, s in shapes.items()
    }
    w = {
      k: jnp.asarray(rng.standard_normal(s) * 0.5, jnp.float32)
      for k, s in shapes.items()
    }
    w["vec"] = jnp.zeros(6)  # Zero-initialised: eps sets the limit.
    g3 = {"a": jnp.asarray(rng.standard_normal((3, 4, 5)), jnp.float32)}
    w3 = {"a": jnp.asarray(rng.standard_normal((3, 4, 5)), jnp.float32)}
    clippings = np.array([0.01, 0.3, 5.0], np.float32)
    axes = (0, (1, 2), -1)

    def run(clipping):
      tx = optaxclip.clip_unitwise(clipping)
      by_rank = tx.update(g, tx.init(w), w)
      ref = optax.adaptive_grad_clip(clipping).update(g, optax.EmptyState(), w)
      by_axis = [
        (
          optaxclip.clip_unitwise(clipping, eps=1e-2, axis=a).update(
            g3, None, w3
          )[0],
          optax.adaptive_grad_clip(clipping, eps=1e-2, axis=a).update(
            g3, None, w3
          )[0],
        )
        for a in axes
      ]
      return by_rank, ref[0], by_axis

    (outs, states), refs, by_axis = _np(jax.jit(jax.vmap(run))(clippings))
    for i, clipping in enumerate(clippings.astype(np.float64)):

      def pick(t, i=i):
        return jax.tree.map(lambda leaf: leaf[i], t)

      chex.assert_trees_all_close(pick(outs), pick(refs), rtol=RTOL, atol=ATOL)
      results = [
        np_refs.agc(x, y, clipping) for x, y in zip(_leaves(g), _leaves(w))
      ]
      _close_leaves(pick(outs), [r[0] for r in results])
      _close(states.norm[i], np_refs.tree_norm(_leaves(g)))
      _close(states.clipped_norm[i], np_refs.tree_norm([r[0] for r in results]))
      factors = np.concatenate([r[2].ravel() for r in results])  # units
      _close(states.clip_fraction[i], np.mean(factors < 1))
      for axis, (ours, theirs) in zip(axes, by_axis):
        chex.assert_trees_all_close(
          pick(ours), pick(theirs), rtol=RTOL, atol=ATOL
        )
        _close(
          pick(ours)["a"],
          np_refs.agc(g3["a"], w3["a"], clipping, 1e-2, axes=axis)[0],
        )

  def test_exactly_on_the_threshold_is_unchanged(self):
    cases = [
      (optaxclip.clip_value(4.0), {"a": jnp.array([3.0, -4.0])}, None),
      (optaxclip.clip_norm(5.0), {"a": jnp.array([3.0, 4.0])}, None),
      (
        optaxclip.clip_global(5.0),
        {"a": jnp.array([1.0, 2.0]), "b": jnp.array([[2.0, 4.0]])},
        None,
      ),
      (optaxclip.clip_block_rms(2.0), {"a": jnp.full(4, 2.0)}, None),
      (
        optaxclip.clip_unitwise(0.5),
        {"a": jnp.array([3.0, 4.0])},
        {"a": jnp.array([6.0, 8.0])},
      ),
    ]
    results = jax.jit(
      lambda: [tx.update(g, tx.init(g), w) for tx, g, w in cases]
    )()
    for (_, g, _), (out, state) in zip(cases, results):
      chex.assert_trees_all_equal(out, g)
      self.assertEqual(float(state.clip_fraction), 0.0)


# --- Every clipper, with and without jit --------------------------------------


def _all_clippers():
  """(name, transformation, needs params) for every static clipper."""
  return [
    ("clip_value", optaxclip.clip_value(0.5), False),
    ("clip_norm", optaxclip.clip_norm(1.0), False),
    ("clip_norm_axis", optaxclip.clip_norm(1.0, axis=-1), False),
    ("clip_global", optaxclip.clip_global(1.0), False),
    ("clip_global_inf", optaxclip.clip_global(0.5, ord="inf"), False),
    ("clip_block_rms", optaxclip.clip_block_rms(0.3), False),
    ("clip_unitwise", optaxclip.clip_unitwise(0.1), True),
  ]


def _reference(name, leaves, params=None):
  """float64 NumPy result and statistics of each clipper in _all_clippers().

  Returns (clipped leaves, norm, clipped_norm, clip_fraction).
  """
  mags = [np.abs(np_refs.f64(x)) for x in leaves]
  if name == "clip_value":
    out = [np_refs.clip_value_complex(x, 0.5) for x in leaves]
    flat = np.concatenate([m.ravel() for m in mags])
    return out, flat.max(), min(flat.max(), 0.5), np.mean(flat > 0.5)
  if name.startswith("clip_global"):
    limit, p = {"clip_global": (1.0, 2.0), "clip_global_inf": (0.5, math.inf)}[
      name
    ]
    norm = np_refs.tree_norm(leaves, p)
    out = [np_refs.f64(x) * min(1.0, limit / norm) for x in leaves]
    return out, norm, min(norm, limit), float(norm > limit)
  if name == "clip_norm":
    out = [np_refs.tf_clip_by_norm(x, 1.0) for x in leaves]
    units = np.array([np.sqrt(np.sum(m**2)) for m in mags])
    limits = 1.0
  elif name == "clip_norm_axis":
    out = [np_refs.tf_clip_by_norm(x, 1.0, axes=-1) for x in leaves]
    units = np.concatenate([np.sqrt(np.sum(m**2, -1)).ravel() for m in mags])
    limits = 1.0
  elif name == "clip_block_rms":
    out = [np_refs.block_rms(x, 0.3) for x in leaves]
    units = np.array([np.sqrt(np.mean(m**2)) for m in mags])
    limits = 0.3
  elif name == "clip_unitwise":
    results = [np_refs.agc(x, w, 0.1) for x, w in zip(leaves, params)]
    out = [r[0] for r in results]
    units = np.concatenate([r[2].ravel() for r in results])
    limits = 1.0  # units holds the factors: clipped where below 1.
    return (
      out,
      np_refs.tree_norm(leaves),
      np_refs.tree_norm(out),
      np.mean(units < limits),
    )
  else:
    raise ValueError(name)
  return (
    out,
    np_refs.tree_norm(leaves),
    np_refs.tree_norm(out),
    np.mean(units > limits),
  )


class ClipperTest(chex.TestCase):
  """Each clipper against its NumPy reference, with and without jit."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
    (name, name, tx, needs) for name, tx, needs in _all_clippers()
  )
  def test_clipper(self, name, tx, needs_params):
    rng = np.random.default_rng(20)
    w_ = {
      "kernel": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
      "bias": jnp.asarray(rng.standard_normal(3) * 0.2, jnp.float32),
    }
    g = {**w_, "frozen": None, "masked": optax.MaskedNode()}
    params = jax.tree.map(lambda x: x * 2, g) if needs_params else None

    def run(g, params):
      results = [tx.update(g, tx.init(g), params)]
      # Empty trees pass through with zero statistics.
      results += [tx.update(e, tx.init(e), e) for e in ({}, [], ())]
      return results

    (out, state), *empties = self.variant(run)(g, params)
    self.assertIsNone(out["frozen"])
    self.assertIsInstance(out["masked"], optax.MaskedNode)
    leaves = _leaves(w_)
    expected, norm, clipped_norm, fraction = _reference(
      name, leaves, _leaves(params) if needs_params else None
    )
    _close_leaves(out, expected)
    _close(state.norm, norm)
    _close(state.clipped_norm, clipped_norm)
    _close(state.clip_fraction, fraction)
    self.assertGreater(fraction, 0)  # the input does get clipped.
    for (e_out, e_state), empty in zip(empties, ({}, [], ())):
      self.assertEqual(e_out, empty)
      self.assertEqual(
        [float(getattr(e_state, f)) for f in ("norm", "clipped_norm")]
        + [float(e_state.clip_fraction)],
        [0.0, 0.0, 0.0],
      )
      self.assertEqual(int(e_state.count), 1)


# --- dtypes: bf16 accuracy, outputs keep dtypes -------------------------------


class DtypeTest(parameterized.TestCase):
  def test_outputs_keep_each_leaf_dtype(self):
    rng = np.random.default_rng(10)
    base = rng.standard_normal((3, 4))
    g = {
      "bf16": jnp.asarray(base, jnp.bfloat16),
      "f16": jnp.asarray(base * 0.5, jnp.float16),
      "f32": jnp.asarray(base * 2, jnp.float32),
      "c64": jnp.asarray(base + 1j * base[::-1], jnp.complex64),
    }
    w = jax.tree.map(lambda x: x * 3, g)
    clippers = _all_clippers()
    results = jax.jit(
      lambda g, w: [tx.update(g, tx.init(g), w) for _, tx, _ in clippers]
    )(g, w)
    tolerances = {"bf16": 1e-2, "f16": 2e-3, "f32": RTOL, "c64": RTOL}
    for (name, _, needs), (out, state) in zip(clippers, results):
      for k in g:
        self.assertEqual(out[k].dtype, g[k].dtype, f"{name} {k}")
      # None fields: none; the step count is int32.
      for field in jax.tree.leaves(state._replace(count=None)):
        self.assertEqual(field.dtype, jnp.float32)
      self.assertEqual(state.count.dtype, jnp.int32)
      expected = _reference(name, _leaves(g), _leaves(w) if needs else None)
      for (k, x), e in zip(sorted(out.items()), expected[0]):
        wide = x.astype(jnp.complex64 if k == "c64" else jnp.float32)
        _close(
          np.asarray(wide), e, rtol=tolerances[k], atol=tolerances[k] * 1e-2
        )
      _close(state.norm, expected[1])

  def test_bf16_global_norm_over_1000_leaves(self):
    rng = np.random.default_rng(11)
    g = [
      jnp.asarray(rng.standard_normal(100), jnp.bfloat16) for _ in range(1000)
    ]
    true_norm = np_refs.tree_norm(_leaves(g))
    # The state alone: the scaled leaves (their dtypes are checked above)
    # would add a third to the compile time of 1000 leaves.
    state = jax.jit(lambda g: optaxclip.clip_global(1.0).update(g, None)[1])(g)
    self.assertLess(abs(float(state.norm) / true_norm - 1), 0.01)
    _close(state.clipped_norm, 1.0, rtol=1e-2)
    # optax 0.2.8 sums the squares in bfloat16: on this input it reports a
    # norm of 193.0 for a true 316.43 (0.61x; ours: 316.4327), and scales
    # its update by that wrong norm.
    optax_norm = float(optax.tree.norm(g))
    self.assertGreater(abs(optax_norm / true_norm - 1), 0.1)


# --- Overflow and underflow ---------------------------------------------------


class OverflowTest(parameterized.TestCase):
  def test_1e30_leaves_clip_along_their_direction(self):
    g = {
      "a": jnp.full((3,), 1e30, jnp.float32),
      "b": jnp.array([[-1e30, 2e30], [5e29, 0.0]], jnp.float32),
    }
    orders = (1.0, 2.0, 3.0)
    out = jax.jit(
      lambda g: [
        optaxclip.clip_global(1.0, ord=p).update(g, None) for p in orders
      ]
    )(g)
    leaves = _leaves(g)
    for p, (clipped, state) in zip(orders, out):
      true_norm = np_refs.tree_norm(leaves, p)
      _close(state.norm, true_norm)
      _close(state.clipped_norm, 1.0)
      _close_leaves(clipped, [np_refs.f64(x) / true_norm for x in leaves])
      _close(np_refs.tree_norm(_leaves(clipped), p), 1.0)
      if p >= 2:
        # torch's formula in float32 squares 1e30, gets an inf norm and a
        # zero coefficient: all-zero updates. optax 0.2.8 gives the same for
        # p = 2: {'a': [0, 0, 0], 'b': [[-0, 0], [0, 0]]}.
        with np.errstate(over="ignore"):
          naive = np.sum(
            [np.sum(np.abs(x) ** np.float32(p)) for x in leaves],
            dtype=np.float32,
          )
        self.assertTrue(np.isinf(naive))
      self.assertTrue(all(np.any(np.asarray(x) != 0) for x in clipped.values()))

  def test_per_leaf_clippers_of_1e30_leaves(self):
    g = {
      "a": jnp.full((2, 3), 1e30, jnp.float32),
      "b": jnp.array([3e30, -4e30], jnp.float32),
    }
    w = {
      "a": jnp.full((2, 3), 2e30, jnp.float32),
      "b": jnp.array([1.0, 1.0], jnp.float32),
    }
    leaves, params = _leaves(g), _leaves(w)
    cases = [
      (
        optaxclip.clip_norm(2.0),
        [np_refs.tf_clip_by_norm(x, 2.0) for x in leaves],
      ),
      (
        optaxclip.clip_norm(2.0, axis=-1),
        [np_refs.tf_clip_by_norm(x, 2.0, axes=-1) for x in leaves],
      ),
      (
        optaxclip.clip_block_rms(1.0),
        [np_refs.block_rms(x, 1.0) for x in leaves],
      ),
      (
        optaxclip.clip_unitwise(0.1),
        [np_refs.agc(x, y, 0.1)[0] for x, y in zip(leaves, params)],
      ),
    ]
    results = jax.jit(
      lambda g, w: [tx.update(g, tx.init(g), w) for tx, _ in cases]
    )(g, w)
    for (_, expected), (out, state) in zip(cases, results):
      _close_leaves(out, expected)
      _close(state.norm, np_refs.tree_norm(leaves))
      _close(state.clipped_norm, np_refs.tree_norm(expected))

  def test_tiny_leaves_underflow_safe(self):
    # Squares of 1e-30 underflow to zero in float32; the norm must not.
    g = {
      "a": jnp.array([3e-30, 4e-30], jnp.float32),
      "b": jnp.array([[1e-30]], jnp.float32),
    }
    leaves = _leaves(g)
    true_norm = np_refs.tree_norm(leaves)
    (out, state), (out_n, _) = jax.jit(
      lambda g: (
        optaxclip.clip_global(1e-31).update(g, None),
        optaxclip.clip_norm(1e-30).update(g, None),
      )
    )(g)
    _close(state.norm, true_norm, atol=0)
    _close_leaves(
      out, [np_refs.f64(x) * 1e-31 / true_norm for x in leaves], atol=0
    )
    _close_leaves(
      out_n, [np_refs.tf_clip_by_norm(x, 1e-30) for x in leaves], atol=0
    )


# --- Meta-gradients -----------------------------------------------------------


_META_CASES = [
  # name, transformation, base gradient (on the limit at scale 1), params
  (
    "clip_value",
    optaxclip.clip_value(4.0),
    {"a": np.array([3.0, -4.0]), "b": np.array([[1.0, 2.0]])},
    None,
  ),
  (
    "clip_norm",
    optaxclip.clip_norm(5.0),
    {"a": np.array([3.0, 4.0]), "b": np.array([[0.0, 5.0]])},
    None,
  ),
  (
    "clip_global",
    optaxclip.clip_global(5.0),
    {"a": np.array([1.0, 2.0]), "b": np.array([[2.0, 4.0]])},
    None,
  ),
  (
    "clip_global_inf",
    optaxclip.clip_global(4.0, ord=math.inf),
    {"a": np.array([1.0, -2.0]), "b": np.array([[2.0, 4.0]])},
    None,
  ),
  (
    "clip_global_ord3",
    optaxclip.clip_global(17 ** (1 / 3), ord=3),
    {"a": np.array([1.0, 2.0]), "b": np.array([[2.0, 0.0]])},
    None,
  ),
  (
    "clip_block_rms",
    optaxclip.clip_block_rms(2.0),
    {"a": np.full(4, 2.0), "b": np.array([[1.0, -1.0]])},
    None,
  ),
  (
    "clip_unitwise",
    optaxclip.clip_unitwise(0.5),
    {"a": np.array([3.0, 4.0]), "b": np.array([[0.1, 0.2]])},
    {"a": np.array([6.0, 8.0]), "b": np.array([[1.0, 1.0]])},
  ),
]


def _meta_reference(name, tree, params):
  """The clipped update as a float64 NumPy function of the gradient."""
  leaves = [tree[k] for k in sorted(tree)]
  if name == "clip_value":
    return [np.clip(x, -4.0, 4.0) for x in leaves]
  if name == "clip_norm":
    return [np_refs.tf_clip_by_norm(x, 5.0) for x in leaves]
  if name.startswith("clip_global"):
    limit, p = {
      "clip_global": (5.0, 2.0),
      "clip_global_inf": (4.0, math.inf),
      "clip_global_ord3": (17 ** (1 / 3), 3.0),
    }[name]
    n = np_refs.tree_norm(leaves, p)
    return [x * min(1.0, limit / n) if n > 0 else x for x in leaves]
  if name == "clip_block_rms":
    return [np_refs.block_rms(x, 2.0) for x in leaves]
  if name == "clip_unitwise":
    return [
      np_refs.agc(x, params[k], 0.5)[0] for k, x in zip(sorted(tree), leaves)
    ]
  raise ValueError(name)


class MetaGradientTest(parameterized.TestCase):
  """jax.grad through update: finite at zero, on the threshold and above."""

  def test_grad_through_update_of_every_clipper(self):
    rng = np.random.default_rng(12)
    weights = [
      {k: rng.standard_normal(v.shape) for k, v in base.items()}
      for _, _, base, _ in _META_CASES
    ]

    def objective(scale, tx, base, params, weight):
      g = jax.tree.map(lambda x: jnp.float32(x) * scale, base)
      w = None if params is None else jax.tree.map(jnp.float32, params)
      out, _ = tx.update(g, tx.init(g), w)
      return sum(jnp.sum(out[k] * weight[k]) for k in out)

    @jax.jit
    def grads(scale):
      return [
        jax.grad(objective)(scale, tx, base, params, weight)
        for (_, tx, base, params), weight in zip(_META_CASES, weights)
      ]

    h = 1e-6
    for scale in (0.0, 1.0, 2.0):  # zero, on the threshold, above it.
      values = grads(jnp.float32(scale))
      for (name, _, base, params), weight, value in zip(
        _META_CASES, weights, values
      ):
        value = float(value)
        self.assertTrue(np.isfinite(value), f"{name} at scale {scale}")

        def f(c, name=name, base=base, params=params, weight=weight):
          out = _meta_reference(
            name, {k: v * c for k, v in base.items()}, params
          )
          return sum(np.sum(o * weight[k]) for o, k in zip(out, sorted(base)))

        right = (f(scale + h) - f(scale)) / h
        left = right if scale == 0 else (f(scale) - f(scale - h)) / h
        # On the threshold the derivative may be either one-sided value (or,
        # element-wise, a mix of them); elsewhere both sides agree.
        low, high = min(left, right), max(left, right)
        self.assertBetween(
          value,
          low - 1e-3 * (1 + abs(low)),
          high + 1e-3 * (1 + abs(high)),
          f"{name} at scale {scale}",
        )

  def test_optax_global_norm_meta_gradient_at_zero(self):
    # What the test above guards against: optax 0.2.8's clip_by_global_norm
    # has a NaN meta-gradient at a zero gradient (the norm's sqrt'(0) = inf
    # times 0); ours is the derivative of the identity, sum(base) = 9.
    base = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([[2.0, 4.0]])}

    def objective(tx, scale):
      g = jax.tree.map(lambda x: x * scale, base)
      out, _ = tx.update(g, tx.init(g))
      return sum(jnp.sum(x) for x in jax.tree.leaves(out))

    ours, theirs = jax.jit(
      lambda s: (
        jax.grad(lambda s: objective(optaxclip.clip_global(5.0), s))(s),
        jax.grad(lambda s: objective(optax.clip_by_global_norm(5.0), s))(s),
      )
    )(0.0)
    self.assertEqual(float(ours), 9.0)
    self.assertTrue(np.isnan(float(theirs)) or float(theirs) == 9.0)


# --- Complex leaves, Python scalars, masked, inject_hyperparams ---------------


class TreeTest(parameterized.TestCase):
  def test_complex_leaves_use_abs_squared(self):
    rng = np.random.default_rng(13)
    c = rng.standard_normal((3, 4)) + 1j * rng.standard_normal((3, 4))
    g = {
      "c": jnp.asarray(c, jnp.complex64),
      "r": jnp.asarray(rng.standard_normal(5), jnp.float32),
    }
    leaves = _leaves(g)
    true = np.sqrt(sum(np.sum(np.abs(np_refs.f64(x)) ** 2) for x in leaves))

    @jax.jit
    def run(g):
      return [
        optaxclip.clip_global(1.0).update(g, None),
        optaxclip.clip_norm(1.0).update(g, None),
        optaxclip.clip_value(0.7).update(g, None),
        optaxclip.clip_block_rms(0.5).update(g, None),
        optaxclip.clip_unitwise(0.1).update(g, None, g),
        optax.clip_by_block_rms(0.5).update(g, None),
        optax.adaptive_grad_clip(0.1).update(g, None, g),
      ]

    (
      (glob, state),
      (norm, _),
      (value, _),
      (rms, _),
      (agc, _),
      (optax_rms, _),
      (optax_agc, _),
    ) = run(g)
    _close(state.norm, true)
    _close_leaves(glob, [np_refs.f64(x) / true for x in leaves])
    _close_leaves(norm, [np_refs.tf_clip_by_norm(x, 1.0) for x in leaves])
    _close_leaves(value, [np_refs.clip_value_complex(x, 0.7) for x in leaves])
    np.testing.assert_allclose(np.angle(value["c"]), np.angle(c), rtol=1e-5)
    chex.assert_trees_all_close(rms, optax_rms, rtol=RTOL, atol=ATOL)
    chex.assert_trees_all_close(agc, optax_agc, rtol=RTOL, atol=ATOL)
    self.assertEqual(glob["c"].dtype, jnp.complex64)

  def test_python_scalar_leaves(self):
    tx = optaxclip.clip_global(1.0)
    out, _ = tx.update({"a": 3.0, "b": np.float32(4.0)}, tx.init(None))
    _close(out["a"], 0.6)
    _close(out["b"], 0.8)

  def test_inside_optax_masked(self):
    g = {
      "w": jnp.array([3.0, 4.0]),
      "b": jnp.array([30.0, 40.0]),
      "frozen": jnp.array([100.0]),
    }
    mask = {"w": True, "b": True, "frozen": False}
    txs = {
      "clip_global": optax.masked(optaxclip.clip_global(5.0), mask),
      "clip_norm": optax.masked(optaxclip.clip_norm(1.0), mask),
    }
    results = jax.jit(
      lambda g: {k: tx.update(g, tx.init(g)) for k, tx in txs.items()}
    )(g)
    expected = {
      "clip_global": (g["w"] / np.sqrt(101), g["b"] / np.sqrt(101)),
      "clip_norm": (g["w"] / 5, g["b"] / 50),
    }
    for key, (out, state) in results.items():
      _close(out["w"], expected[key][0])
      _close(out["b"], expected[key][1])
      chex.assert_trees_all_equal(out["frozen"], g["frozen"])
      # The norm counts the masked-in leaves only.
      _close(optaxclip.stats(state)[f"{key}/norm"], np.sqrt(25 + 2500))

  def test_inside_inject_hyperparams_changed_in_state(self):
    g = {"a": jnp.array([3.0, -4.0]), "b": jnp.array([[0.5, 12.0]])}
    w = {"a": jnp.array([6.0, 8.0]), "b": jnp.array([[1.0, 1.0]])}
    leaves = _leaves(g)
    cases = {
      "clip_value": (
        optaxclip.clip_value,
        "max_delta",
        1.0,
        0.25,
        lambda v: [np.clip(x, -v, v) for x in leaves],
      ),
      "clip_norm": (
        optaxclip.clip_norm,
        "max_norm",
        1.0,
        2.0,
        lambda v: [np_refs.tf_clip_by_norm(x, v) for x in leaves],
      ),
      "clip_global": (
        optaxclip.clip_global,
        "max_norm",
        1.0,
        2.0,
        lambda v: np_refs.tf_clip_by_global_norm(leaves, v)[0],
      ),
      "clip_block_rms": (
        optaxclip.clip_block_rms,
        "threshold",
        1.0,
        0.5,
        lambda v: [np_refs.block_rms(x, v) for x in leaves],
      ),
      "clip_unitwise": (
        optaxclip.clip_unitwise,
        "clipping",
        0.1,
        0.3,
        lambda v: [np_refs.agc(x, y, v)[0] for x, y in zip(leaves, _leaves(w))],
      ),
    }
    txs = {
      k: optax.inject_hyperparams(f)(**{hp: first})
      for k, (f, hp, first, _, _) in cases.items()
    }
    traces = []

    @jax.jit
    def step(g, states):
      traces.append(1)
      return {k: txs[k].update(g, states[k], w) for k in txs}

    states = {k: tx.init(w) for k, tx in txs.items()}
    results = step(g, states)
    for k, (_, hp, first, second, reference) in cases.items():
      _close_leaves(results[k][0], reference(first))
      states[k] = results[k][1]
      states[k].hyperparams[hp] = jnp.asarray(second, jnp.float32)
    results = step(g, states)
    for k, (_, _, _, second, reference) in cases.items():
      _close_leaves(results[k][0], reference(second))
      self.assertIn(f"{k}/norm", optaxclip.stats(results[k][1]))
    step(g, {k: r[1] for k, r in results.items()})
    self.assertLen(traces, 1)

  def test_inject_hyperparams_structural_arguments(self):
    g = {"a": jnp.array([3.0, -4.0])}
    # ord and axis shape the computation: named in static_args they work ...
    tx1 = optax.inject_hyperparams(optaxclip.clip_global, static_args="ord")(
      max_norm=1.0, ord=1
    )
    tx2 = optax.inject_hyperparams(
      optaxclip.clip_norm, static_args=("ord", "axis")
    )(max_norm=1.0, ord=math.inf, axis=0)
    (out1, _), (out2, _) = jax.jit(
      lambda g: (tx1.update(g, tx1.init(g)), tx2.update(g, tx2.init(g)))
    )(g)
    _close(out1["a"], np.array([3.0, -4.0]) / 7)
    _close(out2["a"], np.array([3.0, -4.0]) / 4)
    # ... and injected as arrays they fail with a hint, at init.
    with pytest.raises(TypeError, match=r"ord.*static_args"):
      optax.inject_hyperparams(optaxclip.clip_global)(max_norm=1.0, ord=1).init(
        g
      )
    with pytest.raises(TypeError, match=r"axis.*static_args"):
      optax.inject_hyperparams(optaxclip.clip_norm)(max_norm=1.0, axis=0).init(
        g
      )


# --- Hyperparameter and tree checks -------------------------------------------


_FACTORIES = [
  (optaxclip.clip_value, "max_delta", {}),
  (optaxclip.clip_norm, "max_norm", {}),
  (optaxclip.clip_global, "max_norm", {}),
  (optaxclip.clip_block_rms, "threshold", {}),
  (optaxclip.clip_unitwise, "clipping", {}),
  (optaxclip.clip_unitwise, "eps", {"clipping": 0.1}),
]


class CheckTest(parameterized.TestCase):
  @parameterized.product(
    factory=_FACTORIES,
    bad=[
      (-1.0, ValueError),
      (np.float32(-2.0), ValueError),
      (float("nan"), ValueError),
      (-math.inf, ValueError),
      ("1.0", TypeError),
      (None, TypeError),
      (True, TypeError),
      (1 + 2j, TypeError),
      (np.ones(2), TypeError),
      (np.array(True), TypeError),
      (np.array(1 + 2j), TypeError),
      (np.array("1"), TypeError),
      (np.array(-1.0), ValueError),
    ],
  )
  def test_bad_hyperparameter_fails_at_construction(self, factory, bad):
    fn, name, others = factory
    value, error = bad
    with pytest.raises(error, match=name):
      fn(**others, **{name: value})

  @parameterized.product(
    factory=(optaxclip.clip_norm, optaxclip.clip_global),
    ord_=(0, -1, 0.5, 0.999, float("nan"), -math.inf, "fro", True, "2"),
  )
  def test_bad_ord(self, factory, ord_):
    with pytest.raises((ValueError, TypeError), match="ord"):
      factory(1.0, ord=ord_)

  @parameterized.parameters((1.5,), ("0",), (True,), ((0, 0),), (((0,),),))
  def test_bad_axis(self, axis):
    with pytest.raises((ValueError, TypeError), match="axis"):
      optaxclip.clip_norm(1.0, axis=axis)
    with pytest.raises((ValueError, TypeError), match="axis"):
      optaxclip.clip_unitwise(0.1, axis=axis)

  def test_edge_values_are_accepted(self):
    g = {"a": jnp.array([3.0, 4.0])}
    cases = [
      (optaxclip.clip_value(0), [0.0, 0.0]),
      (optaxclip.clip_global(math.inf), [3.0, 4.0]),
      (optaxclip.clip_global(7.0, ord=1), [3.0, 4.0]),
      (optaxclip.clip_global(5.0, ord=None), [3.0, 4.0]),
      (optaxclip.clip_norm(np.float32(2.0), ord="inf"), [1.5, 2.0]),
      (optaxclip.clip_unitwise(0.0, eps=0.0), [0.0, 0.0]),
      (
        optaxclip.clip_block_rms(np.array(1.0)),
        np.array([3.0, 4.0]) / np.sqrt(12.5),
      ),
    ]
    for tx, expected in cases:
      out, _ = tx.update(g, tx.init(g), g)
      _close(out["a"], expected)

  @parameterized.named_parameters(
    (name, tx, needs) for name, tx, needs in _all_clippers()
  )
  def test_integer_leaf_names_its_path(self, tx, needs):
    g = {"layer": {"kernel": jnp.ones((2, 2)), "step": jnp.ones(2, jnp.int32)}}
    w = jax.tree.map(lambda x: x.astype(jnp.float32), g) if needs else None
    with pytest.raises(TypeError, match=r"\['layer'\]\['step'\].*int32"):
      tx.update(g, tx.init(g), w)

  def test_unitwise_params_checks_name_the_path(self):
    tx = optaxclip.clip_unitwise(0.1)
    g = {"a": {"k": jnp.ones((2, 3))}, "b": jnp.ones(3)}
    with pytest.raises(ValueError, match="params"):
      tx.update(g, tx.init(g))
    with pytest.raises(ValueError, match=r"\['b'\]"):
      tx.update(g, tx.init(g), {"a": {"k": jnp.ones((2, 3))}})
    with pytest.raises(ValueError, match=r"\['c'\]"):
      tx.update(g, tx.init(g), {**g, "c": jnp.ones(1)})
    with pytest.raises(ValueError, match=r"\['a'\]\['k'\].*\(3, 2\)"):
      tx.update(g, tx.init(g), {"a": {"k": jnp.ones((3, 2))}, "b": jnp.ones(3)})
    with pytest.raises(TypeError, match=r"\['b'\].*int32"):
      tx.update(
        g,
        tx.init(g),
        {"a": {"k": jnp.ones((2, 3))}, "b": jnp.ones(3, jnp.int32)},
      )
    with pytest.raises(ValueError, match="structure"):
      tx.update([jnp.ones(2)], tx.init(g), (jnp.ones(2),))

  def test_axis_that_does_not_fit_names_the_leaf(self):
    g = {"m": jnp.ones((2, 3)), "v": jnp.ones(3)}
    with pytest.raises(ValueError, match=r"\['v'\]"):
      optaxclip.clip_norm(1.0, axis=1).update(g, None)
    with pytest.raises(ValueError, match=r"once.*\['m'\]"):
      optaxclip.clip_norm(1.0, axis=(0, -2)).update(g, None)
    with pytest.raises(ValueError, match=r"\['v'\]"):
      optaxclip.clip_unitwise(0.1, axis=1).update(g, None, g)


# --- jit: no host transfer, no retrace ----------------------------------------


class JitTest(parameterized.TestCase):
  def test_no_transfer_no_retrace(self):
    clippers = _all_clippers()
    opts = {name: optax.chain(tx, optax.adam(1e-2)) for name, tx, _ in clippers}
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2, jnp.bfloat16)}
    traces = []

    @jax.jit
    def step(params, states, grads):
      traces.append(1)
      new_params, new_states, logs = {}, {}, {}
      for name, opt in opts.items():
        updates, new_states[name] = opt.update(
          grads, states[name], params[name]
        )
        new_params[name] = optax.apply_updates(params[name], updates)
        logs[name] = optaxclip.stats(new_states[name])
      return new_params, new_states, logs

    params = dict.fromkeys(opts, params)
    states = {name: opt.init(params[name]) for name, opt in opts.items()}
    grads = [
      {"w": jnp.full((3, 2), s), "b": jnp.full(2, s, jnp.bfloat16)}
      for s in (0.5, 30.0, 0.0)
    ]
    jax.block_until_ready((params, states, grads))
    with jax.transfer_guard("disallow"):
      for gr in grads:
        params, states, logs = step(params, states, gr)
    self.assertLen(traces, 1)
    self.assertEqual(step._cache_size(), 1)
    for name in opts:
      self.assertEqual(params[name]["b"].dtype, jnp.bfloat16)
      self.assertEqual(len(logs[name]), 4)
      for value in logs[name].values():
        self.assertEqual(value.dtype, jnp.float32)
        self.assertTrue(np.isfinite(float(value)))


# --- Every finite magnitude, every dtype --------------------------------------
#
# XLA compiles x / s as x * (1 / s); above 2**126 the reciprocal is subnormal
# and flushed to zero. A clipper dividing by such a norm would return zeros
# (or pass the gradient unclipped) and record a norm or clipped norm of 0.


def _clip_np(leaves, limit, norm):
  """The exact clip in float64: leaves * min(1, limit / norm)."""
  factor = 1.0 if norm <= limit else limit / norm
  return [np_refs.f64(x) * factor for x in leaves]


class ExtremeMagnitudeTest(parameterized.TestCase):
  def test_issue_reproductions(self):
    g1 = {"a": jnp.array([1e38, -1e38], jnp.float32)}
    g2 = {"a": jnp.full((100,), 1.4e36, jnp.float32)}  # global norm 1.4e37
    g3 = {"a": jnp.full((7,), 3e38, jnp.float32)}  # norm 7.9e38 > float32 max
    (o1, s1), (o2, s2), (o3, s3), (o4, s4) = jax.jit(
      lambda a, b, c: (
        optaxclip.clip_norm(1.0).update(a, None),
        optaxclip.clip_global(1e-3).update(b, None),
        optaxclip.clip_global(1.0).update(c, None),
        optaxclip.clip_global(1e-37).update(c, None),
      )
    )(g1, g2, g3)
    _close(o1["a"], [2**-0.5, -(2**-0.5)])
    _close(s1.norm, math.sqrt(2) * 1e38)
    _close(s1.clipped_norm, 1.0)
    _close(o2["a"], np.full(100, 1e-4), atol=0)
    _close(s2.clipped_norm, 1e-3)
    _close(o3["a"], np.full(7, 7**-0.5))
    self.assertEqual(float(s3.norm), math.inf)  # beyond float32: honest inf
    _close(s3.clipped_norm, 1.0)
    # A factor of about 2**-250: two powers of two beyond float32's range.
    _close(o4["a"], np.full(7, 1e-37 * 7**-0.5), atol=0)
    _close(s4.clipped_norm, 1e-37, atol=0)

  @parameterized.parameters("exact", "sampled")
  def test_complex_modulus_clipped_by_a_tiny_factor(self, stats):
    # A modulus of 2.7e37 clipped to 2**-21: the factor 1.8e-44 is below
    # float32's smallest normal; it was flushed and the element zeroed.
    g = {"c": jnp.asarray([2.7e37j, -3e30 + 4e30j], jnp.complex64)}
    tx = optaxclip.clip_value(2.0**-21, stats=stats)
    out, _ = jax.jit(tx.update)(g, tx.init(g))
    _close(out["c"], np.asarray([1j, -0.6 + 0.8j]) * 2.0**-21, atol=0)

  def test_complex_modulus_beyond_range(self):
    # Both parts finite, the modulus 4.2e38 beyond float32: clipped, not
    # NaN'd as non-finite.
    g = {"c": jnp.asarray([3e38 + 3e38j, 0.5], jnp.complex64)}
    want = np.asarray([(1 + 1j) / np.sqrt(2), 0.5])
    for tx in (
      optaxclip.clip_value(1.0),
      optaxclip.clip_value(1.0, stats="sampled"),
    ):
      out, state = jax.jit(tx.update)(g, tx.init(g))
      _close(out["c"], want)
      self.assertEqual(float(state.norm), math.inf)  # honest float32 stat
      _close(state.clipped_norm, 1.0)
      _close(state.clip_fraction, 0.5)
    _close(optaxclip.clip_by_value(g, -1.0, 1.0)["c"], want)
    out, _ = jax.jit(optaxclip.clip_norm(1.0).update)(g, None)
    _close(out["c"], [(1 + 1j) / np.sqrt(2), 0.0], atol=1e-7)

  @parameterized.parameters("float16", "bfloat16", "float32")
  def test_largest_finite_values_of_each_dtype(self, dtype):
    big = float(jnp.finfo(dtype).max)
    g = {
      "a": jnp.asarray([big, -big, big], dtype),
      "b": jnp.asarray([[big / 4, 1.0]], dtype),
    }
    w = jax.tree.map(jnp.ones_like, g)
    leaves = _leaves(g)
    cases = {
      "clip_global": (optaxclip.clip_global(1e-3), None),
      "clip_norm": (optaxclip.clip_norm(2.0), None),
      "clip_block_rms": (optaxclip.clip_block_rms(0.5), None),
      "clip_unitwise": (optaxclip.clip_unitwise(0.1, axis=-1), w),
    }
    results = jax.jit(
      lambda g, w: {
        k: tx.update(g, tx.init(g), w if p is not None else None)
        for k, (tx, p) in cases.items()
      }
    )(g, w)
    norm = np_refs.tree_norm(leaves)
    rtol = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-5}[dtype]
    expected = {
      "clip_global": _clip_np(leaves, 1e-3, norm),
      "clip_norm": [np_refs.tf_clip_by_norm(x, 2.0) for x in leaves],
      "clip_block_rms": [np_refs.block_rms(x, 0.5) for x in leaves],
      "clip_unitwise": [
        np_refs.tf_clip_by_norm(
          x,
          0.1 * np.sqrt(np.sum(np.ones_like(x) ** 2, axis=-1, keepdims=True)),
          axes=-1,
        )
        for x in leaves
      ],
    }
    for name, (out, state) in results.items():
      for a, e in zip(jax.tree.leaves(out), expected[name]):
        self.assertEqual(a.dtype, jnp.dtype(dtype))
        _close(a, e, rtol=rtol, atol=1e-7)
      _close(state.clipped_norm, np_refs.tree_norm(expected[name]), rtol=rtol)
      want_norm = norm if norm < np.finfo(np.float32).max else np.inf
      _close(state.norm, want_norm, rtol=rtol)

  def test_float64_under_x64(self):
    with jax.enable_x64(True):
      g = {
        "a": jnp.asarray([1e308, -1e308, 1e308]),  # norm beyond float64
        "b": jnp.asarray([1e-300]),
      }
      (o1, s1), (o2, _), (o3, s3) = jax.jit(
        lambda g: (
          optaxclip.clip_global(1e-300).update(g, None),  # factor ~2**-2000
          optaxclip.clip_norm(2.0).update(g, None),
          optaxclip.clip_value(1e300).update(g, None),
        )
      )(g)
      self.assertEqual(o1["a"].dtype, jnp.float64)
      self.assertEqual(s1.norm.dtype, jnp.float32)  # stats are float32
      _close(
        o1["a"],
        np.array([1, -1, 1]) * 1e-300 / math.sqrt(3),
        rtol=1e-12,
        atol=0,
      )
      self.assertEqual(float(o1["b"][0]), 0.0)  # 1e-300 * 2**-2000 underflows
      _close(o2["a"], np.array([1, -1, 1]) * 2 / math.sqrt(3), rtol=1e-12)
      _close(o2["b"], [1e-300], rtol=1e-12, atol=0)
      _close(o3["a"], [1e300, -1e300, 1e300], rtol=1e-12)
      self.assertEqual(float(s3.clip_fraction), 0.75)

  @parameterized.parameters(1.0, 3.0, math.inf)
  def test_other_orders_of_huge_leaves(self, p):
    g = {"a": jnp.asarray([3e38, -1e38, 2e38], jnp.float32)}
    out, state = jax.jit(
      lambda g: optaxclip.clip_global(1e-2, ord=p).update(g, None)
    )(g)
    norm = np_refs.pnorm(_leaves(g)[0], p)
    _close(out["a"], _clip_np(_leaves(g), 1e-2, norm)[0])
    _close(state.clipped_norm, 1e-2)

  def test_sharded_leaves_inside_shard_map_and_under_jit(self):
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec("d")
    x = jax.device_put(
      jnp.asarray([1e38, 1e38, 1.0, 1.0], jnp.float32),
      jax.sharding.NamedSharding(mesh, spec),
    )
    want = _clip_np([np.asarray(x)], 1.0, np_refs.tree_norm([np.asarray(x)]))
    for tx in (
      optaxclip.clip_global(1.0, axis_name="d"),
      optaxclip.clip_norm(1.0, axis_name="d"),
    ):
      f = jax.shard_map(
        lambda x, tx=tx: tx.update({"a": x}, None)[0]["a"],
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
      )
      _close(jax.jit(f)(x), want[0])
    # Under jit, a leaf that may span devices takes the two-pass exact path.
    out, state = jax.jit(
      lambda x: optaxclip.clip_global(1.0).update({"a": x}, None)
    )(x)
    _close(out["a"], want[0])
    _close(state.norm, math.sqrt(2) * 1e38)


# --- Non-finite gradients: one policy -----------------------------------------


_NONFINITE_CASES = {
  "clip_global": optaxclip.clip_global(1.0),
  "clip_norm": optaxclip.clip_norm(1.0),
  "clip_norm_axis": optaxclip.clip_norm(1.0, axis=-1),
  "clip_value": optaxclip.clip_value(1.0),
  "clip_block_rms": optaxclip.clip_block_rms(1.0),
  "clip_unitwise": optaxclip.clip_unitwise(0.5, axis=-1),
}


@jax.jit
def _nonfinite_run(g, w, clean):
  """Every case on the tree, and on the tree without its leaf "a"."""
  return (
    {k: tx.update(g, tx.init(g), w) for k, tx in _NONFINITE_CASES.items()},
    {
      k: tx.update(clean, tx.init(clean), {j: w[j] for j in clean})[0]
      for k, tx in _NONFINITE_CASES.items()
    },
  )


class NonFinitePolicyTest(parameterized.TestCase):
  @parameterized.parameters(float("nan"), float("inf"))
  def test_no_finite_value_passes_unclipped(self, bad):
    g = {
      "a": jnp.asarray([bad, 1.0], jnp.float32),
      "b": jnp.asarray([1e6, -1e6], jnp.float32),
      "c": jnp.asarray([[0.1, 0.2], [3.0, 4.0]], jnp.float32),
    }
    w = jax.tree.map(jnp.ones_like, g)
    clean = {k: v for k, v in g.items() if k != "a"}
    results, clean_results = _np(_nonfinite_run(g, w, clean))
    for name, (out, state) in results.items():
      # The unit holding the non-finite value comes out all NaN ...
      if name == "clip_global":
        for x in jax.tree.leaves(out):
          self.assertTrue(np.all(np.isnan(x)), name)
        self.assertEqual(float(state.clip_fraction), 1.0)
      else:
        self.assertTrue(np.all(np.isnan(out["a"])), name)
        # ... and the other units are clipped exactly as without it.
        for k in clean:
          _close(out[k], clean_results[name][k], atol=1e-6)
      self.assertTrue(np.isnan(float(state.clipped_norm)), name)
      if math.isnan(bad):
        self.assertTrue(np.isnan(float(state.norm)), name)
      else:
        self.assertEqual(float(state.norm), math.inf, name)

  def test_clip_value_counts_the_leaf_made_nan(self):
    g = {
      "a": jnp.asarray([jnp.inf, 0.5, 0.1], jnp.float32),
      "b": jnp.asarray([2.0, 0.5], jnp.float32),
    }
    out, state = jax.jit(optaxclip.clip_value(1.0).update)(g, None)
    self.assertTrue(np.all(np.isnan(np.asarray(out["a"]))))
    _close(out["b"], [1.0, 0.5])
    _close(state.clip_fraction, 4 / 5)  # three NaN'd, one clipped
    self.assertEqual(float(state.norm), math.inf)


class SampledValueStatsTest(chex.TestCase):
  """clip_value(stats="sampled"): optax.clip's numbers, estimated stats."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_small_leaves_equal_optax_clip_and_exact_stats(self):
    g = _tree(1)
    exact_tx = optaxclip.clip_value(0.5)
    tx = optaxclip.clip_value(0.5, stats="sampled")
    out, state = self.variant(tx.update)(g, tx.init(g))
    _, exact = exact_tx.update(g, exact_tx.init(g))
    chex.assert_trees_all_close(
      out, optax.clip(0.5).update(g, optax.EmptyState())[0]
    )
    for field in ("norm", "clipped_norm", "clip_fraction", "threshold"):
      _close(getattr(state, field), getattr(exact, field))

  def test_inf_element_is_nan_and_the_rest_clipped(self):
    g = {
      "a": jnp.asarray([jnp.inf, 0.5, -3.0, jnp.nan], jnp.float32),
      "c": jnp.asarray([-jnp.inf * (1 + 1j), 2j], jnp.complex64),
    }
    tx = optaxclip.clip_value(1.0, stats="sampled")
    out, state = jax.jit(tx.update)(g, tx.init(g))
    a = np.asarray(out["a"])
    self.assertTrue(np.isnan(a[0]) and np.isnan(a[3]))
    _close(a[1:3], [0.5, -1.0])
    c = np.asarray(out["c"])
    self.assertTrue(np.isnan(c[0]))
    _close(c[1], 1j)
    self.assertTrue(np.isnan(float(state.clipped_norm)))
    _close(state.clip_fraction, 5 / 6)  # inf, -3, nan, inf, 2j

  def test_finite_elements_are_optax_clips_bit_for_bit(self):
    """Signed zeros, subnormals and the largest finite values, in every real
    dtype: the element-wise NaN of an inf is added without touching the
    others (in a large leaf too, whose statistics come from a sample).
    """
    for dtype, bits in (
      (jnp.float32, np.uint32),
      (jnp.bfloat16, np.uint16),
      (jnp.float16, np.uint16),
    ):
      info = jnp.finfo(dtype)
      tiny, big = float(info.smallest_subnormal), float(info.max)
      values = [0.0, -0.0, tiny, -tiny, 0.25, -0.25, 3.0, -3.0, big, -big]
      for n in (len(values), 70_000):
        x = jnp.asarray(np.resize(np.asarray(values), n), dtype)
        tx = optaxclip.clip_value(0.5, stats="sampled")
        out, _ = jax.jit(tx.update)({"w": x}, tx.init({"w": x}))
        want = optax.clip(0.5).update({"w": x}, optax.EmptyState())[0]
        np.testing.assert_array_equal(
          np.asarray(out["w"]).view(bits),
          np.asarray(want["w"]).view(bits),
          err_msg=f"{np.dtype(dtype).name}, {n} elements",
        )

  def test_large_leaf_estimates_fraction_and_bounds_the_norm(self):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(300_000).astype(np.float32)
    x[12345] = 50.0  # off the sample's grid: the estimate misses it
    g = {"w": jnp.asarray(x)}
    tx = optaxclip.clip_value(1.0, stats="sampled")
    out, state = jax.jit(tx.update)(g, tx.init(g))
    _close(out["w"], np.clip(x, -1.0, 1.0))
    true_fraction = np.mean(np.abs(x) > 1.0)
    self.assertLess(abs(float(state.clip_fraction) - true_fraction), 0.02)
    self.assertLessEqual(float(state.norm), np.abs(x).max())
    sample = np.abs(x[::257])
    _close(state.norm, sample.max())

  def test_no_retrace_on_the_second_step(self):
    g = _tree(1)
    tx = optaxclip.clip_value(0.5, stats="sampled")
    traces = []

    @jax.jit
    def step(g, state):
      traces.append(1)
      return tx.update(g, state)

    state = tx.init(g)
    for _ in range(3):
      _, state = step(g, state)
    self.assertLen(traces, 1)


# --- Derivatives of order 0-2 -------------------------------------------------


def _second_order_cases():
  """(name, ours, a reference written with differentiable ops, params)."""
  params = {
    "a": jnp.asarray([0.5, -2.0, 1.5]),
    "b": jnp.asarray([[1.0, 0.3], [-0.2, 2.0]]),
  }

  def per_leaf(c):
    def update(g, state, params=None):
      del params

      def clip(x):
        n = jnp.sqrt(jnp.sum(x * x))
        return x * jnp.where(n > c, c / n, 1.0)

      return jax.tree.map(clip, g), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

  return params, [
    (
      "clip_global",
      optaxclip.clip_global(1.0),
      optax.clip_by_global_norm(1.0),
      None,
    ),
    ("clip_value", optaxclip.clip_value(0.7), optax.clip(0.7), None),
    ("clip_norm", optaxclip.clip_norm(1.0), per_leaf(1.0), None),
    (
      "clip_block_rms",
      optaxclip.clip_block_rms(0.4),
      optax.clip_by_block_rms(0.4),
      None,
    ),
    (
      "clip_unitwise",
      optaxclip.clip_unitwise(0.3),
      optax.adaptive_grad_clip(0.3),
      params,
    ),
  ]


class SecondOrderTest(parameterized.TestCase):
  """Hessians through ``update`` match optax's clippers where both are smooth.

  The custom-JVP rules return a primal that has a JVP of its own (else every
  case raises ``TypeError ... ad_util.Zero ... reshape``).
  """

  def test_hessians_match_optax_away_from_the_threshold(self):
    params, cases = _second_order_cases()
    weights = {
      "a": jnp.asarray([0.3, -1.0, 2.0]),
      "b": jnp.asarray([[1.0, -0.5], [0.25, 2.0]]),
    }
    flat_w, unravel = jax.flatten_util.ravel_pytree(weights)

    def loss(tx, flat):
      out, _ = tx.update(unravel(flat), tx.init(params), params)
      return jnp.sum(
        flat_w * jnp.sin(3 * jax.flatten_util.ravel_pytree(out)[0])
      )

    def hessians(flat):
      return [
        (
          jax.hessian(functools.partial(loss, o))(flat),
          jax.hessian(functools.partial(loss, t))(flat),
        )
        for _, o, t, _ in cases
      ]

    # All below the limits, all above them: one program for both points.
    points = jnp.stack([s * (flat_w + 0.1) for s in (0.05, 3.0)])
    results = run_fast(jax.vmap(hessians), points)
    for (name, _, _, _), (h_ours, h_theirs) in zip(cases, results):
      # optax's AGC guards its divisor with 1e-6.
      tol = 1e-3 if name == "clip_unitwise" else 1e-4
      np.testing.assert_allclose(
        h_ours, h_theirs, rtol=tol, atol=tol, err_msg=name
      )

  @pytest.mark.slow
  def test_every_second_order_form_is_finite_at_zero_and_on_the_limit(self):
    params, cases = _second_order_cases()
    cases.append(
      ("clip_zscore", optaxclip.clip_zscore(warmup_steps=1), None, None)
    )
    # Gradients exactly on each clipper's limit (or 1 where it has none).
    on_limit = {
      "clip_global": 1.0 / math.sqrt(7),
      "clip_value": 0.7,
      "clip_norm": 1.0 / math.sqrt(3),
      "clip_block_rms": 0.4,
      "clip_unitwise": 1.0,
      "clip_zscore": 1.0,
    }

    def forms(v, tx):
      def f(v):
        g = {"a": v[:3], "b": v[3:].reshape(2, 2)}
        out, _ = tx.update(g, tx.init(params), params)
        return sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(out))

      hess = jax.hessian(f)(v)
      # reverse-over-reverse: the same rules as the hessian's reverse pass
      # (forward over reverse); once is enough for the compile time.
      jac2 = jax.jacrev(jax.jacrev(f))(v) if tx is cases[0][1] else hess
      return hess, jac2, jax.jvp(jax.grad(f), (v,), (jnp.ones(7),))[1]

    def run(scales):
      return [
        jax.vmap(lambda s, tx=tx: forms(s * jnp.ones(7), tx))(
          jnp.stack([0.0, scales[i]])
        )
        for i, (_, tx, _, _) in enumerate(cases)
      ]

    scales = jnp.asarray([on_limit[name] for name, _, _, _ in cases])
    for (name, _, _, _), (hess, jac2, hvp) in zip(cases, run_fast(run, scales)):
      for form in (hess, jac2, hvp):
        self.assertTrue(np.all(np.isfinite(form)), name)
      np.testing.assert_allclose(hess, jac2, rtol=1e-5, atol=1e-6, err_msg=name)
      np.testing.assert_allclose(
        hvp, hess.sum(-1), rtol=1e-4, atol=1e-5, err_msg=name
      )
