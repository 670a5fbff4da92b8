"""clip_unitwise's per-unit factors computed once.

``scale_leaf`` keeps a per-unit factor's multiplier rows in memory, so that
no row computes the factor again from the norms and limits (a division and
about a hundred instructions a unit and row). These properties check that
the factor's trip through memory is exact (values, exponents, NaN and inf,
derivatives) and that the rows' kernel does not divide.
"""

import re

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fuzz_strategies as fz
import optaxclip
from optaxclip import _norms


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
  # -0.0 too (a product with 1; the former sum with 0 made it 0.0).
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
  bodies = re.findall(
    r"\n(%fused_computation[^\n]*\{\n.*?\n\})", hlo.as_text(), re.S
  )
  # The kernel that builds the multiplier rows (a stack padded with a row
  # of ones, reduced into memory: f32[rows,1,units], or f32[2,rows,1,units]
  # when XLA writes the padded stack out for a separate reduction; two rows
  # here, three where no bound on the factors is known) reads one operand,
  # the factor in memory (value and exponent: f32[2,1,units]), not the norms
  # and limits (which it read before, five operands and 178 instructions
  # with the factor's tests). The factor's own kernel has that shape too.
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
