"""Properties of the DP aggregation over the whole float32 range.

Every example moves the clipped sum by at most the clip norm (the DP
sensitivity bound), whatever its magnitude (subnormal to near the largest
float32) and whatever other examples hold (NaN, Inf): a float64 NumPy oracle
gives the sum of the finite examples (finite elements and a norm within
float32's range), each clipped along its direction.
"""

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np

import optaxclip

BATCH = 4
SHAPES = {"w": (3, 2), "b": (2,)}


def _magnitudes():
  # Powers of ten over the whole float32 range, and the odd non-finite.
  finite = st.builds(
    lambda e, m, s: s * m * 10.0**e,
    st.integers(-44, 38),
    st.floats(1.0, 3.4),
    st.sampled_from([-1.0, 1.0]),
  )
  return st.one_of(
    finite,
    finite,
    finite,
    st.just(0.0),
    st.sampled_from([float("nan"), float("inf")]),
  )


@st.composite
def _batches(draw):
  out = {}
  for k, shape in SHAPES.items():
    size = BATCH * int(np.prod(shape))
    values = draw(st.lists(_magnitudes(), min_size=size, max_size=size))
    with np.errstate(over="ignore"):
      out[k] = (
        np.array(values, np.float64).astype(np.float32).reshape(BATCH, *shape)
      )
  return out


def _oracle(tree, clip):
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
  flat = np.concatenate([x.reshape(BATCH, -1) for x in leaves], axis=1)
  finite = np.all(np.isfinite(flat), axis=1)
  safe = np.where(finite[:, None], flat, 0.0)
  big = np.max(np.abs(safe), axis=1, keepdims=True)
  scaled = safe / np.where(big > 0, big, 1.0)
  norms = big[:, 0] * np.sqrt(np.sum(scaled**2, axis=1))
  # A norm beyond float32's range is not finite there: that example is left
  # out and counted too (the documented policy; the bound still holds).
  finite &= norms <= np.finfo(np.float32).max
  safe = np.where(finite[:, None], safe, 0.0)
  norms = np.where(finite, norms, 0.0)
  factor = np.where(norms > clip, clip / np.where(norms > 0, norms, 1.0), 1.0)
  contributions = safe * factor[:, None]
  return contributions.sum(0), contributions, finite


_STEPS = {}


def _step(clip):
  if clip not in _STEPS:
    tx = optaxclip.clip_per_example(clip, reduce="sum")
    _STEPS[clip] = jax.jit(tx.update)
  return _STEPS[clip]


@hypothesis.settings(max_examples=25)
@hypothesis.given(tree=_batches(), clip=st.sampled_from([1e-3, 1.0, 1e4]))
def test_each_example_moves_the_sum_by_at_most_the_clip(tree, clip):
  tx = optaxclip.clip_per_example(clip, reduce="sum")
  out, state = _step(clip)(tree, tx.init(None))
  got = np.concatenate(
    [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(out)]
  )
  want, contributions, finite = _oracle(tree, clip)
  assert np.all(np.isfinite(got))
  # The oracle sums the same finite, clipped examples.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * clip)
  assert np.linalg.norm(got) <= finite.sum() * clip * (1 + 1e-5) + 1e-30
  assert np.all(np.linalg.norm(contributions, axis=1) <= clip * (1 + 1e-5))
  assert float(state.nonfinite) == BATCH - finite.sum()
