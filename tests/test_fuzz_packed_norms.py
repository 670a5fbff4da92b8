"""Small leaves packed for one reduction (``leaf_stats`` and the compile time
on many leaves): the norms of leaves stacked as rows of one concatenation
equal those of each leaf reduced on its own, and equal a float64 reference,
on trees of many small leaves of mixed sizes and dtypes, with magnitudes
near float32's largest value and subnormal ones, NaN and inf sprinkled.
"""

import hypothesis
from hypothesis import strategies as st
import jax.numpy as jnp
import numpy as np

import fuzz_strategies
import optaxclip
from optaxclip import _norms

# Several leaves of each size, so that rows are packed together; (2, 3) and
# (6,) share a unit size and are rows of one part.
SHAPES = ((6,), (2, 3), (5,), (1,), (4, 2))
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
SPECIAL = (0.0, 1e-45, 1e-40, 3e38, -3.3e38, 1e30, np.inf, np.nan)


# The ci profile draws the values into these layouts only (each new layout
# compiles new programs): every shape and dtype, several leaves of one size
# and dtype (packed rows), (2, 3) beside (6,), mixed dtypes, 3 to 12 leaves.
# Other profiles (release) draw layouts freely too.
_F32, _BF16, _F16 = DTYPES
LAYOUTS = (
  (
    ((6,), _F32),
    ((2, 3), _F32),
    ((5,), _BF16),
    ((1,), _F16),
    ((4, 2), _F32),
    ((6,), _F32),
    ((1,), _F16),
    ((5,), _BF16),
    ((4, 2), _BF16),
    ((2, 3), _F16),
    ((1,), _F32),
    ((6,), _F32),
  ),
  (((5,), _F32), ((5,), _F32), ((5,), _F16), ((2, 3), _BF16)),
)


@st.composite
def many_small_leaves(draw):
  free = st.lists(
    st.tuples(st.sampled_from(SHAPES), st.sampled_from(DTYPES)),
    min_size=3,
    max_size=12,
  )
  layout = draw(fuzz_strategies.ci_or(st.sampled_from(LAYOUTS), free))
  element = st.one_of(
    st.floats(-4, 4, width=32),
    st.sampled_from(SPECIAL),
  )
  leaves = []
  for shape, dtype in layout:
    size = int(np.prod(shape))
    values = np.asarray(
      draw(st.lists(element, min_size=size, max_size=size)), np.float32
    ).reshape(shape)
    if draw(st.booleans()):  # mostly finite leaves: packed rows matter
      values = np.where(np.isfinite(values), values, 1.0)
    with np.errstate(over="ignore"):  # cast on the host: 3e38 -> inf
      leaves.append(fuzz_strategies.to_jax(values.astype(dtype)))
  return leaves


def _reference(x) -> float:
  a = fuzz_strategies.as_float32(x).astype(np.float64)
  if np.isnan(a).any():
    return np.nan
  return float(np.sqrt(np.sum(a * a)))


# Each leaf reduced on its own (one part per leaf, nothing packed), in one
# compiled program per tree.
_one_at_a_time = fuzz_strategies.FastJit(
  lambda leaves: [_norms.unit_norms([x])[0].reshape(()) for x in leaves]
)

_packed = fuzz_strategies.FastJit(_norms.unit_norms)


def _assert_norms_equal(got, want, err, atol=0.0):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.isnan(got) == np.isnan(want), err
  if not np.isnan(want):
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=atol, err_msg=err)


@fuzz_strategies.examples(4, deadline=None)
@hypothesis.given(many_small_leaves())
def test_packed_unit_norms_equal_one_leaf_at_a_time(leaves):
  packed = _packed(leaves)
  alone = _one_at_a_time(leaves)
  for i, (p, a, x) in enumerate(zip(packed, alone, leaves)):
    # Scalars on the host (a JAX reshape compiles a program per shape).
    p, a = np.asarray(p).reshape(()), np.asarray(a).reshape(())
    _assert_norms_equal(p, a, f"leaf {i}")
    want = _reference(x)
    # A norm beyond float32's range reads inf as a plain float32.
    with np.errstate(over="ignore"):
      want = np.float32(want)
    # XLA:CPU may flush a float32 subnormal to zero (a leaf of 1e-45 alone
    # has norm 0): a platform behaviour, within the smallest normal.
    _assert_norms_equal(
      p,
      want,
      f"leaf {i} vs float64",
      atol=fuzz_strategies.flush_atol(np.float32),
    )


# Built and jitted once (one program a layout across examples).
_WITH_STATS_TX = optaxclip.clip_global(1.0, leaf_stats=True)
_WITHOUT_TX = optaxclip.clip_global(1.0)
_WITH_STATS = fuzz_strategies.FastJit(_WITH_STATS_TX.update)
_WITHOUT = fuzz_strategies.FastJit(_WITHOUT_TX.update)


@fuzz_strategies.examples(3, deadline=None)
@hypothesis.given(many_small_leaves())
def test_leaf_stats_norms_and_clip_equal_the_unpacked_path(leaves):
  tree = {f"l{i:02d}": x for i, x in enumerate(leaves)}
  out, state = _WITH_STATS(tree, _WITH_STATS_TX.init(tree))
  ref_out, ref_state = _WITHOUT(tree, _WITHOUT_TX.init(tree))
  _assert_norms_equal(state.norm, ref_state.norm, "global norm")
  alone = dict(zip(tree, _one_at_a_time(list(tree.values()))))
  for k in tree:
    _assert_norms_equal(state.leaf_norms.tree()[k], alone[k], k)
    got = fuzz_strategies.as_float32(out[k])
    want = fuzz_strategies.as_float32(ref_out[k])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=k)
    ok = ~np.isnan(want)
    # One rounding of the factor apart at most (the global norm is put
    # together from the per-leaf sums in another order).
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-2, err_msg=k)
