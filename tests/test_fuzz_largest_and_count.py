"""One-pass reductions kept whole by XLA:CPU (the compile time on many
leaves, clip_value's statistics in one read):
``maxima._row_largest_and_count`` and ``maxima._largest_and_count``
(clip_value's largest magnitude and count of ``|x| > limit``, per row or
per leaf, compared as integers) must equal a NumPy oracle for every dtype
and every limit (NaN, inf, signed zeros and subnormals included), and
``_norms.limit_bits`` must turn every limit into the integer comparison
that says ``|x| > limit`` for every value of a dtype (all 65536 float16 and
bfloat16 values); ``_norms.max_sum_all`` (clip_value's statistics over the
leaves of its stacked parts) and ``_norms.all_true`` (the norms' overflow
checks) are multi-output reductions that must equal the single-output
formulas they replace, bit for bit; all with the plain formulas'
derivatives.
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
from optaxclip._numerics import maxima

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


# Limits as clip_value passes them (float32, any value a schedule may give).
LIMITS = st.one_of(
  st.sampled_from(
    (0.0, -0.0, 0.5, 1.0, 1e30, np.inf, -1.0, -np.inf, np.nan, 1e-45, 1e-40)
  ),
  st.floats(width=32, allow_nan=False),
)
# The dtypes of a row stack or a leaf of its own (float64 under x64).
ROW_DTYPES = st.sampled_from(("float32", "float16", "bfloat16", "float64"))
FLOAT32 = st.just("float32")


@st.composite
def matrices(draw, dtypes=FLOAT32):
  rows, width = draw(ROWS), draw(WIDTHS)
  values = draw(st.lists(VALUES, min_size=rows * width, max_size=rows * width))
  dtype = fuzz_strategies.DTYPES[draw(dtypes)]
  with np.errstate(over="ignore"):  # 3.4e38 is inf in float16
    m = np.asarray(values, np.float32).astype(dtype).reshape(rows, width)
  return m, np.float32(draw(LIMITS))


def _oracle(m, limit, axis):
  """Largest magnitude (NaN if any) and count of ``~(|x| <= limit)``, in
  float64 on the host (no flush of subnormals).
  """
  a = np.abs(m.astype(np.float64))
  over = ~(a <= np.float64(limit))
  return np.max(a, axis=axis), np.sum(over, axis=axis)


def _assert_largest_and_count(largest, n_over, m, limit, axis):
  want_largest, want_count = _oracle(m, limit, axis)
  got = np.asarray(largest).astype(np.float64).reshape(want_largest.shape)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want_largest))
  keep = ~np.isnan(want_largest)
  np.testing.assert_array_equal(got[keep], want_largest[keep])
  np.testing.assert_array_equal(
    np.asarray(n_over).reshape(want_count.shape), want_count
  )


@hypothesis.example(  # subnormals above a limit of 0 count, and are the max
  case=(np.asarray([[0.0, 1e-45, -1e-40]], np.float32), np.float32(0.0))
)
@hypothesis.example(  # a NaN limit: no element is within it
  case=(np.asarray([[0.0, 1.0]], np.float32), np.float32(np.nan))
)
@hypothesis.example(  # rounds up to float16's 0.0999755859375
  case=(np.asarray([[0.0999755859375]], np.float16), np.float32(0.09997))
)
@hypothesis.given(matrices(ROW_DTYPES))
def test_row_largest_and_count_equal_the_oracle(case):
  m, limit = case
  with fuzz_strategies.x64([m.dtype.name]):
    x = jnp.asarray(m)
    largest, n_over = jax.jit(maxima._row_largest_and_count)(x, limit)
    assert largest.shape == (m.shape[0], 1) and largest.dtype == x.dtype
    assert n_over.shape == (m.shape[0], 1) and n_over.dtype == jnp.float32
    _assert_largest_and_count(largest, n_over, m, limit, axis=1)
    # A leaf of its own: the same statistics over all of it.
    largest, n_over = jax.jit(maxima._largest_and_count)(x, limit)
    _assert_largest_and_count(largest, n_over, m, limit, axis=None)
    # The plain formulas (derivatives, leaves across devices) count alike.
    plain = jax.jit(maxima._row_largest_and_count_plain)(x, limit)[1]
    np.testing.assert_array_equal(
      np.asarray(plain).reshape(-1), _oracle(m, limit, axis=1)[1]
    )


# An explicit example (rarely drawn under the ci profile): a float32 subnormal
# limit whose bfloat16 rounding rounds up, and a negative subnormal limit (both
# compared as floats, XLA:CPU reads them as zeros).
@hypothesis.example(name="bfloat16", limit=3.4547163923955456e-39)
@hypothesis.example(name="float16", limit=-2.1019476964872256e-44)
@hypothesis.given(st.sampled_from(("float16", "bfloat16")), LIMITS)
def test_limit_bits_say_above_the_limit_for_every_16_bit_value(name, limit):
  dtype = fuzz_strategies.DTYPES[name]
  every = np.arange(2**16, dtype=np.uint16).view(dtype)
  above = jax.jit(
    lambda x, lim: _norms.magnitude_bits(x) > _norms.limit_bits(lim, x.dtype)
  )(jnp.asarray(every), np.float32(limit))
  with np.errstate(invalid="ignore"):  # the NaN patterns
    wide = np.abs(every.astype(np.float64))
  want = ~(wide <= np.float64(np.float32(limit)))
  np.testing.assert_array_equal(np.asarray(above), want)


@hypothesis.example(limit=1e-45)  # XLA:CPU flushes it to 0 when widened
@hypothesis.example(limit=-2e-44)  # ... and compares it as -0
@hypothesis.given(LIMITS)
def test_limit_bits_of_a_float32_limit_say_above_it_in_float64(limit):
  """A float32 limit (clip_value's schedule value) against float64 values
  around it and around float32's subnormals: exact, as in NumPy.
  """
  limit = np.float32(limit)
  tiny = np.float64(np.finfo(np.float32).smallest_subnormal)
  anchors = np.concatenate(
    [
      np.arange(-3, 8) * tiny,
      [np.float64(limit), 0.0, 1e-300, np.inf, np.nan, 3.4e38, 1e308],
    ]
  )
  with np.errstate(invalid="ignore"):
    x = np.concatenate(
      [anchors, np.nextafter(anchors, np.inf), np.nextafter(anchors, -np.inf)]
    )
  with fuzz_strategies.x64(["float64"]):
    above = jax.jit(
      lambda v, lim: _norms.magnitude_bits(v) > _norms.limit_bits(lim, v.dtype)
    )(jnp.asarray(x), limit)
  with np.errstate(invalid="ignore"):
    want = ~(np.abs(x) <= np.float64(limit))
  np.testing.assert_array_equal(np.asarray(above), want)


_MAX = jax.jit(jnp.max)


@hypothesis.example(
  case=(np.asarray([[0.0, 1e-45]], np.float32), np.float32(0.0))
)
# An explicit example (rarely drawn under the ci profile): the merge met -1e-40
# after 0 and kept it (equal as zeros); NumPy's max is 0. Either is the max
# under XLA:CPU's flush of subnormal operands.
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
  fast = jax.jit(_norms.all_true)(masks)
  assert bool(fast) == all(bool(np.all(x)) for x in masks)


def test_derivatives_are_the_plain_formulas():
  m = jnp.asarray([[1.0, -3.0, 2.0], [0.5, 0.25, -0.125]], jnp.float32)
  limit = jnp.float32(1.0)

  def through(fn):
    def loss(x):
      largest, n_over = fn(x, limit)
      return jnp.sum(largest * 2 + n_over)

    return jax.grad(loss)

  for fast, plain in (
    (maxima._row_largest_and_count, maxima._row_largest_and_count_plain),
    (maxima._largest_and_count, maxima._largest_and_count_plain),
  ):
    np.testing.assert_array_equal(through(fast)(m), through(plain)(m))
    # Second order (issue 10 item 2): the rule differentiates itself.
    np.testing.assert_array_equal(
      jax.hessian(lambda x, f=fast: jnp.sum(f(x, limit)[0] ** 2))(m),
      jax.hessian(lambda x, f=plain: jnp.sum(f(x, limit)[0] ** 2))(m),
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
