"""Tests of clip_zscore (ZClip), clip_percentile (AutoClip), clip_relative
(AdaGC).

Each clipper is driven by a synthetic stream of gradient norms with spikes and
compared, step by step, with a plain-Python/numpy restatement of its rule.
"""

import inspect
import math

from absl.testing import parameterized
import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxclip

SHAPES = {"a": (3,), "b": (2, 2), "c": (5,)}
RTOL = 2e-5


def directions(seed=0):
  """A fixed unit-norm direction per leaf."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, shape in SHAPES.items():
    v = rng.standard_normal(shape)
    out[name] = v / np.linalg.norm(v)
  return out


DIRS = directions()
# Per-leaf shares of a global norm (unit L2 norm, so the global norm is exact).
WEIGHTS = np.array([0.48, 0.6, 0.64])


def tree(leaf_norms):
  """A gradient tree whose leaves have the given norms."""
  return {
    k: jnp.asarray(DIRS[k] * n, jnp.float32) for k, n in zip(SHAPES, leaf_norms)
  }


def global_tree(norm):
  return tree(norm * WEIGHTS)


def leaf_norms_of(updates):
  return np.array(
    [np.linalg.norm(np.asarray(updates[k], np.float64)) for k in SHAPES]
  )


def global_norm_of(updates):
  return float(np.linalg.norm(leaf_norms_of(updates)))


# A short stream for eager (un-jitted) runs, which cost ~0.5 s a step here.
SHORT = np.array([1.0, 1.3, 0.8, 9.0, 1.1])


def spiky_stream(steps=50, seed=0, base=1.0, spikes=None):
  """Norms around ``base``, slowly drifting up, with spikes."""
  rng = np.random.default_rng(seed)
  g = (
    base
    * (1 + 0.005 * np.arange(steps))
    * np.exp(0.1 * rng.standard_normal(steps))
  )
  if spikes is None:
    spikes = {4: 5.0, 14: 8.0, 15: 3.0, 29: 20.0, 41: 2.0}
  for t, k in spikes.items():
    if t < steps:
      g[t] *= k
  return g


# --- Plain-Python restatements of the rules -----------------------------------


class ZClipRule:
  """The rules of ZClip's reference implementation (bluorion-com/ZClip,
  zclip/zclip.py), restated in plain Python floats.

  Warm-up: gather norms, clip only by max_norm (torch's clip_grad_norm_,
  coefficient max / (norm + 1e-6)); when warmup_steps norms are gathered,
  mean and population variance start the EMAs. Then: detect a spike, pick
  the clip value, take min with max_norm, scale by limit / (norm + 1e-6), and
  update mean then variance (with the new mean) with the clip value on a
  spike, the norm otherwise -- unless skip_update_on_spike on a spike. Not
  in the reference: statistics of only zeros (mean and variance 0) take
  the first nonzero norm as a new level, and with ``patience`` (opt-in) a
  spike after ``patience`` spikes in a row first raises the mean by
  ``growth`` and is judged against the raised mean.
  """

  def __init__(
    self,
    alpha=0.97,
    spike_z=2.5,
    max_norm=None,
    eps=1e-6,
    warmup_steps=25,
    mode="zscore",
    clip_option="adaptive_scaling",
    clip_factor=1.0,
    skip_update_on_spike=False,
    patience=None,
    growth=2.0,
  ):
    self.alpha, self.z, self.max_norm, self.eps = alpha, spike_z, max_norm, eps
    self.patience, self.run, self.restarts = patience, 0, 0
    self.growth = growth
    self.warmup_steps, self.mode, self.option = warmup_steps, mode, clip_option
    self.factor, self.skip = clip_factor, skip_update_on_spike
    self.gathered = []
    self.mean = self.var = None
    self.margins = []

  def step(self, g):
    """Returns (scale factor, spike boundary for the stats)."""
    cap = math.inf if self.max_norm is None else self.max_norm
    self.margins.append(
      abs(g - cap) / cap if cap > 0 and cap < math.inf else math.inf
    )
    if self.mean is None:
      self.gathered.append(g)
      if len(self.gathered) >= self.warmup_steps:
        n = len(self.gathered)
        self.mean = sum(self.gathered) / n
        self.var = sum((x - self.mean) ** 2 for x in self.gathered) / n
      return (cap / (g + 1e-6) if g > cap else 1.0), cap
    clip, boundary = self._judge(g)
    self.margins.append(abs(g - boundary) / boundary)
    if clip is not None and self.mean == 0 and self.var == 0:
      # This package's restart after only zeros: a new level.
      self.restarts += 1
      self.run = 0
      self.var = self.alpha * self.var + (1 - self.alpha) * (g - self.mean) ** 2
      self.mean = g
      factor = cap / g if g > cap else 1.0
      return factor, min(boundary, cap)
    held = clip is not None
    if held and self.patience is not None and self.run >= self.patience:
      # The opt-in rule: the mean rises by `growth`, then the usual step.
      self.restarts += 1
      self.mean *= self.growth
      clip, boundary = self._judge(g)
    self.run = self.run + 1 if held else 0
    limit = min(clip if clip is not None else g, cap)
    factor = limit / (g + 1e-6) if g > limit else 1.0
    if not (clip is not None and self.skip):
      x = clip if clip is not None else g
      self.mean = self.alpha * self.mean + (1 - self.alpha) * x
      self.var = self.alpha * self.var + (1 - self.alpha) * (x - self.mean) ** 2
    return factor, min(boundary, cap)

  def _judge(self, g):
    """Returns (clip value or None, spike boundary) against the EMAs."""
    std = self.var**0.5
    if self.mode == "percentile":
      boundary = self.mean + self.z * std
      return (boundary if g > boundary else None), boundary
    boundary = self.mean + self.z * (std + self.eps)
    z = (g - self.mean) / (std + self.eps)
    if z <= self.z:
      return None, boundary
    if self.option == "adaptive_scaling":
      return (self.mean + self.z * std / (z / self.z)) * self.factor, boundary
    return self.mean, boundary

  def mean_var(self):
    """The state's mean/var: the warm-up's running values, then the EMAs."""
    if self.mean is None:
      xs = np.array(self.gathered)
      return xs.mean(), xs.var()
    return self.mean, self.var


def autoclip_rule(norms, percentile, history):
  """Per step: the threshold and the scale factor of AutoClip's rule."""
  out = []
  for t, g in enumerate(norms):
    recent = norms[max(0, t - history + 1) : t + 1]
    threshold = np.percentile(recent, percentile)
    out.append((threshold, min(1.0, threshold / g)))
  return out


def adagc_rule(
  leaf_norms,
  factor,
  beta,
  warmup_steps,
  warmup_max_norm,
  patience=None,
  growth=2.0,
):
  """Per step: per-leaf scale factors and gamma after the step: AdaGC's
  rule (Wang et al. 2025, Algorithm 1).

  With this package's change: a zero norm leaves gamma as it was (an
  infinite gamma takes the first nonzero norm). With ``patience`` (opt-in),
  a leaf above its limit after ``patience`` such steps in a row first has
  its gamma multiplied by ``growth``, then takes the usual step.
  """
  gamma = np.full(leaf_norms.shape[1], np.inf)
  run = np.zeros(leaf_norms.shape[1], int)
  out = []
  for t, norms in enumerate(leaf_norms):
    if t < warmup_steps:
      h = min(1.0, warmup_max_norm / np.linalg.norm(norms))
      factors = np.full_like(norms, h)
      new = np.minimum(gamma, norms * h)
    else:
      over = norms > factor * gamma
      base = gamma
      if patience is not None:
        base = np.where(over & (run >= patience), growth * gamma, gamma)
      factors = np.where(over, np.minimum(1.0, factor * base / norms), 1.0)
      clipped = norms * factors
      new = np.where(
        np.isinf(gamma), clipped, beta * base + (1 - beta) * clipped
      )
      run = np.where(over, run + 1, 0)
    gamma = np.where(norms > 0, new, gamma)
    out.append((factors, gamma.copy()))
  return out


# --- ZClip --------------------------------------------------------------------

ZCLIP_CONFIGS = (
  ("zscore_adaptive", dict()),
  ("zscore_mean", dict(clip_option="mean")),
  ("percentile", dict(mode="percentile", spike_z=2.0)),
  ("factor_max_norm", dict(clip_factor=0.8, max_norm=3.0)),
  ("skip_on_spike", dict(skip_update_on_spike=True, alpha=0.9)),
  (
    "percentile_skip_max_norm",
    dict(mode="percentile", max_norm=4.0, skip_update_on_spike=True),
  ),
)


class ZscoreTest(chex.TestCase):
  def _run(self, wrap, kwargs, norms, warmup_steps=10, min_clipped=2):
    kwargs = dict(warmup_steps=warmup_steps, **kwargs)
    tx = optaxclip.clip_zscore(**kwargs)
    update = wrap(tx.update)
    rule = ZClipRule(**kwargs)
    state = tx.init(global_tree(1.0))
    clipped_any = 0
    for t, g in enumerate(norms):
      out, state = update(global_tree(g), state)
      factor, threshold = rule.step(g)
      clipped_any += factor < 1
      mean, var = rule.mean_var()
      np.testing.assert_allclose(float(state.norm), g, rtol=RTOL)
      np.testing.assert_allclose(
        global_norm_of(out), g * factor, rtol=RTOL, err_msg=f"step {t}"
      )
      np.testing.assert_allclose(
        float(state.clipped_norm), g * factor, rtol=RTOL
      )
      np.testing.assert_allclose(float(state.threshold), threshold, rtol=RTOL)
      self.assertEqual(float(state.clip_fraction), float(factor < 1))
      self.assertEqual(int(state.count), min(t + 1, kwargs["warmup_steps"]))
      np.testing.assert_allclose(float(state.mean), mean, rtol=RTOL)
      np.testing.assert_allclose(float(state.var), var, rtol=1e-4, atol=1e-9)
    # The data is not borderline: no decision is within 1e-4 of a tie.
    self.assertGreater(min(rule.margins), 1e-4)
    self.assertGreaterEqual(clipped_any, min_clipped)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*ZCLIP_CONFIGS[:1])
  def test_matches_reference_rules(self, kwargs):
    self._run(self.variant, kwargs, SHORT, warmup_steps=3, min_clipped=1)

  @parameterized.named_parameters(*ZCLIP_CONFIGS)
  def test_matches_reference_rules_jit(self, kwargs):
    self._run(jax.jit, kwargs, spiky_stream(50))

  def test_leaf_scope_keeps_statistics_per_leaf(self):
    kwargs = dict(warmup_steps=8, max_norm=50.0)
    tx = optaxclip.clip_zscore(scope="leaf", **kwargs)
    rules = [ZClipRule(**kwargs) for _ in SHAPES]
    streams = np.stack(
      [
        spiky_stream(40, seed=1, base=1.0, spikes={12: 10.0}),
        spiky_stream(40, seed=2, base=0.1, spikes={20: 30.0, 30: 4.0}),
        spiky_stream(40, seed=3, base=10.0, spikes={3: 9.0, 25: 6.0}),
      ],
      axis=1,
    )
    update = jax.jit(tx.update)
    state = tx.init(tree(np.ones(3)))
    self.assertEqual(state.mean.shape, (3,))
    for t, norms in enumerate(streams):
      out, state = update(tree(norms), state)
      steps = [r.step(g) for r, g in zip(rules, norms)]
      factors = np.array([f for f, _ in steps])
      thresholds = np.array([b for _, b in steps])
      np.testing.assert_allclose(
        leaf_norms_of(out), norms * factors, rtol=RTOL, err_msg=f"step {t}"
      )
      np.testing.assert_allclose(
        float(state.norm), np.linalg.norm(norms), rtol=RTOL
      )
      np.testing.assert_allclose(
        float(state.clipped_norm), np.linalg.norm(norms * factors), rtol=RTOL
      )
      np.testing.assert_allclose(
        float(state.clip_fraction), np.mean(factors < 1), rtol=1e-6
      )
      np.testing.assert_allclose(
        float(state.threshold), np.linalg.norm(thresholds), rtol=RTOL
      )
      means, variances = zip(*(r.mean_var() for r in rules))
      np.testing.assert_allclose(state.mean, means, rtol=RTOL)
      np.testing.assert_allclose(state.var, variances, rtol=1e-4, atol=1e-9)
    self.assertGreater(min(min(r.margins) for r in rules), 1e-4)

  def test_default_warmup_does_not_clip_without_max_norm(self):
    tx = optaxclip.clip_zscore()
    update = jax.jit(tx.update)
    state = tx.init(global_tree(1.0))
    for g in [1.0] * 10 + [1000.0] + [1.0] * 14:  # 25 warm-up steps
      out, state = update(global_tree(g), state)
      np.testing.assert_allclose(global_norm_of(out), g, rtol=RTOL)
      self.assertEqual(float(state.threshold), math.inf)
    out, state = update(global_tree(1000.0), state)  # first adaptive step
    self.assertEqual(float(state.clip_fraction), 1.0)
    self.assertLess(global_norm_of(out), 1000.0 / 2)


# --- AutoClip -----------------------------------------------------------------


class PercentileTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
    ("p90_h3", 90.0, 3),
  )
  def test_matches_numpy_percentile(self, percentile, history):
    self._check(self.variant, percentile, history, SHORT)

  @parameterized.named_parameters(
    ("p0_h5", 0.0, 5),
    ("p100_h5", 100.0, 5),
    ("p50_h1", 50.0, 1),
    ("p33_h1024", 33.3, 1024),
    ("p10_h16", 10.0, 16),
    ("p90_h7", 90.0, 7),
  )
  def test_matches_numpy_percentile_jit(self, percentile, history):
    self._check(jax.jit, percentile, history, spiky_stream(40))

  def _check(self, wrap, percentile, history, norms):
    tx = optaxclip.clip_percentile(percentile, history=history)
    update = wrap(tx.update)
    state = tx.init(global_tree(1.0))
    for t, ((threshold, factor), g) in enumerate(
      zip(autoclip_rule(norms, percentile, history), norms)
    ):
      out, state = update(global_tree(g), state)
      np.testing.assert_allclose(
        float(state.threshold), threshold, rtol=RTOL, err_msg=f"step {t}"
      )
      np.testing.assert_allclose(global_norm_of(out), g * factor, rtol=RTOL)
      np.testing.assert_allclose(
        float(state.clipped_norm), g * factor, rtol=RTOL
      )
      self.assertEqual(float(state.clip_fraction), float(factor < 1 - 1e-6))
      self.assertEqual(int(state.filled), min(t + 1, history))
      self.assertEqual(int(state.index), (t + 1) % history)

  def test_leaf_scope_keeps_a_history_per_leaf(self):
    tx = optaxclip.clip_percentile(25.0, history=6, scope="leaf")
    streams = np.stack(
      [
        spiky_stream(20, seed=s, base=b)
        for s, b in ((1, 1.0), (2, 0.01), (3, 50.0))
      ],
      axis=1,
    )
    rules = [autoclip_rule(streams[:, i], 25.0, 6) for i in range(3)]
    update = jax.jit(tx.update)
    state = tx.init(tree(np.ones(3)))
    self.assertEqual(state.history.shape, (6, 3))
    for t, norms in enumerate(streams):
      out, state = update(tree(norms), state)
      thresholds = np.array([r[t][0] for r in rules])
      factors = np.array([r[t][1] for r in rules])
      np.testing.assert_allclose(
        leaf_norms_of(out), norms * factors, rtol=RTOL, err_msg=f"step {t}"
      )
      np.testing.assert_allclose(
        float(state.threshold), np.linalg.norm(thresholds), rtol=RTOL
      )
      np.testing.assert_allclose(
        float(state.clip_fraction), np.mean(factors < 1), rtol=1e-6
      )

  def test_percentile_helper_matches_numpy(self):
    rng = np.random.default_rng(4)
    values = rng.lognormal(size=(9, 2)).astype(np.float32)
    for n in range(1, 10):
      for q in (0.0, 12.5, 50.0, 77.7, 100.0):
        got = optaxclip._adaptive.percentile_linear(jnp.asarray(values), n, q)
        np.testing.assert_allclose(
          got,
          np.percentile(values[:n].astype(np.float64), q, axis=0),
          rtol=1e-6,
        )


# --- AdaGC --------------------------------------------------------------------


class RelativeTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_rule(self):
    streams = np.stack(
      [
        SHORT * 0.5,
        [0.05, 2.0, 0.04, 0.05, 0.3],
        [2.0, 2.1, 1.9, 2.0, 10.0],
      ],
      axis=1,
    )
    self._check(
      self.variant, dict(warmup_steps=3, warmup_max_norm=2.0), streams
    )

  @parameterized.named_parameters(
    ("defaults_short_warmup", dict(warmup_steps=5)),
    ("tight", dict(factor=1.01, beta=0.9, warmup_steps=3, warmup_max_norm=2.0)),
    ("long_warmup", dict(warmup_steps=20, warmup_max_norm=1.5)),
  )
  def test_matches_rule_jit(self, kwargs):
    streams = np.stack(
      [
        spiky_stream(30, seed=1, base=0.5, spikes={10: 6.0}),
        spiky_stream(30, seed=2, base=0.05, spikes={2: 40.0, 17: 3.0}),
        spiky_stream(30, seed=3, base=2.0, spikes={22: 5.0}),
      ],
      axis=1,
    )
    self._check(jax.jit, kwargs, streams)

  def _check(self, wrap, kwargs, streams):
    tx = optaxclip.clip_relative(**kwargs)
    full = dict(factor=1.05, beta=0.98, warmup_steps=100, warmup_max_norm=1.0)
    full.update(kwargs)
    expected = adagc_rule(streams, **full)
    update = wrap(tx.update)
    state = tx.init(tree(np.ones(3)))
    for t, (norms, (factors, gamma)) in enumerate(zip(streams, expected)):
      out, state = update(tree(norms), state)
      np.testing.assert_allclose(
        leaf_norms_of(out), norms * factors, rtol=RTOL, err_msg=f"step {t}"
      )
      np.testing.assert_allclose(state.gamma, gamma, rtol=RTOL)
      np.testing.assert_allclose(
        float(state.norm), np.linalg.norm(norms), rtol=RTOL
      )
      np.testing.assert_allclose(
        float(state.clipped_norm), np.linalg.norm(norms * factors), rtol=RTOL
      )
      np.testing.assert_allclose(
        float(state.clip_fraction), np.mean(factors < 1 - 1e-7), rtol=1e-6
      )
      if t < full["warmup_steps"]:
        self.assertEqual(float(state.threshold), full["warmup_max_norm"])
      else:
        np.testing.assert_allclose(
          float(state.threshold),
          np.linalg.norm(full["factor"] * expected[t - 1][1]),
          rtol=RTOL,
        )
      self.assertEqual(int(state.count), min(t + 1, full["warmup_steps"]))
    self.assertTrue(
      any(np.any(f < 1) for f, _ in expected[full["warmup_steps"] :])
    )

  def test_gamma_starts_infinite(self):
    tx = optaxclip.clip_relative()
    state = tx.init(tree(np.ones(3)))
    self.assertTrue(np.all(np.isposinf(state.gamma)))
    self.assertEqual(state.gamma.dtype, jnp.float32)


# --- Shared behaviour ---------------------------------------------------------

ALL = {
  "zscore": lambda: optaxclip.clip_zscore(warmup_steps=3),
  "zscore_leaf": lambda: optaxclip.clip_zscore(warmup_steps=3, scope="leaf"),
  "percentile": lambda: optaxclip.clip_percentile(history=8),
  "percentile_leaf": lambda: optaxclip.clip_percentile(history=8, scope="leaf"),
  "relative": lambda: optaxclip.clip_relative(warmup_steps=3),
}


def _step_field(state):
  """The step count schedules are evaluated at: clip_percentile's `count`
  (the others' `count` counts their warm-up).
  """
  return "count" if isinstance(state, optaxclip.ClipPercentileState) else "step"


@pytest.mark.parametrize("name", sorted(ALL))
def test_nonfinite_steps_leave_statistics_untouched(name):
  tx = ALL[name]()
  update = jax.jit(tx.update)
  state = tx.init(global_tree(1.0))
  for g in [1.0, 1.1, 0.9, 1.05]:
    _, state = update(global_tree(g), state)
  before = state
  bad = global_tree(1.0)
  for value in (jnp.nan, jnp.inf):
    bad["b"] = bad["b"].at[0, 0].set(value)
    _, state = update(bad, state)
    for field in before._fields:
      if field not in (
        *optaxclip._adaptive.ADAPTIVE_FIELDS,
        _step_field(state),
      ):
        np.testing.assert_array_equal(
          getattr(state, field), getattr(before, field), err_msg=field
        )
    assert not np.isfinite(float(state.norm))
  # The next finite step continues as if the bad ones never happened (but
  # for the step count, which counts every update: schedules follow it).
  _, state = update(global_tree(1.0), state)
  _, expected = update(global_tree(1.0), before)
  step_field = _step_field(state)
  assert getattr(state, step_field) == getattr(expected, step_field) + 2
  chex.assert_trees_all_equal(
    state, expected._replace(**{step_field: getattr(state, step_field)})
  )


@pytest.mark.parametrize("name", sorted(ALL))
def test_one_trace_no_host_transfer_in_a_jitted_loop(name):
  tx = optax.chain(ALL[name](), optax.adam(1e-3))
  traces = []

  def step(params, state, grads):
    traces.append(1)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))  # donation: no shared buffers
  params = global_tree(1.0)
  state = tx.init(params)
  norms = spiky_stream(12)
  grads = [jax.device_put(global_tree(g)) for g in norms]
  with jax.transfer_guard("disallow"):
    for g in grads:
      params, state = step(params, state, g)
  assert len(traces) == 1
  for field in optaxclip._adaptive.ADAPTIVE_FIELDS:
    assert getattr(state[0], field).dtype == jnp.float32
    assert getattr(state[0], field).shape == ()
  # stats() names the clipper's four statistics, read from the state.
  short = "_".join(("clip", name.split("_")[0]))
  stats = optaxclip.stats(state)
  restarts = ("restarts",) if short != "clip_percentile" else ()
  assert list(stats) == [
    f"{short}/{f}"
    for f in ("norm", "clipped_norm", "clip_fraction", "threshold", *restarts)
  ]
  np.testing.assert_allclose(
    float(stats[f"{short}/norm"]), norms[-1], rtol=RTOL
  )


@pytest.mark.parametrize("name", ["zscore_leaf", "relative"])
def test_dtypes_empty_trees_and_none_leaves(name):
  tx = ALL[name]()
  g = {
    "w": jnp.ones((4,), jnp.bfloat16),
    "skip": None,
    "h": jnp.full((2,), 3.0, jnp.float16),
  }
  state = tx.init(g)
  out, state = jax.jit(tx.update)(g, state)
  assert out["w"].dtype == jnp.bfloat16 and out["h"].dtype == jnp.float16
  assert out["skip"] is None
  np.testing.assert_allclose(float(state.norm), math.sqrt(4 + 18), rtol=1e-6)
  empty_state = tx.init({})
  out, empty_state = jax.jit(tx.update)({}, empty_state)
  assert out == {}
  assert float(empty_state.norm) == 0.0


def after_warmup(state):
  """A state as after a warm-up (norms around 1), built directly."""
  if isinstance(state, optaxclip.ClipZscoreState):
    return state._replace(
      count=jnp.int32(3),
      mean=jnp.ones_like(state.mean),
      var=jnp.full_like(state.var, 0.01),
    )
  if isinstance(state, optaxclip.ClipPercentileState):
    extra = state.history.shape[1:]
    rows = jnp.broadcast_to(
      jnp.linspace(0.8, 1.2, 4).reshape((4,) + (1,) * len(extra)), (4, *extra)
    )
    return state._replace(
      history=state.history.at[:4].set(rows),
      filled=jnp.int32(4),
      index=jnp.int32(4),
    )
  return state._replace(
    count=jnp.int32(3), gamma=jnp.full_like(state.gamma, 0.5)
  )


@pytest.mark.parametrize("name", ["zscore", "percentile_leaf"])
def test_gradient_through_update_is_finite(name):
  tx = ALL[name]()
  ones = global_tree(1.0)

  def loss(scale, state):
    updates = jax.tree.map(lambda d: scale * d, ones)
    out, _ = tx.update(updates, state)
    return sum(jnp.sum(x) for x in jax.tree.leaves(out))

  grad = jax.jit(jax.grad(loss))
  # At init (percentile: the threshold is the norm itself) and after warm-up;
  # at a zero gradient, in range and far above the threshold.
  for state in (tx.init(ones), after_warmup(tx.init(ones))):
    for scale in (0.0, 1.0, 1e3):
      assert np.isfinite(float(grad(jnp.float32(scale), state))), (name, scale)


def test_leaf_scope_rejects_a_different_tree():
  for tx in (
    optaxclip.clip_zscore(scope="leaf"),
    optaxclip.clip_percentile(scope="leaf"),
    optaxclip.clip_relative(),
  ):
    state = tx.init({"a": jnp.ones(2)})
    with pytest.raises(
      ValueError, match="built for 1 leaves but the updates have 2"
    ):
      tx.update({"a": jnp.ones(2), "b": jnp.ones(2)}, state)


def test_integer_leaves_are_named():
  tx = optaxclip.clip_percentile()
  g = {"w": jnp.ones(2), "step": jnp.ones(2, jnp.int32)}
  with pytest.raises(TypeError, match=r"\['step'\]"):
    tx.update(g, tx.init(g))


def test_injected_hyperparameters():
  tx = optax.inject_hyperparams(
    optaxclip.clip_zscore,
    static_args=(
      "warmup_steps",
      "mode",
      "clip_option",
      "scope",
      "skip_update_on_spike",
      "max_norm",
    ),
  )(alpha=0.9, spike_z=2.0, warmup_steps=2)
  update = jax.jit(tx.update)
  state = tx.init(global_tree(1.0))
  for g in (1.0, 1.2, 100.0):
    out, state = update(global_tree(g), state)
  assert global_norm_of(out) < 10.0
  tx = optax.inject_hyperparams(
    optaxclip.clip_percentile, static_args=("history", "scope")
  )(percentile=50.0, history=4)
  state = tx.init(global_tree(1.0))
  for g in (1.0, 3.0):
    out, state = tx.update(global_tree(g), state)
  np.testing.assert_allclose(global_norm_of(out), 2.0, rtol=RTOL)


# --- Properties ---------------------------------------------------------------

norm_streams = st.lists(
  st.floats(1e-3, 1e4, allow_nan=False, allow_infinity=False),
  min_size=10,
  max_size=10,
)


PERCENTILE_20 = optaxclip.clip_percentile(20.0, history=6)
ZSCORE_CAPPED = optaxclip.clip_zscore(
  warmup_steps=3, max_norm=500.0, clip_factor=0.9
)
RELATIVE_1_5 = optaxclip.clip_relative(1.5, warmup_steps=2, warmup_max_norm=5.0)
JITTED = {
  id(tx): jax.jit(tx.update)
  for tx in (PERCENTILE_20, ZSCORE_CAPPED, RELATIVE_1_5)
}


@hypothesis.given(norm_streams)
def test_percentile_clipped_norm_is_min_of_norm_and_threshold(norms):
  tx = PERCENTILE_20
  update = JITTED[id(tx)]
  state = tx.init(global_tree(1.0))
  for g in norms:
    out, state = update(global_tree(g), state)
    threshold = float(state.threshold)
    assert min(norms) * (1 - 1e-6) <= threshold <= max(norms) * (1 + 1e-6)
    np.testing.assert_allclose(
      global_norm_of(out), min(g, threshold), rtol=RTOL
    )


@hypothesis.given(norm_streams)
def test_zscore_never_grows_a_norm_nor_passes_max_norm(norms):
  tx = ZSCORE_CAPPED
  update = JITTED[id(tx)]
  state = tx.init(global_tree(1.0))
  for g in norms:
    out, state = update(global_tree(g), state)
    out_norm = global_norm_of(out)
    assert out_norm <= min(g, 500.0) * (1 + RTOL)
    assert float(state.var) >= 0
    if g > float(state.threshold) * (1 + 1e-5):
      assert out_norm < g  # a spike is always clipped (clip_factor <= 1)


@hypothesis.given(
  st.lists(st.tuples(*[st.floats(1e-3, 1e3)] * 3), min_size=6, max_size=6)
)
def test_relative_leaf_norm_stays_within_factor_of_gamma(leaf_norms):
  tx = RELATIVE_1_5
  update = JITTED[id(tx)]
  state = tx.init(tree(np.ones(3)))
  for t, norms in enumerate(leaf_norms):
    gamma = np.asarray(state.gamma, np.float64)
    out, state = update(tree(np.array(norms)), state)
    got = leaf_norms_of(out)
    if t < 2:
      assert np.linalg.norm(got) <= 5.0 * (1 + RTOL)
    else:
      assert np.all(got <= 1.5 * gamma * (1 + RTOL))
    assert np.all(np.asarray(state.gamma) > 0)


# --- Defaults follow the papers; patience is opt-in ---------------------------


def _one_leaf_run(tx, norms):
  """The output norm per step of a one-element leaf fed ``norms``."""
  update = jax.jit(tx.update)
  state = tx.init({"w": jnp.zeros(1)})
  outs = []
  for g in norms:
    out, state = update({"w": jnp.array([g], jnp.float32)}, state)
    outs.append(abs(float(out["w"][0])))
  return np.array(outs), state


def _rule_norms(norms, **kwargs):
  """AdaGC's output norms for a one-leaf stream, with the defaults."""
  full = dict(factor=1.05, beta=0.98, warmup_steps=100, warmup_max_norm=1.0)
  full.update(kwargs)
  column = np.asarray(norms, np.float64)[:, None]
  return np.array([f[0] for f, _ in adagc_rule(column, **full)]) * column[:, 0]


def test_relative_clips_a_spike_after_25_clipped_steps_by_default():
  """Norms of 2 after a warm-up that clipped them to 1: gamma starts at 1
  and every step after the warm-up is clipped (gamma grows by 1.001 a step).
  After exactly 25 of them, spikes of 1000 and 800 come out at
  ``1.05 * 1.001**25``, about 1.08, as the paper's rule gives.
  """
  norms = [2.0] * 125 + [1000.0, 800.0]
  got, state = _one_leaf_run(optaxclip.clip_relative(), norms)
  np.testing.assert_allclose(got, _rule_norms(norms), rtol=RTOL)
  np.testing.assert_allclose(got[125], 1.05 * 1.001**25, rtol=1e-4)
  assert got[126] < 1.1
  assert int(state.restarts) == 0


def test_relative_with_patience_raises_gamma_from_the_clipped_level():
  """The opt-in rule on the same stream: the spike after 25 clipped steps
  comes out at ``factor * growth * gamma``, about 2.15, and a lasting level
  then gets through within a few doublings.
  """
  norms = [2.0] * 125 + [1000.0, 800.0] + [50.0] * 10
  tx = optaxclip.clip_relative(patience=25, growth=2.0)
  got, state = _one_leaf_run(tx, norms)
  np.testing.assert_allclose(
    got, _rule_norms(norms, patience=25, growth=2.0), rtol=RTOL
  )
  np.testing.assert_allclose(got[125], 2 * 1.05 * 1.001**25, rtol=1e-4)
  assert got[126] < 2.2 * got[125]
  np.testing.assert_allclose(got[-4:], 50.0, rtol=RTOL)  # the level passes
  assert int(state.restarts) > 0


def drifting_stream(steps=400, seed=0):
  """Two leaves' norms: a drifting lognormal scale around 2 (above the
  warm-up's limit of 1, so the paper's rule clips most steps), and three
  spikes of 100x.
  """
  rng = np.random.default_rng(seed)
  drift = np.cumsum(rng.normal(0.0, 0.02, steps))
  norms = 2.0 * np.exp(drift)[:, None] * rng.lognormal(0.0, 0.2, (steps, 2))
  for t, leaf in ((150, 0), (250, 1), (350, 0)):
    norms[t, leaf] *= 100.0
  return norms


def test_relative_follows_the_papers_rule_on_a_drifting_stream():
  """0 of 800 leaf-steps deviate from AdaGC's rule under the defaults, and
  each spike comes out below 1.
  """
  norms = drifting_stream()
  directions = {"a": np.ones(3) / np.sqrt(3), "b": np.ones(5) / np.sqrt(5)}
  tx = optaxclip.clip_relative()
  update = jax.jit(tx.update)
  state = tx.init({k: jnp.zeros(v.shape) for k, v in directions.items()})
  got = []
  for n in norms:
    g = {
      k: jnp.asarray(n[i] * directions[k], jnp.float32)
      for i, k in enumerate(directions)
    }
    out, state = update(g, state)
    got.append([np.linalg.norm(np.asarray(out[k], np.float64)) for k in g])
  want = np.array([f for f, _ in adagc_rule(norms, 1.05, 0.98, 100, 1.0)])
  got = np.array(got) / norms
  deviating = np.abs(got - want) > 1e-4 * want
  assert int(deviating.sum()) == 0, np.argwhere(deviating)[:5]
  assert np.mean(want[100:] < 1) > 0.5  # not vacuous: mostly clipped
  for t, leaf in ((150, 0), (250, 1), (350, 0)):
    assert norms[t, leaf] * got[t, leaf] < 1.0


def test_zscore_follows_the_reference_after_equal_norms():
  """A warm-up of equal norms (variance 0) then a new level: the
  reference's rule clips every step to the mean, for ever; with the opt-in
  ``patience`` the mean doubles a step from there until the level passes.
  """
  norms = [1.0] * 5 + [10.0] * 12
  got, state = _one_leaf_run(optaxclip.clip_zscore(warmup_steps=5), norms)
  np.testing.assert_allclose(got, [1.0] * 17, rtol=RTOL)
  assert int(state.restarts) == 0
  tx = optaxclip.clip_zscore(warmup_steps=5, patience=4, growth=2.0)
  got, state = _one_leaf_run(tx, norms)
  np.testing.assert_allclose(
    got, [1.0] * 9 + [2.0, 4.0, 8.0] + [10.0] * 5, rtol=RTOL
  )
  assert int(state.restarts) == 4


def test_zscore_takes_the_first_nonzero_norm_after_zeros():
  """Statistics of zeros only have no scale: the first nonzero norm starts
  them (the reference clips every later step to 0).
  """
  got, state = _one_leaf_run(
    optaxclip.clip_zscore(warmup_steps=3), [0.0] * 3 + [2.0, 2.1, 1.9]
  )
  np.testing.assert_allclose(got, [0.0] * 3 + [2.0, 2.1, 1.9], rtol=RTOL)
  assert int(state.restarts) == 1


@pytest.mark.parametrize("fn", [optaxclip.clip_relative, optaxclip.clip_zscore])
def test_patience_is_off_by_default(fn):
  """The paper's (the reference's) rule: no escape rule unless asked for."""
  parameters = inspect.signature(fn).parameters
  assert parameters["patience"].default is None
  assert parameters["growth"].default == 2.0


RELATIVE_PATIENT = optaxclip.clip_relative(
  1.05, warmup_steps=2, warmup_max_norm=1.0, patience=3, growth=2.0
)
ZSCORE_PATIENT = optaxclip.clip_zscore(
  warmup_steps=3, alpha=0.9, patience=3, growth=2.0
)
JITTED.update(
  {id(tx): jax.jit(tx.update) for tx in (RELATIVE_PATIENT, ZSCORE_PATIENT)}
)
# Levels between 1e-2 and 1e2, and spikes up to 1e8.
levels = st.floats(1e-2, 1e2)
spikes = st.floats(1e2, 1e8)


@hypothesis.given(
  st.lists(
    st.tuples(
      st.one_of(levels, spikes),
      st.one_of(levels, spikes),
      levels,
    ),
    min_size=16,
    max_size=16,
  )
)
@hypothesis.example(
  [(2.0, 2.0, 2.0)] * 6 + [(1e6, 2.0, 2.0)] + [(2.0,) * 3] * 9
)
def test_relative_with_patience_never_passes_a_spike_at_its_own_size(
  leaf_norms,
):
  """With the opt-in rule, each leaf's output norm after the warm-up is at
  most ``factor * growth * gamma`` (gamma before the step), and at most
  ``factor * gamma`` until the leaf has been above its limit ``patience``
  steps in a row: a spike above that comes out clipped, never at its size.
  The outputs are those of the rule restated in NumPy.
  """
  tx = RELATIVE_PATIENT
  update = JITTED[id(tx)]
  state = tx.init(tree(np.ones(3)))
  norms = np.array(leaf_norms)
  want = adagc_rule(norms, 1.05, 0.98, 2, 1.0, patience=3, growth=2.0)
  for t, row in enumerate(norms):
    gamma = np.asarray(state.gamma, np.float64)
    run = np.asarray(state.consecutive_clips)
    out, state = update(tree(row), state)
    got = leaf_norms_of(out)
    np.testing.assert_allclose(got, row * want[t][0], rtol=1e-4)
    if t < 2:
      continue
    limit = 1.05 * gamma * np.where(run >= 3, 2.0, 1.0)
    assert np.all(got <= limit * (1 + 1e-4)), (t, got, limit)
    spike = row > limit * (1 + 1e-4)
    assert np.all(got[spike] < row[spike])


@hypothesis.given(st.lists(st.one_of(levels, spikes), min_size=16, max_size=16))
@hypothesis.example([1.0, 1.1, 0.9] + [1e4] * 13)  # a lasting new level
def test_zscore_with_patience_never_passes_a_spike_at_its_own_size(norms):
  """With the opt-in rule, a step after the warm-up comes out at most
  ``growth * m + spike_z * (s + eps)`` (``m``, ``s`` the statistics before
  the step), and at most ``m + spike_z * (s + eps)`` when it is a spike
  before the ``patience``-th in a row.
  """
  tx = ZSCORE_PATIENT
  update = JITTED[id(tx)]
  state = tx.init(global_tree(1.0))
  for t, g in enumerate(norms):
    m = float(state.mean)
    s = float(optaxclip._moments.spread(state.mean, state.var))
    run = int(state.consecutive_spikes)
    out, state = update(global_tree(g), state)
    got = global_norm_of(out)
    assert got <= g * (1 + RTOL)
    if t < 3:
      continue
    up = 2.0 if run >= 3 else 1.0
    bound = up * m + 2.5 * (s + 1e-6)
    if g > bound * (1 + 1e-4):
      assert got <= bound * (1 + 1e-4), (t, g, got, bound)


# --- Hyperparameter checks ----------------------------------------------------


@pytest.mark.parametrize(
  "make, error, message",
  [
    (lambda: optaxclip.clip_zscore(alpha=1.0), ValueError, "alpha must be < 1"),
    (lambda: optaxclip.clip_zscore(alpha=0.0), ValueError, "alpha must be > 0"),
    (lambda: optaxclip.clip_zscore(spike_z=0.0), ValueError, "spike_z"),
    (lambda: optaxclip.clip_zscore(spike_z=float("nan")), ValueError, "NaN"),
    (lambda: optaxclip.clip_zscore(max_norm=-1.0), ValueError, "max_norm"),
    (lambda: optaxclip.clip_zscore(eps=-1e-6), ValueError, "eps"),
    (lambda: optaxclip.clip_zscore(warmup_steps=0), ValueError, "warmup_steps"),
    (lambda: optaxclip.clip_zscore(warmup_steps=2.5), ValueError, "whole"),
    (lambda: optaxclip.clip_zscore(mode="median"), ValueError, "mode"),
    (
      lambda: optaxclip.clip_zscore(clip_option="max"),
      ValueError,
      "clip_option",
    ),
    (lambda: optaxclip.clip_zscore(clip_factor=0.0), ValueError, "clip_factor"),
    (
      lambda: optaxclip.clip_zscore(skip_update_on_spike=1),
      TypeError,
      "skip_update_on_spike",
    ),
    (lambda: optaxclip.clip_zscore(scope="layer"), ValueError, "scope"),
    (lambda: optaxclip.clip_percentile(-1.0), ValueError, "percentile"),
    (lambda: optaxclip.clip_percentile(100.5), ValueError, "percentile"),
    (lambda: optaxclip.clip_percentile("10"), TypeError, "percentile"),
    (lambda: optaxclip.clip_percentile(history=0), ValueError, "history"),
    (
      lambda: optaxclip.clip_percentile(history=jnp.int32(4)),
      TypeError,
      "static_args",
    ),
    (lambda: optaxclip.clip_percentile(scope="unit"), ValueError, "scope"),
    (lambda: optaxclip.clip_relative(0.0), ValueError, "factor"),
    (
      lambda: optaxclip.clip_relative(patience=3, growth=1.0),
      ValueError,
      "clip_relative: growth must be > 1",
    ),
    (lambda: optaxclip.clip_relative(patience=0), ValueError, "patience"),
    (
      lambda: optaxclip.clip_zscore(growth=float("nan")),
      ValueError,
      "clip_zscore: growth must be a real number; got NaN",
    ),
    (lambda: optaxclip.clip_relative(beta=1.5), ValueError, "beta"),
    (
      lambda: optaxclip.clip_relative(warmup_steps=0),
      ValueError,
      "warmup_steps",
    ),
    (
      lambda: optaxclip.clip_relative(warmup_max_norm=-1.0),
      ValueError,
      "warmup_max_norm",
    ),
  ],
)
def test_bad_hyperparameters_fail_at_construction(make, error, message):
  with pytest.raises(error, match=message):
    make()


def test_percentile_state_from_release_0_1_continues_like_a_fresh_one():
  # Release 0.1.0 kept no sorted copy (restored at its fresh +inf) and held
  # zeros in empty slots; the update rebuilds the sorted window from it.
  tx = optaxclip.clip_percentile(50.0, history=4)
  update = jax.jit(tx.update)
  state = tx.init(global_tree(1.0))
  for g in (2.0, 1.0):
    _, state = update(global_tree(g), state)
  legacy = state._replace(
    history=jnp.where(jnp.isinf(state.history), 0.0, state.history),
    ordered=jnp.full_like(state.ordered, jnp.inf),
  )
  for g in (3.0, 4.0, 0.5):
    out, state = update(global_tree(g), state)
    legacy_out, legacy = update(global_tree(g), legacy)
    chex.assert_trees_all_equal((out, state), (legacy_out, legacy))
  np.testing.assert_allclose(float(state.threshold), 2.0, rtol=RTOL)  # 1,3,4,.5


def test_relative_warmup_clips_a_1e38_gradient_along_its_direction():
  # The warm-up's global limit shared out per leaf: no factor below 2**-126.
  tx = optaxclip.clip_relative(warmup_steps=3)
  g = {"w": jnp.array([1e38, 1e38], jnp.float32)}
  out, state = jax.jit(tx.update)(g, tx.init(g))
  np.testing.assert_allclose(out["w"], [2**-0.5, 2**-0.5], rtol=1e-6)
  np.testing.assert_allclose(float(state.clipped_norm), 1.0, rtol=1e-6)


def test_z_thresh_is_a_deprecated_spelling_of_spike_z():
  grads = {"w": jnp.array([3.0, 4.0])}
  with pytest.warns(DeprecationWarning, match="write spike_z"):
    old = optaxclip.clip_zscore(z_thresh=1.5, warmup_steps=1)
  new = optaxclip.clip_zscore(spike_z=1.5, warmup_steps=1)
  s_old, s_new = old.init(grads), new.init(grads)
  for scale in (1.0, 1.1, 50.0):
    g = jax.tree.map(lambda x, s=scale: s * x, grads)
    out_old, s_old = old.update(g, s_old)
    out_new, s_new = new.update(g, s_new)
    chex.assert_trees_all_equal(out_old, out_new)
