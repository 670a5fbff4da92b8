"""Tests of guard(): skipping whole steps on NaN/Inf, large or spiking norms."""

import math

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

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
  with the new mean. A spike after ``patience`` skipped spikes in a row, or
  against a variance of 0, is a restart instead: not a spike, the
  mean moves to the norm and the variance takes in the jump.
  """

  def __init__(
    self,
    skip_nonfinite=True,
    spike_z=None,
    max_norm=None,
    alpha=0.97,
    warmup_steps=25,
    patience=25,
  ):
    self.skip_nonfinite, self.z, self.cap = skip_nonfinite, spike_z, max_norm
    self.alpha, self.warmup_steps = alpha, warmup_steps
    self.patience, self.run, self.restarts = patience, 0, 0
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
    restart = spike and (self.run >= self.patience or self.var == 0)
    spike = spike and not restart
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
      self.run = self.run + 1 if spike else 0
      if restart:
        self.restarts += 1
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
      self.assertEqual(int(state.skipped), skipped, f"step {t}")
      self.assertEqual(int(state.nonfinite), nonfinite)
      for cause, n in causes.items():
        self.assertEqual(int(getattr(state, f"skipped_{cause}")), n, cause)
      np.testing.assert_allclose(
        float(state.z_score), rule.z_score, rtol=1e-4, atol=1e-5
      )
      self.assertEqual(int(state.consecutive_skips), run)
      np.testing.assert_allclose(float(state.threshold), threshold, rtol=2e-5)
      np.testing.assert_allclose(float(state.mean), rule.mean, rtol=2e-5)
      np.testing.assert_allclose(
        float(state.var), rule.var, rtol=1e-4, atol=1e-9
      )
      if math.isfinite(g_norm):
        np.testing.assert_allclose(float(state.norm), g_norm, rtol=1e-5)
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
      skips.append(int(state.consecutive_skips) > 0)
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
    assert int(state.skipped) == 0 and int(state.nonfinite) == 1

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
    self.assertEqual(state.skipped.dtype, jnp.int32)
    self.assertEqual(state.norm.dtype, jnp.float32)
    self.assertGreater(int(state.skipped), 2)

  def test_keeps_dtypes(self):
    tx = optaxclip.guard(optax.sgd(1.0), max_norm=1.0)
    g = {"w": jnp.full((4,), 2.0, jnp.bfloat16)}
    out, state = jax.jit(tx.update)(g, tx.init(g))
    assert out["w"].dtype == jnp.bfloat16
    assert int(state.skipped) == 1 and float(state.norm) == 4.0


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
      assert int(state.skipped) == expected_skips
    skipped_now = int(state.consecutive_skips) > 0
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
  ],
)
def test_bad_hyperparameters_fail_at_construction(kwargs, error, message):
  with pytest.raises(error, match=message):
    optaxclip.guard(optax.sgd(1.0), **kwargs)


def test_inner_must_be_a_transformation():
  with pytest.raises(TypeError, match="inner must be"):
    optaxclip.guard(optax.sgd)
