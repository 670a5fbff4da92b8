"""Hypothesis properties of the functional API.

* ``clip_by_global_norm`` is :func:`clip_global`'s computation: the same
  output, bit for bit, and the norm its state keeps;
* against the float64 oracle (``tf.clip_by_global_norm``), on float32 trees
  of any finite magnitude: the norm (where float32 holds it) and the
  clipped values agree;
* ``leaf_norms`` combine to ``global_norm``; ``clip_by_norm`` leaves every
  leaf at a norm of at most ``max_norm``.

The programs are jitted once per tree structure (shapes are few, see
fuzz_strategies.SHAPES).
"""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np

import fuzz_strategies as fz
import np_refs
import optaxclip

TOL = 1e-5
SHAPES = ((), (3,), (2, 3), (0,))


@jax.jit
def _run(tree, c):
  tx = optaxclip.clip_global(c)
  out, state = tx.update(tree, tx.init(tree))
  fn_out, fn_norm = optaxclip.clip_by_global_norm(tree, c)
  return (
    out,
    state.norm,
    fn_out,
    fn_norm,
    optaxclip.global_norm(tree),
    optaxclip.leaf_norms(tree),
    optaxclip.leaf_norms(optaxclip.clip_by_norm(tree, c)),
  )


# Under the ci profile the values are drawn into these layouts (each new
# tree structure compiles _run again); other profiles (release) draw the
# structure too.
LAYOUTS = (((), (3,), (2, 3)), ((0,), (3,)), ((2, 3),))


@st.composite
def _layout_trees(draw):
  layout = draw(st.sampled_from(LAYOUTS))
  return {f"l{i}": draw(fz.arrays("float32", s)) for i, s in enumerate(layout)}


@fz.examples(8)
@hypothesis.given(
  tree=fz.ci_or(
    _layout_trees(),
    fz.trees(dtypes=("float32",), shapes=SHAPES, max_leaves=3),
  ),
  c=fz.limits(zero=False, inf=False, magnitudes="ordinary"),
)
# An explicit example (rarely drawn under the ci profile): three subnormal
# elements whose norm, 1.66e-38, is normal; the norm reads 0.
@hypothesis.example(
  tree={
    "k0": np.array([5.9746126e-39, 1.0657445e-38, 1.1242166e-38], np.float32)
  },
  c=0.5,
)
def test_functions_match_the_transformation_and_the_oracle(tree, c):
  out, state_norm, fn_out, fn_norm, norm, per, clipped_per = _run(tree, c)
  # One code path: bit-identical results.
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(fn_out), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(state_norm, fn_norm)
  np.testing.assert_array_equal(norm, fn_norm)
  leaves = [np.asarray(x) for x in fz.leaves(tree)]
  want_out, want_norm = np_refs.tf_clip_by_global_norm(leaves, c)
  # Subnormal elements count as 0 (XLA:CPU flushes them; optaxclip._norms
  # does too wherever it measures): n of them, each below the smallest
  # normal, move a norm by less than sqrt(n) of it, even when their own
  # norm is normal.
  flushed = fz.flush_atol("float32") * math.sqrt(sum(x.size for x in leaves))
  if float(norm) < np.inf:
    np.testing.assert_allclose(norm, want_norm, rtol=TOL, atol=flushed)
  else:  # beyond float32's range (rounded), reported as inf
    assert want_norm > float(np.finfo(np.float32).max) * (1 - TOL)
  for a, b in zip(jax.tree.leaves(fn_out), want_out, strict=True):
    np.testing.assert_allclose(
      np.asarray(a, np.float64),
      b,
      rtol=TOL,
      atol=fz.flush_atol("float32") / TOL,
    )
  per = [float(v) for v in jax.tree.leaves(per)]
  if np.all(np.isfinite(per)):
    np.testing.assert_allclose(
      np_refs.pnorm(np.asarray(per), 2.0),
      want_norm,
      rtol=TOL,
      atol=flushed,
    )
  for n in jax.tree.leaves(clipped_per):
    assert float(n) <= c * (1 + TOL)


@fz.examples(6)
@hypothesis.given(
  tree=fz.trees(dtypes=("float32",), shapes=SHAPES, max_leaves=3),
  bounds=st.tuples(st.floats(-4, 0), st.floats(0, 4)),
)
def test_clip_by_value_keeps_values_in_range(tree, bounds):
  low, high = bounds
  out = jax.jit(optaxclip.clip_by_value)(tree, low, high)
  for a, x in zip(jax.tree.leaves(out), fz.leaves(tree), strict=True):
    want = np_refs.tf_clip_by_value(x, low, high).astype(np.float32)
    # Exact, but for subnormals flushed to 0 (XLA:CPU).
    np.testing.assert_allclose(
      np.asarray(a), want, rtol=0, atol=fz.flush_atol("float32")
    )
