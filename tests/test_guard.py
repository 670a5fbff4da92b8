"""Tests of guard(): skipping whole steps on NaN/Inf, large or spiking norms."""

import math
from unittest import mock

from absl.testing import parameterized
import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import np_refs
import optaxclip

W = np.array([0.6, 0.8])  # two leaves sharing a global norm (unit L2 norm)


def grads(norm, bad=None):
  """A tree with global norm ``norm``; ``bad`` (NaN/inf) in one element."""
  g = {
    "a": jnp.full((2,), norm * W[0] / math.sqrt(2), jnp.float32),
    "b": jnp.full((3,), norm * W[1] / math.sqrt(3), jnp.float32),
  }
  if bad is not None:
    g["b"] = g["b"].at[1].set(bad)
  return g


def stream(steps=45, seed=0):
  """(norm, bad) pairs: norms around 1 with spikes, a NaN and an Inf."""
  rng = np.random.default_rng(seed)
  norms = np.exp(0.1 * rng.standard_normal(steps)) * (
    1 + 0.01 * np.arange(steps)
  )
  for t, k in {3: 4.0, 14: 6.0, 15: 5.0, 27: 30.0, 33: 1.8}.items():
    if t < steps:
      norms[t] *= k
  bad = [None] * steps
  bad[8], bad[20] = float("nan"), float("inf")
  return list(zip(norms, bad))


class GuardRule:
  """The skipping rule, restated with plain Python floats.

  Skip a step whose norm is NaN/Inf, above max_norm, or (after the warm-up
  of finite norms) above mean + spike_z * std; the statistics take in every
  finite norm, clamped at that spike bound, mean first, then the variance
  with the new mean (a variance of 0 makes any norm above the mean a spike).
  After ``patience`` spikes in a row, a further one first raises the mean
  to ``np_refs.guard_raised`` and is judged against the raised bound; the
  statistics go on from there. Against statistics of only zeros a norm
  above 0 is a restart instead: not a spike, the mean moves to the norm and
  the variance takes in the jump.
  """

  def __init__(
    self,
    skip_nonfinite=True,
    spike_z=None,
    max_norm=None,
    alpha=0.97,
    warmup_steps=25,
    patience=25,
    growth=2.0,
  ):
    self.skip_nonfinite, self.z, self.cap = skip_nonfinite, spike_z, max_norm
    self.alpha, self.warmup_steps = alpha, warmup_steps
    self.patience, self.run, self.restarts = patience, 0, 0
    self.growth = growth
    self.gathered, self.mean, self.var = [], 0.0, 0.0
    self.margins = []

  def step(self, g):
    """Returns (skip?, threshold); sets self.cause and self.z_score."""
    finite = math.isfinite(g)
    warming = len(self.gathered) < self.warmup_steps
    std = self.var**0.5
    self.z_score = (
      (g - self.mean) / std if finite and not warming and std else 0.0
    )
    cap = math.inf if self.cap is None else self.cap
    bound = math.inf
    if self.z is not None and not warming:
      bound = self.mean + self.z * self.var**0.5
    spike = finite and g > bound
    restart = spike and self.mean == 0 and self.var == 0
    held = spike = spike and not restart
    raised = held and self.run >= self.patience
    if raised:
      self.mean = np_refs.guard_raised(self.mean, std, self.growth)
      bound = self.mean + self.z * std
      spike = g > bound
      self.z_score = (g - self.mean) / std if std else 0.0
    threshold = min(cap, math.inf if restart else bound)
    if finite and threshold < math.inf:
      self.margins.append(abs(g - threshold) / threshold)
    skip = g > cap or spike or (math.isinf(g) and bound < math.inf)
    skip = skip or (self.skip_nonfinite and not finite)
    self.cause = None
    if skip:
      if self.skip_nonfinite and not finite:
        self.cause = "nonfinite"
      elif g > cap:
        self.cause = "max_norm"
      else:
        self.cause = "spike"
    if finite:
      self.run = self.run + 1 if held else 0
      self.restarts += restart or raised
      if restart:
        self.var = (
          self.alpha * self.var + (1 - self.alpha) * (g - self.mean) ** 2
        )
        self.mean = g
      elif warming:
        self.gathered.append(g)
        self.mean = float(np.mean(self.gathered))
        self.var = float(np.var(self.gathered))
      else:
        g = min(g, bound)  # spikes enter at the bound
        self.mean = self.alpha * self.mean + (1 - self.alpha) * g
        self.var = (
          self.alpha * self.var + (1 - self.alpha) * (g - self.mean) ** 2
        )
    return skip, threshold


class GuardTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_short_stream_skips_nan_and_large_steps(self):
    # NaN, above max_norm, a spike after warm-up, then an ordinary step.
    self._check(
      self.variant,
      dict(spike_z=2.0, max_norm=10.0, warmup_steps=3),
      [
        (1.0, None),
        (1.2, None),
        (0.0, float("nan")),
        (0.9, None),
        (12.0, None),
        (3.0, None),
        (1.1, None),
      ],
    )

  def test_long_stream_matches_rule(self):
    self._check(
      jax.jit, dict(spike_z=3.0, max_norm=15.0, warmup_steps=10), stream()
    )

  def test_only_nonfinite_by_default(self):
    self._check(jax.jit, dict(), stream(30))

  def _check(self, wrap, kwargs, pairs):
    inner = optax.adam(0.1)
    tx = optaxclip.guard(inner, **kwargs)
    rule = GuardRule(**kwargs)
    params = grads(1.0)
    update, inner_update = wrap(tx.update), jax.jit(inner.update)
    state, ref_state = tx.init(params), inner.init(params)
    skipped = nonfinite = run = 0
    causes = {"nonfinite": 0, "max_norm": 0, "spike": 0}
    for t, (norm, bad) in enumerate(pairs):
      g = grads(norm, bad)
      before = state.inner_state
      out, state = update(g, state, params)
      g_norm = math.sqrt(
        sum(
          float(np.sum(np.square(np.asarray(x, np.float64))))
          for x in jax.tree.leaves(g)
        )
      )
      skip, threshold = rule.step(g_norm)
      skipped += skip
      if skip:
        causes[rule.cause] += 1
      nonfinite += not math.isfinite(g_norm)
      run = run + 1 if skip else 0
      if skip:
        chex.assert_trees_all_equal(out, jax.tree.map(jnp.zeros_like, g))
        chex.assert_trees_all_equal(state.inner_state, before)
      else:
        ref_out, ref_state = inner_update(g, ref_state, params)
        chex.assert_trees_all_close(out, ref_out, rtol=1e-6)
        chex.assert_trees_all_close(state.inner_state, ref_state, rtol=1e-6)
      self.assertEqual(int(state.counts.skipped), skipped, f"step {t}")
      self.assertEqual(int(state.counts.nonfinite), nonfinite)
      for cause, n in causes.items():
        self.assertEqual(
          int(getattr(state.counts, f"skipped_{cause}")), n, cause
        )
      np.testing.assert_allclose(
        float(state.verdict.z_score), rule.z_score, rtol=1e-4, atol=1e-5
      )
      self.assertEqual(int(state.counts.consecutive_skips), run)
      np.testing.assert_allclose(
        float(state.verdict.threshold), threshold, rtol=2e-5
      )
      np.testing.assert_allclose(
        float(state.norm_moments.mean), rule.mean, rtol=2e-5
      )
      np.testing.assert_allclose(
        float(state.norm_moments.var), rule.var, rtol=1e-4, atol=1e-9
      )
      if math.isfinite(g_norm):
        np.testing.assert_allclose(float(state.verdict.norm), g_norm, rtol=1e-5)
    self.assertGreater(min(rule.margins, default=1.0), 1e-4)
    self.assertGreater(skipped, nonfinite if kwargs else 0)
    self.assertLess(skipped, len(pairs))

  def test_a_lasting_rise_is_absorbed_not_skipped_forever(self):
    tx = optaxclip.guard(optax.sgd(1.0), spike_z=3.0, warmup_steps=10)
    rule = GuardRule(spike_z=3.0, warmup_steps=10)
    update = jax.jit(tx.update)
    params = grads(1.0)
    state = tx.init(params)
    rng = np.random.default_rng(1)
    norms = list(np.exp(0.05 * rng.standard_normal(20))) + [5.0] * 60
    skips = []
    for n in norms:
      _, state = update(grads(n), state, params)
      skips.append(int(state.counts.consecutive_skips) > 0)
      self.assertEqual(skips[-1], rule.step(float(n))[0])
    first_pass = skips.index(False, 20)
    self.assertGreater(first_pass - 20, 5)  # the jump was first taken as spikes
    self.assertFalse(any(skips[first_pass:]))  # then accepted for good

  def test_skip_nonfinite_false_lets_nan_through(self):
    tx = optaxclip.guard(optax.sgd(1.0), skip_nonfinite=False)
    params = grads(1.0)
    out, state = jax.jit(tx.update)(
      grads(1.0, float("nan")), tx.init(params), params
    )
    assert np.isnan(np.asarray(out["b"])).any()
    assert int(state.counts.skipped) == 0 and int(state.counts.nonfinite) == 1

  def test_extra_args_reach_inner(self):
    def update(updates, state, params=None, *, scale_by=1.0):
      del params
      return jax.tree.map(lambda u: u * scale_by, updates), state

    inner = optax.GradientTransformationExtraArgs(
      lambda p: optax.EmptyState(), update
    )
    tx = optax.chain(optaxclip.guard(inner), optax.identity())
    g = grads(1.0)
    out, _ = tx.update(g, tx.init(g), scale_by=2.0)
    chex.assert_trees_all_close(out, jax.tree.map(lambda x: 2 * x, g))

  def test_stats_of_guard_and_inner_clipper(self):
    tx = optaxclip.guard(
      optax.chain(optaxclip.clip_percentile(history=4), optax.sgd(0.1)),
      max_norm=5.0,
    )
    params = grads(1.0)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for norm in (1.0, 2.0, 9.0):
      _, state = update(grads(norm), state, params)
    stats = optaxclip.stats(state)
    assert list(stats) == [
      "guard/norm",
      "guard/threshold",
      "guard/skipped",
      "guard/nonfinite",
      "guard/consecutive_skips",
      "guard/restarts",
      "guard/skipped_nonfinite",
      "guard/skipped_max_norm",
      "guard/skipped_spike",
      "guard/z_score",
      "guard/skipped_loss_spike",
      "clip_percentile/norm",
      "clip_percentile/clipped_norm",
      "clip_percentile/clip_fraction",
      "clip_percentile/threshold",
    ]
    assert int(stats["guard/skipped"]) == 1
    assert int(stats["guard/skipped_max_norm"]) == 1
    assert float(stats["guard/threshold"]) == 5.0
    # The skipped step left the inner clipper's state at the step before.
    np.testing.assert_allclose(
      float(stats["clip_percentile/norm"]), 2.0, rtol=1e-6
    )

  def test_one_trace_no_host_transfer_in_a_jitted_loop(self):
    tx = optaxclip.guard(
      optax.adam(1e-2), spike_z=3.0, max_norm=15.0, warmup_steps=5
    )
    traces = []

    def step(params, state, g):
      traces.append(1)
      updates, state = tx.update(g, state, params)
      return optax.apply_updates(params, updates), state

    step = jax.jit(step, donate_argnums=(0, 1))  # donation: no shared buffers
    params = grads(1.0)
    state = tx.init(params)
    data = [jax.device_put(grads(n, b)) for n, b in stream(25)]
    with jax.transfer_guard("disallow"):
      for g in data:
        params, state = step(params, state, g)
    self.assertLen(traces, 1)
    self.assertEqual(state.counts.skipped.dtype, jnp.int32)
    self.assertEqual(state.verdict.norm.dtype, jnp.float32)
    self.assertGreater(int(state.counts.skipped), 2)

  def test_keeps_dtypes(self):
    tx = optaxclip.guard(optax.sgd(1.0), max_norm=1.0)
    g = {"w": jnp.full((4,), 2.0, jnp.bfloat16)}
    out, state = jax.jit(tx.update)(g, tx.init(g))
    assert out["w"].dtype == jnp.bfloat16
    assert int(state.counts.skipped) == 1 and float(state.verdict.norm) == 4.0

  @parameterized.parameters("global", "leaf")
  def test_inner_traced_once_and_skips_in_its_output_dtype(self, scope):
    # inner returns float32 updates for bfloat16 gradients: a skipped step's
    # zeros must take inner's dtype, which guard learns from the one trace.
    traces = []
    tx = optaxclip.guard(to_float32(traces), max_norm=1.0, scope=scope)
    g = {
      "a": jnp.full((4,), 2.0, jnp.bfloat16),
      "b": jnp.zeros(2, jnp.bfloat16),
    }
    out, state = jax.jit(tx.update)(g, tx.init(g))
    self.assertLen(traces, 1)
    self.assertEqual(out["a"].dtype, jnp.float32)
    np.testing.assert_array_equal(out["a"], np.zeros(4, np.float32))
    np.testing.assert_array_equal(out["b"], np.zeros(2, np.float32))
    self.assertEqual(int(state.counts.skipped), 1)

  def test_skip_branch_traced_first_still_learns_inner_dtype(self):
    # A JAX that traced the false branch first: guard falls back to
    # eval_shape for inner's output types.
    real_cond = jax.lax.cond

    def cond_false_first(pred, true_fun, false_fun, *operands):
      jax.eval_shape(false_fun, *operands)
      return real_cond(pred, true_fun, false_fun, *operands)

    tx = optaxclip.guard(to_float32([]), max_norm=1.0)
    g = {"a": jnp.full((4,), 2.0, jnp.bfloat16)}
    with mock.patch.object(jax.lax, "cond", cond_false_first):
      out, state = jax.jit(tx.update)(g, tx.init(g))
    self.assertEqual(out["a"].dtype, jnp.float32)
    np.testing.assert_array_equal(out["a"], np.zeros(4, np.float32))
    self.assertEqual(int(state.counts.skipped), 1)

  def test_runs_under_disable_jit(self):
    # Without jit, cond runs one branch: a skipped step traces only the
    # skip branch, which must find inner's output types alone.
    tx = optaxclip.guard(to_float32([]), max_norm=1.0)
    g = {"a": jnp.full((4,), 2.0, jnp.bfloat16)}
    with jax.disable_jit():
      out, state = tx.update(g, tx.init(g))
      self.assertEqual(out["a"].dtype, jnp.float32)
      np.testing.assert_array_equal(out["a"], np.zeros(4, np.float32))
      small = {"a": jnp.full((4,), 0.125, jnp.bfloat16)}
      out, state = tx.update(small, state)
    np.testing.assert_array_equal(out["a"], np.full(4, 0.125, np.float32))
    self.assertEqual(int(state.counts.skipped), 1)


def to_float32(traces: list) -> optax.GradientTransformation:
  """An inner transformation whose updates are float32, counting its traces."""

  def update(updates, state, params=None):
    traces.append(1)
    return jax.tree.map(lambda u: u.astype(jnp.float32), updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


GUARD_CAP = optaxclip.guard(optax.sgd(1.0), max_norm=100.0)
GUARD_CAP_UPDATE = jax.jit(GUARD_CAP.update)


@hypothesis.given(
  st.lists(
    st.one_of(
      st.just(0.0),
      st.floats(1e-20, 1e3),
      st.sampled_from([float("nan"), float("inf")]),
    ),
    min_size=1,
    max_size=8,
  )
)
def test_skips_exactly_nonfinite_or_capped_steps(norms):
  params = grads(1.0)
  state = GUARD_CAP.init(params)
  for k, norm in enumerate(norms, 1):
    bad = norm if not math.isfinite(norm) else None
    g = grads(norm if bad is None else 1.0, bad)
    out, state = GUARD_CAP_UPDATE(g, state, params)
    expected_skips = sum(
      not math.isfinite(n) or n > 100.0 * (1 + 1e-6) for n in norms[:k]
    )
    borderline = any(abs(n - 100.0) < 1e-3 for n in norms[:k])
    if not borderline:
      assert int(state.counts.skipped) == expected_skips
    skipped_now = int(state.counts.consecutive_skips) > 0
    zero = all(not np.any(np.asarray(x)) for x in jax.tree.leaves(out))
    assert zero if skipped_now else (zero == (norm == 0.0))


@pytest.mark.parametrize(
  "kwargs, error, message",
  [
    (dict(spike_z=0.0), ValueError, "spike_z"),
    (dict(spike_z=-1.0), ValueError, "spike_z"),
    (dict(max_norm=-1.0), ValueError, "max_norm"),
    (dict(alpha=1.0), ValueError, "alpha"),
    (dict(warmup_steps=0), ValueError, "warmup_steps"),
    (dict(skip_nonfinite="yes"), TypeError, "skip_nonfinite"),
    (dict(patience=0), ValueError, "patience"),
    (dict(growth=1.0), ValueError, "growth"),
    (dict(growth=float("nan")), ValueError, "growth"),
  ],
)
def test_bad_hyperparameters_fail_at_construction(kwargs, error, message):
  with pytest.raises(error, match=message):
    optaxclip.guard(optax.sgd(1.0), **kwargs)


def test_inner_must_be_a_transformation():
  with pytest.raises(TypeError, match="inner must be"):
    optaxclip.guard(optax.sgd)


# ------------------------------- no release: a held-back level is raised


def guarded_run(tx, norms, losses=None):
  """Runs ``tx`` on gradients of the given global norms (and losses); per
  step, whether it went through and the state after it.
  """
  params = grads(1.0)
  state = tx.init(params)
  if losses is None:
    update = jax.jit(lambda g, s, v: tx.update(g, s, params))
    losses = [0.0] * len(norms)
  else:
    update = jax.jit(lambda g, s, v: tx.update(g, s, params, value=v))
  out = []
  for norm, loss in zip(norms, losses):
    _, state = update(grads(norm), state, jnp.float32(loss))
    out.append((int(state.counts.consecutive_skips) == 0, state))
  return out


def held_at_most(level, mean, std, patience=25, growth=2.0):
  """Guard's bound on the steps in a row a lasting ``level`` is skipped,
  from the statistics ``(mean, std)`` it meets (whose scale only grows
  while it is held back).
  """
  scale = (growth - 1) * max(abs(mean), std)
  return patience + max(0, math.ceil(math.log(level / scale, growth)))


def spread_of(mean, var):
  e = optaxclip._moments.spread_exponent_of(float(mean), np.float32)
  return math.sqrt(float(var)) * 2.0**e


def check_level_released(test, steps, start, level, mean, std):
  """From ``start`` on (a lasting ``level``): skipped on at most the bound
  in a row, through for good after, every raise counted, and nothing
  applied above the threshold it was judged by.
  """
  applied = [a for a, _ in steps[start:]]
  first = applied.index(True)
  test.assertLessEqual(first, held_at_most(level, mean, std))
  test.assertTrue(all(applied[first:]), applied)
  # Raised from the step after `patience` spikes to the one that passed.
  raised = int(steps[start + first][1].counts.restarts) - int(
    steps[start - 1][1].counts.restarts
  )
  test.assertEqual(raised, first - 25 + 1)
  return first


class GuardRaiseTest(chex.TestCase):
  @parameterized.parameters(None, 8)
  def test_a_lasting_spike_after_noisy_norms_is_raised_to_not_released(
    self, window
  ):
    rng = np.random.default_rng(0)
    noisy = list(np.exp(0.1 * rng.standard_normal(25)))
    tx = optaxclip.guard(optax.sgd(1.0), spike_z=3.0, window=window)
    steps = guarded_run(tx, noisy + [1000.0] * 60)
    warm = steps[24][1]
    mean, std = (
      float(warm.norm_moments.mean),
      spread_of(warm.norm_moments.mean, warm.norm_moments.var),
    )
    # The 26th and 27th spikes in a row are skipped too, and every skipped
    # spike is counted.
    self.assertFalse(steps[25 + 25][0] or steps[25 + 26][0])
    first = check_level_released(self, steps, 25, 1000.0, mean, std)
    self.assertEqual(int(steps[-1][1].counts.skipped_spike), first)
    for applied, state in steps:
      if applied:  # never through above the bound it was judged by
        self.assertLessEqual(
          float(state.verdict.norm), float(state.verdict.threshold) * 1.001
        )

  @parameterized.parameters(None, 8)
  def test_a_spike_after_equal_norms_is_skipped(self, window):
    tx = optaxclip.guard(optax.sgd(1.0), spike_z=3.0, window=window)
    steps = guarded_run(tx, [1.0] * 25 + [1000.0] + [1.0] * 10 + [1000.0] * 60)
    # No spread: any norm above the mean is a spike. The spike is skipped,
    # the constant stream around it goes through.
    self.assertEqual(
      [a for a, _ in steps[:36]], [True] * 25 + [False] + [True] * 10
    )
    self.assertEqual(int(steps[35][1].counts.restarts), 0)
    # A lasting level from there passes after 25 + log2(1000) steps.
    first = check_level_released(self, steps, 36, 1000.0, 1.0, 0.0)
    self.assertEqual(first, 25 + 9)  # raised to 2, 4, ..., 1024

  @parameterized.parameters(None, 8)
  def test_a_lasting_loss_spike_is_raised_to_not_released(self, window):
    rng = np.random.default_rng(1)
    losses = list(2.0 + 0.05 * rng.standard_normal(25)) + [500.0] * 40
    tx = optaxclip.guard(optax.sgd(1.0), loss_spike_z=3.0, window=window)
    steps = guarded_run(tx, [1.0] * len(losses), losses)
    moments = steps[24][1].loss_monitor.moments
    mean = float(moments.mean)
    std = spread_of(moments.mean, moments.var)
    self.assertFalse(steps[25 + 25][0] or steps[25 + 26][0])
    first = check_level_released(self, steps, 25, 500.0, mean, std)
    self.assertEqual(int(steps[-1][1].counts.skipped_loss_spike), first)
    # The loss's statistics kept each raise while its steps were skipped.
    moved = [
      float(s.loss_monitor.moments.mean) for _, s in steps[25 + 25 : 25 + first]
    ]
    self.assertEqual(moved, sorted(moved))
    self.assertGreater(moved[-1], 100.0)

  @parameterized.parameters(None, 4)
  def test_equal_negative_losses_rise_above_zero(self, window):
    # A raise from a negative mean without spread goes above 0: with
    # growth 1.5, m + (growth - 1) |m| would only approach 0 (-2, -1, ...).
    tx = optaxclip.guard(
      optax.sgd(1.0),
      loss_spike_z=3.0,
      warmup_steps=3,
      patience=3,
      growth=1.5,
      window=window,
    )
    steps = guarded_run(tx, [1.0] * 12, [-4.0] * 4 + [3.0] * 8)
    applied = [a for a, _ in steps]
    # Held 3 steps, raised to 2 (skipped), then to 3 (through).
    self.assertEqual(applied, [True] * 4 + [False] * 4 + [True] * 4)

  @parameterized.parameters(None, 4)
  def test_statistics_of_only_zeros_take_the_first_value(self, window):
    tx = optaxclip.guard(
      optax.sgd(1.0), spike_z=3.0, warmup_steps=3, window=window
    )
    steps = guarded_run(tx, [0.0] * 5 + [5.0] * 3)
    self.assertTrue(all(a for a, _ in steps))
    self.assertEqual(int(steps[-1][1].counts.restarts), 1)


# ------------------------------------ loss-aware, windows, per-leaf scope


def guard_reference(pairs, *, skip_nonfinite=True, max_norm=None, **kw):
  """Per step of ``(norm, bad, loss)``: (skip?, cause, norm z, loss z) and
  the statistics after it, from np_refs.GuardStat.
  """
  z, loss_z = kw.pop("spike_z", None), kw.pop("loss_spike_z", None)
  norms, losses = np_refs.GuardStat(z, **kw), np_refs.GuardStat(loss_z, **kw)
  cap = math.inf if max_norm is None else max_norm
  out = []
  for g, loss in pairs:
    bound, spike, restart, z_n = norms.judge(g)
    spike_skip = spike or (math.isinf(g) and bound < math.inf)
    nonfinite = skip_nonfinite and (not math.isfinite(g))
    loss_nonfinite = skip_nonfinite and not math.isfinite(loss)
    _, loss_spike, loss_restart, z_l = losses.judge(loss)
    causes = [
      ("nonfinite", nonfinite or loss_nonfinite),
      ("max_norm", g > cap),
      ("spike", spike_skip),
      ("loss_spike", loss_spike),
    ]
    cause = next((name for name, hit in causes if hit), None)
    skip = cause is not None
    seen = min(g, bound) if spike and kw.get("window") is None else g
    norms.learn(seen, kw.get("window") is None or not skip, spike, restart)
    losses.learn(loss, not skip, loss_spike, loss_restart)
    out.append(
      (skip, cause, z_n, z_l, norms.mean, norms.var, losses.mean, losses.var)
    )
  return out


def loss_stream(steps=40, seed=3):
  """(norm, loss) pairs: noisy norms and losses, spikes of each, a NaN loss
  and a lasting rise of the loss.
  """
  rng = np.random.default_rng(seed)
  norms = np.exp(0.1 * rng.standard_normal(steps))
  losses = 2.0 + 0.05 * rng.standard_normal(steps)
  norms[[9, 23]] *= [8.0, 6.0]
  losses[[12, 18]] += [3.0, 1.0]
  losses[30:] += 1.5  # a new level: skipped `patience` times, then taken
  losses = list(losses)
  losses[15] = float("nan")
  return list(zip(norms.tolist(), losses))


class GuardLossWindowTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(None, 6)
  def test_matches_the_reference(self, window):
    kw = dict(
      spike_z=3.0,
      loss_spike_z=3.0,
      max_norm=7.0,
      warmup_steps=5,
      patience=4,
      window=window,
    )
    tx = optaxclip.guard(optax.adam(0.1), **kw)
    kw_ref = {k: v for k, v in kw.items() if k != "warmup_steps"}
    want = guard_reference(loss_stream(), warmup=5, **kw_ref)
    params = grads(1.0)
    update = self.variant(tx.update)
    state = tx.init(params)
    counts = dict.fromkeys(["nonfinite", "max_norm", "spike", "loss_spike"], 0)
    for t, ((norm, loss), ref) in enumerate(zip(loss_stream(), want)):
      skip, cause, z_n, z_l, mean, var, l_mean, l_var = ref
      before = state.inner_state
      out, state = update(grads(norm), state, params, value=jnp.float32(loss))
      msg = f"step {t}"
      self.assertEqual(int(state.counts.consecutive_skips) > 0, skip, msg)
      if skip:
        counts[cause] += 1
        chex.assert_trees_all_equal(state.inner_state, before)
        chex.assert_trees_all_equal(out, jax.tree.map(jnp.zeros_like, out))
      for name, n in counts.items():
        self.assertEqual(int(getattr(state.counts, f"skipped_{name}")), n, msg)
      self.assertEqual(int(state.counts.skipped), sum(counts.values()), msg)
      close = lambda a, b, msg=msg: np.testing.assert_allclose(
        float(a), b, rtol=1e-4, atol=1e-5, err_msg=msg
      )
      close(state.verdict.z_score, z_n)
      close(state.loss_monitor.z_score, z_l)
      close(state.norm_moments.mean, mean)
      close(state.norm_moments.var, var)
      close(state.loss_monitor.moments.mean, l_mean)
      close(state.loss_monitor.moments.var, l_var)
    # Not vacuous: every cause fired, and the new level of the loss passed.
    self.assertTrue(all(counts.values()), counts)
    self.assertGreater(int(state.counts.restarts), 0)
    self.assertFalse(want[-1][0])

  def test_loss_aware_without_value_fails_when_traced(self):
    tx = optaxclip.guard(optax.sgd(1.0), loss_spike_z=3.0)
    params = grads(1.0)
    with pytest.raises(ValueError, match=r"^guard: value must be passed"):
      jax.eval_shape(tx.update, params, tx.init(params), params)
    with pytest.raises(ValueError, match=r"^guard: value must be a scalar"):
      tx.update(params, tx.init(params), params, value=jnp.ones(2))

  def test_value_reaches_inner_in_a_chain_and_in_clipped(self):
    # optax.chain passes `value` to guard, and guard passes it on.
    inner = optax.contrib.reduce_on_plateau(patience=1, factor=0.5)
    tx = optaxclip.clipped(
      optax.chain(optaxclip.guard(inner, loss_spike_z=3.0), optax.sgd(1.0)),
      clipnorm=10.0,
    )
    params = grads(1.0)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for loss in (1.0, 2.0, 3.0, 4.0):
      _, state = update(params, state, params, value=loss)
    guard_state = state[1][0]
    self.assertLess(float(guard_state.inner_state.scale), 1.0)
    self.assertEqual(float(guard_state.loss_monitor.value), 4.0)

  def test_one_trace_with_value_no_host_transfer(self):
    tx = optaxclip.guard(
      optax.adam(1e-2), spike_z=3.0, loss_spike_z=3.0, window=4, scope="leaf"
    )
    traces = []

    def step(params, state, g, loss):
      traces.append(1)
      updates, state = tx.update(g, state, params, value=loss)
      return optax.apply_updates(params, updates), state

    step = jax.jit(step, donate_argnums=(0, 1))
    params = grads(1.0)
    state = tx.init(params)
    data = [
      (jax.device_put(grads(n)), jax.device_put(jnp.float32(loss)))
      for n, loss in loss_stream()[:12]
    ]
    with jax.transfer_guard("disallow"):
      for g, loss in data:
        params, state = step(params, state, g, loss)
    self.assertLen(traces, 1)
    self.assertEqual(state.norm_moments.window.values.shape, (4, 2))

  def test_eager_update_with_value_compiles_once(self):
    tx = optaxclip.guard(optax.sgd(1.0), loss_spike_z=3.0, window=4)
    params = grads(1.0)
    state = tx.init(params)
    _, state = tx.update(params, state, params, value=1.0)  # compiles
    with (
      jax.log_compiles(),
      self.assertNoLogs("jax._src.interpreters.pxla", "WARNING"),
    ):
      _, state = tx.update(params, state, params, value=1.5)

  @parameterized.parameters(
    (dict(loss_spike_z=0.0), "loss_spike_z"),
    (dict(window=1), "window"),
    (dict(window=2.5), "window"),
    (dict(scope="tensor"), "scope"),
  )
  def test_bad_new_arguments_fail_when_built(self, kwargs, name):
    with pytest.raises((ValueError, TypeError), match=f"^guard: {name} must"):
      optaxclip.guard(optax.sgd(1.0), **kwargs)


class GuardLeafTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(None, 3)
  def test_each_leaf_is_judged_alone(self, window):
    kw = dict(spike_z=2.0, max_norm=50.0, warmup_steps=3, patience=3)
    tx = optaxclip.guard(optax.adam(0.1), scope="leaf", window=window, **kw)
    inner = optax.adam(0.1)
    rng = np.random.default_rng(0)
    leaves = ("a", "b")
    refs = {k: np_refs.GuardStat(2.0, window, 3, 3) for k in leaves}
    params = grads(1.0)
    update = self.variant(tx.update)
    state = tx.init(params)
    partial = 0
    for t in range(16):
      scale = {k: float(np.exp(0.1 * rng.standard_normal())) for k in leaves}
      if t in (6, 11):
        scale["a"] *= 10.0
      if t == 8:
        scale["b"] *= 100.0  # above max_norm
      g = {k: grads(scale[k])[k] for k in leaves}
      if t == 13:
        g["b"] = g["b"].at[0].set(jnp.nan)
      before = state.inner_state
      out, state = update(g, state, params)
      skips = {}
      for k in leaves:
        n = float(np.sqrt(np.sum(np.asarray(g[k], np.float64) ** 2)))
        bound, spike, restart, _ = refs[k].judge(n)
        skips[k] = not math.isfinite(n) or n > 50.0 or spike
        seen = min(n, bound) if spike and window is None else n
        refs[k].learn(seen, window is None or not skips[k], spike, restart)
      np.testing.assert_allclose(
        state.norm_moments.mean, [refs[k].mean for k in leaves], rtol=1e-5
      )
      self.assertEqual(int(state.verdict.skipped_leaves), sum(skips.values()))
      partial += 0 < sum(skips.values()) < 2
      # The reference: adam on the gradient with the skipped leaves zeroed,
      # kept where a leaf was skipped.
      g_in = {k: jnp.zeros_like(g[k]) if skips[k] else g[k] for k in leaves}
      ref_out, ref_inner = inner.update(g_in, before, params)
      adam, adam_before, adam_ref = (
        state.inner_state[0],
        before[0],
        ref_inner[0],
      )
      if all(skips.values()):  # a whole skip: nothing moves, count neither
        chex.assert_trees_all_equal(state.inner_state, before)
      else:  # a partial one: count moves on
        self.assertEqual(int(adam.count), int(adam_ref.count))
      for k in leaves:
        if skips[k]:
          np.testing.assert_array_equal(out[k], 0.0)
          for slot in ("mu", "nu"):  # bit for bit as before
            np.testing.assert_array_equal(
              getattr(adam, slot)[k], getattr(adam_before, slot)[k]
            )
        else:
          np.testing.assert_allclose(out[k], ref_out[k], rtol=1e-6)
          for slot in ("mu", "nu"):
            np.testing.assert_allclose(
              getattr(adam, slot)[k], getattr(adam_ref, slot)[k], rtol=1e-6
            )
    self.assertGreaterEqual(partial, 3)

  def test_masked_and_multi_transform_states_split(self):
    labels = {"a": "adam", "b": "momentum"}
    inner = optax.multi_transform(
      {"adam": optax.adam(0.1), "momentum": optax.sgd(0.1, momentum=0.9)},
      labels,
    )
    tx = optaxclip.guard(inner, scope="leaf")
    params = grads(1.0)
    state = tx.init(params)
    _, state = tx.update(grads(1.0), state, params)
    before = state.inner_state
    _, state = tx.update(grads(1.0, float("nan")), state, params)  # b NaN
    trace = lambda s: s.inner_states["momentum"].inner_state[0].trace["b"]
    np.testing.assert_array_equal(trace(state.inner_state), trace(before))
    mu = lambda s: s.inner_states["adam"].inner_state[0].mu["a"]
    self.assertFalse(np.array_equal(mu(state.inner_state), mu(before)))

  def test_an_inner_state_it_cannot_split_fails_at_init(self):
    tx = optaxclip.guard(
      optax.chain(optaxclip.clip_zscore(scope="leaf"), optax.adam(0.1)),
      scope="leaf",
    )
    with pytest.raises(
      ValueError,
      match=r"^guard: with scope='leaf', inner's state must hold only "
      r"scalars.*shape \(2,\) at inner_state\[0\]\.mean",
    ):
      tx.init(grads(1.0))


def test_float64_window_and_loss_keep_float64():
  with jax.enable_x64(True):
    tx = optaxclip.guard(
      optax.sgd(1.0), spike_z=3.0, loss_spike_z=3.0, window=4, warmup_steps=2
    )
    params = {"w": jnp.zeros(2, jnp.float64)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for scale in (1e200, 1.1e200, 0.9e200):
      g = {"w": jnp.array([scale, 0.0], jnp.float64)}
      _, state = update(g, state, params, value=jnp.float64(scale))
    assert state.norm_moments.window.values.dtype == jnp.float64
    assert state.loss_monitor.moments.window.values.dtype == jnp.float64
    assert int(state.counts.skipped) == 0 and int(state.counts.nonfinite) == 0
    np.testing.assert_allclose(
      float(state.norm_moments.mean), 1e200, rtol=1e-12
    )
    np.testing.assert_allclose(float(state.loss_monitor.moments.mean), 1e200)
