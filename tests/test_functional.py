"""The functional API against the NumPy oracles, and against the
transformations built on it (one code path: identical outputs).
"""

import math

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import np_refs
import optaxclip

RTOL = 1e-5
ATOL = 1e-6


def _tree():
  rng = np.random.default_rng(0)
  return {
    "dense": {
      "kernel": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
      "bias": jnp.asarray(rng.standard_normal(3), jnp.float32),
    },
    "conv": jnp.asarray(rng.standard_normal((2, 2, 3, 2)), jnp.float32),
    "frozen": None,
  }


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


class FunctionalTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_norms_match_numpy(self):
    tree = _tree()
    leaves = _leaves(tree)
    for ord_ in (1.0, 2.0, 3.0, math.inf):
      norm = self.variant(lambda t, o=ord_: optaxclip.global_norm(t, ord=o))
      np.testing.assert_allclose(
        norm(tree), np_refs.tree_norm(leaves, ord_), rtol=RTOL
      )
      per = self.variant(lambda t, o=ord_: optaxclip.leaf_norms(t, ord=o))(tree)
      self.assertIsNone(per["frozen"])
      np.testing.assert_allclose(
        [float(v) for v in jax.tree.leaves(per)],
        [np_refs.pnorm(x, ord_) for x in leaves],
        rtol=RTOL,
      )

  @chex.variants(with_jit=True, without_jit=True)
  def test_clip_by_global_norm_is_tf_and_torch(self):
    tree = _tree()
    leaves = _leaves(tree)
    clip = self.variant(
      lambda t, c, n: optaxclip.clip_by_global_norm(t, c, norm=n)
    )
    measure = self.variant(optaxclip.clip_by_global_norm)
    for c in (0.5, 1e3):
      out, norm = measure(tree, c)
      want, want_norm = np_refs.tf_clip_by_global_norm(leaves, c)
      np.testing.assert_allclose(norm, want_norm, rtol=RTOL)
      for a, b in zip(_leaves(out), want, strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
      # torch: get_total_norm, then clip_grads_with_norm_ with that norm.
      torch_out, torch_norm = np_refs.torch_clip_grad_norm(leaves, c)
      out, used = clip(tree, c, jnp.float32(torch_norm))
      self.assertEqual(float(used), np.float32(torch_norm))
      for a, b in zip(_leaves(out), torch_out, strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    # TF's use_norm: scaled by c / max(norm, c) whatever the tree's norm.
    out, used = clip(tree, 1.0, jnp.float32(20.0))
    self.assertEqual(float(used), 20.0)
    for a, b in zip(_leaves(out), leaves, strict=True):
      np.testing.assert_allclose(a, b / 20.0, rtol=RTOL)
    out, _ = clip(tree, 1.0, jnp.float32(0.5))  # below c: unchanged
    chex.assert_trees_all_equal(out, tree)

  @chex.variants(with_jit=True)
  def test_clip_by_norm_and_value_match_tf(self):
    tree = _tree()
    leaves = _leaves(tree)
    out = self.variant(lambda t: optaxclip.clip_by_norm(t, 1.0))(tree)
    for a, x in zip(_leaves(out), leaves, strict=True):
      np.testing.assert_allclose(
        a, np_refs.tf_clip_by_norm(x, 1.0), rtol=RTOL, atol=ATOL
      )
    m = tree["dense"]["kernel"]
    out = self.variant(lambda t: optaxclip.clip_by_norm(t, 1.0, axis=0))(m)
    np.testing.assert_allclose(
      out, np_refs.tf_clip_by_norm(m, 1.0, axes=0), rtol=RTOL, atol=ATOL
    )
    out = self.variant(lambda t: optaxclip.clip_by_value(t, -0.3, 0.7))(tree)
    for a, x in zip(_leaves(out), leaves, strict=True):
      np.testing.assert_array_equal(
        a, np_refs.tf_clip_by_value(x, -0.3, 0.7).astype(np.float32)
      )

  def test_transformations_are_built_on_the_functions(self):
    tree = _tree()
    for c in (0.5,):
      tx = optaxclip.clip_global(c)
      out, state = tx.update(tree, tx.init(tree))
      fn_out, fn_norm = jax.jit(optaxclip.clip_by_global_norm)(tree, c)
      chex.assert_trees_all_equal(out, fn_out)
      self.assertEqual(float(state.norm), float(fn_norm))
      tx = optaxclip.clip_norm(c)
      chex.assert_trees_all_equal(
        tx.update(tree, tx.init(tree))[0],
        jax.jit(lambda t, c=c: optaxclip.clip_by_norm(t, c))(tree),
      )
      tx = optaxclip.clip_value(c)
      chex.assert_trees_all_equal(
        tx.update(tree, tx.init(tree))[0],
        jax.jit(lambda t, c=c: optaxclip.clip_by_value(t, -c, c))(tree),
      )

  def test_numerics_bf16_overflow_and_nonfinite(self):
    # float32 accumulation: 1000 bfloat16 elements of 1 have norm ~31.6.
    bf = {"w": jnp.ones(1000, jnp.bfloat16)}
    self.assertEqual(optaxclip.global_norm(bf).dtype, jnp.float32)
    np.testing.assert_allclose(optaxclip.global_norm(bf), math.sqrt(1000))
    # A norm beyond float32's range: inf reported, the tree clipped exactly.
    big = {"w": jnp.array([3e38, -3e38, 3e38], jnp.float32)}
    out, norm = optaxclip.clip_by_global_norm(big, 1.0)
    self.assertEqual(float(norm), math.inf)
    np.testing.assert_allclose(
      out["w"], np.array([1, -1, 1]) / math.sqrt(3), rtol=RTOL
    )
    # Non-finite policy: the unit with a NaN/inf comes out NaN.
    bad = {"a": jnp.array([jnp.inf, 0.0]), "b": jnp.array([0.5, 2.0])}
    out, norm = optaxclip.clip_by_global_norm(bad, 1.0)
    self.assertTrue(np.isnan(_leaves(out)).all())
    out = optaxclip.clip_by_norm(bad, 1.0)
    self.assertTrue(np.isnan(out["a"]).all())
    np.testing.assert_allclose(out["b"], np.array([0.5, 2.0]) / 4.25**0.5)
    out = optaxclip.clip_by_value(bad, -1.0, 1.0)
    self.assertTrue(np.isnan(out["a"]).all())
    np.testing.assert_array_equal(out["b"], [0.5, 1.0])
    z = {"z": jnp.array([3 + 4j], jnp.complex64)}
    np.testing.assert_allclose(
      optaxclip.clip_by_value(z, -1.0, 1.0)["z"], [0.6 + 0.8j], rtol=RTOL
    )
    self.assertEqual(optaxclip.leaf_norms({}), {})
    self.assertEqual(float(optaxclip.global_norm({})), 0.0)

  def test_bad_arguments_say_which(self):
    tree = _tree()
    cases = [
      (
        lambda: optaxclip.clip_by_global_norm(tree, -1.0),
        ValueError,
        "clip_by_global_norm: max_norm must",
      ),
      (
        lambda: optaxclip.clip_by_global_norm(tree, 1.0, norm=math.nan),
        ValueError,
        "clip_by_global_norm: norm must",
      ),
      (
        lambda: optaxclip.clip_by_norm(tree, 1.0, ord=0.5),
        ValueError,
        "clip_by_norm: ord must",
      ),
      (
        lambda: optaxclip.clip_by_value(tree, 1.0, -1.0),
        ValueError,
        "clip_by_value: max_value must be >= min_value",
      ),
      (
        lambda: optaxclip.clip_by_value(
          {"z": jnp.ones(1, jnp.complex64)}, 0.0, 1.0
        ),
        ValueError,
        "clip_by_value: min_value must be -max_value",
      ),
      (
        lambda: optaxclip.global_norm({"i": jnp.ones(2, jnp.int32)}),
        TypeError,
        r"global_norm: updates leaf \['i'\] must be float",
      ),
      (
        lambda: optaxclip.leaf_norms(tree, ord="two"),
        TypeError,
        "leaf_norms: ord must",
      ),
    ]
    for call, error, message in cases:
      with pytest.raises(error, match=message):
        call()


def test_axis_name_inside_shard_map_gives_the_whole_norm():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
  rng = np.random.default_rng(1)
  tree = {
    "w": rng.standard_normal((16, 3)).astype(np.float32),
    "b": rng.standard_normal(3).astype(np.float32),
  }
  specs = {"w": P("d", None), "b": P()}

  def local(t):
    norm = optaxclip.global_norm(t, axis_name="d", sharded=specs)
    per = optaxclip.leaf_norms(t, axis_name="d", sharded=specs)
    clipped, _ = optaxclip.clip_by_global_norm(
      t, 1.0, axis_name="d", sharded=specs
    )
    return norm, per, clipped

  f = jax.jit(
    jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(specs,),
      out_specs=(P(), P(), specs),
      check_vma=False,
    )
  )
  norm, per, clipped = f(tree)
  leaves = [tree["b"], tree["w"]]
  np.testing.assert_allclose(norm, np_refs.tree_norm(leaves), rtol=RTOL)
  np.testing.assert_allclose(per["w"], np_refs.pnorm(tree["w"], 2), rtol=RTOL)
  want, _ = np_refs.tf_clip_by_global_norm(leaves, 1.0)
  np.testing.assert_allclose(clipped["w"], want[1], rtol=RTOL, atol=ATOL)


def test_a_transformation_spelling_points_to_the_transformation():
  # optax.clip_by_global_norm(1.0) is a transformation; optaxclip's
  # function of that name clips a tree: called the optax way, it says
  # which transformation to use.
  with pytest.raises(TypeError, match=r"optaxclip\.clip_global\(1\.0\)"):
    optaxclip.clip_by_global_norm(1.0)
  with pytest.raises(TypeError, match=r"optaxclip\.clip_norm\(0\.5\)"):
    optaxclip.clip_by_norm(0.5)
  with pytest.raises(TypeError, match="limit is required"):
    optaxclip.clip_by_global_norm({"a": jnp.ones(2)})
