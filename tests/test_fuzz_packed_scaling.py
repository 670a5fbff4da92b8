"""Small leaves scaled in their packed parts (the compile time on many
leaves):
``UnitLayout.scale`` and ``UnitLayout.scale_leafwise`` give, bit for bit,
what each leaf scaled on its own by ``scale_leaf`` gives, for factors far
below the smallest normal number (three exact multipliers), NaN and zero
factors, leaves of mixed dtypes with magnitudes near float32's largest value
and subnormal ones; and the same derivatives.
"""

import hypothesis
from hypothesis import strategies as st
import jax
import numpy as np

import fuzz_strategies
from optaxclip import _norms
from test_fuzz_packed_norms import many_small_leaves

# Exponents of the factor m * 2**e: ordinary ones, and ones for which only
# the three exact multipliers keep a normal result (x near 3e38 times
# 2**-250 is about 2**-122).
EXPONENTS = st.one_of(st.integers(-3, 3), st.integers(-260, -120))
MANTISSAS = st.one_of(
  st.floats(0.5, 1.0, exclude_max=True, width=32),
  st.sampled_from((0.0, 1.0, np.nan)),
)


@st.composite
def leaves_and_factors(draw):
  leaves = draw(many_small_leaves())
  n = len(leaves)
  values = draw(st.lists(MANTISSAS, min_size=n, max_size=n))
  exponents = draw(st.lists(EXPONENTS, min_size=n, max_size=n))
  factor = _norms.Scaled(
    *fuzz_strategies.to_jax(
      (np.asarray(values, np.float32), np.asarray(exponents, np.int32))
    )
  )
  return leaves, factor


def _layout(leaves):
  n = len(leaves)
  return _norms.UnitLayout(leaves, [None] * n, [None] * n)


def _per_part(layout, factor):
  """The per-leaf factors as per-part ones (the layout's unit values)."""
  n = len(layout.shapes)
  shapes = [layout.unit_shape(i) for i in range(n)]
  return [
    _norms.Scaled(v, e)
    for v, e in zip(
      layout.pack_units(
        [factor.value[i].reshape(s) for i, s in enumerate(shapes)]
      ),
      layout.pack_units(
        [factor.exponent[i].reshape(s) for i, s in enumerate(shapes)]
      ),
    )
  ]


def _packed(leaves, factor):
  layout = _layout(leaves)
  return layout.scale(leaves, _per_part(layout, factor))


def _leafwise(leaves, factor):
  return _layout(leaves).scale_leafwise(leaves, factor)


def _alone(leaves, factor):
  return [
    _norms.scale_leaf(x, _norms.Scaled(factor.value[i], factor.exponent[i]))
    for i, x in enumerate(leaves)
  ]


_RUN = {fn: fuzz_strategies.FastJit(fn) for fn in (_packed, _leafwise, _alone)}


def _with_scaled(fn):
  def run(leaves, values, exponents):
    return fn(leaves, _norms.Scaled(values, exponents))

  return run


_GRAD = {
  fn: fuzz_strategies.weighted_sum_grad(_with_scaled(fn))
  for fn in (_packed, _leafwise, _alone)
}
_assert_same = fuzz_strategies.assert_same


@fuzz_strategies.examples(4, deadline=None)
@hypothesis.given(leaves_and_factors())
def test_packed_scaling_equals_each_leaf_scaled_alone(case):
  leaves, factor = case
  want = _RUN[_alone](leaves, factor)
  for fn in (_packed, _leafwise):
    got = _RUN[fn](leaves, factor)
    for i, (g, w, x) in enumerate(zip(got, want, leaves)):
      assert g.dtype == x.dtype and g.shape == x.shape, (fn.__name__, i)
      _assert_same(g, w, f"{fn.__name__}: leaf {i}")


@fuzz_strategies.examples(2, deadline=None)
@hypothesis.given(leaves_and_factors())
def test_packed_scaling_has_the_derivatives_of_each_leaf_alone(case):
  leaves, factor = case
  # Finite leaves of moderate size: derivatives, not the non-finite policy.
  # (On the host: eager operations would compile a program per leaf.)
  leaves = [np.asarray(x) for x in leaves]
  leaves = fuzz_strategies.to_jax(
    [
      np.where(np.isfinite(x) & (np.abs(x) < 1e4), x, 1).astype(x.dtype)
      for x in leaves
    ]
  )
  value = np.asarray(factor.value)
  values = jax.device_put(np.where(np.isnan(value), 0.75, value))
  want = _GRAD[_alone](leaves, values, factor.exponent)
  for fn in (_packed, _leafwise):
    got = _GRAD[fn](leaves, values, factor.exponent)
    for i, (g, w) in enumerate(zip(got[0], want[0])):
      _assert_same(g, w, f"{fn.__name__}: d/dleaf {i}")
    # The factor's cotangent sums a leaf's elements: the order may differ.
    _assert_same(got[1], want[1], f"{fn.__name__}: d/dfactor", exact=False)
