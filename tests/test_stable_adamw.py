"""stable_adamw against a NumPy transcription of torch-optimi 0.3.3's
StableAdamW (``optimi/stableadamw.py``, ``_single_param_stableadamw``;
``optimi/utils.py``, ``debias_beta``), written here without PyTorch.

The reference rounds to its storage dtype after every in-place operation,
as PyTorch does: float32 storage for float32 parameters; for bfloat16 ones,
bfloat16 parameters, moments and Kahan compensation (torch-optimi's
defaults). stable_adamw keeps float32 moments, so the bfloat16 comparison
is in units in the last place of bfloat16; against the same algorithm in
float64 (no rounding), its bfloat16 parameters stay within one of them
(Kahan summation). ``python tests/test_stable_adamw.py`` prints the worst
differences.
"""

import math

import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import fuzz_strategies as fz
import np_refs
import optaxclip

BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = ((4, 5), (7,), (), (3, 2, 2))
STEPS = 40
SPIKE_STEPS = (3, 9, 17, 18, 30)
KW = dict(b1=0.9, b2=0.99, eps=1e-6, weight_decay=0.01)
LR = 1e-2


# --- The reference ----------------------------------------------------------


def debias_beta(beta, step):
  """torch-optimi's ``debias_beta``: ``(beta**t - beta) / (beta**t - 1)``."""
  return (beta**step - beta) / (beta**step - 1)


class StableAdamWReference:
  """torch-optimi 0.3.3's StableAdamW for a list of tensors, in NumPy.

  Every operation is taken in float64 and rounded to ``dtype`` (the
  tensors' storage), as each in-place PyTorch operation rounds its result.
  ``lr`` and ``weight_decay`` may be callables of the 0-based step (a
  scheduler that sets the group's values before each step).
  """

  def __init__(
    self,
    params,
    dtype,
    lr,
    b1,
    b2,
    eps,
    weight_decay,
    decouple_lr=False,
    max_lr=None,
    kahan_sum=True,
    moment_dtype=None,
  ):
    self.dtype = np.dtype(dtype)
    self.moment_dtype = np.dtype(moment_dtype or dtype)
    self.params = [np.asarray(p).astype(self.dtype) for p in params]
    self.m = [np.zeros(p.shape, self.moment_dtype) for p in params]
    self.v = [np.zeros(p.shape, self.moment_dtype) for p in params]
    low = self.dtype in (BF16, np.dtype(np.float16))
    self.kahan = [np.zeros(p.shape, self.dtype) for p in params]
    self.kahan_on = kahan_sum and low
    self.eps_sq = self._r(eps**2, self.moment_dtype)
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
    self.weight_decay = weight_decay
    self.decouple_lr = decouple_lr
    self.max_lr = lr if max_lr is None else max_lr
    self.t = 0
    self.rms = []

  @staticmethod
  def _r(x, dtype):
    return np.asarray(x, np.float64).astype(dtype)

  @staticmethod
  def _w(x):
    return np.asarray(x, np.float64)

  def step(self, grads):
    self.t += 1
    at = lambda v: v(self.t - 1) if callable(v) else v
    lr, wd = float(at(self.lr)), float(at(self.weight_decay))
    b1_hat = debias_beta(self.b1, self.t)
    b2_hat = debias_beta(self.b2, self.t)
    b1_comp, b2_comp = 1 - b1_hat, 1 - b2_hat
    md, r, w = self.moment_dtype, self._r, self._w
    self.rms = []
    for i, g in enumerate(grads):
      g = r(g, self.dtype)
      m, v, p = self.m[i], self.v[i], self.params[i]
      # exp_avg.lerp_(grad, weight=beta1_comp)
      m = r(w(m) + b1_comp * (w(g) - w(m)), md)
      # exp_avg_sq.mul_(beta2_hat).addcmul_(grad, grad, value=beta2_comp)
      v = r(w(v) * b2_hat, md)
      v = r(w(v) + b2_comp * w(g) * w(g), md)
      # grad.pow(2).div_(exp_avg_sq.maximum(eps_sq)).mean().sqrt()
      d = self.dtype
      ratio = r(w(r(w(g) ** 2, d)) / w(np.maximum(v, self.eps_sq)), d)
      mean = r(np.mean(w(ratio)) if ratio.size else np.nan, d)
      rms = float(r(math.sqrt(float(mean)), d))
      self.rms.append(rms)
      lr_t = lr / max(1, rms)
      if wd != 0:
        scale = lr_t / self.max_lr if self.decouple_lr else lr_t
        p = r(w(p) * (1 - scale * wd), self.dtype)
      denom = r(w(r(np.sqrt(w(v)), md)) + self.eps, md)
      step = -lr_t * w(m) / w(denom)
      if self.kahan_on:
        k = r(w(self.kahan[i]) + step, self.dtype)
        before = p
        p = r(w(p) + w(k), self.dtype)
        self.kahan[i] = r(w(k) + w(r(w(before) - w(p), self.dtype)), self.dtype)
      else:
        p = r(w(p) + step, self.dtype)
      self.m[i], self.v[i], self.params[i] = m, v, p


# --- Streams ------------------------------------------------------------------


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


def _grads(seed=1, steps=STEPS, spikes=SPIKE_STEPS, size=1e3):
  """This file's gradient stream (``np_refs.spiky_gradients``)."""
  return np_refs.spiky_gradients(SHAPES, steps, spikes, seed, size)


def _tree(arrays, dtype=None):
  return {
    f"p{i}": jnp.asarray(a if dtype is None else np.asarray(a).astype(dtype))
    for i, a in enumerate(arrays)
  }


def _arrays(tree):
  return [np.asarray(tree[f"p{i}"]) for i in range(len(tree))]


def _run(tx, params, grads, dtype, update=None):
  """Params after each step (NumPy, float64) and the states."""
  update = tx.update if update is None else update
  p = _tree(params, dtype)
  state = tx.init(p)
  trajectory, states = [], []
  for g in grads:
    u, state = update(_tree(g, dtype), state, p)
    p = optax.apply_updates(p, u)
    trajectory.append([a.astype(np.float64) for a in _arrays(p)])
    states.append(state)
  return trajectory, states


def _run_reference(ref, grads):
  trajectory, rms = [], []
  for g in grads:
    ref.step(g)
    trajectory.append([p.astype(np.float64) for p in ref.params])
    rms.append(list(ref.rms))
  return trajectory, rms


def _relative(ours, theirs):
  """The worst over steps and tensors of max |a - b| / max |b|."""
  worst = 0.0
  for a_step, b_step in zip(ours, theirs, strict=True):
    for a, b in zip(a_step, b_step, strict=True):
      scale = max(float(np.max(np.abs(b))), 1e-30)
      worst = max(worst, float(np.max(np.abs(a - b))) / scale)
  return worst


def _ulps(ours, theirs, dtype=BF16):
  """The worst over steps and elements of |a - b| in units of ``dtype``'s
  spacing at b.
  """
  worst = 0.0
  for a_step, b_step in zip(ours, theirs, strict=True):
    for a, b in zip(a_step, b_step, strict=True):
      b_low = np.asarray(b).astype(dtype)
      spacing = np.abs(
        np.nextafter(b_low, np.asarray(np.inf, dtype)).astype(np.float64)
        - b_low.astype(np.float64)
      )
      worst = max(worst, float(np.max(np.abs(a - b) / spacing)))
  return worst


def _schedules():
  lr = optax.warmup_cosine_decay_schedule(0.0, LR, 5, STEPS, LR / 10)
  wd = optax.linear_schedule(0.02, 0.0, STEPS)
  return lr, wd


def _figures():
  """stable_adamw against the reference: the worst differences."""
  params, grads = _params(), _grads()
  out = {}
  tx = optaxclip.stable_adamw(LR, **KW)
  ours, _ = _run(tx, params, grads, np.float32)
  ref, _ = _run_reference(
    StableAdamWReference(params, np.float32, LR, **KW), grads
  )
  out["float32, relative"] = _relative(ours, ref)
  ours16, _ = _run(tx, params, grads, BF16)
  ref16, _ = _run_reference(StableAdamWReference(params, BF16, LR, **KW), grads)
  out["bfloat16 vs optimi's bfloat16 (ulps)"] = _ulps(ours16, ref16)
  exact, _ = _run_reference(
    StableAdamWReference(
      [np.asarray(p).astype(BF16) for p in params], np.float64, LR, **KW
    ),
    [[np.asarray(x).astype(BF16) for x in g] for g in grads],
  )
  out["bfloat16 vs float64 algorithm (ulps)"] = _ulps(ours16, exact)
  return out


# --- Parity -------------------------------------------------------------------


class ParityTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_float32_follows_the_reference(self):
    params, grads = _params(), _grads()
    tx = optaxclip.stable_adamw(LR, **KW)
    ours, states = _run(tx, params, grads, np.float32, self.variant(tx.update))
    ref, rms = _run_reference(
      StableAdamWReference(params, np.float32, LR, **KW), grads
    )
    self.assertLess(_relative(ours, ref), 2e-6)
    # The spikes are scaled, the other steps mostly not.
    scaled = [int(s.scaled) for s in states]
    want = [sum(r > 1 for r in step) for step in rms]
    self.assertEqual(scaled, want)
    self.assertTrue(all(scaled[t - 1] > 0 for t in SPIKE_STEPS))
    for state, step in zip(states, rms):
      np.testing.assert_allclose(
        np.asarray(state.rms.values), step, rtol=2e-6, atol=1e-7
      )

  def test_schedules_and_fully_decoupled_decay(self):
    params, grads = _params(), _grads()
    lr, wd = _schedules()
    kw = dict(KW, weight_decay=wd)
    for extra in ({}, {"decouple_lr": True, "max_lr": LR}):
      tx = optaxclip.stable_adamw(lr, **kw, **extra)
      ours, _ = _run(tx, params, grads, np.float32)
      ref, _ = _run_reference(
        StableAdamWReference(params, np.float32, lr, **kw, **extra), grads
      )
      self.assertLess(_relative(ours, ref), 2e-6, extra)

  def test_bfloat16_within_an_ulp_of_optimi_and_of_the_exact_algorithm(self):
    figures = _figures()
    self.assertLess(figures["float32, relative"], 2e-6)
    self.assertLessEqual(figures["bfloat16 vs optimi's bfloat16 (ulps)"], 2.0)
    self.assertLessEqual(figures["bfloat16 vs float64 algorithm (ulps)"], 1.0)

  def test_bfloat16_decay_is_compensated_too(self):
    """With a strong fully decoupled decay (2% a step), torch-optimi's
    bfloat16 arithmetic rounds the decayed parameter outside its Kahan
    compensation and drifts from the exact algorithm; stable_adamw carries
    the decay in the compensated increment and stays within an ulp.
    """
    params, grads = _params(), _grads()
    lr, wd = _schedules()
    kw = dict(KW, weight_decay=wd, decouple_lr=True, max_lr=LR)
    ours, _ = _run(optaxclip.stable_adamw(lr, **kw), params, grads, BF16)
    exact, _ = _run_reference(
      StableAdamWReference(
        [np.asarray(p).astype(BF16) for p in params], np.float64, lr, **kw
      ),
      [[np.asarray(x).astype(BF16) for x in g] for g in grads],
    )
    optimi, _ = _run_reference(
      StableAdamWReference(params, BF16, lr, **kw), grads
    )
    self.assertLessEqual(_ulps(ours, exact), 1.0)
    self.assertGreater(_ulps(optimi, exact), 2.0)

  def test_kahan_summation_keeps_small_steps(self):
    """Steps far below a bfloat16 ulp add up with the compensation, and are
    lost without it.
    """
    params = {"w": jnp.ones(8, jnp.bfloat16)}
    grads = {"w": jnp.ones(8, jnp.bfloat16)}
    out = {}
    for kahan in (True, False):
      tx = optaxclip.stable_adamw(1e-4, weight_decay=0.0, kahan_sum=kahan)
      p, state = params, tx.init(params)
      step = jax.jit(tx.update)
      for _ in range(100):
        u, state = step(grads, state, p)
        p = optax.apply_updates(p, u)
      out[kahan] = float(p["w"][0])
    self.assertEqual(out[False], 1.0)
    self.assertAlmostEqual(out[True], 1.0 - 100 * 1e-4, delta=4e-3)


class DebiasTest(chex.TestCase):
  def test_debiased_betas_match_debias_beta(self):
    from optaxclip import _stable_adamw

    for beta in (0.0, 0.5, 0.9, 0.99, 0.999):
      for t in (1, 2, 3, 10, 1000):
        hat, comp = _stable_adamw.debiased_beta(
          beta, jnp.float32(t), jnp.float32
        )
        want = 0.0 if beta == 0 else debias_beta(beta, t)
        np.testing.assert_allclose(float(hat), want, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(float(comp), 1 - want, rtol=1e-6)
        if t == 1:
          self.assertEqual(float(comp), 1.0)


# --- Statistics, explain, checks, jit ----------------------------------------


def _one_spike_state():
  tx = optaxclip.stable_adamw(LR, **KW)
  params = {"a": jnp.ones(4), "b": jnp.ones(3)}
  state = tx.init(params)
  g = {"a": jnp.array([1.0, -2.0, 3.0, 0.5]), "b": jnp.ones(3)}
  _, state = tx.update(g, state, params)
  g = {"a": jnp.array([100.0, -2.0, 3.0, 0.5]), "b": jnp.ones(3)}
  _, state = tx.update(g, state, params)
  return state


def test_stats_keys():
  logs = optaxclip.stats(_one_spike_state())
  assert list(logs) == [
    "stable_adamw/max_rms",
    "stable_adamw/scaled",
    "stable_adamw/clip_fraction",
    "stable_adamw/rms/a",
    "stable_adamw/rms/b",
  ]
  assert int(logs["stable_adamw/scaled"]) == 1
  assert float(logs["stable_adamw/clip_fraction"]) == 0.5
  np.testing.assert_allclose(float(logs["stable_adamw/rms/a"]), 1.1169, 1e-4)
  np.testing.assert_allclose(float(logs["stable_adamw/rms/b"]), 1.0, 1e-6)
  assert logs["stable_adamw/scaled"].dtype == jnp.int32


def test_explain_says_how_many_tensors_were_scaled():
  assert optaxclip.explain(_one_spike_state()) == [
    (
      "stable_adamw divided the learning rate of 1 tensor (50%) by their "
      "RMS (largest 1.12)"
    )
  ]
  tx = optaxclip.stable_adamw(LR)
  params = {"a": jnp.ones(2)}
  _, state = tx.update({"a": jnp.ones(2)}, tx.init(params), params)
  assert optaxclip.explain(state) == [
    "stable_adamw scaled no tensor's step (largest RMS 1.0)"
  ]


@pytest.mark.parametrize(
  "kwargs, arg, error",
  [
    ({"learning_rate": -1.0}, "learning_rate", ValueError),
    ({"learning_rate": 0.1, "b1": 1.0}, "b1", ValueError),
    ({"learning_rate": 0.1, "b2": -0.1}, "b2", ValueError),
    ({"learning_rate": 0.1, "eps": -1.0}, "eps", ValueError),
    (
      {"learning_rate": 0.1, "weight_decay": float("nan")},
      "weight_decay",
      ValueError,
    ),
    ({"learning_rate": 0.1, "kahan_sum": 1}, "kahan_sum", TypeError),
    (
      {"learning_rate": optax.constant_schedule(0.1), "decouple_lr": True},
      "max_lr",
      ValueError,
    ),
    (
      {"learning_rate": 0.1, "decouple_lr": True, "max_lr": 0.0},
      "max_lr",
      ValueError,
    ),
  ],
)
def test_bad_hyperparameters_fail_at_construction(kwargs, arg, error):
  with pytest.raises(error, match=rf"^stable_adamw: {arg} must .*; got "):
    optaxclip.stable_adamw(**kwargs)


def test_params_are_required():
  tx = optaxclip.stable_adamw(LR)
  g = {"a": jnp.ones(2)}
  with pytest.raises(ValueError, match="stable_adamw: params must be passed"):
    tx.update(g, tx.init(g))


def test_no_retrace_on_the_second_step():
  tx = optaxclip.stable_adamw(LR)
  params = _tree(_params())
  traces = []

  @jax.jit
  def step(p, s, g):
    traces.append(1)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, optaxclip.stats(s)

  state = tx.init(params)
  for g in _grads(steps=3):
    params, state, _ = step(params, state, _tree(g))
  assert len(traces) == 1


def test_injected_hyperparameters():
  tx = optax.inject_hyperparams(optaxclip.stable_adamw)(
    learning_rate=LR, b1=0.9, b2=0.99, weight_decay=0.01
  )
  params, grads = _params(), _grads(steps=5)
  ours, _ = _run(tx, params, grads, np.float32)
  ref, _ = _run_reference(
    StableAdamWReference(params, np.float32, LR, **KW), grads
  )
  assert _relative(ours, ref) < 2e-6


@hypothesis.given(
  scale=st.sampled_from([1e-30, 1e-8, 1.0, 1e8, 1e15]),
  data=st.data(),
)
@fz.examples(10)
def test_rms_and_step_size_at_every_scale(scale, data):
  """At any gradient scale, the per-tensor RMS is the reference's and the
  update is finite, at most ``lr (1 + wd |p|)`` per element over the first
  two steps (Adam's steps are at most about 1 here).
  """
  values = data.draw(
    st.lists(
      st.floats(-1, 1, allow_nan=False, width=32), min_size=12, max_size=12
    )
  )
  g1 = np.asarray(values, np.float32).reshape(3, 4) * np.float32(scale)
  g2 = g1[::-1].copy()
  g2[0, 0] *= 50
  params = [np.ones((3, 4), np.float32)]
  tx = _JITTED_UPDATE
  ours, states = _run(tx, params, [[g1], [g2]], np.float32)
  ref, rms = _run_reference(
    StableAdamWReference(params, np.float32, LR, **KW), [[g1], [g2]]
  )
  for state, want in zip(states, rms):
    np.testing.assert_allclose(
      np.asarray(state.rms.values), want, rtol=2e-6, atol=1e-6
    )
  assert np.all(np.isfinite(ours[-1][0]))
  steps = np.abs(np.diff([np.ones((3, 4)), *[o[0] for o in ours]], axis=0))
  assert np.all(steps <= LR * (1 + KW["weight_decay"]) * 1.0001)
  assert _relative(ours, ref) < 2e-6


_JITTED_UPDATE = optaxclip.stable_adamw(LR, **KW)


def test_a_gradient_beyond_the_second_moments_range_steps_by_zero():
  """g**2 above float32's range makes v inf, as in every float32 Adam: the
  tensor's step is 0 (torch-optimi's too) and its RMS reads 0 (NaN there:
  it squares g before dividing).
  """
  params = {"a": jnp.ones(3), "b": jnp.ones(2)}
  g = {"a": jnp.array([1e30, -1e30, 1.0]), "b": jnp.ones(2)}
  tx = optaxclip.stable_adamw(LR, weight_decay=0.0)
  updates, state = tx.update(g, tx.init(params), params)
  np.testing.assert_allclose(np.asarray(updates["a"]), [0.0, 0.0, -LR], 1e-6)
  assert float(state.rms.values[0]) <= 1.0


if __name__ == "__main__":
  for name, value in _figures().items():
    print(f"{name}: {value:.3g}")


def test_inside_shard_map_matches_one_device():
  """A leaf split over the devices takes its RMS over the whole tensor."""
  from jax.sharding import PartitionSpec as P

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
  rng = np.random.default_rng(0)
  params = {
    "split": jnp.asarray(rng.normal(size=(16, 3)), jnp.float32),
    "whole": jnp.asarray(rng.normal(size=(5,)), jnp.float32),
  }
  specs = {"split": P("d"), "whole": P()}
  grads = [
    jax.tree.map(
      lambda x, s=s: jnp.asarray(rng.normal(size=x.shape)) * s, params
    )
    for s in (1.0, 1.0, 300.0)
  ]
  plain = optaxclip.stable_adamw(LR, **KW)
  mapped = optaxclip.stable_adamw(LR, **KW, axis_name="d", sharded=specs)

  def run(tx, p, gs):
    state = tx.init(p)
    for g in gs:
      u, state = tx.update(g, state, p)
      p = optax.apply_updates(p, u)
    return p, state.rms.values

  want_p, want_rms = run(plain, params, grads)
  got_p, got_rms = jax.jit(
    jax.shard_map(
      lambda p, *gs: run(mapped, p, gs),
      mesh=mesh,
      in_specs=(specs, *[specs] * len(grads)),
      out_specs=(specs, P()),
    )
  )(params, *grads)
  np.testing.assert_allclose(np.asarray(got_rms), np.asarray(want_rms), 1e-6)
  assert float(np.max(np.asarray(want_rms))) > 1  # the spike was scaled
  for key in params:
    np.testing.assert_allclose(
      np.asarray(got_p[key]), np.asarray(want_p[key]), rtol=1e-6, atol=1e-7
    )


def test_state_round_trips_through_flax_serialization():
  from flax import serialization

  tx = optaxclip.stable_adamw(LR)
  params = _tree(_params(), BF16)
  state = tx.init(params)
  for g in _grads(steps=2):
    _, state = tx.update(_tree(g, BF16), state, params)
  restored = serialization.from_bytes(
    tx.init(params), serialization.to_bytes(state)
  )
  chex.assert_trees_all_equal(restored, state)
