"""Maxima keep NaN.

XLA:CPU (jaxlib 0.10, its YNNPACK reduction fusion) drops a NaN from a max
or min reduction of 4096 elements or more: ``clip_value``'s ``max |g|`` and
``ord=inf`` norms read a NaN leaf as finite, and the leaf's other values
were clipped as usual. ``_norms.nan_max`` and ``_norms.nan_extremes`` are
the reductions every max-based statistic goes through; here they must equal
NumPy's ``max`` and ``min`` (which keep NaN) on arrays on both sides of that
size, and the clippers built on them must make a non-finite unit all NaN.
"""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import fuzz_strategies as fz
import optaxclip
from optaxclip import _norms

# Under ci: a few shapes on both sides of 4096 elements, and of 8192 (a
# float32 leaf reduced whole once took max and min one at a time), each
# compiles once per axis choice; release draws them freely.
CI_SHAPES = ((4095,), (4096,), (5000,), (3, 2048), (70, 80), (8192,), (2, 9000))
DTYPES = ("float32", "float64", "float16", "bfloat16")


def _dtype(name):
  return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


@st.composite
def _arrays(draw):
  shape = draw(
    fz.ci_or(
      st.sampled_from(CI_SHAPES),
      st.lists(st.integers(1, 9000), min_size=1, max_size=2).filter(
        lambda s: np.prod(s) <= 40000
      ),
    )
  )
  shape = tuple(shape)
  dtype = _dtype(draw(st.sampled_from(DTYPES)))
  seed = draw(st.integers(0, 2**32 - 1))
  rng = np.random.default_rng(seed)
  x = rng.uniform(-1, 1, shape) * 10.0 ** draw(st.integers(-30, 30))
  x = x.astype(np.float64)
  flat = x.reshape(-1)
  # A few NaN and inf at drawn places: first, last, anywhere.
  for special in draw(
    st.lists(st.sampled_from([np.nan, np.inf, -np.inf]), max_size=3)
  ):
    where = draw(
      st.sampled_from(["first", "last", "any"]),
    )
    i = {"first": 0, "last": flat.size - 1}.get(where)
    flat[rng.integers(0, flat.size) if i is None else i] = special
  axis = draw(st.sampled_from([None] + list(range(len(shape)))))
  keepdims = draw(st.booleans())
  with np.errstate(over="ignore"):  # beyond float16's range: inf, kept
    return x.astype(dtype), axis, keepdims


@functools.cache
def _reducers(axis, keepdims):
  return (
    fz.FastJit(lambda v: _norms.nan_max(v, axis, keepdims=keepdims)),
    fz.FastJit(lambda v: _norms.nan_extremes(v, axis, keepdims=keepdims)),
    fz.FastJit(lambda v: _norms.largest_magnitude(v, axis, keepdims=keepdims)),
  )


@fz.examples(12)
@hypothesis.given(case=_arrays())
# The release profile's find: one NaN first in 70000 float32 values.
@hypothesis.example(
  case=(
    np.concatenate(
      [[np.nan], np.random.default_rng(0).uniform(-1, 1, 69999)]
    ).astype(np.float32),
    None,
    False,
  )
)
# Found when float16 was left to the plain reductions: their min dropped a
# first NaN of 4096 values too.
@hypothesis.example(
  case=(
    np.concatenate(
      [[np.nan], np.random.default_rng(0).uniform(-1, 1, 4096)[1:]]
    ).astype(np.float16),
    None,
    False,
  )
)
# A float32 leaf reduced whole, max and min one at a time over a flat view:
# a NaN last in a (2, 9000) array, keepdims.
@hypothesis.example(
  case=(
    np.concatenate([np.random.default_rng(1).uniform(-1, 1, 17999), [np.nan]])
    .reshape(2, 9000)
    .astype(np.float32),
    None,
    True,
  )
)
def test_nan_max_and_extremes_keep_nan(case):
  """nan_max and nan_extremes equal NumPy's max and min, and
  largest_magnitude NumPy's max of |x|, NaN included.
  """
  x, axis, keepdims = case
  axes = None if axis is None else (axis,)
  with fz.x64(x):
    top_fn, both_fn, magnitude_fn = _reducers(axes, keepdims)
    wide = x.astype(np.float64)
    want_top = np.max(wide, axis=axis, keepdims=keepdims)
    want_bottom = np.min(wide, axis=axis, keepdims=keepdims)
    want_magnitude = np.max(np.abs(wide), axis=axis, keepdims=keepdims)
    got_top = np.asarray(top_fn(fz.to_jax(x)), np.float64)
    got_both = [np.asarray(v, np.float64) for v in both_fn(fz.to_jax(x))]
    got_magnitude = np.asarray(magnitude_fn(fz.to_jax(x)), np.float64)
  for got, want in (
    (got_top, want_top),
    *zip(got_both, (want_top, want_bottom)),
    (got_magnitude, want_magnitude),
  ):
    np.testing.assert_array_equal(got, want)


def test_nan_max_derivative_is_jnp_max_s():
  """The gradient flows to the largest element, as jnp.max's does."""
  x = jnp.asarray(np.random.default_rng(1).uniform(-1, 1, 5000), jnp.float32)
  got = jax.grad(lambda v: _norms.nan_max(v, initial=0))(x)
  want = jax.grad(lambda v: jnp.max(v, initial=0))(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  got = jax.grad(lambda v: -_norms.nan_extremes(v)[1])(x)
  want = jax.grad(lambda v: -jnp.min(v))(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


CLIPPERS = {
  "clip_value": lambda: optaxclip.clip_value(0.5),
  "clip_norm(ord=inf)": lambda: optaxclip.clip_norm(0.5, ord=np.inf),
  "clip_global(ord=inf)": lambda: optaxclip.clip_global(0.5, ord=np.inf),
}


@functools.cache
def _runner(name):
  tx = CLIPPERS[name]()
  return fz.FastJit(lambda g: tx.update(g, tx.init(g)))


@fz.examples(6)
@hypothesis.given(
  name=st.sampled_from(sorted(CLIPPERS)),
  size=fz.ci_or(st.sampled_from([4096, 5000]), st.integers(4096, 70000)),
  where=st.floats(0, 1),
  special=st.sampled_from([np.nan, np.inf]),
)
def test_max_based_clippers_poison_a_big_nonfinite_leaf(
  name, size, where, special
):
  """A NaN or inf in a leaf of 4096 elements or more: the leaf comes out
  all NaN (the whole tree under clip_global), and norm and clipped_norm
  are non-finite; a finite small leaf beside it is clipped as usual.
  """
  rng = np.random.default_rng(size)
  big = rng.uniform(-1, 1, size).astype(np.float32)
  big[min(int(where * size), size - 1)] = special
  small = np.array([0.25, -2.0], np.float32)
  out, state = _runner(name)(fz.to_jax({"big": big, "small": small}))
  stats = optaxclip.stats(state)
  assert np.all(np.isnan(np.asarray(out["big"]))), name
  norm = float(next(v for k, v in stats.items() if k.endswith("/norm")))
  clipped = float(
    next(v for k, v in stats.items() if k.endswith("/clipped_norm"))
  )
  assert not np.isfinite(norm) and not np.isfinite(clipped), (name, stats)
  if np.isnan(special):
    assert np.isnan(norm), (name, norm)
  if name == "clip_global(ord=inf)":
    assert np.all(np.isnan(np.asarray(out["small"])))
  else:
    want = [0.25, -0.5] if name == "clip_value" else [0.0625, -0.5]
    np.testing.assert_array_equal(np.asarray(out["small"]), want)


# The clippers whose statistics or decisions rest on maxima. A plain float
# max or min anywhere in their update (outside the derivative rules) is one
# XLA:CPU may let drop a NaN once it reduces 4096 elements or more.
_MAX_BASED = {
  "clip_value": lambda: optaxclip.clip_value(0.5),
  "clip_value(sampled)": lambda: optaxclip.clip_value(0.5, stats="sampled"),
  "clip_norm(ord=inf)": lambda: optaxclip.clip_norm(1.0, ord=np.inf),
  "clip_global(ord=inf)": lambda: optaxclip.clip_global(1.0, ord=np.inf),
  "clip_spikes_adaptive": optaxclip.clip_spikes_adaptive,
}


def _plain_extrema(jaxpr, found):
  """The float ``reduce_max`` / ``reduce_min`` equations of ``jaxpr`` and
  of the jaxprs inside it (conds, nested jits, the primal of custom
  derivative rules; the rules themselves are not traced here).
  """
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("reduce_max", "reduce_min") and jnp.issubdtype(
      eqn.invars[0].aval.dtype, jnp.floating
    ):
      found.append((eqn.primitive.name, eqn.invars[0].aval.shape))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          _plain_extrema(sub.jaxpr, found)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          _plain_extrema(sub, found)
  return found


# Leaves of few shapes, so that several share a stacked part; only traced.
_SPEC_SHAPES = ((), (2,), (2,), (3, 2), (0,), (5000,), (70_000,))


@fz.examples(15)
@hypothesis.given(
  specs=st.lists(
    st.tuples(st.sampled_from(_SPEC_SHAPES), st.sampled_from(fz.ALL)),
    min_size=1,
    max_size=12,
  ),
  name=st.sampled_from(sorted(_MAX_BASED)),
)
# Found by reading (a column of the largest magnitudes of leaves stacked
# together, reduced by jnp.max): with 4100 leaves of 2 elements, one NaN,
# clip_value's norm read 0.1.
@hypothesis.example(specs=[((2,), "float32")] * 5, name="clip_value")
def test_max_based_clippers_reduce_no_plain_maximum(specs, name):
  if name == "clip_spikes_adaptive":  # real leaves only
    specs = [(s, d) for s, d in specs if not d.startswith("complex")]
    hypothesis.assume(specs)
  with fz.x64([d for _, d in specs]):
    tree = [jax.ShapeDtypeStruct(s, jnp.dtype(fz.DTYPES[d])) for s, d in specs]
    tx = _MAX_BASED[name]()
    jaxpr = jax.make_jaxpr(tx.update)(tree, jax.eval_shape(tx.init, tree))
    assert _plain_extrema(jaxpr.jaxpr, []) == []


# --- counts: exact, whatever the size, and the mask fused ------------------

_COUNT = jax.jit(_norms.count)
_COUNT_ROWS = jax.jit(jax.vmap(_norms.count))


@fz.examples(12)
@hypothesis.given(
  shape=fz.ci_or(
    st.sampled_from([(0,), (1,), (4096,), (70_000,), (3, 40_000)]),
    st.lists(st.integers(0, 300), min_size=1, max_size=3),
  ),
  density=st.sampled_from([0.0, 1e-4, 0.3, 1.0]),
  seed=st.integers(0, 2**32 - 1),
)
@hypothesis.example(shape=[255, 257, 257], density=1.0, seed=0)
def test_count_is_exact_for_any_mask(shape, density, seed):
  """``_norms.count`` (a two-output reduction, so that XLA:CPU fuses the
  mask into it) equals NumPy's count for masks of any size and density,
  all false and all true included, and row by row under vmap: exactly, as
  a float32 holds it (counted in int32, rounded once: exact up to 2**24;
  the release profile drew 255 x 257 x 257 all true, 16842495, which
  float32 holds as 16842496).
  """
  mask = np.random.default_rng(seed).random(shape) < density
  assert float(_COUNT(mask)) == float(np.float32(np.count_nonzero(mask)))
  if mask.ndim == 2:
    rows = np.asarray(_COUNT_ROWS(mask))
    np.testing.assert_array_equal(rows, mask.sum(axis=1).astype(np.float32))


def test_count_writes_no_leaf_sized_mask():
  """The compiled count of a comparison over a large leaf has no temporary
  of the leaf's size (a plain sum wrote the mask out in full).
  """
  x = jnp.zeros((1 << 20,), jnp.float32)
  compiled = (
    jax.jit(lambda x: _norms.count(jnp.abs(x) > 0.5)).lower(x).compile()
  )
  assert compiled.memory_analysis().temp_size_in_bytes < 1 << 16
