"""Fuzz properties of the static clippers' numerics.

Every finite magnitude (subnormals to the dtype's largest value), every real
dtype (float16, bfloat16, float32, float64 under x64), NaN/Inf sprinkled, and
derivatives of order 0 to 2, against the float64 NumPy oracle of
``fuzz_strategies``. To keep compiles few, one tree shape is used and every
clipper runs in one jitted program per dtype, its limit traced.
"""

import functools
import math

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import fuzz_strategies as fz
import optaxclip

F32 = np.float32
SHAPES = {"a": (3,), "b": (2, 3)}
# (config, uses params): each limit is drawn and passed traced.
CONFIGS = (
  fz.Config("clip_value", (("max_delta", 1.0),)),
  fz.Config("clip_norm", (("max_norm", 1.0), ("ord", None))),
  fz.Config("clip_norm", (("max_norm", 1.0), ("ord", 1))),
  fz.Config("clip_global", (("max_norm", 1.0), ("ord", None))),
  fz.Config("clip_global", (("max_norm", 1.0), ("ord", "inf"))),
  fz.Config("clip_block_rms", (("threshold", 1.0),)),
  fz.Config("clip_unitwise", (("clipping", 1.0), ("eps", 1e-3))),
)


@functools.cache
def _runner(dtype: str):
  """One program per dtype: every config on the same tree."""
  del dtype  # part of the cache key: a dtype retraces anyway

  def run(g, w, limits):
    out = []
    for config, limit in zip(CONFIGS, limits):
      tx = config.make(limit)
      out.append(tx.update(g, tx.init(w), w))
    return out

  return fz.FastJit(run)


@st.composite
def _cases(draw, dtypes, nonfinite=False):
  dtype = draw(st.sampled_from(dtypes))
  g = {
    k: draw(fz.arrays(dtype, s, nonfinite=nonfinite)) for k, s in SHAPES.items()
  }
  # Parameters of clip_unitwise: finite, any magnitude.
  w = {k: draw(fz.arrays(dtype, s)) for k, s in SHAPES.items()}
  limits = [draw(fz.limits(zero=True, inf=True)) for _ in CONFIGS]
  return dtype, g, w, limits


def _run(dtype, g, w, limits):
  with fz.x64([dtype]):
    return jax.tree.map(
      np.asarray,
      _runner(dtype)(
        fz.to_jax(g), fz.to_jax(w), jnp.asarray(limits, jnp.float32)
      ),
    )


def _flushed(x, dtype):
  """What XLA:CPU computes with: values below the smallest normal are 0."""
  x = np.asarray(x, np.float64)
  tiny = fz.flush_atol("float64" if dtype == "float64" else "float32")
  return np.where(np.abs(x) < tiny, 0.0, x)


# No shrinking: a counterexample of these draws is read as it is, and
# shrinking one takes minutes of recompiles.
NO_SHRINK = hypothesis.settings(
  phases=(
    hypothesis.Phase.explicit,
    hypothesis.Phase.reuse,
    hypothesis.Phase.generate,
  )
)


@fz.examples(20, NO_SHRINK)
@hypothesis.given(_cases(fz.REAL))
# An explicit example (rarely drawn under the ci profile): a norm above
# float32's largest value by less than half a unit in the last place rounds to
# that value, not to inf (the oracle reads it so too).
@hypothesis.example(
  (
    "float32",
    {
      "a": np.array([1.4105932e-37, 1.4105932e-37, 3.4028235e38], F32),
      "b": np.array([[0, 0, 1.4e-45], [0, 0, 3.8942226e33]], F32),
    },
    {
      "a": np.array([3.4028235e38, 1.4e-45, 3.6111186e-35], F32),
      "b": np.array(
        [
          [2.9409585e37, -1.0620260e38, -3.5750171e35],
          [-6.3211033e35, -9.9839266e35, 2.9106716e35],
        ],
        F32,
      ),
    },
    [math.inf, math.inf, 0.0, 158.21670532226562, math.inf, 0.0, 0.0],
  )
)
# An explicit example: clip_unitwise's limit, a clipping of
# 2**-126 times a params' norm of 5.7e20, is carried as a mantissa below 1
# and a power of two: as a float32 it is subnormal, flushed, and would clip
# the leaf to 0, not to norm 6.7e-18.
@hypothesis.example(
  (
    "bfloat16",
    {
      "a": np.array([-0.0020752, 0.330078, 0.0100098], jnp.bfloat16),
      "b": np.array([[1.76324e-38, 0, 0], [0, 0, 0]], jnp.bfloat16),
    },
    {
      "a": np.array([-9.18355e-41, -4.43734e-30, 5.71849e20], jnp.bfloat16),
      "b": np.array(
        [
          [3.38953e38, 5.41599e26, 9.62305e26],
          [3.38953e38, -5.58524e26, 7.73713e26],
        ],
        jnp.bfloat16,
      ),
    },
    [
      fz._ldexp32(0.75, -75),
      0.0,
      math.inf,
      0.375,
      math.inf,
      math.inf,
      fz._ldexp32(0.5, -125),
    ],
  )
)
# An explicit example (rarely drawn under the ci profile): a tie at the limit
# (see Oracle.clip_fraction_band in fuzz_strategies.py). And the band taken in
# the oracle's wide dtype: unit norms of float64 leaves above float64's range.
@hypothesis.example(
  (
    "float64",
    {
      "a": np.array([6.74134926e307, -1.79769313e308, 6.74134926e307]),
      "b": np.array([[0.0, 0.0, 1.38350581e19], [0.0, 0.0, 0.0]]),
    },
    {
      "a": np.array([6.74134926e307, 0.0, 0.0]),
      "b": np.array([[0.0, 0.0, 2.22507386e-308], [0.0, 0.0, 0.0]]),
    },
    [math.inf, math.inf, math.inf, 32767.99609375, math.inf, 0.0]
    + [32767.99609375],
  )
)
@hypothesis.example(
  (
    "float16",
    {
      "a": np.array([3.0, 0.0, 0.0], np.float16),
      "b": np.array([[-6e-8, 6e-8, 6e-8], [6e-8, -6e-8, 6e-8]], np.float16),
    },
    {
      "a": np.array([0.0, 5.96e-08, 6.104e-05], np.float16),
      "b": np.array([[5.96e-08, 5.96e-08, 2.29e-05], [0, 0, 0]], np.float16),
    },
    [fz._ldexp32(0.5, 49), 0.0, 0.5, 3.0, math.inf, 0.0, 0.0],
  )
)
# An explicit example (rarely drawn under the ci profile): a float64 subnormal
# above a clip_value limit of 0 counts (compared as integers).
@hypothesis.example(
  (
    "float64",
    {
      "a": np.array([9.88131292e-324, 2.22507386e-308, 0.0]),
      "b": np.array(
        [[0.0, -1.79769313e308, 0.0], [0.0, 2.22507386e-308, -1.79769313e308]]
      ),
    },
    {
      "a": np.array([5.93544564e-001, -7.24243679e-001, 2.22507386e-308]),
      "b": np.array(
        [
          [7.60217354e-014, 4.94065646e-324, 2.22507386e-308],
          [4.79350246e-015, -4.39011972e-016, 4.94065646e-324],
        ]
      ),
    },
    [0.0, 1.2360680103302002, 0.0, 0.0, math.inf, math.inf, math.inf],
  )
)
def test_finite_input_clips_exactly_along_its_direction(case):
  dtype, g, w, limits = case
  results = _run(dtype, g, w, limits)
  keys = list(SHAPES)
  # The oracle sees what the arithmetic sees: float32 (or wider) values
  # with subnormals flushed (float16 subnormals are normal in float32).
  leaves = [_flushed(g[k], dtype) for k in keys]
  params = [_flushed(w[k], dtype) for k in keys]
  rtol = max(1e-5, 2 * fz.round_tol(dtype))
  for config, limit, (out, state) in zip(CONFIGS, limits, results):
    oracle = fz.oracle_static(config, leaves, limit, params)
    if not (
      all(np.all(~np.isnan(lim)) for lim in oracle.limits)
      and all(np.all(np.isfinite(m)) for m in oracle.measures)
    ):
      # The float64 oracle overflows (a norm above 1.8e308, 0 * inf of a
      # zero clipping and overflowing params) where the clipper does not.
      continue
    got = [np.asarray(out[k], np.float64) for k in keys]
    for x, want, k in zip(got, oracle.out, keys):
      assert not np.any(np.isnan(x)), (config, k)
      # The clipped values, hence the direction and every unit's measure.
      atol = 4 * fz.flush_atol(dtype) + rtol * float(
        np.max(np.abs(want), initial=0.0)
      ) * (config.name != "clip_value")
      np.testing.assert_allclose(
        x, want, rtol=rtol, atol=atol, err_msg=f"{config!r} {k} limit={limit}"
      )
    for measure, lim in zip(oracle.unit_measure(got), oracle.limits):
      assert np.all(measure <= lim * (1 + rtol) + 4 * fz.flush_atol(dtype)), (
        config,
        limit,
      )
    stats = oracle.stats
    for name in ("norm", "clipped_norm"):
      _assert_float32_statistic(
        float(getattr(state, name)), stats[name], f"{config!r} {name}"
      )
    if config.name == "clip_value":
      # Its count compares magnitudes as integers, exactly: a subnormal
      # above the limit counts (the clip changes it).
      exact = [np.asarray(g[k]).astype(np.float64) for k in keys]
      lo, hi = fz.oracle_static(config, exact, limit).clip_fraction_band(rtol)
    else:
      lo, hi = oracle.clip_fraction_band(rtol)
    frac = float(state.clip_fraction)
    assert lo - 1e-6 <= frac <= hi + 1e-6, (
      f"{config!r} clip_fraction {frac}, oracle {stats['clip_fraction']} "
      f"(between {lo} and {hi} with ties)"
    )


def _assert_float32_statistic(got: float, want: float, msg: str):
  """A float32 statistic against the float64 oracle ``want``.

  Float32 rounds to nearest: a value above its largest finite one by less
  than half a unit in the last place is that largest value, not inf. Within
  the tolerance of that boundary either reading is right.
  """
  top = float(np.finfo(np.float32).max)
  rtol = 1e-5
  if want >= top * (1 - rtol) and got >= top * (1 - rtol):
    return
  with np.errstate(over="ignore"):
    want = float(np.float32(want))
  np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-37, err_msg=msg)


@NO_SHRINK
@hypothesis.given(_cases(("float32", "bfloat16"), nonfinite=True))
def test_nonfinite_units_come_out_nan_and_the_rest_as_without_them(case):
  dtype, g, w, limits = case
  hypothesis.assume(fz.has_nonfinite(g))
  results = _run(dtype, g, w, limits)
  keys = list(SHAPES)
  leaves = [_flushed(g[k], dtype) for k in keys]
  params = [_flushed(w[k], dtype) for k in keys]
  for config, limit, (out, state) in zip(CONFIGS, limits, results):
    oracle = fz.oracle_static(config, leaves, limit, params)
    assert np.isnan(float(state.clipped_norm)), config
    for x, want, measure, k, leaf in zip(
      [np.asarray(out[k], np.float64) for k in keys],
      oracle.out,
      oracle.measures,
      keys,
      leaves,
    ):
      if config.name == "clip_value":
        bad = np.full(x.shape, not np.all(np.isfinite(leaf)))
      else:
        bad = np.broadcast_to(~np.isfinite(measure), x.shape)
      assert np.all(np.isnan(x[bad])), (config, k)
      rtol = max(1e-5, 2 * fz.round_tol(dtype))
      np.testing.assert_allclose(
        x[~bad],
        want[~bad],
        rtol=rtol,
        atol=4 * fz.flush_atol(dtype)
        + rtol * float(np.max(np.abs(want[~bad]), initial=0.0)),
        err_msg=f"{config!r} {k}",
      )


@functools.cache
def _derivative_runner():
  def loss(v, limits):
    g = {"a": v[:3], "b": v[3:].reshape(2, 3)}
    total = 0.0
    for config, limit in zip(CONFIGS, limits):
      tx = config.make(limit)
      out, _ = tx.update(g, tx.init(g), g)
      total = total + sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(out))
    return total

  def run(v, limits, direction):
    # One forward-over-reverse pass gives the value, the gradient and the
    # Hessian-vector product (one trace of the loss: a third of the program
    # that tracing loss, grad and hvp apart gave XLA to compile).
    (value, grad), (_, hvp) = jax.jvp(
      lambda u: jax.value_and_grad(loss)(u, limits), (v,), (direction,)
    )
    return value, grad, hvp

  return fz.FastJit(run)


def _case32(a, b, limits):
  g = {"a": np.array(a, np.float32), "b": np.array(b, np.float32)}
  return "float32", g, g, limits


@fz.examples(8, NO_SHRINK)
@hypothesis.given(_cases(("float32",)))
# Explicit examples: a Hessian-vector product on smallest normal and
# subnormal values with a zero limit (where the factor's second derivative
# may meet 0 * inf), and clip_unitwise's gradient through params whose norm
# overflows float32 (where a cotangent sum(ct * x) overflows).
@hypothesis.example(
  _case32(
    [0, 0, 1.1754944e-38],
    [[1e-45, -1e-45, 3e-45], [-3e-45, 1e-45, 3e-45]],
    [0, 7.8e29, 49152, 9.5e-7, 0, math.inf, 3],
  )
)
@hypothesis.example(
  _case32(
    [-3.4028235e38, -3.4028235e38, 0],
    [[1, 0, 0], [0, 0, 0]],
    [1, 1, 1, 1, 1, 1, float(np.ldexp(0.5, -117))],
  )
)
# An explicit example, inside the documented limit (only the value
# is checked): clip_unitwise of 0.375 with the gradient as its params
# returns two values of -1.3e38 in one unit, whose inner product with the
# cotangent, divided by the norm's mantissa, overflows: a NaN gradient.
@hypothesis.example(
  _case32(
    [3.4028235e38, 0, 1.171875e-02],
    [[-3.4028235e38, 0, 0], [-3.4028235e38, 0, 1.4e-45]],
    [0.375, 0.375, 0.0, 2.0194836766245472e-28, 2.0**102, 0.0, 0.375],
  )
)
# An explicit example, inside the documented limit at the bottom
# of the range (value and gradient checked, not the Hessian-vector product):
# clip_unitwise(2.35e-38, eps=1e-3) limits units of norm 1.2e-38 to 2.35e-41
# (a NaN HVP); the same with one tiny leaf beside a normal one; and a leaf of
# six values of 1.76e-38 under clip_norm(inf) and clip_block_rms(0).
@hypothesis.example(
  _case32(
    [2.888895e-34, 1.401298e-45, 2.888895e-34],
    [[1.7632415e-38] * 3, [1.7632415e-38] * 3],
    [0.0, math.inf, math.inf, 0.0, math.inf, 0.0, 162013.90625],
  )
)
@hypothesis.example(
  _case32(
    [1.1754944e-38, 1.1754944e-38, 0.0],
    [[0.0, 0.0, 1.5], [0.0, 0.0, 0.0]],
    [math.inf, math.inf, math.inf, 0.0, math.inf, math.inf]
    + [float(np.ldexp(0.5, -125))],
  )
)
@hypothesis.example(
  _case32(
    [1.1754944e-38, 1.4012985e-45, 1.4012985e-45],
    [
      [1.1754944e-38, -1.4012985e-45, 1.4012985e-45],
      [1.4012985e-45, 1.4012985e-45, -1.4012985e-45],
    ],
    [7.834511776089958e29, 1048575.875, 0.0, 3298534883328.0, math.inf]
    + [0.0, 2.3509884213848822e-38],
  )
)
def test_derivatives_of_order_0_to_2_have_no_nan_on_finite_input(case):
  """Value, gradient and Hessian-vector product are free of NaN.

  Every static clipper (the gradient is also clip_unitwise's params), on
  finite input of any magnitude. Known limits (see ``optaxclip._norms``,
  "Derivatives"): where a norm-based clipper's update holds values whose
  magnitudes add up to a quarter of float32's largest value, the
  derivatives may overflow; there only the value is checked. Where all
  values of a unit of a norm-based clipper are within a few powers of two
  of the smallest normal number (below 2**-120), whatever its limit, the
  norm's derivatives are flushed; there the Hessian-vector product is not
  checked.
  """
  _, g, _, limits = case
  v = np.concatenate([np.ravel(g[k]) for k in SHAPES]).astype(np.float32)
  value, grad, hvp = _derivative_runner()(
    jnp.asarray(v), jnp.asarray(limits, jnp.float32), jnp.ones(9)
  )
  top = float(np.finfo(F32).max)
  near_top = any(
    config.name != "clip_value"
    and sum(np.sum(np.abs(np.asarray(x, np.float64))) for x in out.values())
    >= top / 4
    for config, (out, _) in zip(CONFIGS, _run("float32", g, g, limits))
  )
  near_bottom = any(_has_a_tiny_unit(config, g) for config in CONFIGS)
  checked = (("value", value),)
  if not near_top:
    checked += (("grad", grad),) + (() if near_bottom else (("hvp", hvp),))
  for name, x in checked:
    assert not np.any(np.isnan(np.asarray(x))), name


def _has_a_tiny_unit(config, g) -> bool:
  """Whether ``config`` measures a unit of ``g`` whose nonzero values are
  all below 2**-120 (the known limit of float32 derivatives at the bottom
  of the range; see _norms, "Derivatives").
  """
  tiny = 2.0**-120
  if config.name == "clip_value":
    return False
  a, b = (np.asarray(g[k], np.float64) for k in SHAPES)
  if config.name == "clip_global":
    units = [np.concatenate([a.ravel(), b.ravel()])]
  elif config.name == "clip_unitwise":
    # Its units are not all leaves (the kernel's rows or columns): any.
    units = [a, b, *b, *b.T]
  else:
    units = [a, b]
  return any(0 < np.max(np.abs(x)) < tiny for x in units)


def test_hvp_of_zero_limits_on_tiny_values_has_no_nan():
  # The first explicit example above (the factor's second derivative of a
  # zero limit must not meet 0 * inf), checked in full although its values
  # lie in the known limit at the bottom of the range.
  _, g, _, limits = _case32(
    [0, 0, 1.1754944e-38],
    [[1e-45, -1e-45, 3e-45], [-3e-45, 1e-45, 3e-45]],
    [0, 7.8e29, 49152, 9.5e-7, 0, math.inf, 3],
  )
  v = np.concatenate([np.ravel(g[k]) for k in SHAPES]).astype(np.float32)
  out = _derivative_runner()(
    jnp.asarray(v), jnp.asarray(limits, jnp.float32), jnp.ones(9)
  )
  for name, x in zip(("value", "grad", "hvp"), out):
    assert not np.any(np.isnan(np.asarray(x))), name


def test_unitwise_derivative_with_overflowing_param_norm():
  a = np.array([-3.4028235e38, -3.4028235e38, 0.0], np.float32)
  tx = optaxclip.clip_unitwise(float(np.ldexp(0.5, -117)), eps=1e-3)

  def loss(v):
    g = {"a": v}
    out, _ = tx.update(g, tx.init(g), g)
    return jnp.sum(jnp.sin(out["a"]))

  grad = jax.jit(jax.grad(loss))(jnp.asarray(a))
  assert not np.any(np.isnan(np.asarray(grad)))


@functools.cache
def _exact_sum_runner(p):
  """The exact recompute's power sum, compiled as the fuzz suite compiles
  (no LLVM optimisation: subnormals are not flushed there).
  """
  dtype = np.dtype(np.float32)
  return fz.FastJit(lambda x: optaxclip._norms.scaled_sum(x, p, (0,), dtype))


@fz.examples(10, NO_SHRINK)
@hypothesis.given(
  x=fz.arrays("float32", (8,)),
  p=st.sampled_from((1.0, 2.0, 3.0)),
)
# A subnormal largest magnitude beside the largest values: the merge must not
# divide by it (NaN / inf).
@hypothesis.example(
  x=np.array([3.4028235e38, 3.4028235e38, -1.4e-45, -1.4e-45, 0, 0, 0, 0], F32),
  p=1.0,
)
def test_exact_power_sum_matches_the_oracle_whatever_the_compiler(x, p):
  """``sum (|x| * 2**-E)**p`` of the exact recompute against float64, on
  any finite values (subnormals count as 0).
  """
  _check_exact_power_sum(x, p)


def _check_exact_power_sum(x, p):
  q, e = _exact_sum_runner(p)(jnp.asarray(x))
  a = np.abs(_flushed(x, "float32"))
  e = float(np.ravel(e)[0])
  # The scale is the power of two of the largest magnitude M (M * 2**-E in
  # [0.5, 4), below 0.5 only where 2**-E would not be normal).
  top = float(np.max(a, initial=0.0))
  if top > 0:
    ratio = top * 2.0**-e
    assert ratio < 4 and (ratio >= 0.5 or top < 2.0**-100), (top, e)
  want = np.sum((a * 2.0**-e) ** p)
  np.testing.assert_allclose(float(np.ravel(q)[0]), want, rtol=1e-5, atol=0)


@fz.examples(10, NO_SHRINK)
@hypothesis.given(
  x=fz.arrays("float32", (8,), magnitudes="extreme"),
  p=st.sampled_from((1.0, 2.0, 3.0)),
)
# Magnitudes whose sum passes float32's largest value: XLA:CPU's element
# emitters (the suite's fast compile) may turn the merge's q * (small / M)
# into (q * small) / M, which overflows there (an infinite sum of finite
# values, and clip_norm(0.0, ord=1) NaN for zeros).
@hypothesis.example(
  x=np.array([1.2e38, 1.2e38, 1.2e38, 1.3e38, 0, 0, 0, 0], F32), p=1.0
)
@hypothesis.example(
  x=np.array([2.55e38, -2.55e38, 2.55e38, 2.55e38, 0, 0, 0, 0], F32), p=2.0
)
def test_exact_power_sum_of_values_at_the_edges_of_the_range(x, p):
  """As above, with every magnitude at an edge of float32's range (the
  largest values, 2**126 and around, the smallest normals, subnormals):
  where a merge's partial sums come near overflow.
  """
  _check_exact_power_sum(x, p)


def test_clip_norm_l1_of_near_overflow_values_is_exact():
  """A zero L1 limit on a leaf whose L1 norm overflows float32: zeros, as
  the limit asks, not NaN (the merge's overflow, above, made the norm inf).
  """
  leaf = np.array([[1.276e38] * 3, [3.4e38, 0, 1.276e38]], F32)

  def update(g, limit):
    tx = optaxclip.clip_norm(limit, ord=1)
    return tx.update(g, tx.init(g))[0]

  out = fz.FastJit(update)(jnp.asarray(leaf), jnp.float32(0.0))
  np.testing.assert_array_equal(np.asarray(out), np.zeros_like(leaf))


@fz.examples(10, NO_SHRINK)
@hypothesis.given(
  x=fz.arrays("float32", (8,), nonfinite=True),
  p=st.sampled_from((1.0, 2.0)),
)
# A NaN and an inf, in either order: merged, the NaN is kept (the norm is
# NaN, not inf), whatever the reduction's order.
@hypothesis.example(x=np.array([0, 0, 0, np.nan, np.inf, 0, 0, 0], F32), p=2.0)
@hypothesis.example(x=np.array([np.inf, 0, 0, 0, 0, 0, 0, np.nan], F32), p=1.0)
def test_exact_power_sum_keeps_nan_over_inf(x, p):
  """The non-finite policy in the exact recompute: any NaN element gives a
  NaN sum, else any infinite one an infinite sum.
  """
  _check_nan_over_inf(x, p)


def _check_nan_over_inf(x, p):
  for run in (_exact_sum_runner(p), _exact_sum_runner(p).jitted):
    q, _ = run(jnp.asarray(x))
    q = float(np.ravel(q)[0])
    if np.isnan(x).any():
      assert np.isnan(q), (x, q)
    elif np.isinf(x).any():
      assert q == np.inf, (x, q)
    else:
      assert np.isfinite(q), (x, q)


@st.composite
def _long_vectors(draw, nonfinite=False):
  """A float32 vector of 4096 to 40000 elements (where XLA:CPU's
  reductions are vectorized, and its plain max drops a NaN): a background
  of normal values at a drawn power of two (from the subnormal range to
  the top), with eight drawn values (extreme magnitudes, or NaN / inf) at
  drawn places.
  """
  n = draw(st.sampled_from((4096, 4099, 40000)))
  seed = draw(st.integers(0, 2**16))
  scale = draw(st.sampled_from((-149, -130, -126, -60, 0, 60, 100, 126, 127)))
  rng = np.random.default_rng(seed)
  x = np.ldexp(rng.uniform(-1.0, 1.0, n), scale).astype(F32)
  special = draw(fz.arrays("float32", (8,), nonfinite, magnitudes="extreme"))
  places = draw(
    st.lists(st.integers(0, n - 1), min_size=8, max_size=8, unique=True)
  )
  x[places] = special
  return x


@fz.examples(8, NO_SHRINK)
@hypothesis.given(x=_long_vectors(), p=st.sampled_from((1.0, 2.0, 3.0)))
# The largest magnitude negative, far above the largest value: a scale
# taken from max(x) instead of max |x| overflows the scaled values.
@hypothesis.example(
  x=np.where(np.arange(4096) == 5, -3e38, 1e-20).astype(F32), p=2.0
)
def test_exact_power_sum_of_long_vectors_matches_the_oracle(x, p):
  """The exact recompute's two passes (the largest magnitude, then the sum
  scaled by its power of two) on vectors XLA:CPU vectorizes, with values
  over the whole range, against float64.
  """
  _check_exact_power_sum(x, p)


@fz.examples(8, NO_SHRINK)
@hypothesis.given(
  x=_long_vectors(nonfinite=True), p=st.sampled_from((1.0, 2.0))
)
def test_exact_power_sum_of_long_vectors_keeps_nan_over_inf(x, p):
  """The non-finite policy on long vectors, whose plain maximum may drop a
  NaN: a NaN anywhere gives a NaN sum, else an inf an infinite one.
  """
  _check_nan_over_inf(x, p)


def _unitwise_update(g, params, clipping):
  tx = optaxclip.clip_unitwise(clipping)
  return tx.update(g, tx.init(params), params)


# clip_unitwise's update, its clipping traced: one program a tree, compiled
# with the fast options.
_unitwise_runner = fz.FastJit(_unitwise_update)


@fz.examples(6, NO_SHRINK)
@hypothesis.given(
  w=fz.arrays("float32", (3,)),
  rows=st.integers(0, 2),
  clipping=st.sampled_from((0.0, 1.0)),
)
# An empty leaf beside another: XLA's two-output reduction over an empty
# axis may read NaN for its units (clipped_norm NaN, clip_fraction 0.75).
@hypothesis.example(w=np.array([2e19, 0, 0], F32), rows=0, clipping=0.0)
def test_units_of_no_elements_have_norm_zero(w, rows, clipping):
  """clip_unitwise with a leaf whose units have no elements: its units are
  neither clipped nor counted, whatever the other leaf's params.
  """
  g = {"a": np.zeros(3, F32), "b": np.zeros((0, 3), F32)}
  params = {"a": w, "b": np.zeros((0, 3), F32)}
  if rows:
    g["c"] = np.ones((rows, 0), F32)
    params["c"] = np.ones((rows, 0), F32)
  _, state = _unitwise_runner(g, params, np.float32(clipping))
  assert float(state.clipped_norm) == 0.0, state
  assert float(state.clip_fraction) == 0.0, state
