"""Properties at the edges of the range, each for one class of failure,
against a float64 NumPy oracle: per-example norms beyond float32's range
(clipped_grad, vmap and ghost), Hessian-vector products through a clipped
p-norm whose power sum is far from 1, complex moduli beyond float32's range,
and narrow leaves beside a float64 leaf. Within the ``ci`` profile's budget
(small trees, few examples, programs compiled once per shape).
"""

import functools
import math

import flax.linen as nn
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


@fz.examples(6)
@hypothesis.given(
  tree=fz.per_example_trees(nonfinite=True),
  l2=st.sampled_from((1e-30, 1.0, 1e30)),
)
# Elements of 3e38: the example's norm (4.2e38) overflows float32; it is
# clipped, not left out (as an example of norm inf would be).
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


# --------------------------------------------------------------------------
# Hessian-vector products through a clipped p-norm in float32
# --------------------------------------------------------------------------

_HVP_LAYOUT = ((4, 3), (3,))


@functools.cache
def _hvp_runner(ord_):
  """``(g, w, v, limit) -> d^2/dt^2 sum(w * clip_norm(g + t v))`` at 0, by
  ``jax.jvp`` of ``jax.grad`` (a Hessian-vector product) in float32.
  """

  def f(g, w, limit):
    tx = optaxclip.clip_norm(limit, ord=ord_)
    out, _ = tx.update(g, tx.init(g))
    return sum(jnp.vdot(a, b) for a, b in zip(w, out))

  def hvp(g, w, v, limit):
    d = jax.jvp(lambda g_: jax.grad(f)(g_, w, limit), (g,), (v,))[1]
    return sum(jnp.vdot(a, b) for a, b in zip(d, v))

  return fz.FastJit(hvp)


def _clip_norm_f64(leaves, limit, ord_):
  out = []
  for x in leaves:
    n = np.sum(np.abs(x) ** ord_) ** (1 / ord_)
    out.append(x * (min(1.0, limit / n) if n > 0 else 1.0))
  return out


@fz.examples(4)
@hypothesis.given(
  scale=st.sampled_from((1e-30, 1e-15, 1e-8, 1e8, 1e11, 1e19)),
  ord_=st.sampled_from((1.5, 3.0)),
  ratio=st.sampled_from((0.3, 3.0)),
  seed=st.integers(0, 2**16),
)
# clip_norm(ord=3) on a clipped gradient of about 1e8 and of 1e-8: JAX's
# own rule for s**(1/p) flushes s**(1/p - 2) to zero at the first (an HVP 8%
# off) and overflows at the second (NaN).
@hypothesis.example(scale=1e8, ord_=3.0, ratio=0.3, seed=0)
@hypothesis.example(scale=1e-8, ord_=3.0, ratio=0.3, seed=0)
# On the exact recompute (the power sum below float32's range), unclipped.
@hypothesis.example(scale=1e-30, ord_=1.5, ratio=3.0, seed=0)
# On the exact recompute above the range: the derivative of the direct sum
# is masked out, and its second order must not overflow (inf * 0 is NaN).
@hypothesis.example(scale=1e19, ord_=3.0, ratio=0.3, seed=0)
def test_hvp_of_a_clipped_p_norm_in_float32(scale, ord_, ratio, seed):
  """Hessian-vector products through clip_norm(ord=p) in float32 equal
  second finite differences of a float64 NumPy formula, at magnitudes where
  the power sum ``sum |x|**p`` is far from 1 (1e-90 to 1e57: the direct
  sum and the exact recompute, below and above float32's range).
  """
  rng = np.random.default_rng(seed)
  draw = lambda s: [(s * rng.normal(size=n)).astype(F32) for n in _HVP_LAYOUT]
  g, w, v = draw(scale), draw(1.0), draw(scale)
  norms = [
    np.sum(np.abs(x.astype(np.float64)) ** ord_) ** (1 / ord_) for x in g
  ]
  limit = F32(ratio * max(norms))
  h = 1e-4
  # |x|**p for p < 2 has an unbounded second derivative at 0: the finite
  # differences must not step across it (an element of 2e-34 moved by
  # h * v = 2e-34 put the oracle 15% off; the float32 and float64 clippers
  # agree with each other).
  hypothesis.assume(
    ord_ >= 2
    or all(np.all(np.abs(x) > 10 * h * np.abs(d)) for x, d in zip(g, v))
  )
  got = float(_hvp_runner(ord_)(g, w, v, limit))

  def value(t):
    moved = [x.astype(np.float64) + t * d for x, d in zip(g, v)]
    out = _clip_norm_f64(moved, float(limit), ord_)
    return sum(np.longdouble(np.vdot(a, b)) for a, b in zip(w, out))

  want = float((value(h) - 2 * value(0.0) + value(-h)) / (h * h))
  size = float(fz.measure_tree(w)) * float(fz.measure_tree(v)) ** 2
  size /= float(fz.measure_tree(g))
  assert math.isfinite(got), got
  assert abs(got - want) <= 1e-3 * abs(want) + 1e-3 * size, (got, want)


# --------------------------------------------------------------------------
# Complex moduli beyond float32's range, under jit and the fast compile
# --------------------------------------------------------------------------

_COMPLEX_CLIPPERS = ("clip_norm", "clip_global", "clip_block_rms")
_PART = st.one_of(
  st.sampled_from((0.0, 1e-45, 1.2e-38, 8.5e37, 3e38, 3.4028235e38)),
  st.floats(allow_nan=False, allow_infinity=False, width=32),
)


@functools.cache
def _complex_runners(name):
  """``(g, limit) -> (update, state)`` under the default jit and compiled
  with the fast options of tests/fast_compile.py (the fuzz suite's).
  """

  def run(g, limit):
    tx = getattr(optaxclip, name)(limit)
    return tx.update(g, tx.init(g))

  return {"jit": jax.jit(run), "fast": fz.FastJit(run)}


@fz.examples(6)
@hypothesis.given(
  name=st.sampled_from(_COMPLEX_CLIPPERS),
  parts=st.lists(st.tuples(_PART, _PART), min_size=3, max_size=3),
  limit=st.sampled_from((0.0, 1.0, 1e37, 2e38)),
)
# clip_block_rms(0.0) of a leaf whose modulus (of 3.4e38 - 8.2e37j) exceeds
# float32's range: zeros, not NaN.
@hypothesis.example(
  name="clip_block_rms",
  parts=[(3.4028235e38, -8.1875762e37), (0.0, 6.4e37), (0.0, 0.0)],
  limit=0.0,
)
@hypothesis.example(
  name="clip_block_rms",
  parts=[(3.4028235e38, -8.1875762e37), (0.0, 6.4e37), (0.0, 0.0)],
  limit=2e38,
)
# An explicit example (rarely drawn under the ci profile): 0.75+0.75j scaled by
# 1.18e-38 has subnormal parts (each flushed) and a normal modulus.
@hypothesis.example(
  name="clip_norm", parts=[(0.0, 0.0), (0.0, 8.5e37), (0.75, 0.75)], limit=1.0
)
def test_complex_leaves_beyond_the_range_are_clipped(name, parts, limit):
  """A complex64 leaf with finite parts (moduli up to 4.8e38, beyond
  float32's range) is clipped to a finite update within the limit, along
  its direction, under the default jit and the fast compile alike.
  """
  x = np.array([complex(a, b) for a, b in parts], np.complex64)
  wide = x.astype(np.complex128)
  norm = float(np.sqrt(np.sum(np.abs(wide) ** 2)))
  bound = limit * (math.sqrt(x.size) if name == "clip_block_rms" else 1.0)
  factor = min(1.0, bound / norm) if norm > 0 else 1.0
  for how, run in _complex_runners(name).items():
    out, _ = run({"c": jnp.asarray(x)}, F32(limit))
    got = np.asarray(out["c"]).astype(np.complex128)
    assert np.all(np.isfinite(got)), (how, got)
    # Each part below the smallest normal may be flushed to 0: a complex
    # element moves by up to sqrt(2) of it.
    flushed = math.sqrt(2) * fz.flush_atol(F32)
    tol = 1e-5 * np.abs(wide) * factor + flushed
    assert np.all(np.abs(got - wide * factor) <= tol), (how, got, factor)


# --------------------------------------------------------------------------
# Narrow leaves beside a float64 leaf (x64): the tree's norm accumulates in
# float64, and every narrow leaf is scaled in float64's range
# --------------------------------------------------------------------------

_NARROW = ("complex64", "float32", "bfloat16", "float16")
_TINY = st.sampled_from((0.0, 1e-45, 1e-39, 1.2e-38, 3e-30, 1.0, 3e37, 3e38))
_MIXED_CONFIGS = (
  fz.Config("clip_global", (("max_norm", 1.0), ("ord", None))),
  fz.Config("clipped.global_clipnorm", (("global_clipnorm", 1.0),)),
  fz.Config("clip_norm", (("axis", None), ("max_norm", 1.0), ("ord", None))),
)


@fz.examples(6)
@hypothesis.given(
  config=st.sampled_from(_MIXED_CONFIGS),
  narrow=st.sampled_from(_NARROW),
  values=st.lists(st.tuples(_TINY, _TINY), min_size=3, max_size=3),
  wide=st.sampled_from((0.0, 1e-300, 1.0, 1e300)),
  limit=st.sampled_from((0.0, 1e-3, 1.0)),
)
# A zero complex64 leaf beside a float64 one: the exact recompute must not
# scale the complex parts by 2**1021 (the scale of a zero in float64's
# range) cast to float32, inf (0 * inf is NaN: a NaN global norm, and the
# whole update NaN at any limit).
@hypothesis.example(
  config=_MIXED_CONFIGS[0],
  narrow="complex64",
  values=[(0.0, 0.0)] * 3,
  wide=0.0,
  limit=1.0,
)
@hypothesis.example(
  config=_MIXED_CONFIGS[1],
  narrow="complex64",
  values=[(0.0, 1e-45), (0.0, 0.0), (0.0, 0.0)],
  wide=1e-300,
  limit=0.0,
)
# A complex64 leaf's modulus beside a float64 leaf is taken in float64 (in
# float32, the float64 leaf's update is off by 1e-8). A float16 value of
# 3e37 (inf in float16): the property clips it to float16's largest finite
# value, and compares clipping twice at the narrow leaf's rounding, which
# moves the norm more than float64's.
@hypothesis.example(
  config=_MIXED_CONFIGS[0],
  narrow="complex64",
  values=[(0.0, 0.0), (0.0, 0.0), (1.0, 1.0)],
  wide=1.0,
  limit=1e-3,
)
@hypothesis.example(
  config=_MIXED_CONFIGS[0],
  narrow="complex64",
  values=[(0.0, 0.0), (0.0, 0.0), (0.0, 1.0)],
  wide=1.0,
  limit=1e-3,
)
@hypothesis.example(
  config=_MIXED_CONFIGS[0],
  narrow="float16",
  values=[(0.0, 0.0), (0.0, 0.0), (3e37, 0.0)],
  wide=0.0,
  limit=0.0,
)
def test_narrow_leaves_beside_a_float64_leaf(
  config, narrow, values, wide, limit
):
  """A tree of one narrow leaf (complex64, float32, bfloat16, float16:
  zeros, subnormals, tiny and huge values) and one float64 leaf, under x64:
  global_norm equals the float64 oracle, and the clippers return a finite
  update that equals the oracle's (values below the narrow dtype's smallest
  normal may be flushed to 0) and clipping it again changes nothing.
  """
  dtype = np.dtype(fz.DTYPES[narrow])
  if dtype.kind == "c":
    x = np.array([complex(a, b) for a, b in values], dtype)
  else:
    # Finite in the narrow dtype: 3e37 is inf in float16.
    top = float(jnp.finfo(dtype).max)
    x = np.clip(np.array([a for a, _ in values], np.float32), -top, top)
    x = x.astype(dtype)
  tree = {"a": x, "b": np.full(2, wide)}
  leaves = fz.leaves(tree)
  flushed = math.sqrt(x.size) * fz.flush_atol(dtype)
  with fz.x64(tree):
    g = fz.to_jax(tree)
    norm = float(jax.jit(optaxclip.global_norm)(g))
    want = fz.measure_tree(leaves)
    assert abs(norm - want) <= 1e-6 * want + flushed, (norm, want)
    run = fz.static_runner(config)
    limit = F32(limit)
    oracle = fz.oracle_static(config, leaves, limit)
    out, _ = run(g, limit, None)
    twice, _ = run(out, limit, None)
    for got, again, w, leaf in zip(
      fz.leaves(out), fz.leaves(twice), oracle.out, leaves
    ):
      got = np.asarray(got).astype(w.dtype)
      again = np.asarray(again).astype(w.dtype)
      tol = 2 * fz.round_tol(leaf.dtype) * np.abs(w) + flushed
      assert np.all(np.isfinite(got)) and np.all(np.isfinite(again)), got
      assert np.all(np.abs(got - w) <= tol), (got, w)
      # Clipping again sees the narrow leaf rounded to its dtype: the tree's
      # norm may exceed the limit by that rounding, which the second clip
      # takes off every leaf (the float64 one too).
      coarsest = max(fz.round_tol(x.dtype) for x in leaves)
      again_tol = 2 * coarsest * np.abs(got) + flushed
      assert np.all(np.abs(again - got) <= again_tol), (again, got)


# --------------------------------------------------------------------------
# clipped_grad(method="ghost"): examples whose squared norm overflows
# float32 are clipped, as by the vmap method
# --------------------------------------------------------------------------


class _GhostNet(nn.Module):
  """Every path of the ghost norms: a Conv (the layer's own per-example
  gradient), a Dense by the Gram form (2 positions, 8 -> 8), a Dense by the
  direct form (8 -> 1) and a bare parameter (the exact fallback).
  """

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(8, kernel_size=(1,))(x)
    x = nn.Dense(8)(x)
    y = nn.Dense(1)(x)[..., 0].sum(axis=-1)
    return y * self.param("s", nn.initializers.ones, ())


_GHOST_SHAPE = (4, 2, 8)


def _host_init(net):
  """Parameters like flax's defaults (kernels of variance ``1 / fan_in``,
  zero biases, ``s`` one), drawn on the host: no init program traced and
  compiled (the methods are compared on any values).
  """
  shapes = jax.eval_shape(
    net.init,
    jax.ShapeDtypeStruct((2,), jnp.uint32),
    jax.ShapeDtypeStruct(_GHOST_SHAPE, jnp.float32),
  )
  rng = np.random.default_rng(0)

  def init(path, s):
    name = jax.tree_util.keystr(path[-1:])
    if "kernel" in name:
      fan_in = int(np.prod(s.shape[:-1]))
      return (rng.normal(size=s.shape) / np.sqrt(fan_in)).astype(s.dtype)
    fill = 0.0 if "bias" in name else 1.0
    return np.full(s.shape, fill, s.dtype)

  return jax.tree_util.tree_map_with_path(init, shapes)


@functools.cache
def _ghost_runners():
  """``(params, xs, padding) -> (grads, norms)`` per method, compiled once."""
  net = _GhostNet()
  params = _host_init(net)

  def loss(p, xs):
    return net.apply(p, xs)

  def runner(method):
    fn = optaxclip.clipped_grad(loss, 1.0, method=method)

    def run(p, xs, padding, clip):
      return fn(p, xs, is_padding_example=padding, l2_clip=clip)

    return fz.FastJit(run)

  return params, {m: runner(m) for m in ("ghost", "vmap")}


def _tree_norm(tree) -> float:
  return float(fz.measure_tree([np.asarray(g) for g in jax.tree.leaves(tree)]))


@fz.examples(5)
@hypothesis.given(
  scales=st.lists(
    st.sampled_from((1e-3, 1.0, 1e10, 1e19, 1e25, 1e30)),
    min_size=4,
    max_size=4,
  ),
  l2=st.sampled_from((1e-2, 1.0, 1e3)),
  seed=st.integers(0, 2**16),
)
# An example of norm ~1e21 (its squared norm above float32's range): ghost
# left it out (norm inf, zero contribution) where vmap clipped it.
@hypothesis.example(scales=[1.0, 1e20, 1e-3, 1e30], l2=1.0, seed=0)
def test_clipped_grad_ghost_clips_examples_beyond_the_range(scales, l2, seed):
  """clipped_grad(method="ghost") equals method="vmap" on examples of any
  finite size (norms up to ~1e31, squared far beyond float32's range): the
  same per-example norms and clipped sum, and each example alone (the
  others masked as padding) contributes at most ``l2_clip``.
  """
  params, runners = _ghost_runners()
  rng = np.random.default_rng(seed)
  xs = rng.normal(size=_GHOST_SHAPE).astype(F32)
  xs *= np.asarray(scales, F32)[:, None, None]
  clip = F32(l2)
  none = np.zeros(len(scales), bool)
  got = {m: run(params, xs, none, clip) for m, run in runners.items()}
  (g_ghost, n_ghost), (g_vmap, n_vmap) = got["ghost"], got["vmap"]
  n_ghost, n_vmap = np.asarray(n_ghost), np.asarray(n_vmap)
  assert np.all(np.isfinite(n_ghost)), n_ghost
  np.testing.assert_allclose(n_ghost, n_vmap, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_ghost), jax.tree.leaves(g_vmap)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    atol = 1e-5 * len(scales) * l2 + fz.flush_atol(F32)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)
  for b in range(len(scales)):
    alone = np.arange(len(scales)) != b
    grads, _ = runners["ghost"](params, xs, alone, clip)
    # Clipped, not dropped: an example of norm above l2 contributes l2.
    want = min(l2, float(n_vmap[b]))
    assert abs(_tree_norm(grads) - want) <= 1e-4 * want + 1e-30, (b, want)
