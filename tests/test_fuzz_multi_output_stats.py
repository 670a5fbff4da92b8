"""Statistics of many units in one pass (the compile time on many leaves):
``_norms.combine_norms_each`` reduces several vectors of unit
norms (and counts boolean vectors) in one multi-output reduction, each
partial result carrying its own largest exponent. It equals a float64
reference, with NaN and inf where the reference has them, for norms near
float32's largest value, subnormal ones, zeros and exponents beyond the
range; ``combine_norms`` of each vector alone is the same number, bit for
bit; counts are exact. ``_adaptive._first_and_count`` (clip_percentile's
sorted window) equals ``argmax`` and ``sum`` exactly.
"""

import math

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import fuzz_strategies
from optaxclip import _adaptive
from optaxclip import _norms

VALUES = st.one_of(
  st.floats(0, 4, width=32),
  st.sampled_from((0.0, 1e-45, 1e-40, 3e38, 3.4e38, np.inf, np.nan)),
)
# Under ci, a few lengths (each one a program to compile): one unit, a
# short vector, and vectors longer than the 32 elements XLA:CPU's
# reduction rewriter splits.
LENGTHS = fuzz_strategies.ci_or(
  st.sampled_from((1, 7, 300)), st.integers(1, 400)
)


@st.composite
def unit_norms(draw):
  n = draw(LENGTHS)
  k = draw(st.integers(1, 3))
  rows = []
  for _ in range(k):
    values = draw(st.lists(VALUES, min_size=n, max_size=n))
    exponents = draw(st.lists(st.integers(-60, 60), min_size=n, max_size=n))
    rows.append((np.asarray(values, np.float32), np.asarray(exponents)))
  flags = draw(st.lists(st.booleans(), min_size=n, max_size=n))
  return rows, np.asarray(flags)


def _reference(values, exponents) -> float:
  """The L2 norm of ``values * 2**exponents`` in float64, as float32."""
  x = values.astype(np.float64) * np.exp2(exponents.astype(np.float64))
  with np.errstate(over="ignore", invalid="ignore"):
    return float(np.float32(np.sqrt(np.sum(x * x))))


def _each(rows, flags):
  norms = [_norms.Scaled(v, e) for v, e in rows]
  return _norms.combine_norms_each(norms, counts=[flags, ~flags])


def _alone(rows):
  return [_norms.combine_norms([_norms.Scaled(v, e)]) for v, e in rows]


_RUN = {fn: fuzz_strategies.FastJit(fn) for fn in (_each, _alone)}


@fuzz_strategies.examples(8, deadline=None)
@hypothesis.given(unit_norms())
# A subnormal norm: XLA:CPU may flush it to 0 (as the other fuzz files allow).
@hypothesis.example(
  ([(np.asarray([1e-45], np.float32), np.asarray([0]))], np.asarray([True]))
)
# An explicit example (rarely drawn under the ci profile): a subnormal mantissa
# with a positive exponent, flushed to 0 by XLA:CPU, read as a normal 1.2e-35.
@hypothesis.example(
  (
    [(np.asarray([0, 1e-45, 0], np.float32), np.asarray([0, 33, 0]))],
    np.asarray([False, True, False]),
  )
)
def test_one_pass_equals_the_reference_and_each_vector_alone(case):
  rows, flags = case
  args = fuzz_strategies.to_jax([(v, e.astype(np.int32)) for v, e in rows])
  totals, (n_true, n_false) = _RUN[_each](args, jax.device_put(flags))
  alone = _RUN[_alone](args)
  for i, ((v, e), got, one) in enumerate(zip(rows, totals, alone)):
    want = _reference(v, e)
    err = f"vector {i}: {v[:4]} * 2**{e[:4]}"
    fuzz_strategies.assert_same(got, one, err)
    if math.isnan(want) or math.isinf(want):
      fuzz_strategies.assert_same(got, want, err)
    else:
      # A subnormal mantissa may be flushed to 0 before its exponent scales
      # it (1e-45 * 2**33 is a normal 1.2e-35): either reading is right.
      tiny = np.finfo(np.float32).tiny
      flushed = _reference(np.where(np.abs(v) < tiny, 0, v).astype(v.dtype), e)
      close = [
        math.isclose(float(got), w, rel_tol=1e-5, abs_tol=float(tiny))
        for w in (want, flushed)
      ]
      assert any(close), (err, float(got), want, flushed)
  assert float(n_true) == int(flags.sum())
  assert float(n_false) == int((~flags).sum())


def test_derivatives_are_those_of_the_plain_form():
  v = jax.device_put(np.asarray([3.0, 0.0, 4.0, 1e-3], np.float32))

  def one_pass(v):
    (a, b), _ = _norms.combine_norms_each([v, 2 * v])
    return a + 0.5 * b

  def plain(v):
    a = jnp.sqrt(jnp.sum(v * v))
    return a + 0.5 * jnp.sqrt(jnp.sum(4 * v * v))

  # Jitted: eagerly, each of the many small operations compiles a program.
  np.testing.assert_allclose(
    jax.jit(jax.grad(one_pass))(v), jax.jit(jax.grad(plain))(v), rtol=1e-6
  )


# Under ci, a few shapes (each one a program to compile): one row, a short
# window and one longer than the 32 rows XLA:CPU's reduction rewriter
# splits; one column and several.
ROWS = fuzz_strategies.ci_or(st.sampled_from((1, 7, 40)), st.integers(1, 40))
COLS = fuzz_strategies.ci_or(st.sampled_from((1, 3)), st.integers(1, 4))
_FIRST_AND_COUNT = fuzz_strategies.FastJit(_adaptive._first_and_count)


@st.composite
def sorted_columns(draw):
  rows = draw(ROWS)
  cols = draw(COLS)
  values = draw(
    st.lists(
      st.sampled_from((0.0, 1.0, 2.0, 3.0, np.inf)),
      min_size=rows * cols,
      max_size=rows * cols,
    )
  )
  ordered = np.sort(np.asarray(values, np.float32).reshape(rows, cols), 0)
  old = draw(
    st.lists(
      st.sampled_from((0.0, 1.0, 2.5, np.inf)), min_size=cols, max_size=cols
    )
  )
  new = draw(
    st.lists(st.sampled_from((0.5, 2.0, np.inf)), min_size=cols, max_size=cols)
  )
  return ordered, np.asarray(old, np.float32), np.asarray(new, np.float32)


@fuzz_strategies.examples(15, deadline=None)
@hypothesis.given(sorted_columns())
def test_first_and_count_is_argmax_and_sum(case):
  ordered, old, new = case
  hit, below, finite = ordered == old, ordered < new, ordered < np.inf
  first, (n_below, n_finite) = _FIRST_AND_COUNT(
    *fuzz_strategies.to_jax((hit, [below, finite]))
  )
  np.testing.assert_array_equal(first, np.argmax(hit, axis=0))
  np.testing.assert_array_equal(n_below, below.sum(0))
  np.testing.assert_array_equal(n_finite, finite.sum(0))


# Row parts (units x elements) of different widths, as the exact recompute
# of _part_norms merges them: under ci, two layouts (each a program).
ROW_LAYOUTS = (((3, 5), (2, 40), (4, 1)), ((1, 33), (2, 7)))
ELEMENTS = st.one_of(
  st.floats(-4, 4, width=32),
  st.sampled_from((0.0, 1e-45, 1e-40, 3e38, -3.3e38, np.inf, np.nan)),
)


@st.composite
def row_parts(draw):
  free = st.lists(
    st.tuples(st.integers(1, 4), st.integers(1, 50)), min_size=2, max_size=4
  )
  layout = draw(fuzz_strategies.ci_or(st.sampled_from(ROW_LAYOUTS), free))
  parts = []
  for units, width in layout:
    values = draw(
      st.lists(ELEMENTS, min_size=units * width, max_size=units * width)
    )
    parts.append(np.asarray(values, np.float32).reshape(units, width))
  return parts, draw(st.sampled_from((1.0, 2.0, 3.0)))


def _merged(parts, p):
  n = len(parts)
  out = _norms.exact_rows(parts, [(1,)] * n, [()] * n, list(range(n)), p)
  return [out[i] for i in range(n)]


def _one_by_one(parts, p):
  return [
    _norms.scaled_norm(*_norms.scaled_sum(x, p, (1,), jnp.float32), p)
    for x in parts
  ]


_ROW_OF_19 = np.zeros((1, 19), np.float32)
_ROW_OF_19[0, 16:] = (3e38, 3e38, -3.3e38)


@fuzz_strategies.examples(6, deadline=None)
@hypothesis.given(row_parts())
# An explicit example (an AVX-512 host's case): the row of
# 19 padded to 33 sums its last three squares in another order (XLA:CPU
# groups a row's elements by its vector width), one float32 unit apart.
@hypothesis.example(case=([np.zeros((1, 33), np.float32), _ROW_OF_19], 2.0))
def test_exact_rows_merged_equal_each_part_alone(case):
  parts, p = case
  units = sum(x.shape[0] for x in parts)
  width = max(x.shape[1] for x in parts)
  # Merged only where the padding at most quadruples the elements.
  hypothesis.assume(units * width <= 4 * sum(x.size for x in parts))
  args = fuzz_strategies.to_jax(parts)
  got = jax.jit(_merged, static_argnums=1)(args, p)
  want = jax.jit(_one_by_one, static_argnums=1)(args, p)
  for i, (g, w) in enumerate(zip(got, want)):
    err = f"part {i} of {[x.shape for x in parts]}, p={p}"
    # The same terms, summed in an order that depends on the row's padded
    # width: equal to float32's rounding of a sum of `width` terms, not bit
    # for bit (the value and its power of two taken together).
    g_, w_ = (
      np.asarray(v.value, np.float64) * 2.0 ** np.asarray(v.exponent, float)
      for v in (g, w)
    )
    np.testing.assert_array_equal(np.isnan(g_), np.isnan(w_), err_msg=err)
    ok = ~np.isnan(w_)
    np.testing.assert_allclose(
      g_[ok], w_[ok], rtol=width * 2.0**-23, err_msg=err
    )
