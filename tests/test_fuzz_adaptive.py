"""Hypothesis properties for the adaptive clippers and guard.

Each property here stands beside the examples in test_adaptive.py and
test_guard.py:

* no absorbing state: after any history (zeros, equal norms, NaN/Inf, huge
  and tiny norms), a new constant level of the norm is held back a bounded
  number of steps in a row: ``history`` for clip_percentile, and for guard
  and for clip_zscore and clip_relative with their opt-in ``patience``,
  ``patience`` plus the raises by ``growth`` that reach the level (the
  histories and levels span 35 decades: 35 raises by 10);
* float64: tiny and huge float64 norms keep float64 decisions, statistics
  and outputs (nothing flushed to zero, nothing counted as non-finite);
* every scale: the z-score statistics (clip_zscore, guard's norm and loss
  tests, EMA and window) judge a stream of norms scaled by a power of two
  as the stream itself, in float32 and float64 (the variance is kept scaled
  beyond 2**+-40; kept unscaled, it would saturate above ~1e19 in float32);
* a mean near 0: guard's loss z-scores (EMA and window) over signed
  losses whose mean is 0 or near it equal a float64 oracle (kept at the
  scale of a mean of 0, the variance would saturate: z-scores of 2**21);
* non-finite steps: a NaN/Inf anywhere gives a non-finite update (the bad
  unit all NaN), ``clipped_norm`` is NaN, and the statistics do not move;
* sharded == one device: under ``pmap`` with ``axis_name`` every device
  holds the state of one device and the same (split) update.

The programs are jitted once per configuration (module level), so examples
only run them.
"""

import functools
import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fuzz_strategies as fz
import optaxclip
from optaxclip import _moments

PATIENCE, WARMUP, HISTORY = 4, 3, 6
ALPHA = 0.9
GROWTH = 10.0
RAISES = 35  # raises by GROWTH that cover the 35 decades drawn below
CLIPPERS = {
  "zscore": lambda **kw: optaxclip.clip_zscore(
    warmup_steps=WARMUP, patience=PATIENCE, growth=GROWTH, alpha=ALPHA, **kw
  ),
  "zscore_skip": lambda **kw: optaxclip.clip_zscore(
    warmup_steps=WARMUP,
    patience=PATIENCE,
    growth=GROWTH,
    skip_update_on_spike=True,
    mode="percentile",
    **kw,
  ),
  "zscore_leaf": lambda **kw: optaxclip.clip_zscore(
    warmup_steps=WARMUP,
    patience=PATIENCE,
    growth=GROWTH,
    scope="leaf",
    **kw,
  ),
  "percentile": lambda **kw: optaxclip.clip_percentile(
    10.0, history=HISTORY, **kw
  ),
  "percentile_leaf": lambda **kw: optaxclip.clip_percentile(
    50.0, history=HISTORY, scope="leaf", **kw
  ),
  "relative": lambda **kw: optaxclip.clip_relative(
    warmup_steps=WARMUP,
    patience=PATIENCE,
    growth=GROWTH,
    warmup_max_norm=math.inf,
    **kw,
  ),
}
GUARD = lambda **kw: optaxclip.guard(
  optax.sgd(1.0),
  spike_z=2.0,
  warmup_steps=WARMUP,
  patience=PATIENCE,
  growth=GROWTH,
  alpha=ALPHA,
  **kw,
)
SHARE = np.array([0.6, 0.8])  # leaf shares of the global norm


def tree(norm, dtype=np.float32):
  """Two leaves whose norms are ``norm * SHARE`` (NaN/Inf go in as such)."""
  return {
    "a": jax.device_put(np.asarray(np.full((1,), norm * SHARE[0]), dtype)),
    "b": jax.device_put(np.asarray([norm * SHARE[1], 0.0], dtype)),
  }


def norm_of(t):
  """The global L2 norm in float64, scaled (no overflow, no underflow)."""
  flat = np.concatenate(
    [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(t)]
  )
  scale = np.max(np.abs(flat)) if flat.size else 0.0
  if not np.isfinite(scale) or scale == 0:
    return float(scale) if np.isnan(scale) or scale == 0 else math.inf
  return float(scale * np.sqrt(np.sum(np.square(flat / scale))))


@functools.cache
def transform(name):
  if name == "guard_plain":  # skips NaN/Inf only: judges no spread
    tx = optaxclip.guard(optax.sgd(1.0))
  else:
    tx = GUARD() if name == "guard" else CLIPPERS[name]()
  return tx, fz.FastJit(tx.update)  # fast options: compiles dominate


# A history: zeros, one repeated value, NaN/Inf and norms over 40 decades.
histories = st.lists(
  st.one_of(
    st.just(0.0),
    st.just(1.0),
    st.sampled_from([math.nan, math.inf]),
    st.floats(1e-20, 1e20),
  ),
  min_size=0,
  max_size=14,
)
levels = st.floats(1e-15, 1e15)


@fz.examples(25)
@hypothesis.given(
  name=st.sampled_from([*CLIPPERS, "guard"]), history=histories, level=levels
)
def test_a_new_level_is_held_back_a_bounded_number_of_steps(
  name, history, level
):
  tx, update = transform(name)
  params = tree(1.0)
  state = tx.init(params)
  for g in history:
    _, state = update(tree(g), state, params)
  # clip_percentile's window forgets; the others raise their judged level
  # by GROWTH a step once held back PATIENCE steps.
  percentile = name.startswith("percentile")
  bound = HISTORY if percentile else PATIENCE + RAISES + 1
  held = []  # per step at the new level: held back (skipped or cut)?
  for _ in range(bound + 6):
    out, state = update(tree(level), state, params)
    got = norm_of(out)
    if name == "guard":
      held.append(got == 0.0)
    else:  # each leaf keeps its share of the level: nothing cut
      held.append(got < level * (1 - 1e-5))
  runs = "".join("x" if h else "." for h in held)
  assert "x" * (bound + 1) not in runs, (runs, bound)
  if name.startswith("percentile"):
    assert "x" not in runs[bound:], runs  # the window now holds the level
  restarts = optaxclip.stats(state).get(
    f"{'guard' if name == 'guard' else 'clip_' + name.split('_')[0]}/restarts"
  )
  assert restarts is None or int(restarts) >= 0


@fz.examples(10)
@hypothesis.given(
  name=st.sampled_from([*CLIPPERS, "guard_plain"]),
  exponent=st.integers(-300, 300),
  factors=st.lists(st.floats(0.5, 4.0), min_size=5, max_size=5),
)
def test_float64_keeps_tiny_and_huge_norms(name, exponent, factors):
  with jax.enable_x64(True):
    tx, update = transform(name)
    params = tree(1.0, np.float64)
    state = tx.init(params)
    for f in factors:
      g = tree(f * 10.0**exponent, np.float64)
      out, state = update(g, state, params)
      want = norm_of(g)
      assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(out))
      got = norm_of(out)
      assert math.isfinite(got) and 0 < got <= want * (1 + 1e-12), (got, want)
      norm = state.verdict.norm if name == "guard_plain" else state.norm
      np.testing.assert_allclose(float(norm), want, rtol=1e-12)
    floats = [
      x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    assert all(x.dtype == jnp.float64 for x in floats)
    if name == "guard_plain":  # a finite 1e200 is not counted non-finite
      counts = state.counts
      assert int(counts.nonfinite) == 0 and int(counts.skipped) == 0


STAT_FIELDS = {
  "count",
  "mean",
  "var",
  "consecutive_spikes",
  "restarts",
  "filled",
  "index",
  "history",
  "ordered",
  "gamma",
  "consecutive_clips",
}


@fz.examples(20)
@hypothesis.given(
  name=st.sampled_from(list(CLIPPERS)),
  history=st.lists(st.floats(0.1, 10.0), min_size=0, max_size=5),
  bad=st.sampled_from([math.nan, math.inf, -math.inf]),
  leaf=st.sampled_from(["a", "b"]),
  other=st.floats(1e-3, 1e6),
)
def test_a_nonfinite_step_gives_a_nonfinite_update_and_keeps_statistics(
  name, history, bad, leaf, other
):
  tx, update = transform(name)
  params = tree(1.0)
  state = tx.init(params)
  for g in history:
    _, state = update(tree(g), state, params)
  g = tree(other)
  g[leaf] = g[leaf].at[0].set(bad)
  out, new = update(g, state, params)
  # clip_percentile's count is its step count (for threshold schedules): it
  # counts every update, the non-finite one too.
  kept = STAT_FIELDS - ({"count"} if name.startswith("percentile") else set())
  for field in kept & set(state._fields):
    np.testing.assert_array_equal(
      getattr(new, field), getattr(state, field), err_msg=field
    )
  assert math.isnan(float(new.clipped_norm))
  assert not np.all(np.isfinite(np.asarray(out[leaf])))
  per_leaf = name.endswith("_leaf") or name == "relative"
  for key in ("a", "b"):
    # The unit of the bad leaf (the tree, or that leaf) comes out all NaN:
    # nothing of it passes unclipped; it counts as clipped.
    if key == leaf or not per_leaf:
      assert np.all(np.isnan(np.asarray(out[key]))), (key, out[key])
  assert float(new.clip_fraction) >= (0.5 if per_leaf else 1.0)


# Sharded == one device: a (4, 2) kernel split over 8 pmap devices along its
# flattened elements, and a replicated bias.
N_DEV = 8


def _split_tree(norms):
  """Per step: a kernel of 8 elements (one per device) and a bias."""
  rng = np.random.default_rng(0)
  direction = rng.standard_normal(N_DEV + 2)
  direction /= np.linalg.norm(direction)
  return [
    {
      "k": (n * direction[:N_DEV]).astype(np.float32),
      "b": (n * direction[N_DEV:]).astype(np.float32),
    }
    for n in norms
  ]


@functools.cache
def _sharded_runner(name, steps):
  make = GUARD if name == "guard" else CLIPPERS[name]

  def run(stacked, mapped):
    tx = (
      make(axis_name="i", sharded={"k": True, "b": False}) if mapped else make()
    )

    def step(state, g):
      out, state = tx.update(g, state, g)
      return state, (out, optaxclip.stats(state))

    params = jax.tree.map(lambda x: x[0], stacked)
    return jax.lax.scan(step, tx.init(params), stacked)[1]

  single = fz.FastJit(functools.partial(run, mapped=False))
  sharded = jax.pmap(
    functools.partial(run, mapped=True),
    axis_name="i",
    in_axes=({"k": 1, "b": None},),
  )
  return single, sharded


@fz.examples(6)
@hypothesis.given(
  name=st.sampled_from(["zscore", "percentile", "relative", "guard"]),
  norms=st.lists(
    st.one_of(st.floats(1e-3, 1e3), st.just(0.0), st.just(math.nan)),
    min_size=6,
    max_size=6,
  ),
)
def test_sharded_equals_one_device(name, norms):
  single, sharded = _sharded_runner(name, len(norms))
  trees = _split_tree(norms)
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *trees)
  want_out, want_stats = single(stacked)
  local = {"k": stacked["k"].reshape(len(norms), N_DEV, 1), "b": stacked["b"]}
  got_out, got_stats = sharded(local)
  np.testing.assert_allclose(
    np.moveaxis(np.asarray(got_out["k"]), 0, 1).reshape(len(norms), N_DEV),
    want_out["k"],
    rtol=2e-5,
    atol=1e-30,
  )
  for key, value in want_stats.items():
    np.testing.assert_allclose(
      np.asarray(got_stats[key]),
      np.broadcast_to(value, (N_DEV, len(norms))),
      rtol=2e-5,
      err_msg=key,
    )


# Finite trees whose norms exceed float32's range: clip_relative's warm-up
# share must not be inf / inf, nor scale_by_norm_ema's EMA target divided by
# an overflowed leaf norm (NaN).
BEYOND = {
  **CLIPPERS,
  "relative_warmup": lambda: optaxclip.clip_relative(
    warmup_steps=WARMUP, patience=PATIENCE, warmup_max_norm=1.0
  ),
  "guard": GUARD,
  "guard_max_norm": lambda: optaxclip.guard(optax.sgd(1.0), max_norm=10.0),
  "norm_ema": lambda: optaxclip.scale_by_norm_ema(reset_interval=None),
  "spikes_adaptive": optaxclip.clip_spikes_adaptive,
  "spam": lambda: optaxclip.spam(1e-3, warmup_steps=0),
  "stable_spam": lambda: optaxclip.stable_spam(1e-3),
}


@functools.cache
def beyond_transform(name):
  tx = BEYOND[name]()
  return tx, fz.FastJit(tx.update)


def huge_tree(value):
  """Two float32 leaves of finite elements at ``value``: at 3e38 the leaf
  norms (4.2e38, 5.2e38) and the global one exceed float32's range.
  """
  return {
    "a": jnp.asarray(np.array([value, -value], np.float32)),
    "b": jnp.asarray(np.array([value, value, -value / 2], np.float32)),
  }


@fz.examples(25)
@hypothesis.given(
  name=st.sampled_from(sorted(BEYOND)),
  values=st.lists(
    st.sampled_from([1.0, 1e-3, 1e30, 2e38, 3e38, 3.4028235e38]),
    min_size=1,
    max_size=8,
  ),
)
@hypothesis.example(name="relative_warmup", values=[1.0, 3e38])
# An explicit example of the variance kept scaled: a spread of ~1.4e38 must
# not make clip_zscore's clip limit z * std / eta = inf / inf.
@hypothesis.example(name="zscore_leaf", values=[1.0, 1.0, 2e38, 3e38])
@hypothesis.example(name="norm_ema", values=[1.0, 3e38])
def test_norms_beyond_the_range_give_no_nan(name, values):
  """Finite input, whatever its norms: a finite update at every step, from
  every adaptive clipper, guard and the SPAM family (their statistics may
  read inf: a norm beyond the dtype's range).
  """
  tx, update = beyond_transform(name)
  state = tx.init(huge_tree(1.0))
  for i, value in enumerate(values):
    g = huge_tree(value)
    out, state = update(g, state, g)
    for leaf in jax.tree.leaves(out):
      assert np.all(np.isfinite(np.asarray(leaf))), (name, values, i, out)


@fz.examples(6)
@hypothesis.given(
  unused=st.integers(1, 3),
  warmup=st.integers(1, 3),
  growth=st.sampled_from([1.5, 3.0, 10.0]),
)
def test_explain_says_warming_up_only_when_nothing_has_a_threshold(
  unused, warmup, growth
):
  """clip_relative with leaves whose gradient stays zero (unused
  parameters): the reported threshold (the norm of the per-leaf ones) may
  be inf while the used leaf is clipped after its warm-up; explain() never
  says it is warming up in a sentence that says it clipped (not "scaled down
  50% of its units ... no threshold yet: warming up" three steps after a
  one-step warm-up).
  """
  params = {
    "used": jnp.ones(3),
    **{f"z{i}": jnp.ones(2) for i in range(unused)},
  }
  tx = optaxclip.clip_relative(1.5, warmup_steps=warmup)
  state = tx.init(params)
  for step in range(warmup + 3):
    g = {
      "used": jnp.full(3, growth**step),
      **{f"z{i}": jnp.zeros(2) for i in range(unused)},
    }
    _, state = tx.update(g, state)
    text = " ".join(optaxclip.explain(state))
    if float(state.clip_fraction) > 0:
      assert "no threshold yet: warming up" not in text, text
      if math.isinf(float(state.threshold)):
        assert "some units have no threshold yet" in text, text


# The z-score statistics at every scale. Kept as the variance itself, the
# variance of the norms would saturate at float32's largest value once the
# norms pass ~1e19 (ordinary steps would read as spikes: 10 of 15 steps of
# norms moving by 10% around 1e30 clipped) and flush to 0 below ~1e-19 (every
# move a new level, and a spike restarting the statistics instead of being
# clipped). It is kept scaled beyond 2**+-40 (a power of two, so exactly): a
# stream of norms scaled by 2**k must be judged as the stream.
SCALE_FREE = {
  # eps=0: ZClip's eps is an absolute floor on the spread, not scale-free.
  "zscore": lambda: optaxclip.clip_zscore(
    eps=0.0, warmup_steps=WARMUP, patience=PATIENCE, alpha=ALPHA
  ),
  "zscore_percentile": lambda: optaxclip.clip_zscore(
    mode="percentile", warmup_steps=WARMUP, patience=PATIENCE, alpha=ALPHA
  ),
  "zscore_leaf": lambda: optaxclip.clip_zscore(
    eps=0.0, warmup_steps=WARMUP, patience=PATIENCE, scope="leaf"
  ),
  "guard": GUARD,
  "guard_leaf": lambda: GUARD(scope="leaf"),
  "guard_window": lambda: GUARD(window=4),
  "guard_loss": lambda: optaxclip.guard(
    optax.sgd(1.0),
    loss_spike_z=2.0,
    warmup_steps=WARMUP,
    patience=PATIENCE,
    alpha=ALPHA,
  ),
  "guard_loss_window": lambda: optaxclip.guard(
    optax.sgd(1.0), loss_spike_z=2.0, warmup_steps=WARMUP, window=4
  ),
}


@functools.cache
def scale_free_transform(name):
  tx = SCALE_FREE[name]()
  if name.startswith("guard_loss"):
    return tx, fz.FastJit(lambda g, s, p, v: tx.update(g, s, p, value=v))
  return tx, fz.FastJit(lambda g, s, p, v: tx.update(g, s, p))


SCALED_STATS = ("norm", "clipped_norm", "threshold", "loss")


def _scaled_run(name, stream, k, dtype, sign):
  """Per step, the update and ``stats()`` of ``name`` on the norms
  ``stream * 2**k`` (and the losses ``sign *`` those), in float64.
  """
  tx, update = scale_free_transform(name)
  state = tx.init(tree(1.0, dtype))
  out = []
  for x in stream:
    value = math.ldexp(x, k)
    g = tree(value, dtype)
    u, state = update(g, state, g, np.asarray(sign * value, dtype))
    stats = {
      key.split("/")[-1]: float(v) for key, v in optaxclip.stats(state).items()
    }
    out.append((jax.tree.map(lambda a: np.asarray(a, np.float64), u), stats))
  return out


@fz.examples(16)
@hypothesis.given(
  name=st.sampled_from(sorted(SCALE_FREE)),
  x64=st.booleans(),
  stream=st.lists(
    st.one_of(
      st.floats(0.5, 2.0),  # ordinary moves of the level
      st.floats(4.0, 1000.0),  # spikes
      st.just(0.0),
    ),
    min_size=4,
    max_size=14,
  ),
  k=st.integers(-1000, 1000),
  sign=st.sampled_from([1.0, -1.0]),
)
@hypothesis.example(
  name="zscore",
  x64=False,
  stream=[1.0, 1.1, 0.9, 1.05, 0.95, 1.1, 10.0, 1.0],
  k=100,
  sign=1.0,
)
@hypothesis.example(
  name="guard",
  x64=False,
  stream=[1.0, 1.1, 0.9, 1.05, 0.95, 20.0],
  k=-80,
  sign=1.0,
)
# An explicit example (rarely drawn under the ci profile): the losses -4, -4, -4
# then -0.0 restart the statistics at a mean of 0: a variance kept at the
# scale of that mean would saturate, and the next z-score read -2**21 at k=0,
# -2**22 at k=1.
@hypothesis.example(
  name="guard_loss",
  x64=False,
  stream=[4.0, 4.0, 4.0, 0.0, 1.0],
  k=1,
  sign=-1.0,
)
def test_a_stream_scaled_by_a_power_of_two_is_judged_alike(
  name, x64, stream, k, sign
):
  """Every decision on the norms ``stream * 2**k`` (within the dtype's
  range, leaves normal) is the decision on ``stream``: the same clip
  fractions, skips, restarts and z-scores, and updates, norms and
  thresholds scaled by ``2**k``.
  """
  dtype = np.float64 if x64 else np.float32
  info = np.finfo(dtype)
  # The largest element (1000 * 0.8 * 2**k) below the dtype's largest value
  # by 2**2; the smallest nonzero one (0.5 * 0.6 * 2**k) normal by 2**30.
  k = int(np.clip(k, info.minexp + 32, info.maxexp - 13))
  with jax.enable_x64(x64):
    want = _scaled_run(name, stream, 0, dtype, sign)
    got = _scaled_run(name, stream, k, dtype, sign)
  for step, ((u0, s0), (u1, s1)) in enumerate(zip(want, got)):
    where = str((name, dtype.__name__, k, stream, step))
    assert s0.keys() == s1.keys()
    for key in s0:
      expected = s0[key]
      if key in SCALED_STATS and math.isfinite(expected):
        expected = math.ldexp(expected, k)
      np.testing.assert_allclose(
        s1[key], expected, rtol=1e-6, atol=0, err_msg=f"{key} {where}"
      )
    for a, b in zip(jax.tree.leaves(u0), jax.tree.leaves(u1)):
      np.testing.assert_allclose(
        b, np.ldexp(a, k), rtol=1e-6, atol=0, err_msg=where
      )


@fz.examples(30)
@hypothesis.given(
  x64=st.booleans(),
  mean=st.one_of(
    st.floats(allow_nan=False, allow_infinity=True, width=32),
    st.floats(allow_nan=False, allow_infinity=True),
    st.just(0.0),
  ),
)
def test_the_python_spread_exponent_is_the_traced_one(x64, mean):
  """explain()'s Python ``spread_exponent_of`` decodes a state's variance
  as the traced ``spread_exponent`` keeps it, for any mean of the dtype
  (0, subnormals, the largest values, inf).
  """
  dtype = np.float64 if x64 else np.float32
  with jax.enable_x64(x64):
    with np.errstate(over="ignore"):  # float64 beyond float32: inf
      value = np.asarray(mean).astype(dtype)
    traced = int(_moments.spread_exponent(jnp.asarray(value)))
  assert _moments.spread_exponent_of(float(value), dtype) == traced, value


# A mean near 0 beside a spread. The variance is kept at the scale of its
# mean (above); beside a mean of 0 (losses around 0, a restart at a loss of
# 0) any spread above ~5e-7 would saturate, and the next steps would read
# z-scores of about 2**21: guard would skip ordinary losses as spikes (3 of 16
# steps of the losses -1, 1, -1, ... with window=4). The kept mean sits at
# least 2**-22 standard deviations from 0.
LOSS_WARMUP, LOSS_WINDOW = 2, 3


@functools.cache
def loss_tracker(window):
  tx = optaxclip.guard(
    optax.sgd(1.0),
    loss_spike_z=1e30,  # judged, never skipped: the statistics alone
    warmup_steps=LOSS_WARMUP,
    alpha=ALPHA,
    window=window,
  )
  return tx, fz.FastJit(lambda g, s, v: tx.update(g, s, g, value=v))


def loss_z_oracle(losses, window):
  """Per step, guard's loss z-score (against the statistics before it) and
  the mean and standard deviation it is judged against, in float64: the
  warm-up's plain moments then the EMA, or the last ``window`` losses'
  mean and sample deviation; and whether the step is skipped. A window of
  equal losses has no spread: a larger loss is a spike (skipped, it does not
  enter), or restarts the window when it held only zeros.
  """
  count, mean, var, seen, out = 0, 0.0, 0.0, [], []
  for x in losses:
    std = math.sqrt(var)
    judged = count >= LOSS_WARMUP and std > 0
    flat = count >= LOSS_WARMUP and var == 0 and x > mean
    skip = flat and mean != 0  # a spike against no spread
    out.append(((x - mean) / std if judged else 0.0, mean, std, skip))
    if skip:
      continue
    if flat:
      count, mean, seen = 0, x, [x]  # restarted (count 1 below)
    elif window is not None:
      seen = (seen + [x])[-window:]
      mean = float(np.mean(seen))
      var = float(np.var(seen, ddof=1)) if len(seen) > 1 else 0.0
    elif count < LOSS_WARMUP:
      new_mean = mean + (x - mean) / (count + 1)
      var += ((x - mean) * (x - new_mean) - var) / (count + 1)
      mean = new_mean
    else:
      mean += (1 - ALPHA) * (x - mean)
      var = ALPHA * var + (1 - ALPHA) * (x - mean) ** 2
    count = min(count + 1, LOSS_WARMUP)
  return out


@fz.examples(12)
@hypothesis.given(
  window=st.sampled_from([None, LOSS_WINDOW]),
  x64=st.booleans(),
  losses=st.lists(
    st.sampled_from([-18.0, -4.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0, 4.0]),
    min_size=3,
    max_size=10,
  ),
  k=st.integers(-1000, 1000),
)
@hypothesis.example(window=3, x64=False, losses=[-1.0, 1.0, -1.0, 1.0], k=0)
@hypothesis.example(window=None, x64=False, losses=[1.0, 3.0, -18.0, 1.0], k=0)
def test_loss_z_scores_around_a_mean_of_zero_equal_the_oracle(
  window, x64, losses, k
):
  """The loss z-scores of guard over signed losses ``losses * 2**k``, whose
  mean is often exactly 0 (the EMA of 1, 3 reaches 0 at -18), equal a
  float64 oracle: the statistics keep any spread beside any mean.
  """
  hypothesis.assume(losses[0] != losses[1])  # a variance from the start
  dtype = np.float64 if x64 else np.float32
  info = np.finfo(dtype)
  # Away from subnormal differences (flushed on CPU: the losses' own
  # arithmetic), as the scaled streams above.
  k = int(np.clip(k, info.minexp + 32, info.maxexp - 13))
  tx, update = loss_tracker(window)
  g = {"w": np.ones(2, dtype)}
  with jax.enable_x64(x64):
    state = tx.init(g)
    # The oracle of the unscaled losses: z-scores do not depend on k.
    skipped = 0
    for step, (x, (want, mean, std, skip)) in enumerate(
      zip(losses, loss_z_oracle(losses, window))
    ):
      _, state = update(g, state, np.asarray(math.ldexp(x, k), dtype))
      got = float(state.loss_monitor.z_score)
      # The rounding of the stored mean and of x - mean, against std; the
      # kept mean's distance from 0 moves a z-score by at most 2**-21.
      tol = 2.0**-20 + (
        64 * info.eps * (abs(x) + abs(mean)) / std if std > 0 else 0.0
      )
      assert abs(got - want) <= tol + 1e-5 * abs(want), (
        step,
        got,
        want,
        losses,
      )
      skipped += bool(skip)
      assert int(state.counts.skipped) == skipped, (step, losses)
