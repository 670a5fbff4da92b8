"""Reductions: maxima, extremes, counts and the multi-output reductions of
``_numerics.reductions`` and ``_numerics.maxima``, and the statistics of many
units computed in one pass, against NumPy.

* Maxima keep NaN. XLA:CPU (jaxlib 0.10, its YNNPACK reduction fusion) drops
  a NaN from a max or min reduction of 4096 elements or more, so that a
  plain max reads a NaN leaf as finite (``clip_value``'s ``max |g|``,
  ``ord=inf`` norms). ``_norms.nan_max``, ``_norms.nan_extremes`` and
  ``_norms.largest_magnitude``, which every max-based statistic goes
  through, equal NumPy's ``max`` and ``min`` (which keep NaN) on arrays on
  both sides of that size, in every float dtype; the clippers built on them
  make a non-finite unit all NaN and reduce no plain maximum.
* Counts (``_norms.count``) are exact for masks of any size and write no
  leaf-sized mask.
* ``maxima._row_largest_and_count`` and ``maxima._largest_and_count``
  (``clip_value``'s largest magnitude and count of ``|x| > limit``, per row
  or per leaf, compared as integers) equal a NumPy oracle for every dtype
  and every limit (NaN, inf, signed zeros and subnormals included), and
  ``_norms.limit_bits`` turns every limit into the integer comparison that
  says ``|x| > limit`` for every value of a dtype (all 65536 float16 and
  bfloat16 values). ``_norms.max_sum_all`` (``clip_value``'s statistics over
  the leaves of its stacked parts) and ``_norms.all_true`` (the norms'
  overflow checks) are multi-output reductions that equal the
  single-output formulas, bit for bit; all with the plain formulas'
  derivatives.
* Statistics of many units in one pass (the compile time on many leaves):
  ``_norms.combine_norms_each`` reduces several vectors of unit norms (and
  counts boolean vectors) in one multi-output reduction, each partial
  result carrying its own largest exponent; it equals a float64 reference,
  with NaN and inf where the reference has them, for norms near float32's
  largest value, subnormal ones, zeros and exponents beyond the range, and
  ``combine_norms`` of each vector alone, bit for bit; counts are exact.
  ``_adaptive._first_and_count`` (clip_percentile's sorted window) equals
  ``argmax`` and ``sum`` exactly, and ``_norms.exact_rows`` (the exact
  recompute of row parts of different widths, merged) equals each part's
  exact norm alone, to float32's rounding of a row's sum.
"""

import functools
import math

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import fuzz_strategies as fz
import optaxclip
from optaxclip import _adaptive
from optaxclip import _norms
from optaxclip._numerics import maxima

# --- maxima and extremes that keep NaN ---------------------------------------

# Under ci: a few shapes on both sides of 4096 elements, and of 8192 (a
# float32 leaf reduced whole, max and min one at a time over a flat view),
# each compiles once per axis choice; release draws them freely.
CI_SHAPES = ((4095,), (4096,), (5000,), (3, 2048), (70, 80), (8192,), (2, 9000))
DTYPES = ("float32", "float64", "float16", "bfloat16")


def _dtype(name):
  return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


@st.composite
def _arrays(draw):
  shape = draw(
    fz.ci_or(
      st.sampled_from(CI_SHAPES),
      st.lists(st.integers(1, 9000), min_size=1, max_size=2).filter(
        lambda s: np.prod(s) <= 40000
      ),
    )
  )
  shape = tuple(shape)
  dtype = _dtype(draw(st.sampled_from(DTYPES)))
  seed = draw(st.integers(0, 2**32 - 1))
  rng = np.random.default_rng(seed)
  x = rng.uniform(-1, 1, shape) * 10.0 ** draw(st.integers(-30, 30))
  x = x.astype(np.float64)
  flat = x.reshape(-1)
  # A few NaN and inf at drawn places: first, last, anywhere.
  for special in draw(
    st.lists(st.sampled_from([np.nan, np.inf, -np.inf]), max_size=3)
  ):
    where = draw(
      st.sampled_from(["first", "last", "any"]),
    )
    i = {"first": 0, "last": flat.size - 1}.get(where)
    flat[rng.integers(0, flat.size) if i is None else i] = special
  axis = draw(st.sampled_from([None] + list(range(len(shape)))))
  keepdims = draw(st.booleans())
  with np.errstate(over="ignore"):  # beyond float16's range: inf, kept
    return x.astype(dtype), axis, keepdims


@functools.cache
def _reducers(axis, keepdims):
  return (
    fz.FastJit(lambda v: _norms.nan_max(v, axis, keepdims=keepdims)),
    fz.FastJit(lambda v: _norms.nan_extremes(v, axis, keepdims=keepdims)),
    fz.FastJit(lambda v: _norms.largest_magnitude(v, axis, keepdims=keepdims)),
  )


@fz.examples(12)
@hypothesis.given(case=_arrays())
# One NaN first in 70000 float32 values.
@hypothesis.example(
  case=(
    np.concatenate(
      [[np.nan], np.random.default_rng(0).uniform(-1, 1, 69999)]
    ).astype(np.float32),
    None,
    False,
  )
)
# float16 too: a plain min drops a NaN first of 4096 values.
@hypothesis.example(
  case=(
    np.concatenate(
      [[np.nan], np.random.default_rng(0).uniform(-1, 1, 4096)[1:]]
    ).astype(np.float16),
    None,
    False,
  )
)
# A float32 leaf reduced whole, max and min one at a time over a flat view:
# a NaN last in a (2, 9000) array, keepdims.
@hypothesis.example(
  case=(
    np.concatenate([np.random.default_rng(1).uniform(-1, 1, 17999), [np.nan]])
    .reshape(2, 9000)
    .astype(np.float32),
    None,
    True,
  )
)
def test_nan_max_and_extremes_keep_nan(case):
  """nan_max and nan_extremes equal NumPy's max and min, and
  largest_magnitude NumPy's max of |x|, NaN included.
  """
  x, axis, keepdims = case
  axes = None if axis is None else (axis,)
  with fz.x64(x):
    top_fn, both_fn, magnitude_fn = _reducers(axes, keepdims)
    wide = x.astype(np.float64)
    want_top = np.max(wide, axis=axis, keepdims=keepdims)
    want_bottom = np.min(wide, axis=axis, keepdims=keepdims)
    want_magnitude = np.max(np.abs(wide), axis=axis, keepdims=keepdims)
    got_top = np.asarray(top_fn(fz.to_jax(x)), np.float64)
    got_both = [np.asarray(v, np.float64) for v in both_fn(fz.to_jax(x))]
    got_magnitude = np.asarray(magnitude_fn(fz.to_jax(x)), np.float64)
  for got, want in (
    (got_top, want_top),
    *zip(got_both, (want_top, want_bottom)),
    (got_magnitude, want_magnitude),
  ):
    np.testing.assert_array_equal(got, want)


def test_nan_max_derivative_is_jnp_max_s():
  """The gradient flows to the largest element, as jnp.max's does."""
  x = jnp.asarray(np.random.default_rng(1).uniform(-1, 1, 5000), jnp.float32)
  got = jax.grad(lambda v: _norms.nan_max(v, initial=0))(x)
  want = jax.grad(lambda v: jnp.max(v, initial=0))(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  got = jax.grad(lambda v: -_norms.nan_extremes(v)[1])(x)
  want = jax.grad(lambda v: -jnp.min(v))(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


CLIPPERS = {
  "clip_value": lambda: optaxclip.clip_value(0.5),
  "clip_norm(ord=inf)": lambda: optaxclip.clip_norm(0.5, ord=np.inf),
  "clip_global(ord=inf)": lambda: optaxclip.clip_global(0.5, ord=np.inf),
}


@functools.cache
def _runner(name):
  tx = CLIPPERS[name]()
  return fz.FastJit(lambda g: tx.update(g, tx.init(g)))


@fz.examples(6)
@hypothesis.given(
  name=st.sampled_from(sorted(CLIPPERS)),
  size=fz.ci_or(st.sampled_from([4096, 5000]), st.integers(4096, 70000)),
  where=st.floats(0, 1),
  special=st.sampled_from([np.nan, np.inf]),
)
def test_max_based_clippers_poison_a_big_nonfinite_leaf(
  name, size, where, special
):
  """A NaN or inf in a leaf of 4096 elements or more: the leaf comes out
  all NaN (the whole tree under clip_global), and norm and clipped_norm
  are non-finite; a finite small leaf beside it is clipped as usual.
  """
  rng = np.random.default_rng(size)
  big = rng.uniform(-1, 1, size).astype(np.float32)
  big[min(int(where * size), size - 1)] = special
  small = np.array([0.25, -2.0], np.float32)
  out, state = _runner(name)(fz.to_jax({"big": big, "small": small}))
  stats = optaxclip.stats(state)
  assert np.all(np.isnan(np.asarray(out["big"]))), name
  norm = float(next(v for k, v in stats.items() if k.endswith("/norm")))
  clipped = float(
    next(v for k, v in stats.items() if k.endswith("/clipped_norm"))
  )
  assert not np.isfinite(norm) and not np.isfinite(clipped), (name, stats)
  if np.isnan(special):
    assert np.isnan(norm), (name, norm)
  if name == "clip_global(ord=inf)":
    assert np.all(np.isnan(np.asarray(out["small"])))
  else:
    want = [0.25, -0.5] if name == "clip_value" else [0.0625, -0.5]
    np.testing.assert_array_equal(np.asarray(out["small"]), want)


# The clippers whose statistics or decisions rest on maxima. A plain float
# max or min anywhere in their update (outside the derivative rules) is one
# XLA:CPU may let drop a NaN once it reduces 4096 elements or more.
_MAX_BASED = {
  "clip_value": lambda: optaxclip.clip_value(0.5),
  "clip_value(sampled)": lambda: optaxclip.clip_value(0.5, stats="sampled"),
  "clip_norm(ord=inf)": lambda: optaxclip.clip_norm(1.0, ord=np.inf),
  "clip_global(ord=inf)": lambda: optaxclip.clip_global(1.0, ord=np.inf),
  "clip_spikes_adaptive": optaxclip.clip_spikes_adaptive,
}


def _plain_extrema(jaxpr, found):
  """The float ``reduce_max`` / ``reduce_min`` equations of ``jaxpr`` and
  of the jaxprs inside it (conds, nested jits, the primal of custom
  derivative rules; the rules themselves are not traced here).
  """
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("reduce_max", "reduce_min") and jnp.issubdtype(
      eqn.invars[0].aval.dtype, jnp.floating
    ):
      found.append((eqn.primitive.name, eqn.invars[0].aval.shape))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          _plain_extrema(sub.jaxpr, found)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          _plain_extrema(sub, found)
  return found


# Leaves of few shapes, so that several share a stacked part; only traced.
_SPEC_SHAPES = ((), (2,), (2,), (3, 2), (0,), (5000,), (70_000,))


@fz.examples(15)
@hypothesis.given(
  specs=st.lists(
    st.tuples(st.sampled_from(_SPEC_SHAPES), st.sampled_from(fz.ALL)),
    min_size=1,
    max_size=12,
  ),
  name=st.sampled_from(sorted(_MAX_BASED)),
)
# Leaves stacked together: the column of their largest magnitudes is
# reduced too, and a plain jnp.max of it drops a NaN once it has 4096
# entries (with 4100 leaves of 2 elements, one NaN, clip_value's norm would
# read 0.1); five leaves of one shape give that column.
@hypothesis.example(specs=[((2,), "float32")] * 5, name="clip_value")
def test_max_based_clippers_reduce_no_plain_maximum(specs, name):
  if name == "clip_spikes_adaptive":  # real leaves only
    specs = [(s, d) for s, d in specs if not d.startswith("complex")]
    hypothesis.assume(specs)
  with fz.x64([d for _, d in specs]):
    tree = [jax.ShapeDtypeStruct(s, jnp.dtype(fz.DTYPES[d])) for s, d in specs]
    tx = _MAX_BASED[name]()
    jaxpr = jax.make_jaxpr(tx.update)(tree, jax.eval_shape(tx.init, tree))
    assert _plain_extrema(jaxpr.jaxpr, []) == []


# --- counts: exact, whatever the size, and the mask fused ------------------

_COUNT = jax.jit(_norms.count)
_COUNT_ROWS = jax.jit(jax.vmap(_norms.count))


@fz.examples(12)
@hypothesis.given(
  shape=fz.ci_or(
    st.sampled_from([(0,), (1,), (4096,), (70_000,), (3, 40_000)]),
    st.lists(st.integers(0, 300), min_size=1, max_size=3),
  ),
  density=st.sampled_from([0.0, 1e-4, 0.3, 1.0]),
  seed=st.integers(0, 2**32 - 1),
)
@hypothesis.example(shape=[255, 257, 257], density=1.0, seed=0)
def test_count_is_exact_for_any_mask(shape, density, seed):
  """``_norms.count`` (a two-output reduction, so that XLA:CPU fuses the
  mask into it) equals NumPy's count for masks of any size and density,
  all false and all true included, and row by row under vmap: exactly, as
  a float32 holds it (counted in int32, rounded once: exact up to 2**24;
  255 x 257 x 257 all true, 16842495, is 16842496 as a float32).
  """
  mask = np.random.default_rng(seed).random(shape) < density
  assert float(_COUNT(mask)) == float(np.float32(np.count_nonzero(mask)))
  if mask.ndim == 2:
    rows = np.asarray(_COUNT_ROWS(mask))
    np.testing.assert_array_equal(rows, mask.sum(axis=1).astype(np.float32))


def test_count_writes_no_leaf_sized_mask():
  """The compiled count of a comparison over a large leaf has no temporary
  of the leaf's size (a plain sum writes the mask out in full).
  """
  x = jnp.zeros((1 << 20,), jnp.float32)
  compiled = (
    jax.jit(lambda x: _norms.count(jnp.abs(x) > 0.5)).lower(x).compile()
  )
  assert compiled.memory_analysis().temp_size_in_bytes < 1 << 16


# --- largest magnitude and count above a limit; multi-output -----------------

MATRIX_VALUES = st.one_of(
  st.floats(-4, 4, width=32),
  st.sampled_from(
    (0.0, -0.0, 1e-45, -1e-40, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan)
  ),
)
# Under ci, a few shapes (each one a program to compile): rows shorter and
# longer than the 32 elements XLA:CPU's reduction rewriter splits.
MATRIX_ROWS = fz.ci_or(st.sampled_from((1, 3)), st.integers(1, 5))
MATRIX_WIDTHS = fz.ci_or(st.sampled_from((1, 63)), st.integers(1, 80))


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
  rows, width = draw(MATRIX_ROWS), draw(MATRIX_WIDTHS)
  values = draw(
    st.lists(MATRIX_VALUES, min_size=rows * width, max_size=rows * width)
  )
  dtype = fz.DTYPES[draw(dtypes)]
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
  with fz.x64([m.dtype.name]):
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
  dtype = fz.DTYPES[name]
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
  with fz.x64(["float64"]):
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
    # Second order: the rule differentiates itself.
    np.testing.assert_array_equal(
      jax.hessian(lambda x, f=fast: jnp.sum(f(x, limit)[0] ** 2))(m),
      jax.hessian(lambda x, f=plain: jnp.sum(f(x, limit)[0] ** 2))(m),
    )
  v = m.reshape(-1)
  grad = jax.grad(lambda x: _norms.max_sum_all(x, x * x, x > 0)[0] * 2)(v)
  np.testing.assert_array_equal(grad, jax.grad(lambda x: jnp.max(x) * 2)(v))


# --- statistics of many units in one pass ------------------------------------

NORM_VALUES = st.one_of(
  st.floats(0, 4, width=32),
  st.sampled_from((0.0, 1e-45, 1e-40, 3e38, 3.4e38, np.inf, np.nan)),
)
# Under ci, a few lengths (each one a program to compile): one unit, a
# short vector, and vectors longer than the 32 elements XLA:CPU's
# reduction rewriter splits.
LENGTHS = fz.ci_or(st.sampled_from((1, 7, 300)), st.integers(1, 400))


@st.composite
def scaled_unit_norms(draw):
  n = draw(LENGTHS)
  k = draw(st.integers(1, 3))
  rows = []
  for _ in range(k):
    values = draw(st.lists(NORM_VALUES, min_size=n, max_size=n))
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


_RUN = {fn: fz.FastJit(fn) for fn in (_each, _alone)}


@fz.examples(8, deadline=None)
@hypothesis.given(scaled_unit_norms())
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
  args = fz.to_jax([(v, e.astype(np.int32)) for v, e in rows])
  totals, (n_true, n_false) = _RUN[_each](args, jax.device_put(flags))
  alone = _RUN[_alone](args)
  for i, ((v, e), got, one) in enumerate(zip(rows, totals, alone)):
    want = _reference(v, e)
    err = f"vector {i}: {v[:4]} * 2**{e[:4]}"
    fz.assert_same(got, one, err)
    if math.isnan(want) or math.isinf(want):
      fz.assert_same(got, want, err)
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
WINDOW_ROWS = fz.ci_or(st.sampled_from((1, 7, 40)), st.integers(1, 40))
WINDOW_COLS = fz.ci_or(st.sampled_from((1, 3)), st.integers(1, 4))
_FIRST_AND_COUNT = fz.FastJit(_adaptive._first_and_count)


@st.composite
def sorted_columns(draw):
  rows = draw(WINDOW_ROWS)
  cols = draw(WINDOW_COLS)
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


@fz.examples(15, deadline=None)
@hypothesis.given(sorted_columns())
def test_first_and_count_is_argmax_and_sum(case):
  ordered, old, new = case
  hit, below, finite = ordered == old, ordered < new, ordered < np.inf
  first, (n_below, n_finite) = _FIRST_AND_COUNT(
    *fz.to_jax((hit, [below, finite]))
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
  layout = draw(fz.ci_or(st.sampled_from(ROW_LAYOUTS), free))
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


@fz.examples(6, deadline=None)
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
  args = fz.to_jax(parts)
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
