"""Small leaves packed for one reduction (issue 12's leaf_stats cost, issue
15 item 4): the norms of leaves stacked as rows of one concatenation equal
those of each leaf reduced on its own, and equal a float64 reference, on
trees of many small leaves of mixed sizes and dtypes, with magnitudes near
float32's largest value and subnormal ones, NaN and inf sprinkled.
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


@st.composite
def many_small_leaves(draw):
  n = draw(st.integers(3, 12))
  element = st.one_of(
    st.floats(-4, 4, width=32),
    st.sampled_from(SPECIAL),
  )
  leaves = []
  for _ in range(n):
    shape = draw(st.sampled_from(SHAPES))
    dtype = draw(st.sampled_from(DTYPES))
    size = int(np.prod(shape))
    values = np.asarray(
      draw(st.lists(element, min_size=size, max_size=size)), np.float32
    ).reshape(shape)
    if draw(st.booleans()):  # mostly finite leaves: packed rows matter
      values = np.where(np.isfinite(values), values, 1.0)
    leaves.append(jnp.asarray(values).astype(dtype))
  return leaves


def _reference(x) -> float:
  a = np.asarray(x.astype(jnp.float32), np.float64)
  if np.isnan(a).any():
    return np.nan
  return float(np.sqrt(np.sum(a * a)))


# Each leaf reduced on its own (one part per leaf, nothing packed), in one
# compiled program per tree.
_one_at_a_time = fuzz_strategies.FastJit(
  lambda leaves: [_norms.unit_norms([x])[0].reshape(()) for x in leaves]
)

_packed = fuzz_strategies.FastJit(_norms.unit_norms)


def _assert_norms_equal(got, want, err):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.isnan(got) == np.isnan(want), err
  if not np.isnan(want):
    np.testing.assert_allclose(got, want, rtol=2e-6, err_msg=err)


@fuzz_strategies.examples(4, deadline=None)
@hypothesis.given(many_small_leaves())
def test_packed_unit_norms_equal_one_leaf_at_a_time(leaves):
  packed = _packed(leaves)
  alone = _one_at_a_time(leaves)
  for i, (p, a, x) in enumerate(zip(packed, alone, leaves)):
    _assert_norms_equal(p.reshape(()), a.reshape(()), f"leaf {i}")
    want = _reference(x)
    # A norm beyond float32's range reads inf as a plain float32.
    with np.errstate(over="ignore"):
      want = np.float32(want)
    _assert_norms_equal(p.reshape(()), want, f"leaf {i} vs float64")


@fuzz_strategies.examples(3, deadline=None)
@hypothesis.given(many_small_leaves())
def test_leaf_stats_norms_and_clip_equal_the_unpacked_path(leaves):
  tree = {f"l{i:02d}": x for i, x in enumerate(leaves)}
  with_stats = optaxclip.clip_global(1.0, leaf_stats=True)
  without = optaxclip.clip_global(1.0)
  out, state = fuzz_strategies.FastJit(with_stats.update)(
    tree, with_stats.init(tree)
  )
  ref_out, ref_state = fuzz_strategies.FastJit(without.update)(
    tree, without.init(tree)
  )
  _assert_norms_equal(state.norm, ref_state.norm, "global norm")
  alone = dict(zip(tree, _one_at_a_time(list(tree.values()))))
  for k in tree:
    _assert_norms_equal(state.leaf_norms.tree()[k], alone[k], k)
    got = np.asarray(out[k].astype(jnp.float32))
    want = np.asarray(ref_out[k].astype(jnp.float32))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=k)
    ok = ~np.isnan(want)
    # One rounding of the factor apart at most (the global norm is put
    # together from the per-leaf sums in another order).
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-2, err_msg=k)
