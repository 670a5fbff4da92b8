"""The norms' code paths (optaxclip._norms): fast sum, zero settling, exact
recompute.

Each path is forced by the data (normal, zero, tiny, huge, non-finite values)
and checked against NumPy in float64; derivatives on every path are checked
against x / ||x||; and the compiled steps keep no leaf-sized temporary (the
reason the paths are written as they are: see optaxclip._numerics's
docstring).
"""

import functools
import math

from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optaxclip
from optaxclip import _norms


def _np_unit_norms(x, p, axes):
  a = np.abs(np.asarray(x, np.float64))
  if math.isinf(p):
    return np.max(a, axis=axes, keepdims=True)
  return np.sum(a**p, axis=axes, keepdims=True) ** (1 / p)


def _np_global_norm(leaves, p):
  flat = np.concatenate([np.asarray(x, np.float64).ravel() for x in leaves])
  return _np_unit_norms(flat, p, None).item()


def _leaves(scale, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  shapes = [(3,), (70_000,), (50, 60), (5, 4)]  # small and large leaves
  return [jnp.asarray(rng.normal(size=s) * scale, dtype) for s in shapes]


class NormPathsTest(parameterized.TestCase):
  @parameterized.product(scale=[1.0, 1e30, 1e-30], p=[1.0, 2.0, 3.0, math.inf])
  def test_global_and_unit_norms_match_numpy(self, scale, p):
    leaves = _leaves(scale)
    axes = [None, None, (0,), (1,)]
    glob, units = jax.jit(
      lambda xs: (_norms.global_norm(xs, p), _norms.unit_norms(xs, p, axes))
    )(leaves)
    np.testing.assert_allclose(glob, _np_global_norm(leaves, p), rtol=1e-5)
    for x, ax, got in zip(leaves, axes, units):
      np.testing.assert_allclose(got, _np_unit_norms(x, p, ax), rtol=1e-5)

  @parameterized.parameters(jnp.float32, jnp.bfloat16)
  def test_zero_and_tiny_units_are_settled_exactly(self, dtype):
    x = np.random.default_rng(1).normal(size=(4, 5))
    x[:, 2] = 0.0  # a zero unit: settled by the max pass
    x[:, 3] = 1e-30  # every square underflows: exact recompute
    zeros = np.zeros((3, 5))  # a zero leaf
    leaves = [jnp.asarray(x, dtype), jnp.asarray(zeros, dtype)]
    got = jax.jit(lambda xs: _norms.unit_norms(xs, 2.0, [(0,), (0,)]))(leaves)
    want = _np_unit_norms(np.asarray(leaves[0], np.float64), 2.0, (0,))
    np.testing.assert_allclose(got[0], want, rtol=1e-5)
    np.testing.assert_array_equal(got[1], np.zeros((1, 5)))

  def test_only_zero_units_stay_on_the_fast_path_values(self):
    x = jnp.asarray([[3.0, 0.0], [4.0, 0.0]])
    got = jax.jit(lambda x: _norms.unit_norms([x], 2.0, [(0,)]))(x)[0]
    np.testing.assert_array_equal(got, [[5.0, 0.0]])

  def test_bfloat16_over_1000_leaves_is_accurate(self):
    rng = np.random.default_rng(2)
    leaves = [
      jnp.asarray(rng.normal(size=100), jnp.bfloat16) for _ in range(1000)
    ]
    leaves.append(jnp.asarray(rng.normal(size=(300, 300)), jnp.bfloat16))
    got = jax.jit(_norms.global_norm)(leaves)
    self.assertEqual(got.dtype, jnp.float32)
    np.testing.assert_allclose(got, _np_global_norm(leaves, 2.0), rtol=1e-4)

  def test_non_finite_values(self):
    inf, nan = jnp.array([1.0, jnp.inf]), jnp.array([1.0, jnp.nan])
    self.assertEqual(float(_norms.global_norm([inf])), math.inf)
    self.assertTrue(math.isnan(float(_norms.global_norm([nan]))))
    self.assertEqual(float(_norms.unit_norms([inf])[0][0]), math.inf)
    self.assertTrue(math.isnan(float(_norms.unit_norms([nan])[0][0])))

  @parameterized.product(
    scale=[1.0, 1e30, 1e-30], dtype=["float32"], which=["global", "unit"]
  )
  def test_derivative_is_x_over_norm_on_every_path(self, scale, dtype, which):
    x = jnp.asarray([3.0 * scale, 4.0 * scale], dtype)

    def norm(v):
      if which == "global":
        return _norms.global_norm([v])
      return _norms.unit_norms([v])[0].sum()

    # d||x||/dx = x / ||x||, scale-free: check it on the scaled inputs.
    grad = jax.grad(norm)(x)
    np.testing.assert_allclose(grad, [0.6, 0.8], rtol=1e-5)
    np.testing.assert_array_equal(jax.grad(norm)(jnp.zeros(2)), [0.0, 0.0])

  def test_bfloat16_derivative(self):
    x = jnp.asarray([3.0, 4.0], jnp.bfloat16)
    grad = jax.grad(lambda x: _norms.global_norm([x]))(x)
    np.testing.assert_allclose(
      np.asarray(grad, np.float32), [0.6, 0.8], rtol=1e-2
    )

  def test_largest_magnitude_of_complex_leaves_keeps_nan(self):
    # Moduli reduced as a real leaf (the integer max), on both sides of the
    # 4096 elements where XLA:CPU's plain max drops a NaN.
    rng = np.random.default_rng(0)
    for n in (7, 5000):
      x = (rng.normal(size=n) + 1j * rng.normal(size=n)).astype(np.complex64)
      for special in (
        None,
        complex(np.nan, 0),
        complex(0, np.inf),
        3e38 + 3e38j,
      ):
        y = x.copy()
        if special is not None:
          y[-1] = special
        got = float(jax.jit(_norms.largest_magnitude)(jnp.asarray(y)))
        with np.errstate(over="ignore"):
          want = np.float32(np.max(np.abs(y.astype(np.complex128))))
        if np.isnan(want):
          self.assertTrue(np.isnan(got), (n, special, got))
        else:  # the modulus in float32: to a rounding
          np.testing.assert_allclose(got, want, rtol=2e-7, err_msg=str(n))
    grad = jax.grad(_norms.largest_magnitude)(
      jnp.asarray([3 + 4j, 1j], jnp.complex64)
    )
    np.testing.assert_allclose(np.asarray(grad), [0.6 - 0.8j, 0], rtol=1e-6)

  def test_largest_and_count_above(self):
    x = jnp.asarray([[-3.0, 0.5], [2.0, -1.0]])
    fn = jax.jit(_norms.largest_and_count_above)
    largest, count = fn(x, 1.0)  # 1.0 itself is not above the limit
    self.assertEqual((float(largest), float(count)), (3.0, 2.0))
    largest, count = fn(x, jnp.float32(5.0))
    self.assertEqual((float(largest), float(count)), (3.0, 0.0))
    grad = jax.grad(lambda x: sum(_norms.largest_and_count_above(x, 1.0)))(x)
    np.testing.assert_array_equal(grad, [[-1.0, 0.0], [0.0, 0.0]])


def _leaves_for_memory(dtype):
  # Leaves above SMALL_LEAF_SIZE: nothing is concatenated.
  n = 2 * _norms.SMALL_LEAF_SIZE
  rng = np.random.default_rng(0)
  return [
    jnp.asarray(rng.normal(size=(n // 256, 256)), dtype) for _ in range(2)
  ]


@functools.cache
def _scale_floor_bytes(dtype):
  return _temp_bytes(
    optax.chain(_scale_by_state(), optax.adam(1e-3)), _leaves_for_memory(dtype)
  )


def _temp_bytes(tx, leaves):
  grads = {f"w{i}": x for i, x in enumerate(leaves)}

  def step(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  lowered = jax.jit(step, donate_argnums=(0, 1)).lower(
    grads, tx.init(grads), grads
  )
  compiled = lowered.compile({"xla_backend_optimization_level": 0})
  return compiled.memory_analysis().temp_size_in_bytes


def _scale_by_state():
  """Every leaf times a factor kept in the state: no norm, no statistics."""

  def init_fn(params):
    del params
    return jnp.ones((), jnp.float32)

  def update_fn(updates, state, params=None):
    del params
    return jax.tree.map(lambda x: _norms.scale_leaf(x, state), updates), state

  return optax.GradientTransformation(init_fn, update_fn)


class TemporaryMemoryTest(parameterized.TestCase):
  """No compiled step keeps a leaf-sized temporary beyond what scaling needs.

  In float32 adam and ``chain(scale, adam)`` keep none. In bfloat16, XLA on
  CPU writes out any transformed gradient that adam reads twice (a bfloat16
  copy: optax.clip does it too); beyond that copy, nothing leaf-sized (a
  float32 upcast would be twice its size).
  """

  @parameterized.product(
    clipper=[
      "clip_global",
      "clip_norm",
      "clip_value",
      "clip_block_rms",
      "clip_unitwise",
    ],
    dtype=["float32", "bfloat16"],
  )
  def test_no_leaf_sized_temporary(self, clipper, dtype):
    leaves = _leaves_for_memory(dtype)
    adam = optax.adam(1e-3)
    tx = {
      "clip_global": lambda: optax.chain(optaxclip.clip_global(1.0), adam),
      "clip_norm": lambda: optax.chain(optaxclip.clip_norm(1.0), adam),
      "clip_value": lambda: optax.chain(optaxclip.clip_value(0.1), adam),
      "clip_block_rms": lambda: optax.chain(
        optaxclip.clip_block_rms(0.1), adam
      ),
      "clip_unitwise": lambda: optax.chain(optaxclip.clip_unitwise(0.01), adam),
    }[clipper]()
    self.assertLess(
      _temp_bytes(tx, leaves), _scale_floor_bytes(dtype) + leaves[0].nbytes // 4
    )

  def test_raw_gradient_norm_is_not_merged_with_adams_square(self):
    # A norm of the raw gradient next to adam's own g * g (as guard does).
    n = 2 * _norms.SMALL_LEAF_SIZE
    leaves = [jnp.ones((n,), jnp.float32) for _ in range(2)]
    adam = optax.adam(1e-3)

    def norm_then_adam():
      def init_fn(params):
        return adam.init(params)

      def update_fn(updates, state, params=None):
        norm = _norms.global_norm(jax.tree.leaves(updates))
        out, state = adam.update(updates, state, params)
        return jax.tree.map(lambda u: u * (norm > 0), out), state

      return optax.GradientTransformation(init_fn, update_fn)

    self.assertLess(
      _temp_bytes(norm_then_adam(), leaves), leaves[0].nbytes // 4
    )
