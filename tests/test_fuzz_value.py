"""Properties of ``clip_value(stats="sampled")``, and of
the exact mode's count on leaves too large to be their own sample.

Its update must be ``optax.clip``'s element by element, except that an inf
element becomes NaN, for every tree (every dtype, the whole finite range,
NaN and inf sprinkled); in leaves small enough to be their own sample its
statistics equal the exact formulation's oracle.
"""

import hypothesis
from hypothesis import strategies as st
import jax
import ml_dtypes
import numpy as np

import fuzz_strategies as fz
import optaxclip


def _oracle(x: np.ndarray, limit: float) -> np.ndarray:
  """Each element clipped in float64 (complex: its modulus); inf -> NaN."""
  if not np.iscomplexobj(x):
    x = x.astype(np.float64)
    return np.where(np.isinf(x), np.nan, np.clip(x, -limit, limit))
  x = x.astype(np.complex128)
  mag = np.abs(x)
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    # The phase first: limit / mag may underflow where the result does not.
    phase = x / np.where(mag > 0, mag, 1)
    out = np.where(mag > limit, phase * limit, x)
  return np.where(np.isinf(mag), np.nan, out)


def _run(g, limit):
  tx = optaxclip.clip_value(limit, stats="sampled")
  return tx.update(g, tx.init(g))


_RUN = fz.FastJit(_run)


def _seen(x: np.ndarray) -> np.ndarray:
  """``|x|`` in float64 as the accumulation dtype holds it: XLA:CPU flushes
  its subnormals to zero (a complex element's parts each, before its
  modulus is taken: a modulus of 1.2e-38 from two subnormal parts is 0).
  """
  acc = np.float64 if x.dtype == np.float64 else np.float32
  tiny = np.finfo(acc).tiny
  if np.iscomplexobj(x):
    flush = lambda v: np.where(np.abs(v) < tiny, 0.0, v)
    parts = x.astype(np.complex128)
    x = np.empty_like(parts)  # parts set apart: 1j * inf would be NaN + inf j
    x.real, x.imag = flush(parts.real), flush(parts.imag)
  mag = np.abs(x.astype(np.complex128 if np.iscomplexobj(x) else np.float64))
  return np.where(mag < tiny, 0.0, mag)


def _kept(x: np.ndarray, limit: float) -> np.ndarray:
  """The elements clip_value's count reads as within ``limit``: a real
  element's magnitude exactly (compared as integers: a subnormal above a
  limit of 0 counts, and the clip changes it), a complex one's modulus as
  :func:`_seen` has it (taken in floats, from flushed parts).
  """
  if np.iscomplexobj(x):
    return _seen(x) <= limit
  with np.errstate(invalid="ignore"):
    return np.abs(x.astype(np.float64)) <= limit


# Under ci the tree's layout comes from this palette (each layout compiles
# one program, shared by the examples that draw it again; the values drawn
# as fz.trees draws them): every dtype (float64 under x64, complex64),
# scalars, empty leaves, ranks 1 to 3, dict and list nesting, small leaves
# stacked for the statistics. Other
# profiles (release) draw layouts freely.
LAYOUTS = (
  {"a": ((3,), "float16"), "b": [((2, 3), "bfloat16"), ((), "complex64")]},
  [((4, 4), "float64"), ((0,), "float32"), ((2, 2, 3), "float32")],
  {
    "a": ((1,), "complex64"),
    "b": ((0, 3), "float16"),
    "c": ((2, 3), "float64"),
    "d": ((), "bfloat16"),
  },
  # Leaves of one size and accumulation dtype, stacked for the statistics.
  {
    "a": ((2, 3), "float32"),
    "b": ((6,), "float16"),
    "c": [((3, 2), "bfloat16"), ((), "float32"), ((), "float16")],
  },
)


def _is_spec(x) -> bool:
  return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str)


@st.composite
def _palette_trees(draw):
  """A tree of a :data:`LAYOUTS` layout, with a NaN / Inf somewhere."""
  specs, treedef = jax.tree.flatten(draw(st.sampled_from(LAYOUTS)), _is_spec)
  items = [
    draw(fz.arrays(dtype, shape, nonfinite=True)) for shape, dtype in specs
  ]
  sized = [x for x in items if x.size]
  if not fz.has_nonfinite(items):
    x = sized[draw(st.integers(0, len(sized) - 1))].reshape(-1)
    x[draw(st.integers(0, x.size - 1))] = draw(st.sampled_from(fz.NONFINITE))
  return jax.tree.unflatten(treedef, items)


@fz.examples(10)
@hypothesis.given(
  tree=fz.ci_or(
    _palette_trees(), fz.trees(dtypes=fz.ALL, nonfinite=True, min_leaves=1)
  ),
  limit=fz.limits(),
  finite=st.booleans(),
)
# An explicit example (rarely drawn under the ci profile): a complex64 element
# of two subnormal parts (modulus 1.2e-38) is 0 as XLA:CPU sees it, and comes
# out 0 where kept.
@hypothesis.example(
  tree={
    "a": np.array(np.nan, np.float16),
    "b": np.array(-3.731568e-39 - 1.1463796e-38j, np.complex64),
  },
  limit=0.0,
  finite=False,
)
@hypothesis.example(
  tree={"a": np.array(-3.731568e-39 - 1.1463796e-38j, np.complex64)},
  limit=2.0**-21,
  finite=False,
)
# An explicit example (rarely drawn under the ci profile): bfloat16 subnormals
# above a limit of 0 are clipped to 0 and count (compared as integers).
@hypothesis.example(
  tree={
    "k0": np.array(-6e-08, np.float16),
    "k1": np.array([np.nan, 9.18355e-41, 9.18355e-41], ml_dtypes.bfloat16),
  },
  limit=0.0,
  finite=False,
)
def test_sampled_stats_clip_element_wise(tree, limit, finite):
  if finite:  # half of the draws: finite trees, where NaN must not appear
    tree = jax.tree.map(
      lambda x: np.where(np.isfinite(x), x, np.zeros_like(x)), tree
    )
  with fz.x64(tree):
    out, state = _RUN(fz.to_jax(tree), jax.device_put(np.float32(limit)))
    mags, kept = [], []
    for x, y in zip(fz.leaves(tree), fz.leaves(out)):
      x, y = np.asarray(x), np.asarray(y)
      assert y.dtype == x.dtype and y.shape == x.shape
      want = _oracle(x, limit)
      got = y.astype(want.dtype)
      np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
      ok = ~np.isnan(want)
      tol = fz.round_tol(x.dtype)
      # Both parts of a complex element may be flushed: up to sqrt(2) tiny.
      flushed = fz.flush_atol(x.dtype) * (1.5 if np.iscomplexobj(x) else 1)
      np.testing.assert_allclose(got[ok], want[ok], rtol=2 * tol, atol=flushed)
      # The limit itself is rounded to x's dtype (a subnormal one to its
      # grid).
      real = np.float32 if np.iscomplexobj(x) else x.dtype
      spacing = float(ml_dtypes.finfo(real).smallest_subnormal)
      assert np.all(np.abs(got[ok]) <= limit * (1 + 2 * tol) + spacing)
      mag = _seen(x)
      mags.append(mag.ravel())
      kept.append(_kept(x, limit).ravel())
    mags, kept = np.concatenate(mags), np.concatenate(kept)
    if mags.size:
      assert np.isclose(
        float(state.clip_fraction), np.mean(~kept), rtol=1e-6, atol=1e-6
      )
      largest = np.max(mags)  # NaN if one is
      if np.isnan(largest):
        assert np.isnan(float(state.norm))
      else:
        with np.errstate(over="ignore"):  # a float64 norm: inf in float32
          want = np.float32(largest)
        # The float32 statistic of a float64 tree may be flushed subnormal.
        np.testing.assert_allclose(
          float(state.norm), want, rtol=1e-6, atol=fz.flush_atol(np.float32)
        )
      # NaN exactly when the update holds one (a float64 clipped norm may
      # still read inf in float32).
      nonfinite = not np.all(np.isfinite(mags))
      assert np.isnan(float(state.clipped_norm)) == nonfinite


# --- the exact mode counts every clipped element of a large leaf ------------

LARGE = 70_000  # above EXACT_COUNT_SIZE: stats="sampled" samples it


def _run_exact(g, limit):
  tx = optaxclip.clip_value(limit)
  return tx.update(g, tx.init(g))[1]


_RUN_EXACT = fz.FastJit(_run_exact)


@fz.examples(10)
@hypothesis.given(
  seed=st.integers(0, 2**32 - 1),
  outliers=st.integers(0, 40),
  dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
)
def test_exact_stats_count_every_clipped_element_of_a_large_leaf(
  seed, outliers, dtype
):
  """A few elements above the limit anywhere in a leaf of 70000 (mostly off
  the sample's grid of every 257th element, where a sampled count misses
  them) and in a small leaf beside it: ``clip_fraction`` is their exact
  share: the exact mode counts in the same pass as it reads the max, and
  does not estimate a large leaf's count from the sample.
  """
  rng = np.random.default_rng(seed)
  dt = fz.DTYPES[dtype]
  big = rng.uniform(-0.5, 0.5, LARGE).astype(dt)
  small = rng.uniform(-2.0, 2.0, 7).astype(np.float32)
  where = rng.choice(LARGE, outliers, replace=False)
  big[where] = (rng.choice([-1.0, 1.0], outliers) * 3.0).astype(dt)
  state = _RUN_EXACT({"big": jax.device_put(big), "small": small}, 1.0)
  want = (np.abs(big.astype(np.float64)) > 1.0).sum()
  want += (np.abs(small.astype(np.float64)) > 1.0).sum()
  fraction = float(state.clip_fraction)
  assert round(fraction * (LARGE + 7)) == want, (fraction, want)
  assert float(state.norm) == max(
    np.abs(big.astype(np.float64)).max(), np.abs(small).max()
  )
