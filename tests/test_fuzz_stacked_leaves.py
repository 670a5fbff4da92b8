"""Stacked small leaves: clip_unitwise and
clip_norm(axis=...) stack kernels of one shape, clip_value reduces small
leaves stacked, clip_global hands one copy of its factor to every leaf. Each
gives the numbers of the same clipper on one leaf at a time (no stacking),
special values included.
"""

import functools
import re

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import fuzz_strategies as fz
import optaxclip

# Kernels (units across the leading axis), vectors and a conv-like leaf.
SHAPES = ((3, 2), (2, 3), (4,), (2, 2, 3), (1, 3))


# The ci profile draws the values into these layouts only (each new layout
# compiles a new program): repeated shapes apart and together, transposed
# kernels, every shape of SHAPES, two to seven leaves. Other profiles
# (release) draw layouts freely too.
LAYOUTS = (
  ((3, 2), (2, 3), (3, 2), (4,), (2, 2, 3), (3, 2), (1, 3)),
  ((2, 3), (2, 3)),
  ((4,), (1, 3), (2, 2, 3), (4,), (2, 2, 3)),
)


@st.composite
def kernel_trees(draw):
  free = st.lists(st.sampled_from(SHAPES), min_size=2, max_size=7)
  shapes = draw(fz.ci_or(st.sampled_from(LAYOUTS), free))
  special = st.sampled_from([0.0, 1e-30, 1e30, np.inf, np.nan])
  element = st.one_of(st.floats(-4, 4, width=32), special)
  tree = {}
  for i, s in enumerate(shapes):
    values = draw(
      st.lists(element, min_size=int(np.prod(s)), max_size=int(np.prod(s)))
    )
    tree[f"l{i}"] = np.asarray(values, np.float32).reshape(s)
  return tree


@functools.cache
def _runner(tx):
  """``tx.update`` compiled once per tree signature (fast options), cached
  across examples; both sides of each comparison are compiled alike.
  """
  return fz.FastJit(tx.update)


def _one_at_a_time(tx, tree, params):
  # Each leaf alone under one key: one program per shape, not per leaf name.
  out = {}
  for k, x in tree.items():
    alone = {"x": params[k]}
    out[k] = _runner(tx)({"x": x}, tx.init(alone), alone)[0]["x"]
  return out


# One transformation object each, so that _runner's cache holds.
TXS = {
  "unitwise": optaxclip.clip_unitwise(0.1),
  "norm_axis0": optaxclip.clip_norm(1.0, axis=0),
  "value": optaxclip.clip_value(1.0),
}


@fz.examples(6, deadline=None)
@hypothesis.given(kernel_trees(), st.sampled_from(["unitwise", "norm_axis0"]))
def test_stacked_units_match_one_leaf_at_a_time(tree, which):
  params = {k: np.full(x.shape, 0.5, np.float32) for k, x in tree.items()}
  tx = TXS[which]
  out, _ = _runner(tx)(tree, tx.init(params), params)
  want = _one_at_a_time(tx, tree, params)
  for k in tree:
    np.testing.assert_allclose(out[k], want[k], rtol=2e-6, err_msg=k)


@fz.examples(6, deadline=None)
@hypothesis.given(kernel_trees())
def test_clip_value_stacked_matches_one_leaf_at_a_time(tree):
  tx = TXS["value"]
  out, state = _runner(tx)(tree, tx.init(tree))
  want = _one_at_a_time(tx, tree, tree)
  clipped = 0
  for k, x in tree.items():
    np.testing.assert_array_equal(out[k], want[k], err_msg=k)
    a = np.abs(np.asarray(x))
    clipped += a.size if not np.all(np.isfinite(a)) else np.sum(a > 1.0)
  total = sum(x.size for x in tree.values())
  np.testing.assert_allclose(float(state.clip_fraction), clipped / total)


def _bitcasts(fn, tree) -> int:
  text = jax.jit(fn).lower(tree).compile().as_text()
  return len(re.findall(r"bitcast-convert\(", text))


def test_clip_global_factor_arithmetic_is_not_copied_per_leaf():
  # The factor's exponent arithmetic (bitcast-converts) was fused into
  # every leaf's kernel; now it is computed once, whatever the leaves.
  def tree(n):
    return {f"l{i:02d}": jnp.full((3,), i + 1.0) for i in range(n)}

  tx = optaxclip.clip_global(1.0)

  def step(g):
    return tx.update(g, tx.init(g))

  assert _bitcasts(step, tree(4)) == _bitcasts(step, tree(24))
