"""The fuzz suite's cross-cutting invariants, against float64 oracles.

Drawn with the strategies of ``fuzz_strategies`` (trees of float16, bfloat16,
float32, float64 under x64 and complex64 leaves over the whole finite range,
NaN/Inf sprinkled, clipper configurations over the public API, 1, 2 or 8
devices, derivative order 0 to 2), each property holds for every input:

* static clippers: each unit's measure is within its limit (relative 1e-5,
  plus the rounding of the leaf's dtype), the update is the gradient times
  ``min(1, limit / measure)`` per unit (direction kept), the statistics equal
  the oracle's, finite input gives finite output, clipping twice is clipping
  once;
* non-finite input (one policy for every clipper): a NaN anywhere makes the
  update non-finite, as does an Inf for norm-based clippers (``clip_value``
  clips an infinite element to the limit, as PyTorch, optax and TF do), no
  finite leaf comes back unclipped, and ``clipped_norm`` is finite exactly
  when the update is;
* adaptive clippers and ``guard``, after any history: finite steps give
  finite updates that keep their direction and never grow, the statistics
  describe the update returned, what is held back is counted, and a lasting
  new level of the norm gets through within a bounded number of steps (no
  absorbing state);
* ``clip_per_example``: each example moves the sum by at most ``l2_clip``,
  whatever it holds (huge or non-finite examples included);
* sharded leaves (``axis_name`` inside ``shard_map``, 1, 2 or 8 devices)
  give the oracle's numbers for the whole tree;
* first and second derivatives through ``update`` exist and equal float64
  finite differences of the oracle;
* a second step does not retrace and no step moves data to or from the host.

Values below a dtype's smallest normal may come back as zero: XLA:CPU flushes
subnormals (``fuzz_strategies.flush_atol``). Compilation dominates the cost:
the limit is a traced argument and shapes come from a small set, so examples
reuse compiled programs; each test's ``max_examples`` keeps the suite near a
minute under the ``ci`` profile (``HYPOTHESIS_PROFILE=release`` runs many
more, see conftest.py). Rare inputs each property must hold on are pinned as
explicit examples. A property that fails on today's code only because a fix
has not landed is marked ``xfail(strict=True)`` with the item and branch, so
that the mark goes when the fix lands.
"""

import functools
import math
import os

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fuzz_strategies as fz

REL = 1e-5
F32 = np.float32
F16 = np.float16


def _examples(n, xfailing=False):
  """``n`` examples under the ci profile (the suite's budget of about a
  minute); other profiles (release) keep their own count. ``xfailing``: a
  property expected to fail on today's code stops at its first falsifying
  example instead of shrinking it (minutes of compiles); FUZZ_SHRINK=1
  shrinks anyway, to report a minimal example.
  """
  kwargs = {}
  if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci":
    kwargs["max_examples"] = n
  if xfailing:  # one AssertionError, as the xfail mark expects
    kwargs["report_multiple_bugs"] = False
  if xfailing and not os.environ.get("FUZZ_SHRINK"):
    kwargs["phases"] = (
      hypothesis.Phase.explicit,
      hypothesis.Phase.reuse,
      hypothesis.Phase.generate,
    )
  return hypothesis.settings(**kwargs)


def _host(tree):
  """A JAX result as float64 / complex128 NumPy leaves."""
  return [
    np.asarray(x).astype(np.complex128 if np.iscomplexobj(x) else np.float64)
    for x in jax.tree.leaves(tree)
  ]


def _finite(values) -> bool:
  return all(np.all(np.isfinite(v)) for v in values)


def _rtol(dtype) -> float:
  return 2 * REL + fz.round_tol(dtype)


def _stat_close(got, want, rtol=2 * REL, what="", atol=0.0):
  """A float32 statistic against the float64 oracle (cast to the stat's
  dtype: float32 statistics of a float64 tree may be 0 or inf).
  """
  got = np.asarray(got)
  want_c = np.asarray(want, np.float64).astype(got.dtype)
  if np.isinf(want_c) or np.isinf(got):
    top = float(np.finfo(got.dtype).max)
    assert (got == want_c) or min(abs(float(got)), abs(float(want))) >= (
      top * (1 - rtol)
    ), f"{what}: {got} != {want}"
    return
  atol = atol + float(np.finfo(got.dtype).tiny)
  assert abs(float(got) - float(want_c)) <= rtol * abs(float(want_c)) + atol, (
    f"{what}: {got} != {want}"
  )


def _limit_for(tree, value):
  """The limit as the clipper sees it: float64 for an all-float64 tree,
  else float32; no subnormal in either (XLA:CPU flushes it, in float64 too:
  a float64 limit of 1.7e-310 reads as 0).
  """
  leaves = fz.leaves(tree)
  dtype = F32
  if leaves and all(np.asarray(x).dtype == np.float64 for x in leaves):
    dtype = np.float64
  v = np.asarray(value, dtype)[()]
  if 0 < abs(v) < np.finfo(dtype).tiny:
    v = dtype(0)
  return v


# --------------------------------------------------------------------------
# Static clippers on finite input
# --------------------------------------------------------------------------

RATIOS = (0.0, 1e-30, 1e-3, 0.5, 0.99999, 1.0, 2.0)


def _check_static(config, tree, params, limit, out, state, stats=True):
  leaves = fz.leaves(tree)
  oracle = fz.oracle_static(
    config, leaves, limit, fz.leaves(params) if params is not None else None
  )
  got = _host(out)
  msg = f"{config!r} limit={limit!r}"
  assert jax.tree.structure(out) == jax.tree.structure(tree), msg
  assert [np.asarray(x).dtype for x in jax.tree.leaves(out)] == [
    np.asarray(x).dtype for x in leaves
  ], f"{msg}: dtypes changed"
  # Finite input: finite output.
  assert _finite(got), f"{msg}: non-finite output from finite input"
  got_measures = oracle.unit_measure(got)
  tree_flush = max(
    (
      fz.norm_flush_atol(
        np.asarray(x).dtype, sum(np.size(y) for y in leaves), oracle.order
      )
      for x in leaves
    ),
    default=0.0,
  )
  tree_rtol = max((_rtol(np.asarray(x).dtype) for x in leaves), default=REL)
  for x, g, want, m, lim in zip(
    leaves, got, oracle.out, got_measures, oracle.limits
  ):
    dtype = np.asarray(x).dtype
    atol = fz.norm_flush_atol(dtype, x.size, oracle.order)
    rtol = _rtol(dtype)
    if config.static_name == "clip_global":  # one unit: the whole tree
      atol, rtol = tree_flush, tree_rtol
    # 1. Within the limit.
    over = m > lim * (1 + rtol) + atol
    assert not np.any(over), (
      f"{msg}: a unit's measure {m[over].max():.6g} exceeds its limit "
      f"{np.broadcast_to(lim, m.shape)[over].max():.6g} ({dtype})"
    )
    # 2. The gradient times min(1, limit / measure): direction kept.
    err = np.abs(g - want)
    bound = _rtol(dtype) * np.abs(want) + fz.element_flush_atol(dtype)
    assert np.all(err <= bound), (
      f"{msg}: update differs from the oracle by {np.max(err - bound):.3g}"
      f" beyond tolerance ({dtype}); got {g.ravel()[:4]}, want "
      f"{want.ravel()[:4]}"
    )
  if not stats:
    return
  # 3. Statistics equal the oracle's (up to flushed subnormals).
  for field in ("norm", "clipped_norm"):
    _stat_close(
      getattr(state, field),
      oracle.stats[field],
      what=f"{msg}: {field}",
      atol=tree_flush,
    )
  # Measures below the smallest normal may be flushed to 0 (either side);
  # clip_global's unit is the whole tree.
  lo, hi = oracle.clip_fraction_band(
    REL,
    [
      tree_flush
      if config.static_name == "clip_global"
      else fz.norm_flush_atol(np.asarray(x).dtype, x.size, oracle.order)
      for x in leaves
    ],
  )
  # Exact in leaves of any size (clip_value's count of a large leaf, once
  # estimated from a sample, comes with the read of its max).
  frac = float(state.clip_fraction)
  assert lo - 1e-6 <= frac <= hi + 1e-6, (
    f"{msg}: clip_fraction {frac}, oracle between {lo} and {hi}"
  )


def _clipper_state(state):
  """The clipper's own state inside ``clipped``'s chain."""
  return (
    state[0]
    if isinstance(state, tuple) and not hasattr(state, "_fields")
    else state
  )


def _static(name, **kw):
  return fz.Config(name, tuple(sorted(kw.items())))


# Under the ci profile the (configuration, tree layout) pairs come from this
# palette, the values drawn freely (each pair compiles one program, shared
# by the examples that draw it again); other profiles (release) draw both
# freely. Together: every static clipper and clipped() kind, every ord and
# axis, every dtype (float64 under x64, complex64), scalars, empty leaves
# and a large one (not concatenated), dict and list nesting.
STATIC_PALETTE = (
  (
    _static("clip_value", max_delta=1.0),
    {"a": ((3,), "float16"), "b": [((2, 3), "bfloat16"), ((), "float32")]},
  ),
  (
    _static("clip_norm", max_norm=1.0, ord=None, axis=None),
    [((70_000,), "float32"), ((0,), "float16"), ((2, 2, 3), "complex64")],
  ),
  (
    _static("clip_norm", max_norm=1.0, ord=1, axis=0),
    {"a": ((2, 3), "float32"), "b": ((4, 4), "bfloat16")},
  ),
  (
    _static("clip_norm", max_norm=1.0, ord="inf", axis=-1),
    [((2, 2, 3), "float16"), ((1, 5), "float64")],
  ),
  (
    _static("clip_norm", max_norm=1.0, ord=2, axis=(0, 1)),
    {"a": ((2, 3), "complex64"), "b": ((2, 2, 3), "float32")},
  ),
  (
    _static("clip_global", max_norm=1.0, ord=None),
    {
      "a": ((2, 3), "complex64"),
      "b": ((4, 4), "float64"),
      "c": ((0, 3), "float32"),
    },
  ),
  (
    _static("clip_global", max_norm=1.0, ord=1),
    [((3,), "bfloat16"), ((70_000,), "float16")],
  ),
  (
    _static("clip_global", max_norm=1.0, ord="inf"),
    {"a": ((), "float32"), "b": ((1,), "float64")},
  ),
  (
    _static("clip_global", max_norm=1.0, ord=3),
    [((4, 4), "float32"), ((3,), "complex64")],
  ),
  (
    _static("clip_block_rms", threshold=1.0),
    {
      "a": ((2, 2, 3), "float64"),
      "b": ((0,), "float32"),
      "c": ((3,), "bfloat16"),
    },
  ),
  (
    _static("clip_unitwise", clipping=1.0, eps=1e-3),
    {"a": ((4, 4), "float32"), "b": ((3,), "float64")},
  ),
  (
    _static("clip_unitwise", clipping=1.0, eps=0.0),
    {"a": ((2, 3), "bfloat16"), "b": ((0, 3), "float16"), "c": ((), "float32")},
  ),
  (
    _static("clipped.clipvalue", clipvalue=1.0),
    {"a": ((2, 3), "complex64"), "b": ((), "float64")},
  ),
  (
    _static("clipped.clipnorm", clipnorm=1.0),
    [((70_000,), "bfloat16"), ((1,), "float32")],
  ),
  (
    _static("clipped.global_clipnorm", global_clipnorm=1.0),
    {"a": ((4, 4), "float16"), "b": ((2, 3), "float32")},
  ),
)


def _is_spec(x):
  return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str)


@st.composite
def _palette_tree(draw, layout, nonfinite, magnitudes):
  """Values of ``layout`` (leaves ``(shape, dtype name)``) drawn as
  ``fz.trees`` draws them: a NaN/Inf somewhere with ``nonfinite``.
  """
  specs, treedef = jax.tree.flatten(layout, is_leaf=_is_spec)
  items = [
    draw(fz.arrays(dtype, shape, nonfinite=nonfinite, magnitudes=magnitudes))
    for shape, dtype in specs
  ]
  sized = [x for x in items if x.size]
  if nonfinite and sized and not fz.has_nonfinite(items):
    x = sized[draw(st.integers(0, len(sized) - 1))].reshape(-1)
    x[draw(st.integers(0, x.size - 1))] = draw(st.sampled_from(fz.NONFINITE))
  return jax.tree.unflatten(treedef, items)


@st.composite
def _static_case(draw, nonfinite=False, magnitudes="all"):
  if fz.ci_profile():
    config, layout = draw(st.sampled_from(STATIC_PALETTE))
    tree = draw(_palette_tree(layout, nonfinite, magnitudes))
    params = (
      draw(fz.like(tree, magnitudes=magnitudes))
      if config.needs_params
      else None
    )
    return config, tree, params, draw(fz.limits(magnitudes=magnitudes))
  config = draw(fz.static_configs(axes=fz.AXES))
  shapes = (
    fz.MATRIX_SHAPES if config.kw.get("axis") is not None else (fz.SHAPES)
  )
  dtypes = fz.REAL if config.name == "clip_unitwise" else fz.ALL
  tree = draw(
    fz.trees(
      dtypes=dtypes,
      shapes=shapes,
      nonfinite=nonfinite,
      min_leaves=2 if nonfinite else 1,
      large=config.kw.get("axis") is None,
      magnitudes=magnitudes,
    )
  )
  params = (
    draw(fz.like(tree, magnitudes=magnitudes)) if config.needs_params else None
  )
  extra = draw(fz.limits(magnitudes=magnitudes))
  return config, tree, params, extra


@_examples(12)
@hypothesis.given(case=_static_case(magnitudes="ordinary"))
# Clipping twice moves the float32 leaf by 5.7e-5 relative (its own rounding
# allows 2e-5): the tree's norm, measured again, sees the float16 and
# bfloat16 leaves rounded to their dtypes, so the check allows the coarsest
# leaf's rounding.
@hypothesis.example(
  case=(
    fz.Config("clip_global", (("max_norm", 1.0), ("ord", None))),
    {
      "k0": np.array(-0.635, np.float16),
      "k1": {
        "k0": np.array(-0.635, np.float16),
        "k1": {
          "k0": np.array(-0.63671875, jnp.bfloat16),
          "k1": np.array(-0.63489336, F32),
        },
      },
    },
    None,
    0.0,
  )
)
# Both parts of a complex element scaled below float32's smallest normal are
# flushed, which moves the element by up to sqrt(2) times it (here 1.56e-38,
# above the smallest normal, 1.18e-38).
@hypothesis.example(
  case=(
    fz.Config("clip_block_rms", (("threshold", 1.0),)),
    {"a": np.array([1000 + 1000j, 0.75 + 0.75j], np.complex64)},
    None,
    1.47e-35,
  )
)
def test_static_clippers_match_the_oracle(case):
  """Bound, direction, statistics, finiteness, idempotence of every static
  clipper on ordinary magnitudes (2**-40 to 2**40), for limits around the
  tree's own measure and one drawn in the same range.
  """
  _static_property(*case)


@_examples(8)
@hypothesis.given(case=_static_case(magnitudes="extreme"))
# A tree of a complex64 and a float64 leaf (x64) whose complex values are
# all 0 (or below 2**-128) has a finite norm: the exact recompute's
# power-of-two scale, taken in float64's range (2**1021), must not be cast to
# float32 (inf) to scale the complex parts (0 * inf is NaN). clip(clip(g)) at
# limit 0, where clip(g) is 0, takes that path.
@hypothesis.example(
  case=(
    fz.Config("clipped.global_clipnorm", (("global_clipnorm", 1.0),)),
    {"a": np.zeros(2, np.complex64), "b": np.zeros(2)},
    None,
    0.0,
  )
)
# A complex64 leaf holding 3.4e38 - 8.2e37j (a modulus beyond float32's
# range, both parts finite) is a finite gradient: clip_block_rms must not take
# its norm as inf and return NaN.
@hypothesis.example(
  case=(
    fz.Config("clip_block_rms", (("threshold", 1.0),)),
    {"a": np.array([3.4028235e38 - 8.1875762e37j, 6.4e37j, 0], np.complex64)},
    None,
    0.0,
  )
)
# A leaf above 2**126 (its norm must not flush to 0 and leave the leaf
# unclipped) and a clip factor below float32's smallest normal.
@hypothesis.example(
  case=(
    fz.Config("clip_norm", (("axis", None), ("max_norm", 1.0), ("ord", None))),
    {"a": np.array([1e38, -1e38], F32)},
    None,
    1.0,
  )
)
@hypothesis.example(
  case=(
    fz.Config("clip_global", (("max_norm", 1.0), ("ord", None))),
    {"a": np.array([1.4e37, 1e37], F32)},
    None,
    1e-3,
  )
)
@hypothesis.example(
  case=(
    fz.Config("clip_unitwise", (("clipping", 1.0), ("eps", 1e-3))),
    {"a": np.zeros(3, F32), "b": np.zeros((0, 3), F32)},
    {"a": np.array([2e19, 0, 0], F32), "b": np.zeros((0, 3), F32)},
    1.0,
  )
)
# clip_block_rms's limit, the threshold times sqrt(n)'s mantissa 0.5, is
# subnormal for a threshold of 1.5e-38 on a one-element leaf, and must not be
# flushed (the leaf clipped to 0).
@hypothesis.example(
  case=(
    fz.Config("clip_block_rms", (("threshold", 1.0),)),
    {
      "k0": np.zeros(0, np.float16),
      "k1": np.array(-1.49692e-38, jnp.bfloat16),
    },
    None,
    fz._ldexp32(0.5, -125),
  )
)
# clip_global's unit is the whole tree, so a flushed measure is allowed the
# tree's flush, not the float64 leaf's (both values subnormal: norm 0, nothing
# clipped at a zero limit); and a bfloat16 param of 9.2e-41 is read as 0 (a
# limit of 0 with eps=0).
@hypothesis.example(
  case=(
    fz.Config("clip_global", (("max_norm", 1.0), ("ord", None))),
    {
      "k0": np.zeros(0, F16),
      "k1": {
        "k0": np.array(-9.18355e-41, jnp.bfloat16),
        "k1": np.array(-5e-324, np.float64),
      },
    },
    None,
    fz._ldexp32(0.5, -125),
  )
)
@hypothesis.example(
  case=(
    _static("clip_unitwise", clipping=1.0, eps=0.0),
    {"k0": np.array(-1.49692e-38, jnp.bfloat16)},
    {"k0": np.array(-9.18355e-41, jnp.bfloat16)},
    fz._ldexp32(0.5, -125),
  )
)
# The infinity norm of a complex leaf whose modulus exceeds float32's range
# while both parts are finite: the p = inf paths scale by the largest part's
# power of two (the plain modulus reads inf, and the whole tree would come
# out NaN).
@hypothesis.example(
  case=(
    _static("clip_global", max_norm=1.0, ord="inf"),
    {
      "k0": np.tile(np.array([-6e-08, 6e-08], F16), 35000),
      "k1": {
        "k0": np.array(-6e-08, F16),
        "k1": np.array(-2.7005377e37 + 3.4028235e38j, np.complex64),
      },
    },
    None,
    fz._ldexp32(0.5, -125),
  )
)
@hypothesis.example(
  case=(
    _static("clip_norm", max_norm=1.0, ord="inf", axis=-1),
    {"k0": np.array([[-2.7005377e37 + 3.4028235e38j, 1 + 1j]], np.complex64)},
    None,
    1.0,
  )
)
# A float64 limit below the smallest normal (1.7e-310, twice this leaf's RMS)
# is read as 0 by XLA:CPU, and the leaf is clipped to 0, as for float32
# limits.
@hypothesis.example(
  case=(
    fz.Config("clip_block_rms", (("threshold", 1.0),)),
    {
      "k0": np.concatenate(
        [[2.2250738585072014e-308], np.tile([5e-324, -5e-324], 35000)[1:]]
      )
    },
    None,
    fz._ldexp32(0.5, -125),
  )
)
def test_static_clippers_at_the_edges_of_the_range(case):
  """The same properties for values at the edges of each dtype's range
  (subnormals, smallest normals, 2**126 and above, the largest finite) and
  limits anywhere in float32's normal range.
  """
  _static_property(*case)


def _static_property(config, tree, params, extra):
  leaves = fz.leaves(tree)
  with fz.x64(tree):
    g = fz.to_jax(tree)
    p = fz.to_jax(params) if params is not None else None
    run = fz.static_runner(config)
    # Limits as multiples of the largest measure-to-limit ratio of a unit.
    at_one = fz.oracle_static(
      config, leaves, 1.0, fz.leaves(params) if params is not None else None
    )
    scale = max(
      (
        float(np.max(m / np.where(lim > 0, lim, 1)))
        for m, lim in zip(at_one.measures, at_one.limits)
        if m.size
      ),
      default=1.0,
    )
    for ratio in RATIOS + (None,):
      value = extra if ratio is None else ratio * scale
      if not math.isfinite(value):
        value = math.inf if ratio is None else float(np.finfo(F32).max)
      limit = _limit_for(tree, value)
      out, state = run(g, limit, p)
      state = _clipper_state(state)
      _check_static(config, tree, params, limit, out, state)
      # 4. Clipping twice is clipping once.
      twice, _ = run(out, limit, p)
      # Clipping again measures the clipped leaves rounded to their dtypes:
      # where one norm spans the tree (clip_global), the coarsest leaf's
      # rounding may put it above the limit, and the second clip takes that
      # off every leaf.
      coarsest = max(
        (np.asarray(x).dtype for x in leaves), key=fz.round_tol, default=F32
      )
      for a, b, x in zip(_host(twice), _host(out), leaves):
        dtype = np.asarray(x).dtype
        rounded = coarsest if config.static_name == "clip_global" else dtype
        np.testing.assert_allclose(
          a,
          b,
          rtol=2 * REL + max(fz.round_tol(dtype), fz.round_tol(rounded)),
          atol=fz.element_flush_atol(dtype),
          err_msg=f"{config!r} limit={limit!r}: clip(clip(g)) != clip(g)",
        )


# --------------------------------------------------------------------------
# Non-finite input: one policy for every clipper
# --------------------------------------------------------------------------


def _has(values, pred) -> bool:
  return any(np.any(pred(v)) for v in values)


def _check_nonfinite_policy(config, tree, params, limit, out, clipped_norm):
  leaves = _host(tree)
  got = _host(out)
  msg = f"{config!r} limit={limit!r}"
  has_nan = _has(leaves, np.isnan)
  has_inf = _has(leaves, np.isinf)
  update_finite = _finite(got)
  if has_nan or (has_inf and config.static_name != "clip_value"):
    assert not update_finite, (
      f"{msg}: a {'NaN' if has_nan else 'Inf'} in the gradient gave a "
      "finite update"
    )
  # The unit of a non-finite norm comes out all NaN: the whole tree for
  # clip_global, a leaf holding a NaN or inf for clip_value (exact).
  for x, g in zip(leaves, got):
    whole_tree = config.static_name == "clip_global" and (has_nan or has_inf)
    own_leaf = (
      config.static_name == "clip_value"
      and config.kw.get("stats", "exact") == "exact"
      and not np.all(np.isfinite(x))
    )
    if whole_tree or own_leaf:
      assert np.all(np.isnan(g)), (
        f"{msg}: a value of a non-finite unit came out as a number"
      )
  # Never a finite leaf passed unclipped: every finite unit of the output is
  # within its limit; for clip_global the finite leaves together are.
  oracle_leaves = [np.where(np.isfinite(x), x, 0) for x in leaves]
  oracle = fz.oracle_static(
    config,
    oracle_leaves,
    limit,
    fz.leaves(params) if params is not None else None,
  )
  if config.static_name == "clip_global":
    finite_out = [g for g in got if np.all(np.isfinite(g))]
    norm = fz.measure_tree(finite_out, config.kw.get("ord"))
    tol = max(_rtol(np.asarray(x).dtype) for x in fz.leaves(tree))
    size = sum(np.size(x) for x in fz.leaves(tree))
    flush = max(
      fz.norm_flush_atol(np.asarray(x).dtype, size, oracle.order)
      for x in fz.leaves(tree)
    )
    assert norm <= limit * (1 + tol) + flush, (
      f"{msg}: finite leaves of global norm {norm:.6g} > {limit}"
    )
  else:
    measures = oracle.unit_measure(got)
    for x, g, lim, m in zip(fz.leaves(tree), got, oracle.limits, measures):
      x = np.asarray(x)
      ok = ~np.isfinite(m) | (
        m
        <= lim * (1 + _rtol(x.dtype))
        + fz.norm_flush_atol(x.dtype, x.size, oracle.order)
      )
      assert np.all(ok), f"{msg}: a finite unit above its limit: {g}"
  # clipped_norm describes the update returned.
  assert bool(np.isfinite(clipped_norm)) == update_finite, (
    f"{msg}: clipped_norm {clipped_norm} but the update is "
    f"{'finite' if update_finite else 'non-finite'}"
  )


@_examples(8)
@hypothesis.given(case=_static_case(nonfinite=True, magnitudes="ordinary"))
# A NaN leaf must not switch clipping off for the others.
@hypothesis.example(
  case=(
    fz.Config("clip_global", (("max_norm", 1.0), ("ord", None))),
    {"a": np.array([np.nan], F32), "b": np.array([1e6], F32)},
    None,
    1.0,
  )
)
# An explicit example (rarely drawn under the ci profile): clipping=inf is no
# limit, also for a unit whose params' norm and eps are 0 (an empty leaf's; the
# oracle must not take inf * 0 = NaN).
@hypothesis.example(
  case=(
    _static("clip_unitwise", clipping=1.0, eps=0.0),
    {"k0": np.array(np.nan, F16), "k1": np.zeros((0,), F16)},
    {"k0": np.array(-0.635, F16), "k1": np.zeros((0,), F16)},
    math.inf,
  )
)
# An explicit example (rarely drawn under the ci profile): XLA:CPU's reductions
# of 4096 elements or more drop a NaN from a plain max, so clip_value's max |g|
# is _norms.nan_max (else the leaf's other values are clipped as usual and
# clipped_norm reads 0.5).
@hypothesis.example(
  case=(
    _static("clip_value", max_delta=1.0),
    {
      "k0": np.concatenate(
        [[np.nan], np.random.default_rng(0).uniform(-1, 1, 69999)]
      ).astype(F32),
      "k1": np.array(-0.635, F16),
    },
    None,
    0.5,
  )
)
def test_static_clippers_nonfinite_policy(case):
  """A NaN (or, norm-based, an Inf) anywhere: a non-finite update, no
  finite leaf above its limit, and clipped_norm non-finite with it.
  """
  config, tree, params, value = case
  hypothesis.assume(fz.has_nonfinite(tree))
  with fz.x64(tree):
    limit = _limit_for(tree, value)
    out, state = fz.static_runner(config)(
      fz.to_jax(tree), limit, fz.to_jax(params) if params is not None else None
    )
    state = _clipper_state(state)
    _check_nonfinite_policy(
      config, tree, params, float(limit), out, np.asarray(state.clipped_norm)
    )


# --------------------------------------------------------------------------
# Adaptive clippers and guard: histories
# --------------------------------------------------------------------------

# Histories run on one of a few tree layouts (each compiles once per config).
LAYOUTS = ({"w": (3,)}, {"a": (2, 2), "b": [(3,)]})
FINITE_LEVELS = (0.0, 1e-3, 1.0, 1e3, 1e30)
NONFINITE_LEVELS = (math.nan, math.inf)
F64_LEVELS = (1e-50, 1e200)
LASTING = (1e-3, 1.0, 1e3)  # below guard's max_norm (a cap by design)
BOUND = 60  # steps within which a lasting new level must get through
ZERO_LEAF = -1.0  # a level: the first leaf zero, the others at norm 1


# Under ci, (configuration, layout, dtype) of a history from this palette
# (each compiles once, shared by the four history properties; the dtype is
# drawn where a property asks for others, float64), the history and levels
# drawn; release draws all freely. Together: every adaptive clipper and
# guard, both scopes, each mode, clip option and spike rule, caps and none.
HISTORY_PALETTE = (
  (
    _static(
      "clip_zscore",
      warmup_steps=1,
      alpha=0.5,
      spike_z=1.0,
      max_norm=None,
      mode="zscore",
      clip_option="adaptive_scaling",
      skip_update_on_spike=True,
      scope="global",
    ),
    LAYOUTS[0],
    "float32",
  ),
  (
    _static(
      "clip_zscore",
      warmup_steps=3,
      alpha=0.97,
      spike_z=2.5,
      max_norm=1.0,
      mode="percentile",
      clip_option="mean",
      skip_update_on_spike=False,
      scope="leaf",
    ),
    LAYOUTS[1],
    "bfloat16",
  ),
  (
    _static("clip_percentile", percentile=0.0, history=1, scope="global"),
    LAYOUTS[1],
    "float32",
  ),
  (
    _static("clip_percentile", percentile=50.0, history=4, scope="leaf"),
    LAYOUTS[1],
    "float32",
  ),
  (
    _static("clip_percentile", percentile=100.0, history=4, scope="global"),
    LAYOUTS[0],
    "bfloat16",
  ),
  (
    _static(
      "clip_relative",
      factor=1.0,
      beta=0.5,
      warmup_steps=1,
      warmup_max_norm=math.inf,
    ),
    LAYOUTS[1],
    "float32",
  ),
  (
    _static(
      "clip_relative",
      factor=2.0,
      beta=0.98,
      warmup_steps=3,
      warmup_max_norm=1.0,
    ),
    LAYOUTS[0],
    "bfloat16",
  ),
  (
    _static(
      "guard.clip_global",
      spike_z=1.0,
      max_norm=1e4,
      warmup_steps=3,
      alpha=0.5,
      inner_limit=1.0,
    ),
    LAYOUTS[1],
    "float32",
  ),
  (
    _static(
      "guard.identity",
      spike_z=3.0,
      max_norm=None,
      warmup_steps=1,
      alpha=0.97,
    ),
    LAYOUTS[0],
    "float32",
  ),
  (
    _static(
      "guard.identity",
      spike_z=None,
      max_norm=1e30,
      warmup_steps=3,
      alpha=0.5,
    ),
    LAYOUTS[1],
    "bfloat16",
  ),
)


@st.composite
def _history_case(
  draw,
  levels=FINITE_LEVELS,
  lasting=LASTING,
  dtypes=("float32", "bfloat16"),
  configs=None,
  zero_warmup=False,
):
  if configs is None and fz.ci_profile():
    config, layout, dtype = draw(st.sampled_from(HISTORY_PALETTE))
    if dtype not in dtypes:
      dtype = draw(st.sampled_from(tuple(dtypes)))
  else:
    config = draw(
      configs
      if configs is not None
      else st.one_of(fz.adaptive_configs(), fz.guard_configs())
    )
    layout = draw(st.sampled_from(LAYOUTS))
    dtype = draw(st.sampled_from(tuple(dtypes)))
  direction = jax.tree.map(
    lambda shape: draw(fz.arrays("float64", shape, magnitudes="ordinary")),
    layout,
    is_leaf=lambda x: isinstance(x, tuple),
  )
  hypothesis.assume(fz.measure_tree(fz.leaves(direction)) > 0)
  history = draw(st.lists(st.sampled_from(tuple(levels)), max_size=8))
  if zero_warmup:  # a warm-up of zeros (or of a zero leaf) first
    history = [draw(st.sampled_from((0.0, ZERO_LEAF)))] * draw(
      st.integers(1, 4)
    ) + history
  cap = config.kw.get("max_norm") if config.kind == "guard" else None
  # guard's max_norm is a fixed cap: steps above it are skipped by design.
  lasting = [x for x in lasting if cap is None or x < cap]
  hypothesis.assume(lasting)
  new_level = draw(st.sampled_from(tuple(lasting)))
  return config, direction, dtype, history, new_level


def _at_level(direction, level, dtype):
  """``direction`` scaled to global L2 norm ``level`` (NaN/Inf: one element
  of it), in ``dtype``.
  """
  flat, treedef = jax.tree.flatten(direction)
  norm = float(fz.measure_tree(flat))
  out = []
  for i, x in enumerate(flat):
    if level == ZERO_LEAF:
      y = np.asarray(x / norm) * (i > 0)
    elif math.isfinite(level):
      y = np.asarray(x / norm * level)
    else:
      y = np.array(x, copy=True)
      if i == 0:
        y.reshape(-1)[0] = level
    out.append(y.astype(fz.DTYPES[dtype]))
  return jax.tree.unflatten(treedef, out)


def _scope(config):
  return config.kw.get(
    "scope", "leaf" if config.name == "clip_relative" else "global"
  )


def _check_finite_step(config, g, out, old, new, step):
  """One finite step of an adaptive clipper or guard."""
  msg = f"{config!r} step {step}"
  g_l, o_l = _host(g), _host(out)
  assert _finite(o_l), f"{msg}: non-finite update from a finite gradient"
  g_norm = float(fz.measure_tree(g_l))
  o_norm = float(fz.measure_tree(o_l))
  dtype = np.asarray(fz.leaves(g)[0]).dtype
  rtol, atol = _rtol(dtype), fz.flush_atol(dtype) * 4
  # The update is the gradient times a factor in [0, 1] per clipping unit.
  units = (
    list(zip(g_l, o_l))
    if _scope(config) == "leaf"
    else [
      (
        np.concatenate([x.ravel() for x in g_l]),
        np.concatenate([x.ravel() for x in o_l]),
      )
    ]
  )
  for x, y in units:
    top = float(np.max(np.abs(x), initial=0.0))
    xs, ys = (x / top, y / top) if top > 0 else (x, y)  # no overflow
    xx = float(np.sum(xs * xs))
    f = float(np.sum(xs * ys)) / xx if xx > 0 else 0.0
    assert -rtol <= f <= 1 + rtol, f"{msg}: factor {f} outside [0, 1]"
    assert np.all(np.abs(y - f * x) <= rtol * np.abs(x) + atol), (
      f"{msg}: the update is not the gradient times one factor"
    )
  if config.kind == "guard":
    skipped = int(new.counts.skipped) - int(old.counts.skipped)
    assert int(new.counts.nonfinite) == int(old.counts.nonfinite), (
      f"{msg}: a finite norm {g_norm:.3g} counted as non-finite"
    )
    assert skipped in (0, 1), msg
    if skipped:
      assert o_norm == 0, f"{msg}: a skipped step returned {o_norm}"
    if config.name == "guard.identity" and not skipped:
      assert o_norm == pytest.approx(g_norm, rel=rtol, abs=atol), msg
    _stat_close(new.verdict.norm, g_norm, rtol=2 * rtol, what=f"{msg}: norm")
    return
  _stat_close(new.norm, g_norm, rtol=2 * rtol, what=f"{msg}: norm", atol=atol)
  _stat_close(
    new.clipped_norm,
    o_norm,
    rtol=2 * rtol,
    what=f"{msg}: clipped_norm",
    atol=atol,
  )
  # Whatever is held back is counted.
  if o_norm < g_norm * (1 - 4 * rtol) - atol:
    assert float(new.clip_fraction) > 0, (
      f"{msg}: norm {g_norm:.6g} went out as {o_norm:.6g} with clip_fraction 0"
    )


def _check_nonfinite_step(config, g, out, old, new, step):
  msg = f"{config!r} step {step}"
  o_l = _host(out)
  if config.kind == "guard":
    assert all(np.all(y == 0) for y in o_l), f"{msg}: not skipped"
    assert int(new.counts.skipped) == int(old.counts.skipped) + 1, msg
    assert int(new.counts.nonfinite) == int(old.counts.nonfinite) + 1, msg
    return
  assert not _finite(o_l), f"{msg}: a non-finite gradient gave a finite update"
  assert not np.isfinite(np.asarray(new.clipped_norm)), (
    f"{msg}: clipped_norm {new.clipped_norm} but the update is non-finite"
  )


def _run_history(case, check_lasting=True):
  config, direction, dtype, history, new_level = case
  tx, step = fz.step_runner(config)
  levels = list(history) + [new_level] * (BOUND if check_lasting else 1)
  with fz.x64((dtype,)):
    state = tx.init(fz.to_jax(_at_level(direction, 1.0, dtype)))
    passed = None
    for i, level in enumerate(levels):
      g = fz.to_jax(_at_level(direction, level, dtype))
      out, new = step(g, state, None)
      if fz.has_nonfinite(jax.tree.map(np.asarray, g)):
        _check_nonfinite_step(config, g, out, state, new, i)
      else:
        _check_finite_step(config, g, out, state, new, i)
      if (
        i >= len(history)
        and passed is None
        and level > 0
        and (float(fz.measure_tree(_host(out))) > 0)
      ):
        passed = i - len(history)
      state = new
  if check_lasting:
    assert passed is not None, (
      f"{config!r}: after the history {history} (norm levels), a lasting "
      f"norm of {new_level} never got through in {BOUND} steps"
    )


@_examples(6)
@hypothesis.given(case=_history_case(levels=(1e-3, 1.0, 1e3), lasting=LASTING))
def test_adaptive_and_guard_finite_histories(case):
  """Finite histories without zero steps: finite updates that keep their
  direction and never grow, statistics that describe them, held-back steps
  counted, and a lasting new level gets through.
  """
  _run_history(case)


@_examples(6)
@hypothesis.given(
  case=_history_case(levels=(0.0, ZERO_LEAF, 1e-3, 1.0, 1e3), zero_warmup=True)
)
# guard(spike_z) and clip_zscore after an all-zero warm-up, clip_relative
# after one zero step of a leaf.
@hypothesis.example(
  case=(
    fz.Config("guard.identity", (("spike_z", 3.0), ("warmup_steps", 3))),
    {"a": np.array([[0.6, 0.0], [0.0, 0.0]]), "b": [np.array([0.8, 0, 0])]},
    "float32",
    [0.0] * 3,
    1.0,
  )
)
@hypothesis.example(
  case=(
    fz.Config("clip_zscore", (("warmup_steps", 3),)),
    {"a": np.array([[0.6, 0.0], [0.0, 0.0]]), "b": [np.array([0.8, 0, 0])]},
    "float32",
    [0.0] * 3,
    1.0,
  )
)
@hypothesis.example(
  case=(
    fz.Config("clip_relative", (("warmup_steps", 3),)),
    {"a": np.array([[0.6, 0.0], [0.0, 0.0]]), "b": [np.array([0.8, 0, 0])]},
    "float32",
    [ZERO_LEAF, 1.0, 1.0],
    1.0,
  )
)
def test_adaptive_and_guard_no_absorbing_state(case):
  """After any finite history, zero steps included (a loss switched on by a
  schedule, LoRA's A at step 0), a lasting new level gets through.
  """
  _run_history(case)


@_examples(6)
@hypothesis.given(case=_history_case(levels=(1.0, 1e3, math.nan, math.inf)))
def test_adaptive_and_guard_nonfinite_steps(case):
  """NaN/Inf steps: a non-finite update whose clipped_norm says so (guard:
  skipped and counted); the memory is not poisoned.
  """
  _run_history(case)


@_examples(4)
@hypothesis.given(
  case=_history_case(
    levels=(1.0,) + F64_LEVELS, lasting=F64_LEVELS, dtypes=("float64",)
  )
)
# A float64 norm of 1e-50, which clip_percentile and clip_relative must not
# zero, and a finite 1e200, which must not count as non-finite.
@hypothesis.example(
  case=(
    fz.Config("clip_percentile", (("history", 4),)),
    {"a": np.array([[0.6, 0.0], [0.0, 0.0]]), "b": [np.array([0.8, 0, 0])]},
    "float64",
    [],
    1e-50,
  )
)
@hypothesis.example(
  case=(
    fz.Config("clip_relative", (("warmup_steps", 1),)),
    {"a": np.array([[0.6, 0.0], [0.0, 0.0]]), "b": [np.array([0.8, 0, 0])]},
    "float64",
    [],
    1e-50,
  )
)
@hypothesis.example(
  case=(
    fz.Config("guard.identity", ()),
    {"a": np.array([[0.6, 0.0], [0.0, 0.0]]), "b": [np.array([0.8, 0, 0])]},
    "float64",
    [],
    1e200,
  )
)
def test_adaptive_and_guard_float64(case):
  """float64 trees under x64 with norms outside float32's range (1e-50,
  1e200): finite, counted right, and they get through.
  """
  _run_history(case)


# --------------------------------------------------------------------------
# Per-example clipping: the sensitivity bound
# --------------------------------------------------------------------------


def _per_example_property(config, tree):
  """Each example moves the sum by at most l2_clip, whatever it holds."""
  leaves = fz.leaves(tree)
  l2 = config.kw["l2_clip"]
  scope = config.kw["scope"]
  batch = np.shape(leaves[0])[0]
  msg = f"{config!r} batch={batch}"
  # The limit is traced: one program for every l2_clip of a scope.
  run = fz.static_runner(config.with_limit(1.0))
  limit = np.float32(l2)

  def run_host(t):
    out, state = run(fz.to_jax(t), limit, None)
    return _host(out), state

  full, state = run_host(tree)
  want, _, nonfinite = fz.oracle_per_example(leaves, float(limit), scope)
  assert int(state.nonfinite) == nonfinite, (
    f"{msg}: nonfinite {int(state.nonfinite)}, oracle {nonfinite}"
  )
  # A float32 sum of B contributions may overflow (in any order of
  # summation) where their magnitudes add up beyond float32's range: with
  # no clip (l2_clip=inf), or a clip whose B-fold exceeds the range.
  top = float(np.finfo(F32).max)
  sums_fit = math.isfinite(l2) and batch * l2 <= top
  if sums_fit:
    # Finite clips of finite (or zeroed) examples: a finite sum.
    assert _finite(full), f"{msg}: a non-finite sum {full}"
  # The sum equals the oracle's (float32 summation of B clipped examples).
  scale = batch * (l2 if math.isfinite(l2) else 0.0)
  for got, w, x in zip(full, want, leaves):
    atol = 8 * batch * fz.round_tol(F32) * np.max(np.abs(w), initial=0.0)
    atol = max(atol, scale * 1e-6, fz.flush_atol(F32))
    with np.errstate(invalid="ignore", over="ignore"):
      ok = (np.abs(got - w) <= 2 * REL * np.abs(w) + atol) | (got == w)
      a = np.abs(np.asarray(x, np.float64))
      magnitudes = np.sum(np.where(np.isfinite(a), a, 0), axis=0)
    overflowed = (
      ~sums_fit
      & (magnitudes > top)
      & np.isinf(got)
      & (np.sign(got) == np.sign(w))
    )
    ok = ok | overflowed
    assert np.all(ok), f"{msg}: sum {got.ravel()[:4]} != {w.ravel()[:4]}"
  if not math.isfinite(l2):
    return
  # Removing (zeroing) any one example moves the sum by at most l2_clip.
  for b in range(batch):
    without = jax.tree.map(np.array, tree)
    for x in fz.leaves(without):
      x.reshape(batch, -1)[b] = 0
    rest, _ = run_host(without)
    moved = float(fz.measure_tree([f - r for f, r in zip(full, rest)]))
    rounding = 8 * batch * fz.round_tol(F32) * float(fz.measure_tree(full))
    assert moved <= l2 * (1 + 2 * REL) + rounding + fz.flush_atol(F32), (
      f"{msg}: example {b} moves the sum by {moved:.6g} > l2_clip {l2}"
    )


@_examples(6)
@hypothesis.given(
  config=fz.per_example_configs(),
  tree=fz.per_example_trees(huge=False),
)
# A tiny l2_clip and an example norm below 0.5: the example is scaled by
# limit / norm, not by limit / mantissa.
@hypothesis.example(
  config=fz.Config(
    "clip_per_example",
    (("l2_clip", 1e-20), ("reduce", "sum"), ("scope", "global")),
  ),
  tree={"a": np.array([-0.31744668], F32)},
)
def test_per_example_sensitivity_bound(config, tree):
  """clip_per_example on finite examples of ordinary size (zero ones
  included): each moves the sum by at most l2_clip; l2_clip=inf is the plain
  sum.
  """
  _per_example_property(config, tree)


@_examples(6)
@hypothesis.given(
  config=fz.per_example_configs(),
  tree=fz.per_example_trees(nonfinite=True),
)
# An example whose norm overflows float32 (4.2e38): clipped, not zeroed.
@hypothesis.example(
  config=fz.Config(
    "clip_per_example",
    (("l2_clip", 1.0), ("reduce", "sum"), ("scope", "global")),
  ),
  tree={"a": np.array([[3e38, 3e38], [1.0, 0.0]], F32)},
)
# Finite elements of 1.7e38 whose example norm overflows float32 are clipped,
# not counted in nonfinite and zeroed.
@hypothesis.example(
  config=fz.Config(
    "clip_per_example",
    (("l2_clip", 1e30), ("reduce", "sum"), ("scope", "leaf")),
  ),
  tree={"a": np.array([[0.0] * 4, [1.7014117e38] * 4], F32)},
)
# An example whose leaf norm is 1e38 (its sum of squares overflows float32).
@hypothesis.example(
  config=fz.Config(
    "clip_per_example",
    (("l2_clip", 1.0), ("reduce", "sum"), ("scope", "global")),
  ),
  tree={"a": np.array([[1e38, 1e38], [1.0, 0.0]], F32)},
)
# With no clip, a float32 sum of three examples of 1.7e38 overflows (the
# oracle's 5.1e38 is beyond float32).
@hypothesis.example(
  config=fz.Config(
    "clip_per_example",
    (("l2_clip", math.inf), ("reduce", "sum"), ("scope", "global")),
  ),
  tree=np.array([1.7014117e38] * 3 + [-0.8647483], F32),
)
def test_per_example_sensitivity_bound_huge_and_nonfinite(config, tree):
  """The bound for every input: examples far above 2**126 and examples
  holding a NaN / Inf (zeroed and counted) included.
  """
  _per_example_property(config, tree)


# --------------------------------------------------------------------------
# Sharded leaves: 1, 2 or 8 devices
# --------------------------------------------------------------------------

SHARDED_NAMES = ("clip_value", "clip_norm", "clip_global", "clip_block_rms")


# Under ci, (configuration, devices, layout) from this palette (each compiles
# once; the two explicit examples' own among them), values drawn; release
# draws all freely.
SHARDED_PALETTE = (
  (
    _static("clip_value", max_delta=1.0),
    2,
    {"a": ((8,), "float32"), "b": ((16, 2), "bfloat16")},
  ),
  (
    _static("clip_norm", max_norm=1.0, ord=None, axis=None),
    8,
    [((8, 3), "float32"), ((16,), "bfloat16")],
  ),
  (
    _static("clip_norm", max_norm=1.0, ord=1, axis=None),
    2,
    {"a": ((8,), "float32")},
  ),
  (
    _static("clip_norm", max_norm=1.0, ord="inf", axis=None),
    1,
    {"a": ((16, 2), "float32"), "b": [((8,), "bfloat16")]},
  ),
  (
    _static("clip_global", max_norm=1.0, ord=None),
    2,
    {"a": ((8,), "float32")},
  ),
  (
    _static("clip_global", max_norm=1.0, ord=3),
    8,
    [((16,), "float32"), ((8, 3), "bfloat16"), ((16, 2), "float32")],
  ),
  (
    _static("clip_global", max_norm=1.0, ord="inf"),
    1,
    [((16, 2), "bfloat16"), ((8,), "float32")],
  ),
  (
    _static("clip_block_rms", threshold=1.0),
    8,
    {"a": ((8, 3), "bfloat16"), "b": ((8,), "float32")},
  ),
)


@st.composite
def _sharded_case(draw, magnitudes="ordinary"):
  if fz.ci_profile():
    config, n, layout = draw(st.sampled_from(SHARDED_PALETTE))
    tree = draw(_palette_tree(layout, False, magnitudes))
    return config, n, tree, draw(fz.limits(magnitudes=magnitudes))
  config = draw(fz.static_configs(names=SHARDED_NAMES))
  n = draw(st.sampled_from((1, 2, 8)))
  tree = draw(
    fz.trees(
      dtypes=("float32", "bfloat16"),
      shapes=fz.SHARD_SHAPES,
      min_leaves=1,
      max_leaves=3,
      magnitudes=magnitudes,
    )
  )
  return config, n, tree, draw(fz.limits(magnitudes=magnitudes))


def _sharded_property(config, n, tree, value):
  limit = _limit_for(tree, value)
  out, state = fz.sharded_runner(config, n)(fz.on_mesh(tree, n), limit)
  # clip_value takes no axis_name: its statistics are the local shard's.
  stats = config.name != "clip_value"
  _check_static(config, tree, None, limit, out, state, stats=stats)


@_examples(6)
@hypothesis.given(case=_sharded_case())
def test_sharded_leaves_match_the_oracle(case):
  """Every leaf split over 1, 2 or 8 devices (shard_map, axis_name): the
  numbers of the float64 oracle on the whole tree.
  """
  _sharded_property(*case)


@_examples(6)
@hypothesis.given(case=_sharded_case(magnitudes="extreme"))
# clip_norm(ord=1) over 2 devices on these values: the exact recompute's merge
# must not divide by a subnormal largest magnitude where the compiled code
# keeps them (NaN).
@hypothesis.example(
  case=(
    fz.Config("clip_norm", (("axis", None), ("max_norm", 1.0), ("ord", 1))),
    2,
    {
      "a": np.array(
        [3.4028235e38, 3.4028235e38, -1.4e-45, -1.4e-45] + [0] * 4, F32
      )
    },
    0.0,
  )
)
# [1e38, 1e38, 1, 1] over 2 devices: the norm must not flush to 0 and let the
# values through unclipped.
@hypothesis.example(
  case=(
    fz.Config("clip_global", (("max_norm", 1.0), ("ord", None))),
    2,
    {"a": np.array([1e38, 1e38, 1, 1, 0, 0, 0, 0], F32)},
    1.0,
  )
)
# Flushing n subnormal elements moves an L1 norm by up to n times the
# smallest normal (sqrt(n) for L2): these eight read 0, the oracle's L1 norm
# 7.1e-38.
@hypothesis.example(
  case=(
    fz.Config("clip_norm", (("axis", None), ("max_norm", 1.0), ("ord", 1))),
    1,
    {
      "k0": np.array(
        [
          9.0726116e-39,
          1.1373334e-38,
          -1.0672628e-38,
          -5.8935671e-39,
          -1.0916841e-38,
          -6.0748699e-39,
          1.0166001e-38,
          6.9098826e-39,
        ],
        F32,
      )
    },
    fz._ldexp32(0.5, -125),
  )
)
def test_sharded_leaves_at_the_edges_of_the_range(case):
  _sharded_property(*case)


# --------------------------------------------------------------------------
# Derivatives of order 1 and 2 through update
# --------------------------------------------------------------------------

DERIV_LAYOUT = {"a": (4, 3), "b": (3,)}


@functools.cache
def _derivative_runner(config):
  """``(g, w, v, limit, params) -> (first, second)``, the derivatives of
  order 1 and 2 of ``sum(w * update(g + t v))`` at ``t = 0``: ``jax.grad``
  and ``jax.jvp`` of it, in one program (the jvp computes both; one compile
  a config for both orders).
  """

  def f(g, w, limit, params):
    tx = config.make(limit)
    out, _ = tx.update(g, tx.init(g if params is None else params), params)
    return sum(
      jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(out))
    )

  def along_v(d, v):
    return sum(
      jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(d), jax.tree.leaves(v))
    )

  def directional(g, w, v, limit, params):
    grad = lambda g_: jax.grad(f)(g_, w, limit, params)
    first, second = jax.jvp(grad, (g,), (v,))
    return along_v(first, v), along_v(second, v)

  return fz.FastJit(directional)


@st.composite
def _derivative_case(draw):
  names = (
    "clip_value",
    "clip_norm",
    "clip_global",
    "clip_block_rms",
    "clip_unitwise",
  )
  config = draw(
    fz.static_configs(names=names, ords=(None, 1, 3), axes=(None, 0))
  )
  seed = draw(st.integers(0, 2**32 - 1))
  rng = np.random.default_rng(seed)
  scale = 10.0 ** draw(st.integers(-20, 20))
  tree = lambda s: jax.tree.map(
    lambda shape: (s * rng.normal(size=shape)).astype(F32),
    DERIV_LAYOUT,
    is_leaf=lambda x: isinstance(x, tuple),
  )
  g, w, v = tree(scale), tree(1.0), tree(scale)
  params = tree(scale) if config.needs_params else None
  ratio = draw(st.sampled_from((0.3, 3.0)))
  return config, g, w, v, params, ratio


def _oracle_directional(config, g, w, v, limit, params, order):
  """Central finite differences of the float64 oracle along ``v``."""
  gl, wl, vl = fz.leaves(g), fz.leaves(w), fz.leaves(v)
  pl = fz.leaves(params) if params is not None else None
  size = float(fz.measure_tree(gl)) / float(fz.measure_tree(vl))
  h = 1e-4 * size if order == 2 else 1e-6 * size

  def value(t):
    moved = [
      np.asarray(x, np.float64) + t * np.asarray(d, np.float64)
      for x, d in zip(gl, vl)
    ]
    out = fz.oracle_static(config, moved, limit, pl).out
    return sum(np.longdouble(np.vdot(a, b)) for a, b in zip(wl, out))

  if order == 1:
    return float((value(h) - value(-h)) / (2 * h))
  return float((value(h) - 2 * value(0.0) + value(-h)) / (h * h))


def _derivative_property(config, g, w, v, params, ratio, orders=(1, 2)):
  oracle = fz.oracle_static(
    config, fz.leaves(g), 1.0, fz.leaves(params) if params is not None else None
  )
  scale = max(
    float(np.max(m / np.where(lim > 0, lim, 1)))
    for m, lim in zip(oracle.measures, oracle.limits)
  )
  limit = F32(ratio * scale)
  if config.static_name == "clip_value":  # elements away from the limit
    hypothesis.assume(
      all(
        np.all(np.abs(np.abs(x) - limit) > 1e-2 * limit) for x in fz.leaves(g)
      )
    )
  both = _derivative_runner(config)(
    fz.to_jax(g),
    fz.to_jax(w),
    fz.to_jax(v),
    limit,
    fz.to_jax(params) if params is not None else None,
  )
  for order in orders:
    got = float(both[order - 1])
    want = _oracle_directional(config, g, w, v, float(limit), params, order)
    # The natural size of the derivative: |w| |v| / |g|^(order - 1).
    size = (
      float(fz.measure_tree(fz.leaves(w)))
      * float(fz.measure_tree(fz.leaves(v))) ** order
      / float(fz.measure_tree(fz.leaves(g))) ** (order - 1)
    )
    assert math.isfinite(got), f"{config!r}: order {order} derivative {got}"
    assert abs(got - want) <= 1e-3 * abs(want) + 1e-3 * size, (
      f"{config!r} limit={limit}: order-{order} directional derivative "
      f"{got}, finite differences of the oracle {want}"
    )


def _derivative_example(config, scale, ratio, seed=0):
  rng = np.random.default_rng(seed)
  tree = lambda s: jax.tree.map(
    lambda shape: (s * rng.normal(size=shape)).astype(F32),
    DERIV_LAYOUT,
    is_leaf=lambda x: isinstance(x, tuple),
  )
  g, w, v = tree(scale), tree(1.0), tree(scale)
  params = tree(scale) if config.needs_params else None
  return config, g, w, v, params, ratio


# One property for both orders: each case compiles one program that gives
# the first and the second derivative (a property per order would compile
# each of its cases again).
@_examples(8)
@hypothesis.given(case=_derivative_case())
# clip_block_rms's Hessian-vector product on values near 1e19 (a leaf's sum
# of squares near 1e38, taken directly): JAX's rule for sqrt overflows at the
# second order (NaN, or 15% off), so _numerics.floats._root differentiates
# p = 2 too.
@hypothesis.example(
  case=_derivative_example(
    fz.Config("clip_block_rms", (("threshold", 1.0),)), 1e19, 0.3, seed=2
  )
)
# clip_unitwise's Hessian-vector product on a unit of four values near 1e19:
# its sum of squares, 3.3e38, fits float32, but taken directly its tangent
# overflows (NaN), so _norms.trusted_max sends such sums to the exact
# recompute.
@hypothesis.example(
  case=_derivative_example(
    fz.Config("clip_unitwise", (("clipping", 1.0), ("eps", 0.001))), 1e19, 0.3
  )
)
def test_first_and_second_derivatives_through_update(case):
  """jax.grad through every static clipper's update equals finite
  differences of the float64 oracle, clipped or not, at magnitudes from
  1e-20 to 1e20; so do Hessian-vector products (jax.jvp of jax.grad) and
  second finite differences.
  """
  _derivative_property(*case)


def test_first_derivative_of_a_clipped_global_norm_at_1e19():
  """The first derivative through clip_global of a gradient of 1e19, whose
  squares (1e38) come near float32's largest value.
  """
  config = fz.Config("clip_global", (("max_norm", 1.0), ("ord", None)))
  _derivative_property(*_derivative_example(config, 1e19, 0.3), orders=(1,))


# --------------------------------------------------------------------------
# A second step: no retrace, no host transfer
# --------------------------------------------------------------------------


@st.composite
def _any_config(draw):
  return draw(
    st.one_of(
      fz.static_configs(),
      fz.adaptive_configs(),
      fz.guard_configs(),
      fz.per_example_configs(),
    )
  )


@_examples(3)
@hypothesis.given(
  config=_any_config(), dtype=fz.dtype_names(("float32", "bfloat16", "float64"))
)
def test_second_step_neither_retraces_nor_transfers(config, dtype):
  """Two steps of any clipper under the user's jit: one trace (the state
  keeps its dtypes and shapes), and no transfer to or from the host inside
  the steps (jax.transfer_guard("disallow")), float64 under x64 included;
  eager steps (the clipper's own jit) transfer nothing either.
  """
  rng = np.random.default_rng(0)
  shape = (4, 3)
  params = {"w": rng.normal(size=shape).astype(fz.DTYPES[dtype])}
  grads = [
    {"w": (s * rng.normal(size=shape)).astype(fz.DTYPES[dtype])}
    for s in (1.0, 10.0, 0.1)
  ]
  traces = []
  with fz.x64((dtype,)):
    tx = config.make()
    p = fz.to_jax(params)
    gs = [fz.to_jax(g) for g in grads]
    state = tx.init(p)

    def step(g, state):
      traces.append(1)
      return tx.update(g, state, p)

    jitted = jax.jit(step)
    with jax.transfer_guard("disallow"):
      for g in gs:
        _, state = jitted(g, state)
        jax.block_until_ready(state)
    assert len(traces) == 1, f"{config!r} ({dtype}): {len(traces)} traces"
    with jax.transfer_guard("disallow"):
      for g in gs:
        _, state = tx.update(g, state, p)
        jax.block_until_ready(state)


@st.composite
def _sharded_history_case(draw):
  config = draw(
    st.one_of(fz.adaptive_configs(scopes=("global",)), fz.guard_configs())
  )
  n = draw(st.sampled_from((1, 2, 8)))
  tree = draw(
    fz.trees(
      dtypes=("float32",),
      shapes=((8,), (16, 2)),
      min_leaves=1,
      max_leaves=2,
      magnitudes="ordinary",
    )
  )
  # Off the configs' fixed bounds (max_norm and warmup_max_norm of 1.0): a
  # norm drawn exactly on one is a tie that an ulp of summation order
  # decides either way (an explicit case: clip_zscore's norm of
  # a tree scaled to 1.0 read 1.0000001 on one device and 1.0 on two, so
  # that one clipped and the other did not).
  levels = draw(
    st.lists(st.sampled_from((0.0, 1e-3, 1.5, 1e3)), min_size=3, max_size=8)
  )
  return config, n, tree, levels


@_examples(5)
@hypothesis.given(case=_sharded_history_case())
def test_sharded_adaptive_and_guard_match_one_device(case):
  """Adaptive clippers and guard with axis_name over 1, 2 or 8 devices (every
  leaf split): step by step the updates and the whole state of one device.
  """
  config, n, tree, levels = case
  tx1, step1 = fz.step_runner(config)
  txn, stepn = fz.sharded_step_runner(config, n)
  g0 = fz.to_jax(tree)
  s1, sn = tx1.init(g0), txn.init(g0)
  base = float(fz.measure_tree(fz.leaves(tree))) or 1.0
  for i, level in enumerate(levels):
    g = jax.tree.map(lambda x, lv=level: (x / base * lv).astype(x.dtype), tree)
    o1, s1 = step1(fz.to_jax(g), s1, None)
    on, sn = stepn(fz.on_mesh(g, n), sn)
    msg = f"{config!r} on {n} devices, step {i} (levels {levels})"
    for a, b in zip(_host(on), _host(o1)):
      np.testing.assert_allclose(
        a, b, rtol=4 * REL, atol=1e-6 * level + 1e-30, err_msg=msg
      )
    for a, b in zip(jax.tree.leaves(sn), jax.tree.leaves(s1)):
      a, b = np.asarray(a), np.asarray(b)
      if jnp.issubdtype(a.dtype, jnp.floating):
        np.testing.assert_allclose(a, b, rtol=4 * REL, atol=1e-30, err_msg=msg)
      else:
        np.testing.assert_array_equal(a, b, err_msg=msg)


def test_second_derivative_of_a_clipped_3_norm_in_float32():
  """The float32 Hessian-vector product of clip_norm(ord=3) on a clipped
  gradient of about 1e8: JAX's rule for ``s ** (1/p)`` flushes ``s ** (1/p -
  2)`` to zero (8% off: 3.335e7 against 3.634e7), so _numerics.floats._root
  differentiates through the sum's mantissa and exponent instead.
  """
  config = fz.Config(
    "clip_norm", (("axis", None), ("max_norm", 1.0), ("ord", 3))
  )
  _derivative_property(*_derivative_example(config, 1e8, 0.3), orders=(2,))
