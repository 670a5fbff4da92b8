"""Properties for the failures at the edges of the range (issue 10) that the
cross-cutting suite (test_fuzz.py) found: each pins a class of failure that
was fixed, against a float64 NumPy oracle, within the ``ci`` profile's
budget (small trees, few examples, programs compiled once per shape).
"""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import fuzz_strategies as fz
import optaxclip

F32 = np.float32

# --------------------------------------------------------------------------
# clipped_grad (method="vmap"): a finite example whose norm overflows float32
# is clipped, not zeroed
# --------------------------------------------------------------------------


def _linear_loss(params, xs):
  """Per-example losses whose gradient for example b is ``xs[b]`` itself."""
  return sum(
    jnp.sum(x * w, axis=tuple(range(1, x.ndim)))
    for x, w in zip(jax.tree.leaves(xs), jax.tree.leaves(params))
  )


@functools.cache
def _vmap_runner():
  """The clipped sum and norms, compiled once per tree signature."""

  def run(params, xs, clip):
    fn = optaxclip.clipped_grad(_linear_loss, 1.0, method="vmap")
    return fn(params, xs, l2_clip=clip)

  return fz.FastJit(run)


@hypothesis.settings(max_examples=6)
@hypothesis.given(
  tree=fz.per_example_trees(nonfinite=True),
  l2=st.sampled_from((1e-30, 1.0, 1e30)),
)
# Elements of 3e38: the example's norm (4.2e38) overflows float32; it used
# to be left out (norm inf) and its clipped gradient lost.
@hypothesis.example(
  tree={"a": np.array([[3e38, 3e38], [1.0, 0.0]], F32)}, l2=1.0
)
def test_clipped_grad_vmap_clips_examples_beyond_the_range(tree, l2):
  """clipped_grad(method="vmap") sums the same clipped examples as the
  oracle (examples holding an Inf / NaN left out, finite ones clipped
  whatever their norm), and reports a finite norm for every finite example.
  """
  leaves = fz.leaves(tree)
  batch = np.shape(leaves[0])[0]
  params = [np.zeros(np.shape(x)[1:], F32) for x in leaves]
  xs = [np.asarray(x) for x in leaves]
  grads, norms = _vmap_runner()(params, xs, F32(l2))
  want, _, nonfinite = fz.oracle_per_example(xs, float(F32(l2)), "global")
  finite = [all(np.all(np.isfinite(x[b])) for x in xs) for b in range(batch)]
  assert sum(not f for f in finite) == nonfinite
  norms = np.asarray(norms)
  # A finite example has a finite reported norm (clamped to float32's
  # largest value beyond it); a non-finite one is inf or NaN.
  assert np.array_equal(np.isfinite(norms), np.array(finite)), norms
  for got, w in zip(grads, want):
    got = np.asarray(got, np.float64)
    atol = max(
      8 * batch * fz.round_tol(F32) * np.max(np.abs(w), initial=0.0),
      batch * l2 * 1e-6,
      fz.flush_atol(F32),
    )
    assert np.all(np.abs(got - w) <= 2e-5 * np.abs(w) + atol), (got, w)
  # Each example contributes at most l2 (the sensitivity bound).
  assert float(fz.measure_tree([np.asarray(g) for g in grads])) <= (
    sum(finite) * l2 * (1 + 1e-5) + fz.flush_atol(F32)
  )
