"""Scaling: clip factors applied to leaves by exact powers of two, in two
multipliers where a static bound allows, three otherwise, bit for bit alike.

* One factor for the whole tree (what keeps the compile of
  ``chain(clip_global, adam)`` on many leaves small): where a static bound
  keeps the factor at or above ``2**-252``, ``_norms.scale_all`` applies it
  in two steps and gives, bit for bit, what ``scale_leaf`` gives each leaf
  in three, on XLA:CPU, for leaves of mixed dtypes with magnitudes near
  float32's largest value and subnormal ones, with the same derivatives;
  ``clip_global`` with a fixed limit (two multipliers where the bound
  allows) equals the same limit passed as an array (three).
* Per-unit factors: a leaf scaled by a row of factors is each unit scaled
  by its scalar factor; two multipliers per unit equal three, with the same
  derivatives, and clip_unitwise and clip_norm use two where a number for
  the limit bounds the factors. clip_unitwise's factors reach a leaf's
  kernels as multipliers kept in memory: no kernel of the leaf's shape
  carries the factor arithmetic (exponent bits, clamps, powers of two),
  which would run once per element (3.6x adam's step for
  ``chain(clip_unitwise, adam)`` on a transformer), and the kernel that
  builds the multiplier rows reads the factor, not the norms and limits,
  and does not divide.
* Values kept in memory (``_norms.materialized``, ``materialized_scaled``),
  as a product with a row of ones: every number, -0.0 and NaN included, and
  every exponent comes back as it went in, with the identity's derivative,
  in XLA's own loop (a sum with zeros would turn -0.0 into +0.0, and
  XLA:CPU hands a float sum to YNNPACK, whose calls cost about 10 ms a step
  on a 12-block transformer); small leaves scaled in packed parts kept in
  memory are each, bit for bit, the leaf scaled alone.
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
from test_fuzz_packing import many_small_leaves

# --- one factor for the whole tree -------------------------------------------

# Exponents of the factor m * 2**e (at most 1, at least 2**-252): ordinary
# ones, and ones that need a power of two beyond float32's range (x near
# 3e38 times 2**-250 is about 2**-122, a normal result).
EXPONENTS = st.one_of(st.integers(-3, 0), st.integers(-251, -120))
MANTISSAS = st.one_of(
  st.floats(0.5, 1.0, exclude_max=True, width=32),
  st.sampled_from((0.5, np.nan)),
)
SMALLEST = math.ldexp(1.0, -252)


@st.composite
def leaves_and_factor(draw):
  leaves = draw(many_small_leaves())
  value = draw(MANTISSAS)
  exponent = draw(EXPONENTS)
  return leaves, jnp.float32(value), jnp.int32(exponent)


def _two(leaves, value, exponent):
  factor = _norms.Scaled(value, exponent)
  return _norms.scale_all(leaves, factor, smallest=SMALLEST)


def _three(leaves, value, exponent):
  factor = _norms.Scaled(value, exponent)
  return [_norms.scale_leaf(x, factor) for x in leaves]


_TREE_SCALED = {fn: fz.FastJit(fn) for fn in (_two, _three)}


_TREE_GRAD = {fn: fz.weighted_sum_grad(fn) for fn in (_two, _three)}
_assert_same = fz.assert_same


@fz.examples(6, deadline=None)
@hypothesis.given(leaves_and_factor())
def test_two_multipliers_equal_three_bit_for_bit(case):
  leaves, value, exponent = case
  want = _TREE_SCALED[_three](leaves, value, exponent)
  got = _TREE_SCALED[_two](leaves, value, exponent)
  for i, (g, w, x) in enumerate(zip(got, want, leaves)):
    assert g.dtype == x.dtype and g.shape == x.shape, i
    _assert_same(g, w, f"leaf {i}, factor {value} * 2**{exponent}")


def _factor_of_2_to_the_minus_127():
  """Small leaves, one nonzero value in three of them, and a factor of
  ``0.5 * 2**-126`` (the explicit example below).
  """
  leaves = [np.zeros(n, np.float32) for n in (6, 6, 6, 5, 5)]
  leaves += [np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32)]
  leaves[6][3, 1] = 1.0
  leaves += [np.array([0, 0, 0, 0, -1], np.float32)]
  leaves += [np.ones(1, jnp.bfloat16), np.zeros(6, np.float32)]
  return fz.to_jax(leaves), jnp.float32(0.5), jnp.int32(-126)


@fz.examples(2, deadline=None)
@hypothesis.given(leaves_and_factor())
# An explicit example (rarely drawn under the ci profile): the two multipliers
# and the three flush different products below the smallest normal in the
# factor's cotangent (2.6e-38 against 2.1e-38; the exact value is 2.4e-38).
@hypothesis.example(case=_factor_of_2_to_the_minus_127())
def test_two_multipliers_have_the_derivatives_of_three(case):
  leaves, value, exponent = case
  # Finite leaves of moderate size: derivatives, not the non-finite policy.
  leaves = [np.asarray(x) for x in leaves]
  leaves = [
    fz.to_jax(
      np.where(np.isfinite(x) & (np.abs(x) < 1e4), x, 1).astype(x.dtype)
    )
    for x in leaves
  ]
  value = jnp.float32(0.75) if np.isnan(value) else value
  want = _TREE_GRAD[_three](leaves, value, exponent)
  got = _TREE_GRAD[_two](leaves, value, exponent)
  for i, (g, w) in enumerate(zip(got[0], want[0])):
    _assert_same(g, w, f"d/dleaf {i}")
  # The factor's cotangent sums the leaves' elements: the order may differ,
  # and so may which products below the smallest normal are flushed: each
  # term w * x * 2**e (w the loss's weight of the leaf, 0.25 (k + 1)) is a
  # product of x, w and the factor's powers of two (each at most 1: the
  # factor is), and a partial product flushed loses at most the smallest
  # normal times what multiplies it later (w, or powers of two).
  got_f, want_f = float(got[1]), float(want[1])
  assert np.isnan(got_f) == np.isnan(want_f), (got_f, want_f)
  weights = sum(max(0.25 * (k + 1), 1) * x.size for k, x in enumerate(leaves))
  atol = weights * fz.flush_atol(np.float32)
  if not np.isnan(want_f):
    np.testing.assert_allclose(
      got_f, want_f, rtol=1e-5, atol=atol, err_msg="d/dfactor"
    )


def test_the_bound_is_below_every_factor_and_zero_when_unknown():
  leaves = [jnp.zeros((3, 4)), jnp.zeros(5, jnp.bfloat16)]
  bound = _norms.smallest_clip_factor(leaves, 1.0)
  # 17 elements below 2**128 each: any p-norm below 17 * 2**128.
  assert 0 < bound <= 1.0 / (17 * 2.0**128)
  assert _norms.smallest_clip_factor(leaves, jnp.float32(1.0)) == 0.0
  assert _norms.smallest_clip_factor(leaves, 0.0) == 0.0
  assert _norms.smallest_clip_factor(leaves, math.inf) == 0.0
  assert _norms.smallest_clip_factor([], 1.0) == 0.0


@functools.cache
def _traced_limit(p):
  """clip_global's update with the limit traced, one ``jax.jit`` per
  ``ord`` (examples of the same layout share its program).
  """
  return jax.jit(lambda g, c: optaxclip.clip_global(c, ord=p).update(g, None))


@fz.examples(5, deadline=None)
@hypothesis.given(
  many_small_leaves(),
  fz.limits(zero=False, inf=False),
  st.sampled_from((1.0, 2.0, math.inf)),
)
def test_clip_global_with_a_fixed_limit_equals_a_traced_one(leaves, limit, p):
  got, got_state = optaxclip.clip_global(limit, ord=p).update(
    leaves, None
  )  # eagerly: clip_global's own jitted update, limit static
  want, want_state = _traced_limit(p)(leaves, np.float32(limit))
  for i, (g, w) in enumerate(zip(got, want)):
    _assert_same(g, w, f"leaf {i}, limit {limit}, ord {p}")
  for field in ("norm", "clipped_norm", "clip_fraction"):
    _assert_same(
      getattr(got_state, field), getattr(want_state, field), field, exact=True
    )


# --- per-unit factors --------------------------------------------------------

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


def _fused_bodies(hlo: str) -> list[str]:
  """The bodies of the fused computations of compiled HLO text."""
  return re.findall(r"\n(%fused_computation[^\n]*\{\n.*?\n\})", hlo, re.S)


def _fusions_of_shape(hlo: str, shape: tuple[int, ...]) -> list[str]:
  """The bodies of the fused computations whose root has ``shape``."""
  dims = ",".join(str(d) for d in shape)
  return [
    b
    for b in _fused_bodies(hlo)
    if re.search(rf"ROOT [^\n]*= f32\[{dims}\]", b)
  ]


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


def _scaled_sum(x, value, exponent, smallest):
  out = _norms.scale_leaf(x, _norms.Scaled(value, exponent), smallest=smallest)
  return jnp.sum(out * jnp.arange(1.0, out.size + 1).reshape(out.shape))


_UNIT_SCALE = {
  s: jax.jit(lambda x, f, s=s: _norms.scale_leaf(x, f, smallest=s))
  for s in (0.0, SMALLEST)
}
_UNIT_GRAD = {
  s: jax.jit(jax.grad(functools.partial(_scaled_sum, smallest=s), (0, 1)))
  for s in (0.0, SMALLEST)
}


@fz.examples(10, deadline=None)
@hypothesis.given(units_and_bounded_factors())
def test_two_multipliers_per_unit_equal_three_bit_for_bit(case):
  x, factor = case
  np.testing.assert_array_equal(
    _bits(_UNIT_SCALE[SMALLEST](x, factor)), _bits(_UNIT_SCALE[0.0](x, factor))
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
  got = _UNIT_GRAD[SMALLEST](x, value, factor.exponent)
  want = _UNIT_GRAD[0.0](x, value, factor.exponent)
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


# --- per-unit factors kept in memory -----------------------------------------


# The ci profile draws the values into these lengths only (each new length
# compiles new programs); other profiles (release) draw it freely too.
@st.composite
def scaled_factors(draw):
  n = draw(fz.ci_or(st.sampled_from((2, 5, 8)), st.integers(2, 8)))
  dtype = draw(st.sampled_from([np.float32, np.float64]))
  values = draw(
    st.lists(
      st.one_of(
        st.floats(0.5, 2.0, width=32),
        st.sampled_from([0.0, 1.0, np.inf, np.nan]),
      ),
      min_size=n,
      max_size=n,
    )
  )
  exponents = draw(st.lists(st.integers(-2200, 2200), min_size=n, max_size=n))
  return np.asarray(values, dtype), np.asarray(exponents, np.int32)


def _total(v, exponents):
  scaled = _norms.materialized_scaled(_norms.Scaled(v, exponents))
  return jnp.sum(scaled.value * jnp.arange(1.0, len(v) + 1, dtype=v.dtype))


# Jitted once (the exponents an argument): one program a length and dtype.
_MATERIALIZED_SCALED = jax.jit(_norms.materialized_scaled)
_grad_total = jax.jit(jax.grad(_total))


@fz.examples(20, deadline=None)
@hypothesis.given(scaled_factors())
def test_a_materialized_factor_is_the_factor(case):
  values, exponents = case
  with jax.enable_x64(values.dtype == np.float64):
    got = _MATERIALIZED_SCALED(_norms.Scaled(*fz.to_jax((values, exponents))))
    assert got.value.dtype == values.dtype
    assert got.exponent.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(got.value), values)
    np.testing.assert_array_equal(np.asarray(got.exponent), exponents)

    finite = np.where(np.isfinite(values), values, 1).astype(values.dtype)
    np.testing.assert_array_equal(
      np.asarray(_grad_total(*fz.to_jax((finite, exponents)))),
      np.arange(1.0, len(values) + 1, dtype=values.dtype),
    )


_MATERIALIZED = jax.jit(_norms.materialized)


_NUMBERS = st.one_of(
  st.floats(width=32, allow_subnormal=False),
  st.sampled_from([0.0, -0.0, np.inf, -np.inf, np.nan]),
)


# The ci profile draws the values into lengths 1 and 6 only (each new length
# compiles a new program); other profiles (release) draw 1 to 6.
@fz.examples(20, deadline=None)
@hypothesis.given(
  fz.ci_or(st.sampled_from((1, 6)), st.integers(1, 6)).flatmap(
    lambda n: st.lists(_NUMBERS, min_size=n, max_size=n)
  )
)
def test_materialized_keeps_every_number(values):
  v = np.asarray(values, np.float32)
  got = np.asarray(_MATERIALIZED(jax.device_put(v)))
  np.testing.assert_array_equal(got, v)
  # -0.0 too (a product with 1 keeps it; a sum with 0 would make it 0.0).
  np.testing.assert_array_equal(np.signbit(got), np.signbit(v))


@fz.examples(2, deadline=None)
@hypothesis.given(st.sampled_from([(260, 256), (256, 260)]))
def test_the_multiplier_rows_do_not_recompute_the_factor(shape):
  params = {"k": jnp.ones(shape)}
  tx = optax.chain(optaxclip.clip_unitwise(0.01), optax.adam(1e-3))

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  hlo = jax.jit(step).lower(params, tx.init(params), params).compile()
  units = shape[1]
  bodies = _fused_bodies(hlo.as_text())
  # The kernel that builds the multiplier rows (a stack padded with a row
  # of ones, reduced into memory: f32[rows,1,units], or f32[2,rows,1,units]
  # when XLA writes the padded stack out for a separate reduction; two rows
  # here, three where no bound on the factors is known) reads one operand,
  # the factor in memory (value and exponent: f32[2,1,units]), not the norms
  # and limits (from which each row would compute the factor again: five
  # operands and about 180 instructions with the factor's tests). The
  # factor's own kernel has that shape too.
  factor = rf"f32\[2,1,{units}\]"
  rows = [
    b
    for b in bodies
    if re.search(rf"ROOT [^\n]*= f32\[(2,)?[23],1,{units}\]", b)
    and " pad(" in b
    and re.search(rf"\(param_[0-9.]+: {factor}\)", b.split("\n")[0])
  ]
  assert rows, "no kernel of the multiplier rows found"
  for body in rows:
    assert body.count(" parameter(") == 1, body
    assert " divide(" not in body and " is-finite(" not in body, body
