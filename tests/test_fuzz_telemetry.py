"""Properties of the per-leaf telemetry (leaf_stats=, layer_axis=) over
values of every magnitude: leaf norms agree with a float64 oracle, their
squares add up to the squared global norm, top_leaf_share is a share.
"""

import hypothesis
from hypothesis import strategies as st
import jax
import numpy as np

import fuzz_strategies as fs
import np_refs
import optaxclip

SHAPES = {"a": (3, 4), "b": (5,), "c": (2, 2, 2)}
LAYERS = {"a": 0, "b": None, "c": 2}
LAYER_AXES = [LAYERS[k] for k in sorted(SHAPES)]
CLIPPERS = {
  "clip_global": optaxclip.clip_global(1.0, leaf_stats=True, layer_axis=LAYERS),
  "clip_zscore_leaf": optaxclip.clip_zscore(
    scope="leaf", leaf_stats=True, layer_axis=LAYERS
  ),
}


# Each clipper's update compiled once with the fast options (its own jit
# compiles with the default ones).
RUN = {
  name: fs.FastJit(lambda g, tx=tx: tx.update(g, tx.init(g), g)[1])
  for name, tx in CLIPPERS.items()
}


@st.composite
def trees(draw):
  return {
    k: draw(fs.arrays("float32", s, magnitudes="all"))
    for k, s in sorted(SHAPES.items())
  }


@hypothesis.given(tree=trees(), name=st.sampled_from(sorted(CLIPPERS)))
def test_leaf_norms_agree_with_numpy_and_add_up(tree, name):
  g = {k: jax.device_put(np.asarray(v)) for k, v in tree.items()}
  state = RUN[name](g)
  leaves = [tree[k] for k in sorted(tree)]
  expected = np_refs.leaf_norms(leaves, 2.0, LAYER_AXES)
  got = np.concatenate(
    [np.ravel(np.asarray(state.leaf_norms.tree()[k])) for k in sorted(tree)]
  ).astype(np.float64)
  # float32 results: inf beyond its range; values below its smallest normal
  # may be flushed to 0 by XLA:CPU.
  np.testing.assert_allclose(
    got,
    expected.astype(np.float32),
    rtol=1e-5,
    atol=fs.flush_atol("float32") * 4,
  )
  if np.all(np.isfinite(got)) and np.isfinite(float(state.norm)):
    # The squares of the leaf (or layer) norms add up to the squared norm.
    np.testing.assert_allclose(
      np.sqrt(np.sum(got**2)),
      float(state.norm),
      rtol=1e-5,
      atol=fs.flush_atol("float32") * 4,
    )
  share = float(state.top_leaf_share)
  assert 0.0 <= share <= 1.0, share
  if np.max(expected, initial=0) > 1e-30:  # not flushed (see above)
    want_share, want_index = np_refs.top_leaf(expected)
    np.testing.assert_allclose(share, want_share, atol=1e-5)
    top = expected[int(state.top_leaf)]
    assert top >= expected[want_index] * (1 - 1e-5)


@st.composite
def trees_with_none(draw):
  """A nesting of float32 leaves and None nodes (frozen parameters) in
  drawn places, with drawn layer axes.
  """
  n = draw(st.integers(1, 4))
  shapes = [draw(st.sampled_from(((3,), (2, 3), (), (4, 2)))) for _ in range(n)]
  leaves = [
    draw(fs.arrays("float32", s, magnitudes="ordinary")) for s in shapes
  ]
  layers = [
    draw(st.sampled_from((None, 0))) if len(s) >= 1 else None for s in shapes
  ]
  items = []
  for i, (x, lay) in enumerate(zip(leaves, layers)):
    if draw(st.booleans()):
      items.append((f"none{i}", None, None))
    items.append((f"leaf{i}", x, lay))
  nested = draw(st.booleans())
  tree = {k: ([v] if nested else v) for k, v, _ in items}
  axes = {k: ([a] if nested else a) for k, _, a in items}
  return tree, axes


@fs.examples(8)
@hypothesis.given(case=trees_with_none())
def test_leaf_norm_names_match_their_values_beside_none_nodes(case):
  """Every name of leaf_norm_table (and stats()' leaf_norm keys) carries its
  own leaf's (or layer's) norm, with None nodes anywhere in the tree: a None
  node takes no name (else every later name would carry the norm of the
  leaf before it: 3 names for 2 values).
  """
  tree, axes = case
  tx = optaxclip.clip_global(1.0, leaf_stats=True, layer_axis=axes)
  g = jax.tree.map(lambda x: jax.device_put(np.asarray(x)), tree)
  _, state = tx.update(g, tx.init(g))
  names, values = optaxclip.leaf_norm_table(state)
  want = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = "clip_global/leaf_norm/" + jax.tree_util.keystr(
      tuple(path), simple=True, separator="/"
    )
    axis = axes
    for key in path:
      axis = axis[key.key if hasattr(key, "key") else key.idx]
    x = np.asarray(x, np.float64)
    if axis is None:
      want[name] = np.sqrt(np.sum(x * x))
    else:
      for k in range(x.shape[0]):
        want[f"{name}/{k}"] = np.sqrt(np.sum(x[k] ** 2))
  assert names == list(want), (names, list(want))
  np.testing.assert_allclose(np.asarray(values), list(want.values()), rtol=1e-5)
  logs = optaxclip.stats(state)
  for name, value in want.items():
    np.testing.assert_allclose(float(logs[name]), value, rtol=1e-5)
