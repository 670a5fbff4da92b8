"""Packing: small leaves packed (concatenated, stacked into parts, copied in
blocks) for one reduction or one scaling give, leaf by leaf, the numbers each
leaf has alone.

* Norms: ``_norms.unit_norms`` of leaves packed as rows of one concatenation
  equal those of each leaf reduced alone and a float64 reference (trees of
  many small leaves of mixed sizes and dtypes, magnitudes near float32's
  largest value and subnormal ones, NaN and inf sprinkled);
  ``clip_global(leaf_stats=True)``'s leaf norms are those of each leaf
  alone, and its update that of the path without leaf_stats; the parts'
  exact norms (``unit_norms_packed``) are those of each leaf alone, bit for
  bit, beyond float32's range too, and leaves copied in blocks
  (``blocked_concat``) are the plain concatenation, bit for bit.
* Scaling: ``UnitLayout.scale`` and ``UnitLayout.scale_leafwise`` give, bit
  for bit, what ``scale_leaf`` gives each leaf alone (factors far below the
  smallest normal number, NaN and zero factors), with the same derivatives.
* Clippers: ``clip_norm`` on many leaves gives the per-leaf oracle;
  ``clip_unitwise`` and ``clip_norm(axis=...)`` (kernels of one shape
  stacked) and ``clip_value`` (small leaves reduced stacked) give the
  numbers of the same clipper on one leaf at a time.
* Cutting back: ``take_each`` is exact indexing; ``split_parts`` pieces
  concatenated again in order are the vector they were cut from.
* Compiled size: the program does not grow with one kernel per leaf, and
  ``clip_global``'s factor arithmetic is not copied per leaf.
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
from optaxclip import _norms

# --- norms of small leaves packed for one reduction --------------------------

# Several leaves of each size, so that rows are packed together; (2, 3) and
# (6,) share a unit size and are rows of one part.
SMALL_SHAPES = ((6,), (2, 3), (5,), (1,), (4, 2))
SMALL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
SPECIAL = (0.0, 1e-45, 1e-40, 3e38, -3.3e38, 1e30, np.inf, np.nan)


# The ci profile draws the values into these layouts only (each new layout
# compiles new programs): every shape and dtype, several leaves of one size
# and dtype (packed rows), (2, 3) beside (6,), mixed dtypes, 3 to 12 leaves.
# Other profiles (release) draw layouts freely too.
_F32, _BF16, _F16 = SMALL_DTYPES
SMALL_LAYOUTS = (
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
    st.tuples(st.sampled_from(SMALL_SHAPES), st.sampled_from(SMALL_DTYPES)),
    min_size=3,
    max_size=12,
  )
  layout = draw(fz.ci_or(st.sampled_from(SMALL_LAYOUTS), free))
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
      leaves.append(fz.to_jax(values.astype(dtype)))
  return leaves


def _float64_norm(x) -> float:
  """The L2 norm of a leaf's float32 values in float64 (NaN if any is)."""
  a = fz.as_float32(x).astype(np.float64)
  if np.isnan(a).any():
    return np.nan
  return float(np.sqrt(np.sum(a * a)))


# Each leaf reduced on its own (one part per leaf, nothing packed), in one
# compiled program per tree.
_unit_norms_alone = fz.FastJit(
  lambda leaves: [_norms.unit_norms([x])[0].reshape(()) for x in leaves]
)

# The leaves packed (one program a layout).
_UNIT_NORMS = fz.FastJit(_norms.unit_norms)


def _assert_norms_equal(got, want, err, atol=0.0):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.isnan(got) == np.isnan(want), err
  if not np.isnan(want):
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=atol, err_msg=err)


@fz.examples(4, deadline=None)
@hypothesis.given(many_small_leaves())
def test_packed_unit_norms_equal_one_leaf_at_a_time(leaves):
  packed = _UNIT_NORMS(leaves)
  alone = _unit_norms_alone(leaves)
  for i, (p, a, x) in enumerate(zip(packed, alone, leaves)):
    # Scalars on the host (a JAX reshape compiles a program per shape).
    p, a = np.asarray(p).reshape(()), np.asarray(a).reshape(())
    _assert_norms_equal(p, a, f"leaf {i}")
    want = _float64_norm(x)
    # A norm beyond float32's range reads inf as a plain float32.
    with np.errstate(over="ignore"):
      want = np.float32(want)
    # XLA:CPU may flush a float32 subnormal to zero (a leaf of 1e-45 alone
    # has norm 0): a platform behaviour, within the smallest normal.
    _assert_norms_equal(
      p,
      want,
      f"leaf {i} vs float64",
      atol=fz.flush_atol(np.float32),
    )


# Built and jitted once (one program a layout across examples).
_WITH_STATS_TX = optaxclip.clip_global(1.0, leaf_stats=True)
_WITHOUT_TX = optaxclip.clip_global(1.0)
_WITH_STATS = fz.FastJit(_WITH_STATS_TX.update)
_WITHOUT = fz.FastJit(_WITHOUT_TX.update)


@fz.examples(3, deadline=None)
@hypothesis.given(many_small_leaves())
def test_leaf_stats_norms_and_clip_equal_the_unpacked_path(leaves):
  tree = {f"l{i:02d}": x for i, x in enumerate(leaves)}
  out, state = _WITH_STATS(tree, _WITH_STATS_TX.init(tree))
  ref_out, ref_state = _WITHOUT(tree, _WITHOUT_TX.init(tree))
  _assert_norms_equal(state.norm, ref_state.norm, "global norm")
  alone = dict(zip(tree, _unit_norms_alone(list(tree.values()))))
  for k in tree:
    _assert_norms_equal(state.leaf_norms.tree()[k], alone[k], k)
    got = fz.as_float32(out[k])
    want = fz.as_float32(ref_out[k])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=k)
    ok = ~np.isnan(want)
    # One rounding of the factor apart at most (the global norm is put
    # together from the per-leaf sums in another order).
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-2, err_msg=k)


# --- many-leaf trees: packed norms, clip_norm, compiled size -----------------

LEAF_SHAPES = ((5,), (2, 3), (1,), (3, 1, 2))


def _tree(draw_shapes, values):
  return {
    f"l{i:02d}": jax.device_put(np.asarray(v, np.float32).reshape(s))
    for i, (s, v) in enumerate(zip(draw_shapes, values))
  }


# The ci profile draws the values into these layouts only (each new layout
# compiles a new program): every shape of LEAF_SHAPES, repeated and alone,
# two to nine leaves. Other profiles (release) draw layouts freely too.
LEAF_LAYOUTS = (
  ((5,), (2, 3)),
  ((1,), (3, 1, 2), (5,), (1,), (2, 3), (3, 1, 2), (5,), (1,), (2, 3)),
)


@st.composite
def many_leaves(draw):
  free = st.lists(st.sampled_from(LEAF_SHAPES), min_size=2, max_size=9)
  shapes = draw(fz.ci_or(st.sampled_from(LEAF_LAYOUTS), free))
  special = st.sampled_from([0.0, 1e-30, 1e30, np.inf, -np.inf, np.nan])
  element = st.one_of(st.floats(-5, 5, width=32), special)
  values = [
    draw(st.lists(element, min_size=int(np.prod(s)), max_size=int(np.prod(s))))
    for s in shapes
  ]
  return _tree(shapes, values)


# Jitted as the clippers use it (one program a shape).
_TAKE_EACH = jax.jit(_norms.take_each)


def _lists(length):
  return st.lists(
    st.sampled_from([0.0, 1.0, -2.5, 1e38, np.inf, -np.inf, np.nan]),
    min_size=length,
    max_size=length,
  )


# The ci profile draws the values into these lengths only (each new length
# runs new programs); other profiles (release) draw the length freely too.
@fz.examples(10, deadline=None)
@hypothesis.given(
  fz.ci_or(st.sampled_from((0, 1, 4, 11)), st.integers(0, 11)).flatmap(_lists)
)
def test_take_each_is_exact_indexing(values):
  v = np.asarray(values, np.float32)
  got = _TAKE_EACH(jax.device_put(v))
  assert len(got) == len(v)
  for g, w in zip(got, v):
    np.testing.assert_array_equal(np.asarray(g), w)  # NaN == NaN here
  if len(v):
    rows = _TAKE_EACH(jax.device_put(np.stack([v, -v], 1)))
    np.testing.assert_array_equal(
      np.stack([np.asarray(r) for r in rows]), np.stack([v, -v], 1)
    )


# Jitted once (one program a layout, compiled with the fast options; the
# state's init inside it: eagerly, each of its operations compiles).
_CLIP_NORM_TX = optaxclip.clip_norm(1.0)
_CLIP_NORM = fz.FastJit(
  lambda g: _CLIP_NORM_TX.update(g, _CLIP_NORM_TX.init(g))
)


@fz.examples(5, deadline=None)
@hypothesis.example(  # an explicit example: 2**-126 / 2 flushed
  tree=fz.to_jax(
    {
      "l00": np.zeros(5, np.float32),
      "l01": np.array([0, 0, 0, 2, 1.1754944e-38], np.float32),
    }
  )
)
@hypothesis.given(many_leaves())
def test_clip_norm_many_leaves_matches_per_leaf(tree):
  out, state = _CLIP_NORM(tree)
  clipped = 0
  for k, x in tree.items():
    x64 = np.asarray(x, np.float64)
    norm = _float64_norm(x64)
    got = np.asarray(out[k], np.float64)
    if not np.isfinite(norm):  # the non-finite policy: the unit is NaN
      assert np.all(np.isnan(got)), k
      clipped += 1
      continue
    factor = min(1.0, 1.0 / norm) if norm > 0 else 1.0
    clipped += factor < 1
    # XLA:CPU flushes a product below float32's smallest normal to 0
    # (2**-126 * 0.5 is 0): a platform behaviour, within the smallest normal.
    np.testing.assert_allclose(
      got,
      (x64 * factor).astype(np.float32),
      rtol=2e-6,
      atol=fz.flush_atol(np.float32),
      err_msg=k,
    )
  np.testing.assert_allclose(
    float(state.clip_fraction), clipped / len(tree), rtol=1e-6
  )


@fz.examples(4, deadline=None)
@hypothesis.example(  # an explicit example: a subnormal norm
  tree=fz.to_jax(
    {"l00": np.zeros(1, np.float32), "l01": np.array([8e-45], np.float32)}
  )
)
@hypothesis.given(many_leaves())
def test_unit_norms_packed_match_unpacked(tree):
  leaves = list(tree.values())
  got = _UNIT_NORMS(leaves)
  assert [g.shape for g in got] == [(1,) * x.ndim for x in leaves]
  for g, x in zip(got, leaves):
    want = _float64_norm(x)
    got = float(np.asarray(g).ravel()[0])
    if np.isnan(want):
      assert np.isnan(got)
    else:
      # XLA:CPU may flush a subnormal norm to 0 (a leaf of 8e-45 has norm
      # 0, packed or alone): a platform behaviour, within the smallest
      # normal.
      np.testing.assert_allclose(
        got, min(want, np.inf), rtol=1e-6, atol=fz.flush_atol(np.float32)
      )


def _kernels(fn, tree) -> int:
  """The number of distinct fused computations XLA compiles for fn."""
  text = jax.jit(fn).lower(tree).compile().as_text()
  bodies = set()
  for comp in re.split(r"\n(?=%\S+ \()", text):
    if comp.startswith("%fused"):
      body = comp.partition("{\n")[2]
      body = re.sub(r", metadata=\{[^}]*\}", "", body)
      bodies.add(re.sub(r"%[\w.\-]+", "%x", body))
  return len(bodies)


def test_kernels_do_not_grow_with_leaves_of_one_shape():
  # Leaves of one shape share their kernels (a leaf scaled by its own slice
  # of one factor vector would compile a kernel per leaf: the slice's
  # offset is a constant in the kernel): 12, 36 or 72 leaves, the same
  # kernels.
  def tree(n):  # only lowered: shapes and dtypes are all it needs
    return {
      f"l{i:02d}": jax.ShapeDtypeStruct(LEAF_SHAPES[i % 2], jnp.float32)
      for i in range(n)
    }

  tx = optaxclip.clip_norm(1.0)

  def step(g):
    return tx.update(g, tx.init(g))

  # No growth per leaf; XLA may fuse the per-part kernels of bigger parts
  # differently: one kernel more than for 12 leaves at most.
  few, many, more = (_kernels(step, tree(n)) for n in (12, 36, 72))
  assert more <= many <= few + 1


# The ci profile draws the values into this layout only (a new layout
# compiles a new program); other profiles (release) draw layouts freely.
MIXED_LAYOUT = (
  ((5,), jnp.float32),
  ((2, 3), jnp.bfloat16),
  ((5,), jnp.float32),
  ((3, 1, 2), jnp.float32),
  ((2, 3), jnp.float32),
  ((5,), jnp.bfloat16),
)


@st.composite
def leaves_of_several_layouts(draw):
  """Small leaves of several shapes and dtypes (several packed parts and
  groups), with magnitudes whose squares overflow or underflow float32.
  """
  free = st.lists(
    st.tuples(
      st.sampled_from(LEAF_SHAPES), st.sampled_from([jnp.float32, jnp.bfloat16])
    ),
    min_size=3,
    max_size=8,
  )
  layout = draw(fz.ci_or(st.just(MIXED_LAYOUT), free))
  element = st.sampled_from([0.0, -2.0, 1.5, 1e-30, 1e30, 3e38, np.inf, np.nan])
  out = []
  for shape, dtype in layout:
    size = int(np.prod(shape))
    values = draw(st.lists(element, min_size=size, max_size=size))
    # Cast on the host: an eager cast is a program per shape.
    out.append(
      jax.device_put(
        np.asarray(values, np.float32).reshape(shape).astype(dtype)
      )
    )
  return out


def _exactly(n: _norms.Scaled) -> np.ndarray:
  return np.ldexp(np.asarray(n.value, np.float64), np.asarray(n.exponent))


@functools.partial(jax.jit, static_argnums=1)
def _packed_and_alone(leaves, p):
  layout, parts = _norms.unit_norms_packed(leaves, p)
  alone = [_norms.unit_norms_scaled([x], p)[0] for x in leaves]
  return layout.unpack(parts), alone


@fz.examples(4, deadline=None)
@hypothesis.given(
  leaves_of_several_layouts(),
  fz.ci_or(st.just(2.0), st.sampled_from([1.0, 2.0, 3.0])),
)
def test_packed_unit_norms_equal_each_leaf_alone(leaves, p):
  # The parts' sums are checked, rooted and recomputed exactly on one
  # concatenation per group and sliced back: each leaf's norm is the one it
  # has alone (the exact path beyond float32's range included), bit for bit.
  packed, alone = _packed_and_alone(leaves, p)
  for got, want in zip(packed, alone):
    np.testing.assert_array_equal(_exactly(got), _exactly(want))


# One layout under ci: leaves of 63 and 40 elements (copied in blocks, see
# _norms.blocked_concat), one of them alone, units whole or per row.
BLOCKED_LAYOUT = ((7, 9),) * 5 + ((40,),) * 3 + ((5, 8),)


@st.composite
def leaves_copied_in_blocks(draw):
  """Leaves of 33 to 64 elements, which UnitLayout packs block by block."""
  free = st.lists(
    st.sampled_from([(7, 9), (40,), (5, 8), (64,), (33,)]),
    min_size=2,
    max_size=9,
  )
  layout = draw(fz.ci_or(st.just(BLOCKED_LAYOUT), free))
  element = st.sampled_from([0.0, -2.0, 1.5, 1e-30, 1e30, 3e38, np.inf, np.nan])
  return [
    np.asarray(
      draw(st.lists(element, min_size=n, max_size=n)), np.float32
    ).reshape(shape)
    for shape in layout
    for n in [int(np.prod(shape))]
  ]


def _blocked_and_plain(leaves, per_row):
  # per_row: one unit per column of the 2-D leaves (their units across the
  # leading axis: stacked parts), else whole leaves (rows).
  axes = [(0,) if per_row else None for _ in leaves]
  by_size = {}
  for x in leaves:
    by_size.setdefault(x.shape, []).append(x)
  blocked = [_norms.blocked_concat(xs) for xs in by_size.values()]
  plain = [jnp.concatenate([x.ravel() for x in xs]) for xs in by_size.values()]
  layout, parts = _norms.unit_norms_packed(
    leaves, 2.0, axes, several_units=True
  )
  alone = [
    _norms.unit_norms_scaled([x], 2.0, [ax])[0] for x, ax in zip(leaves, axes)
  ]
  return blocked, plain, layout.unpack(parts), alone


# Compiled with the fast options, one program a layout.
_BLOCKED = {
  r: fz.FastJit(functools.partial(_blocked_and_plain, per_row=r))
  for r in (False, True)
}


@fz.examples(3, deadline=None)
@hypothesis.given(leaves_copied_in_blocks(), st.booleans())
def test_blocked_packing_is_the_concatenation(leaves, per_row):
  # Small leaves are stacked in blocks before their concatenation (cheaper
  # for XLA:CPU to compile): the same elements in the same order, bit for
  # bit, and each leaf's unit norms (whole leaves, or one unit per column,
  # packed as rows or as a stack) those it has alone.
  blocked, plain, packed, alone = _BLOCKED[per_row](leaves)
  for b, q in zip(blocked, plain):
    np.testing.assert_array_equal(
      np.asarray(b).view(np.uint32), np.asarray(q).view(np.uint32)
    )
  for got, want in zip(packed, alone):
    np.testing.assert_array_equal(_exactly(got), _exactly(want))


# --- small leaves scaled in their packed parts -------------------------------

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
    *fz.to_jax(
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


_SCALED = {fn: fz.FastJit(fn) for fn in (_packed, _leafwise, _alone)}


def _with_scaled(fn):
  def run(leaves, values, exponents):
    return fn(leaves, _norms.Scaled(values, exponents))

  return run


_SCALED_GRAD = {
  fn: fz.weighted_sum_grad(_with_scaled(fn))
  for fn in (_packed, _leafwise, _alone)
}
_assert_same = fz.assert_same


@fz.examples(4, deadline=None)
@hypothesis.given(leaves_and_factors())
def test_packed_scaling_equals_each_leaf_scaled_alone(case):
  leaves, factor = case
  want = _SCALED[_alone](leaves, factor)
  for fn in (_packed, _leafwise):
    got = _SCALED[fn](leaves, factor)
    for i, (g, w, x) in enumerate(zip(got, want, leaves)):
      assert g.dtype == x.dtype and g.shape == x.shape, (fn.__name__, i)
      _assert_same(g, w, f"{fn.__name__}: leaf {i}")


@fz.examples(2, deadline=None)
@hypothesis.given(leaves_and_factors())
def test_packed_scaling_has_the_derivatives_of_each_leaf_alone(case):
  leaves, factor = case
  # Finite leaves of moderate size: derivatives, not the non-finite policy.
  # (On the host: eager operations would compile a program per leaf.)
  leaves = [np.asarray(x) for x in leaves]
  leaves = fz.to_jax(
    [
      np.where(np.isfinite(x) & (np.abs(x) < 1e4), x, 1).astype(x.dtype)
      for x in leaves
    ]
  )
  value = np.asarray(factor.value)
  values = jax.device_put(np.where(np.isnan(value), 0.75, value))
  want = _SCALED_GRAD[_alone](leaves, values, factor.exponent)
  for fn in (_packed, _leafwise):
    got = _SCALED_GRAD[fn](leaves, values, factor.exponent)
    for i, (g, w) in enumerate(zip(got[0], want[0])):
      _assert_same(g, w, f"{fn.__name__}: d/dleaf {i}")
    # The factor's cotangent sums a leaf's elements: the order may differ.
    _assert_same(got[1], want[1], f"{fn.__name__}: d/dfactor", exact=False)


# --- stacked small leaves: the clippers, one leaf at a time ------------------

# Kernels (units across the leading axis), vectors and a conv-like leaf.
KERNEL_SHAPES = ((3, 2), (2, 3), (4,), (2, 2, 3), (1, 3))


# The ci profile draws the values into these layouts only (each new layout
# compiles a new program): repeated shapes apart and together, transposed
# kernels, every shape of KERNEL_SHAPES, two to seven leaves. Other profiles
# (release) draw layouts freely too.
KERNEL_LAYOUTS = (
  ((3, 2), (2, 3), (3, 2), (4,), (2, 2, 3), (3, 2), (1, 3)),
  ((2, 3), (2, 3)),
  ((4,), (1, 3), (2, 2, 3), (4,), (2, 2, 3)),
)


@st.composite
def kernel_trees(draw):
  free = st.lists(st.sampled_from(KERNEL_SHAPES), min_size=2, max_size=7)
  shapes = draw(fz.ci_or(st.sampled_from(KERNEL_LAYOUTS), free))
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


def _each_leaf_alone(tx, tree, params):
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
  want = _each_leaf_alone(tx, tree, params)
  for k in tree:
    np.testing.assert_allclose(out[k], want[k], rtol=2e-6, err_msg=k)


@fz.examples(6, deadline=None)
@hypothesis.given(kernel_trees())
def test_clip_value_stacked_matches_one_leaf_at_a_time(tree):
  tx = TXS["value"]
  out, state = _runner(tx)(tree, tx.init(tree))
  want = _each_leaf_alone(tx, tree, tree)
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
  # The factor's exponent arithmetic (bitcast-converts) is computed once,
  # not fused into every leaf's kernel: as many for 24 leaves as for 4.
  def tree(n):
    return {f"l{i:02d}": jnp.full((3,), i + 1.0) for i in range(n)}

  tx = optaxclip.clip_global(1.0)

  def step(g):
    return tx.update(g, tx.init(g))

  assert _bitcasts(step, tree(4)) == _bitcasts(step, tree(24))


# --- pieces cut from one vector ----------------------------------------------


def test_pieces_concatenated_in_order_are_the_vector_they_were_cut_from():
  def check(flat):
    like = [jnp.zeros((2, 1)), jnp.zeros((3,))]
    pieces = _norms.split_parts(flat, like)
    assert _norms.concat_parts(pieces) is flat
    # Out of order, or a part only: a plain concatenation.
    assert _norms.concat_parts(pieces[:1]) is not flat
    swapped = _norms.concat_parts(pieces[::-1])
    assert swapped is not flat
    return swapped

  flat = jnp.arange(5.0)
  np.testing.assert_array_equal(
    jax.jit(check)(flat), jnp.concatenate([flat[2:], flat[:2]])
  )
