"""clip_unitwise's step (issue 15, helper unitwise).

Per-unit factors reach a leaf's kernels as multipliers kept in memory: the
factor arithmetic (exponent bits, clamps, powers of two) fused into the
element-wise consumers of the scaled leaf ran once per element and made
``chain(clip_unitwise, adam)`` 3.6x adam's step on a transformer (1.9x
before the exact factors). These properties check that the numbers are
those of scalar factors applied one unit at a time, and that no kernel
of a leaf's shape carries the factor arithmetic.

Small leaves are scaled in packed parts kept in memory
(``_norms.materialized``): as a product with a row of ones, which keeps
every bit (a sum with zeros turned -0.0 into +0.0, and XLA:CPU handed it to
YNNPACK, whose calls cost about 10 ms a step on a 12-block transformer).
"""

import functools
import math
import re

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuzz_strategies as fz
import optaxclip
from optaxclip import _norms

# Above _norms.SMALL_LEAF_SIZE elements: a part of its own (not stacked).
BIG = (260, 256)


# The ci profile draws the values into these leaf shapes only (each new shape
# compiles two programs): one row and several, 2 to 6 units. Other profiles
# (release) draw the shape freely too.
UNIT_SHAPES = ((1, 2), (3, 6), (5, 4))


@st.composite
def units_and_factors(draw):
  rows, cols = draw(
    fz.ci_or(
      st.sampled_from(UNIT_SHAPES),
      st.tuples(st.integers(1, 5), st.integers(2, 6)),
    )
  )
  elements = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 1e-38, -3e-39, 3.4e38, np.inf, np.nan]),
  )
  x = draw(
    st.lists(elements, min_size=rows * cols, max_size=rows * cols).map(
      lambda v: np.asarray(v, np.float32).reshape(rows, cols)
    )
  )
  values = draw(
    st.lists(
      st.one_of(
        st.floats(0.5, 2.0, width=32), st.sampled_from([1.0, 0.0, np.nan])
      ),
      min_size=cols,
      max_size=cols,
    )
  )
  exponents = draw(
    st.lists(st.integers(-300, 300), min_size=cols, max_size=cols)
  )
  # Values exact in float32 and int32: built on the host (jnp.asarray and
  # reshape compile a program per shape).
  factor = _norms.Scaled(
    fz.to_jax(np.asarray(values, np.float32).reshape(1, cols)),
    fz.to_jax(np.asarray(exponents, np.int32).reshape(1, cols)),
  )
  return fz.to_jax(x), factor


_SCALE_LEAF = jax.jit(_norms.scale_leaf)


@fz.examples(25, deadline=None)
@hypothesis.given(units_and_factors())
def test_per_unit_factors_scale_as_scalar_factors_one_unit_at_a_time(case):
  x, factor = case
  got = np.asarray(_SCALE_LEAF(x, factor))
  # Units sliced on the host (indexing a JAX array compiles a program per
  # shape); each still goes through scale_leaf as a JAX array of its own.
  xs = np.asarray(x)
  values, exponents = np.asarray(factor.value), np.asarray(factor.exponent)
  for j in range(xs.shape[1]):
    want = _SCALE_LEAF(xs[:, j], _norms.Scaled(values[0, j], exponents[0, j]))
    np.testing.assert_array_equal(
      got[:, j], np.asarray(want), err_msg=f"unit {j}"
    )


def _fusions_of_shape(hlo: str, shape: tuple[int, ...]) -> list[str]:
  """The bodies of the fused computations whose root has ``shape``."""
  dims = ",".join(str(d) for d in shape)
  bodies = re.findall(r"\n(%fused_computation[^\n]*\{\n.*?\n\})", hlo, re.S)
  return [b for b in bodies if re.search(rf"ROOT [^\n]*= f32\[{dims}\]", b)]


# Each case compiles a large program with the default (optimising) options,
# whose fusions are under test: the two orientations are parametrized, one
# compile each; the clipping, a constant of the program that does not change
# its kernels, is drawn per orientation under other profiles.
@pytest.mark.parametrize("which", ["up", "down"])
@fz.examples(1, deadline=None)
@hypothesis.given(clipping=st.sampled_from([0.01, 0.1]))
def test_no_factor_arithmetic_in_a_leaf_kernel(clipping, which):
  shape = BIG if which == "up" else BIG[::-1]
  params = {"k": jnp.ones(shape), "b": jnp.ones(shape[1:])}
  tx = optax.chain(optaxclip.clip_unitwise(clipping), optax.adam(1e-3))

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  hlo = jax.jit(step).lower(params, tx.init(params), params).compile()
  kernels = _fusions_of_shape(hlo.as_text(), shape)
  assert kernels, "no kernel of the leaf's shape found"
  for body in kernels:
    # The exponent arithmetic of a factor: bit casts and shifts.
    assert "shift-left" not in body and "bitcast-convert" not in body, body


# Three leaves of one shape are packed into one part (several units each);
# alone, a leaf is a part of its own, scaled by scale_leaf.
PACKED_SHAPE = (4, 3)


@st.composite
def packed_trees(draw):
  elements = st.one_of(
    st.floats(-1e3, 1e3, width=32), st.sampled_from([0.0, -0.0, 1e-39])
  )
  n = 3 * math.prod(PACKED_SHAPE)
  g = np.asarray(draw(st.lists(elements, min_size=n, max_size=n)), np.float32)
  w = draw(st.lists(st.floats(-2.0, 2.0, width=32), min_size=n, max_size=n))
  w = np.asarray(w, np.float32)
  split = lambda v: [v[k::3].reshape(PACKED_SHAPE) for k in range(3)]
  return split(g), split(w)


def _unitwise_update(g, w):
  tx = optaxclip.clip_unitwise(0.01)
  return tx.update(g, tx.init(w), w)[0]


_UNITWISE_UPDATE = jax.jit(_unitwise_update)


def _bits(x):
  x = np.asarray(x, np.float32)
  return np.where(np.isnan(x), np.float32(np.nan), x).view(np.uint32)


def _packed_case(cells):
  """Three leaves of PACKED_SHAPE, zero but for ``cells``: (leaf, row,
  column, value); params zero.
  """
  g = [np.zeros(PACKED_SHAPE, np.float32) for _ in range(3)]
  for k, i, j, value in cells:
    g[k][i, j] = value
  return g, [np.zeros(PACKED_SHAPE, np.float32) for _ in range(3)]


@fz.examples(10, deadline=None)
@hypothesis.given(packed_trees())
# An explicit example (rarely drawn under the ci profile): a tiny norm in one
# leaf sent every unit of the tree to the exact recompute, whose norms may
# differ from the direct root in the last bit.
@hypothesis.example(
  _packed_case([(0, 1, 1, 2.220446e-16), (1, 0, 0, 193.0), (1, 2, 0, 196.5625)])
)
def test_packed_leaves_are_scaled_bit_for_bit_as_each_alone(case):
  g, w = case
  names = ["a", "b", "c"]
  together = _UNITWISE_UPDATE(dict(zip(names, g)), dict(zip(names, w)))
  for name, g_k, w_k in zip(names, g, w):
    alone = _UNITWISE_UPDATE({name: g_k}, {name: w_k})[name]
    # Zero signs included: a -0.0 element stays -0.0 in a packed part.
    np.testing.assert_array_equal(
      _bits(together[name]), _bits(alone), err_msg=name
    )


def test_materialized_values_are_not_a_library_call():
  # XLA:CPU hands float sums, max and min to YNNPACK, whose call costs
  # 0.4-4 ms on a few thousand elements; XLA's own loop microseconds.
  v = jnp.ones((3, 4096))
  hlo = jax.jit(lambda v: _norms.materialized(v * 2)).lower(v).compile()
  assert "ynn" not in hlo.as_text()


# Per-unit factors of at least 2**-251 and at most 1: where a static bound
# says so, scale_leaf applies them in two multipliers (clip_unitwise with a
# number for clipping and eps); three otherwise.
@st.composite
def units_and_bounded_factors(draw):
  x, factor = draw(units_and_factors())
  cols = x.shape[1]
  values = draw(
    st.lists(
      st.one_of(st.floats(0.5, 1.0, width=32), st.just(np.nan)),
      min_size=cols,
      max_size=cols,
    )
  )
  exponents = draw(st.lists(st.integers(-251, 0), min_size=cols, max_size=cols))
  # On the host (eager jnp operations compile a program per shape).
  factor = _norms.Scaled(
    fz.to_jax(np.minimum(np.asarray(values, np.float32), 1.0).reshape(1, cols)),
    fz.to_jax(np.asarray(exponents, np.int32).reshape(1, cols)),
  )
  return x, factor


BOUND = 2.0**-252


def _scaled_sum(x, value, exponent, smallest):
  out = _norms.scale_leaf(x, _norms.Scaled(value, exponent), smallest=smallest)
  return jnp.sum(out * jnp.arange(1.0, out.size + 1).reshape(out.shape))


_SCALE = {
  s: jax.jit(lambda x, f, s=s: _norms.scale_leaf(x, f, smallest=s))
  for s in (0.0, BOUND)
}
_GRAD = {
  s: jax.jit(jax.grad(functools.partial(_scaled_sum, smallest=s), (0, 1)))
  for s in (0.0, BOUND)
}


@fz.examples(10, deadline=None)
@hypothesis.given(units_and_bounded_factors())
def test_two_multipliers_per_unit_equal_three_bit_for_bit(case):
  x, factor = case
  np.testing.assert_array_equal(
    _bits(_SCALE[BOUND](x, factor)), _bits(_SCALE[0.0](x, factor))
  )


@fz.examples(3, deadline=None)
@hypothesis.given(units_and_bounded_factors())
# An explicit example (rarely drawn under the ci profile): with a factor of
# 2**-127 the three multipliers flush x * 2**-127 before the cotangent's weight
# 5 makes it normal (0), the two keep it (2.9e-38, the exact value).
@hypothesis.example(
  (
    np.array([[0, 0], [0, 0], [1, 0]], np.float32),
    _norms.Scaled(
      np.array([[np.nan, 1]], np.float32), np.array([[-127, 0]], np.int32)
    ),
  )
)
def test_two_multipliers_per_unit_have_the_derivatives_of_three(case):
  x, factor = case
  # Finite values of moderate size: derivatives, not the non-finite policy.
  x = np.asarray(x)
  x = fz.to_jax(np.where(np.isfinite(x) & (np.abs(x) < 1e4), x, 1))
  value = np.asarray(factor.value)
  value = fz.to_jax(np.where(np.isnan(value), np.float32(0.75), value))
  got = _GRAD[BOUND](x, value, factor.exponent)
  want = _GRAD[0.0](x, value, factor.exponent)
  np.testing.assert_array_equal(_bits(got[0]), _bits(want[0]))
  # The factor's cotangent sums a unit's elements: the order may differ,
  # and so may which products below the smallest normal are flushed (each
  # term ct * x * 2**E, with ct at most the element count).
  got_f, want_f = (
    np.asarray(got[1], np.float64),
    np.asarray(want[1], np.float64),
  )
  np.testing.assert_array_equal(np.isnan(got_f), np.isnan(want_f))
  size = np.asarray(x).size
  atol = size * (size + 1) / 2 * fz.flush_atol(np.float32)
  ok = ~np.isnan(want_f)
  np.testing.assert_allclose(
    got_f[ok], want_f[ok], rtol=1e-5, atol=atol, err_msg="d/dfactor"
  )


def test_clip_unitwise_applies_two_multipliers_where_bounded():
  # Kernels of the leaf's shape multiply the scaled gradient by two rows of
  # multipliers with numbers for clipping and eps, three with a schedule.
  shape = BIG

  def rows_in_kernels(clipping):
    params = {"k": jnp.ones(shape)}
    tx = optax.chain(optaxclip.clip_unitwise(clipping), optax.adam(1e-3))
    hlo = (
      jax.jit(lambda p, s, g: tx.update(g, s, p))
      .lower(params, tx.init(params), params)
      .compile()
      .as_text()
    )
    kernels = _fusions_of_shape(hlo, shape)
    # A row of multipliers reaches the kernel broadcast along its units
    # (kernels of the exact recompute's branch read none).
    return max(
      len(re.findall(r"broadcast\([^\n]*dimensions=\{1\}", b)) for b in kernels
    )

  assert rows_in_kernels(0.01) == 2
  assert rows_in_kernels(lambda count: 0.01) == 3


def test_clip_norm_applies_two_multipliers_where_bounded():
  # A number for max_norm bounds clip_norm's factors too: two multiplications
  # per element of the scaled leaf, three with a schedule.
  g = {"k": jnp.ones(BIG[0] * BIG[1])}

  def multiplications(max_norm):
    tx = optaxclip.clip_norm(max_norm)
    hlo = jax.jit(lambda s, g: tx.update(g, s)[0]).lower(tx.init(g), g)
    kernels = _fusions_of_shape(hlo.compile().as_text(), g["k"].shape)
    return max(
      len(re.findall(rf"= f32\[{g['k'].size}\][^\n]* multiply\(", b))
      for b in kernels
    )

  assert multiplications(1.0) == 2
  assert multiplications(lambda count: 1.0) == 3
