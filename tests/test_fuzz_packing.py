"""Many-leaf trees (issue 15, item 4): small leaves packed and reduced
together, each leaf scaled by its own factor, give the per-leaf numbers, and
the compiled program does not grow with one kernel per leaf.
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

SHAPES = ((5,), (2, 3), (1,), (3, 1, 2))


def _tree(draw_shapes, values):
  return {
    f"l{i:02d}": jax.device_put(np.asarray(v, np.float32).reshape(s))
    for i, (s, v) in enumerate(zip(draw_shapes, values))
  }


# The ci profile draws the values into these layouts only (each new layout
# compiles a new program): every shape of SHAPES, repeated and alone, two to
# nine leaves. Other profiles (release) draw layouts freely too.
LAYOUTS = (
  ((5,), (2, 3)),
  ((1,), (3, 1, 2), (5,), (1,), (2, 3), (3, 1, 2), (5,), (1,), (2, 3)),
)


@st.composite
def many_leaves(draw):
  free = st.lists(st.sampled_from(SHAPES), min_size=2, max_size=9)
  shapes = draw(fz.ci_or(st.sampled_from(LAYOUTS), free))
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


def _oracle_norm(x):
  x = np.asarray(x, np.float64)
  return np.sqrt(np.sum(x * x))


# Jitted once (one program a layout, compiled with the fast options; the
# state's init inside it: eagerly, each of its operations compiles).
_CLIP_NORM_TX = optaxclip.clip_norm(1.0)
_CLIP_NORM = fz.FastJit(
  lambda g: _CLIP_NORM_TX.update(g, _CLIP_NORM_TX.init(g))
)
_UNIT_NORMS = fz.FastJit(_norms.unit_norms)


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
    norm = _oracle_norm(x64)
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
    want = _oracle_norm(x)
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
  # Each leaf scaled by a slice of one factor vector compiled one kernel
  # per leaf (the slice offset is a constant in the kernel); now leaves of
  # one shape share their kernels: 12 or 36 leaves, the same kernels.
  def tree(n):  # only lowered: shapes and dtypes are all it needs
    return {
      f"l{i:02d}": jax.ShapeDtypeStruct(SHAPES[i % 2], jnp.float32)
      for i in range(n)
    }

  tx = optaxclip.clip_norm(1.0)

  def step(g):
    return tx.update(g, tx.init(g))

  # No growth per leaf; XLA may fuse the per-part kernels of bigger parts
  # differently (29 kernels for 12 leaves, 28 for 36 after the rows of
  # small leaves came from one concatenation; 28, 29 and 29 for 12, 36 and
  # 72 leaves once the unit norms came from one concatenation of the parts'
  # sums).
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
      st.sampled_from(SHAPES), st.sampled_from([jnp.float32, jnp.bfloat16])
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
