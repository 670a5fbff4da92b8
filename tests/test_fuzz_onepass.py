"""One-pass reductions kept whole by XLA:CPU (issue 15 item 4, compile time
on many leaves): ``_norms._row_extremes_and_count`` (clip_value's per-row
max, min and count of ``|x| > limit``), ``_norms.max_sum_all`` (clip_value's
statistics over the leaves of its stacked parts) and ``_norms._all_of`` (the
norms' overflow checks) are multi-output reductions that must equal the
single-output formulas they replace, bit for bit (NaN, inf, signed zeros
and subnormals included), with the plain formulas' derivatives.
``_norms.split_parts`` pieces concatenated again in order give back the
vector they were cut from (the same array), and anything else a plain
concatenation.
"""

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import fuzz_strategies
from optaxclip import _norms

VALUES = st.one_of(
  st.floats(-4, 4, width=32),
  st.sampled_from(
    (0.0, -0.0, 1e-45, -1e-40, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan)
  ),
)
# Under ci, a few shapes (each one a program to compile): rows shorter and
# longer than the 32 elements XLA:CPU's reduction rewriter splits.
ROWS = fuzz_strategies.ci_or(st.sampled_from((1, 3)), st.integers(1, 5))
WIDTHS = fuzz_strategies.ci_or(st.sampled_from((1, 63)), st.integers(1, 80))


def _bits(x):
  return np.atleast_1d(np.asarray(x)).view(np.uint8)


@st.composite
def matrices(draw):
  rows, width = draw(ROWS), draw(WIDTHS)
  values = draw(st.lists(VALUES, min_size=rows * width, max_size=rows * width))
  limit = draw(st.sampled_from((0.0, 0.5, 1.0, 1e30, np.inf)))
  return np.asarray(values, np.float32).reshape(rows, width), np.float32(limit)


@hypothesis.given(matrices())
def test_row_extremes_and_count_equal_the_plain_reductions(case):
  m, limit = case
  fast = jax.jit(_norms._row_extremes_and_count)(m, limit)
  plain = jax.jit(_norms._row_extremes_and_count_plain)(m, limit)
  for a, b in zip(fast, plain):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(_bits(a), _bits(b))


_MAX = jax.jit(jnp.max)


@hypothesis.example(
  case=(np.asarray([[0.0, 1e-45]], np.float32), np.float32(0.0))
)
# Found by the release profile: the merge met -1e-40 after 0 and kept it
# (equal as zeros); NumPy's max is 0. Either is the max under XLA:CPU's
# flush of subnormal operands.
@hypothesis.example(
  case=(np.asarray([[0.0, -1e-40]], np.float32), np.float32(0.0))
)
@hypothesis.given(matrices())
def test_max_sum_all_equals_the_plain_reductions(case):
  m, _ = case
  v = m.reshape(-1)
  # Counts (whole numbers, summed exactly in any order), as clip_value's.
  counts = (~(np.abs(v) <= 1)).astype(np.float32) * 3
  flags = np.isfinite(v)
  fast = jax.jit(_norms.max_sum_all)(v, counts, flags)
  plain = (np.max(v), np.sum(counts, dtype=np.float32), np.all(flags))
  assert bool(fast[2]) == bool(plain[2])
  np.testing.assert_array_equal(_bits(fast[1]), _bits(plain[1]))
  if np.isnan(plain[0]):
    assert np.isnan(fast[0])
    return
  # The max equals jnp.max compiled alike, and NumPy's max, but for
  # subnormals: XLA:CPU compares them as zeros, so the max of [0, 1e-45] or
  # of [0, -1e-40] is any of them, as the merge meets them (the merge keeps
  # NaN, jnp.max's reduction does not: see _norms.nan_max).
  tiny = np.finfo(np.float32).tiny
  for want in (float(_MAX(v)), float(plain[0])):
    assert float(fast[0]) == want or (
      abs(float(fast[0])) < tiny and abs(want) < tiny
    ), (float(fast[0]), want)


@hypothesis.given(matrices())
def test_all_of_equals_jnp_all(case):
  m, limit = case
  masks = [np.abs(m) <= limit, np.isfinite(m).reshape(-1)]
  fast = jax.jit(_norms._all_of)(masks)
  assert bool(fast) == all(bool(np.all(x)) for x in masks)


def test_derivatives_are_the_plain_formulas():
  m = jnp.asarray([[1.0, -3.0, 2.0], [0.5, 0.25, -0.125]], jnp.float32)
  limit = jnp.float32(1.0)

  def through(fn):
    def loss(x):
      top, bottom, n_over = fn(x, limit)
      return jnp.sum(top * 2 + bottom * 3 + n_over)

    return jax.grad(loss)(m)

  np.testing.assert_array_equal(
    through(_norms._row_extremes_and_count),
    through(_norms._row_extremes_and_count_plain),
  )
  v = m.reshape(-1)
  grad = jax.grad(lambda x: _norms.max_sum_all(x, x * x, x > 0)[0] * 2)(v)
  np.testing.assert_array_equal(grad, jax.grad(lambda x: jnp.max(x) * 2)(v))


def test_pieces_concatenated_in_order_are_the_vector_they_were_cut_from():
  def check(flat):
    like = [jnp.zeros((2, 1)), jnp.zeros((3,))]
    pieces = _norms.split_parts(flat, like)
    assert _norms.concat_parts(pieces) is flat
    # Out of order, or a part only: a plain concatenation.
    assert _norms.concat_parts(pieces[:1]) is not flat
    swapped = _norms.concat_parts(pieces[::-1])
    assert swapped is not flat
    return swapped

  flat = jnp.arange(5.0)
  np.testing.assert_array_equal(
    jax.jit(check)(flat), jnp.concatenate([flat[2:], flat[:2]])
  )
