"""Threshold schedules: every threshold of every clipper takes a schedule
(``step -> value``) as well as a number, evaluated at the clipper's own step.

The oracle of a scheduled step is the same clipper built with the number the
schedule gives at that step (a JAX array, so one compilation serves every
step), applied to the same state.
"""

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fast_compile import run_fast
import optaxclip


def _table(*values):
  """A schedule: ``values[step]``, the last one for later steps."""
  table = jnp.asarray(values, jnp.float32)
  return lambda step: table[jnp.minimum(step, len(values) - 1)]


def _grads(step):
  rng = np.random.default_rng(step)
  scale = (3.0, 1.0, 8.0, 2.0)[step % 4]
  return {
    "a": jnp.asarray(rng.standard_normal(3) * scale, jnp.float32),
    "b": jnp.asarray(rng.standard_normal((2, 2)) * scale, jnp.float32),
  }


def _per_example(step):
  rng = np.random.default_rng(step)
  return {
    "a": jnp.asarray(rng.standard_normal((4, 3)) * 2, jnp.float32),
    "b": jnp.asarray(rng.standard_normal((4, 2, 2)) * 2, jnp.float32),
  }


PARAMS = {"a": jnp.ones(3), "b": jnp.full((2, 2), 2.0)}

# name -> (factory of the threshold, schedule values at steps 0, 1, 2,
# input kind). Each schedule makes the threshold act at each step.
CLIPPERS = {
  "clip_value": (optaxclip.clip_value, (2.0, 1.0, 0.5), "tree"),
  "clip_norm": (optaxclip.clip_norm, (2.0, 1.0, 0.5), "tree"),
  "clip_global": (optaxclip.clip_global, (4.0, 1.0, 0.5), "tree"),
  "clip_block_rms": (optaxclip.clip_block_rms, (2.0, 1.0, 0.5), "tree"),
  "clip_unitwise": (optaxclip.clip_unitwise, (1.0, 0.3, 0.1), "params"),
  "clip_zscore.spike_z": (
    lambda v: optaxclip.clip_zscore(spike_z=v, warmup_steps=1),
    (2.5, 0.5, 0.1),
    "tree",
  ),
  "clip_zscore.max_norm": (
    lambda v: optaxclip.clip_zscore(max_norm=v, warmup_steps=1),
    (4.0, 1.0, 0.5),
    "tree",
  ),
  "clip_percentile": (
    lambda v: optaxclip.clip_percentile(v, history=4),
    (50.0, 10.0, 90.0),
    "tree",
  ),
  "clip_relative.factor": (
    lambda v: optaxclip.clip_relative(v, warmup_steps=1),
    (1.5, 1.2, 1.0),
    "tree",
  ),
  "clip_relative.warmup_max_norm": (
    lambda v: optaxclip.clip_relative(warmup_steps=3, warmup_max_norm=v),
    (4.0, 1.0, 0.5),
    "tree",
  ),
  "guard.max_norm": (
    lambda v: optaxclip.guard(optax.sgd(1.0), max_norm=v),
    (10.0, 1.0, 30.0),
    "params",
  ),
  "guard.spike_z": (
    lambda v: optaxclip.guard(optax.sgd(1.0), spike_z=v, warmup_steps=1),
    (3.0, 0.1, 3.0),
    "params",
  ),
  "clip_per_example": (
    optaxclip.clip_per_example,
    (4.0, 1.0, 0.5),
    "per_example",
  ),
  "dp_noise": (
    lambda v: optaxclip.dp_noise(v, reduce="sum"),
    (4.0, 1.0, 0.5),
    "norms",
  ),
  # SPAM's threshold (0 turns its clipping off: not a limit, so not in
  # ZERO_LIMITS below).
  "clip_spikes": (
    lambda v: optaxclip.clip_spikes(v, b2=0.5, grad_accu_steps=1),
    (4.0, 1.0, 0.5),
    "tree",
  ),
  "spam": (
    lambda v: optaxclip.spam(
      0.1, threshold=v, b2=0.5, grad_accu_steps=1, warmup_steps=0
    ),
    (4.0, 1.0, 0.5),
    "tree",
  ),
}
# Where the threshold is reported as it is (the others report the norm
# limit it leads to).
REPORTED_AS_IS = (
  "clip_value",
  "clip_norm",
  "clip_global",
  "clip_block_rms",
  "clip_unitwise",
  "clip_per_example",
  "dp_noise",
  "clip_spikes",
)


def _inputs(kind, step):
  if kind in ("per_example",):
    return _per_example(step), {}
  g = _grads(step)
  if kind == "norms":
    norms = jnp.asarray([0.5, 2.0, 6.0], jnp.float32) * (step + 1)
    return g, {"example_norms": norms}
  return g, {}


def _update(tx, kind, state, inputs):
  g, extra = inputs
  params = PARAMS if kind == "params" else None
  return tx.update(g, state, params, **extra)


def _threshold(state):
  (value,) = [
    v for k, v in optaxclip.stats(state).items() if k.endswith("/threshold")
  ]
  return float(value)


def _assert_same(a, b):
  chex.assert_trees_all_close(a, b, rtol=1e-6, atol=1e-7)


def _stack(trees):
  return jax.tree.map(lambda *x: jnp.stack(x), *trees)


class ScheduleTest(parameterized.TestCase):
  @parameterized.named_parameters(*((name, name) for name in CLIPPERS))
  def test_each_step_uses_the_schedules_value(self, name):
    # Three steps inside one jitted program (a scan: one compilation), each
    # against the clipper built with the schedule's value at that step.
    # Without jit: ZeroTest (and the other tests) call update eagerly.
    make, values, kind = CLIPPERS[name]
    tx = make(_table(*values))

    def step(state, x):
      inputs, number = x
      want = _update(make(number), kind, state, inputs)
      out, state = _update(tx, kind, state, inputs)
      return state, ((out, state), want)

    inputs = _stack([_inputs(kind, t) for t in range(len(values))])
    args = (tx.init(PARAMS), (inputs, jnp.asarray(values, jnp.float32)))
    run = jax.jit(lambda state, xs: jax.lax.scan(step, state, xs)[1])
    (out, state), (want_out, want_state) = run_fast(run, *args)
    _assert_same(out, want_out)
    if kind in ("per_example", "norms"):
      # clip_norm is the next step's clip norm: the schedule's next value.
      np.testing.assert_array_equal(state.clip_norm, values[1:] + values[-1:])
      want_state = want_state._replace(clip_norm=state.clip_norm)
    _assert_same(state, want_state)
    if name in REPORTED_AS_IS:
      np.testing.assert_allclose(state.threshold, values, rtol=1e-6)
    # The threshold did act on some step.
    if kind == "norms":  # dp_noise clips nothing itself: it counts.
      np.testing.assert_allclose(state.clip_fraction, [1 / 3, 2 / 3, 1.0])
    else:
      self.assertFalse(np.array_equal(out["a"], inputs[0]["a"]), name)

  def test_a_schedule_keeps_the_state_layout_of_a_number(self):
    for make, values, _ in CLIPPERS.values():
      state = make(_table(*values)).init(PARAMS)
      number_state = make(values[0]).init(PARAMS)
      self.assertEqual(
        jax.tree.structure(state), jax.tree.structure(number_state)
      )
      chex.assert_trees_all_equal_shapes_and_dtypes(state, number_state)


def _zero_after_first(step):
  return jnp.where(step < 1, 2.0, 0.0)


# Thresholds that are limits: a schedule reaching 0 gives zero updates.
ZERO_LIMITS = {
  "clip_value": (optaxclip.clip_value, "tree"),
  "clip_norm": (optaxclip.clip_norm, "tree"),
  "clip_global": (optaxclip.clip_global, "tree"),
  "clip_block_rms": (optaxclip.clip_block_rms, "tree"),
  "clip_unitwise": (optaxclip.clip_unitwise, "params"),
  "clip_zscore.max_norm": (
    lambda v: optaxclip.clip_zscore(max_norm=v, warmup_steps=1),
    "tree",
  ),
  "clip_relative.factor": (
    lambda v: optaxclip.clip_relative(v, warmup_steps=1),
    "tree",
  ),
  "clip_relative.warmup_max_norm": (
    lambda v: optaxclip.clip_relative(warmup_steps=5, warmup_max_norm=v),
    "tree",
  ),
  # adam: a zero gradient still moves (momentum) unless the step is skipped.
  "guard.max_norm": (
    lambda v: optaxclip.guard(optax.adam(0.1), max_norm=v),
    "params",
  ),
  "clip_per_example": (optaxclip.clip_per_example, "per_example"),
}


def _hard_inputs(kind, step):
  """Zeros, huge and tiny values: a 0/0 or inf * 0 would show."""
  if kind == "per_example":
    g = _per_example(step)
    return {
      "a": g["a"].at[0].set(0.0).at[1].set(1e30),
      "b": g["b"].at[2].set(1e-30),
    }
  g = _grads(step)
  if step == 2:
    return jax.tree.map(jnp.zeros_like, g)
  return {"a": g["a"].at[0].set(1e30), "b": jnp.zeros_like(g["b"])}


class ZeroTest(parameterized.TestCase):
  @parameterized.named_parameters(*((name, name) for name in ZERO_LIMITS))
  def test_a_schedule_reaching_zero_gives_zero_updates(self, name):
    make, kind = ZERO_LIMITS[name]
    # Without jit (the update's own compilation): 2, then 0 from step 1,
    # then below 0 (counted as 0).
    tx = make(lambda step: 2.0 - 2.0 * step)
    state = tx.init(PARAMS)
    for step in range(3):
      params = PARAMS if kind == "params" else None
      out, state = tx.update(_hard_inputs(kind, step), state, params)
      if step:
        for leaf in jax.tree.leaves(out):
          np.testing.assert_array_equal(np.asarray(leaf), 0.0, err_msg=name)
      for leaf in jax.tree.leaves((out, optaxclip.stats(state))):
        assert not np.any(np.isnan(np.asarray(leaf))), name
      if name in REPORTED_AS_IS:
        self.assertEqual(_threshold(state), max(2.0 - 2.0 * step, 0.0))

  def test_dp_noise_reports_a_zero_clip_norm_for_the_next_step(self):
    tx = optaxclip.dp_noise(_zero_after_first, reduce="sum")
    state = tx.init(PARAMS)
    norms = jnp.asarray([0.0, 3.0])
    assert float(state.clip_norm) == 2.0
    _, state = tx.update(PARAMS, state, example_norms=norms)
    assert (float(state.threshold), float(state.clip_norm)) == (2.0, 0.0)
    _, state = tx.update(PARAMS, state, example_norms=norms)
    assert float(state.clip_fraction) == 0.5  # a zero norm is not clipped
    assert not np.isnan(float(state.clipped_norm))

  def test_other_thresholds_at_zero_stay_finite(self):
    # spike_z 0: every norm above the mean is clipped to it; percentile 0:
    # to the smallest recent norm; spike_z 0: above the mean is skipped.
    for tx in (
      optaxclip.clip_zscore(spike_z=_zero_after_first, warmup_steps=1),
      optaxclip.clip_percentile(_zero_after_first, history=4),
      optaxclip.guard(optax.sgd(1.0), spike_z=_zero_after_first),
    ):
      state = tx.init(PARAMS)
      for step in range(4):
        out, state = tx.update(_grads(step), state, PARAMS)
        for leaf in jax.tree.leaves((out, optaxclip.stats(state))):
          assert not np.any(np.isnan(np.asarray(leaf)))
    # The percentile's last step was clipped to the smallest norm so far.
    norms = [float(optax.tree.norm(_grads(s))) for s in range(4)]
    tx = optaxclip.clip_percentile(_zero_after_first, history=4)
    state = tx.init(PARAMS)
    for step in range(4):
      out, state = tx.update(_grads(step), state)
    np.testing.assert_allclose(float(state.threshold), min(norms), rtol=1e-6)
    np.testing.assert_allclose(
      float(optax.tree.norm(out)), min(norms), rtol=1e-5
    )


class NanTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("clip_global", optaxclip.clip_global),
    ("clip_value", optaxclip.clip_value),
    ("clip_zscore", lambda v: optaxclip.clip_zscore(spike_z=v)),
    ("clip_percentile", optaxclip.clip_percentile),
    ("clip_relative", lambda v: optaxclip.clip_relative(v, warmup_steps=1)),
    ("clip_per_example", optaxclip.clip_per_example),
  )
  def test_a_nan_from_a_schedule_gives_a_nan_update(self, make):
    tx = make(lambda step: jnp.where(step < 1, 2.0, jnp.nan))
    state = tx.init(PARAMS)
    per_example = make is optaxclip.clip_per_example
    g = _per_example if per_example else _grads
    out, state = tx.update(g(0), state)
    assert np.all(np.isfinite(np.asarray(jax.tree.leaves(out)[0])))
    out, state = tx.update(g(1), state)
    assert np.all(np.isnan(np.asarray(jax.tree.leaves(out)[0])))

  def test_guard_skips_a_step_whose_bound_is_nan(self):
    for kwargs in ({"max_norm": 100.0}, {"spike_z": 10.0}):
      name, value = next(iter(kwargs.items()))
      tx = optaxclip.guard(
        optax.sgd(1.0),
        warmup_steps=1,
        **{name: lambda s, v=value: jnp.where(s < 2, v, jnp.nan)},
      )
      state = tx.init(PARAMS)
      for step in range(3):
        out, state = tx.update(_grads(step), state)
      assert int(state.counts.skipped) == 1, name
      np.testing.assert_array_equal(np.asarray(out["a"]), 0.0)


class InjectHyperparamsTest(parameterized.TestCase):
  def test_inject_hyperparams_evaluates_a_schedule_itself(self):
    # optax.inject_hyperparams takes every callable for a schedule of its
    # own: the clipper receives arrays (numbers), and the values agree.
    schedule = _table(4.0, 1.0, 0.5)
    for static_args in ((), ("max_norm",)):
      tx = optax.inject_hyperparams(
        optaxclip.clip_global, static_args=static_args
      )(max_norm=schedule)
      state = tx.init(PARAMS)
      update = jax.jit(tx.update)
      for step, value in enumerate((4.0, 1.0, 0.5)):
        out, state = update(_grads(step), state)
        assert _threshold(state) == value, static_args
        norm = float(optax.tree.norm(_grads(step)))
        np.testing.assert_allclose(
          float(optax.tree.norm(out)), min(norm, value), rtol=1e-6
        )
      # With static_args the clipper evaluates it: no hyperparameter.
      assert ("max_norm" in state.hyperparams) == (not static_args)

  def test_a_stateful_schedule_is_refused(self):
    class Stateful(optax.schedules.StatefulSchedule):
      def init(self):
        return None

      def update(self, state, **extra_args):
        return state

      def __call__(self, state, **extra_args):
        return 1.0

    with pytest.raises(TypeError, match=r"^clip_global: max_norm must be"):
      optaxclip.clip_global(Stateful())

  def test_a_schedule_of_several_values_is_refused(self):
    tx = optaxclip.clip_norm(lambda step: jnp.ones(2))
    with pytest.raises(TypeError, match=r"^clip_norm: the schedule max_norm"):
      tx.update(_grads(0), tx.init(PARAMS))

  def test_an_adaptive_clip_norm_takes_a_number_only(self):
    for make in (optaxclip.clip_per_example, optaxclip.dp_noise):
      with pytest.raises(ValueError, match=r"l2_clip must be a number when"):
        make(_zero_after_first, target_quantile=0.5)

  def test_numbers_are_still_checked_when_built(self):
    with pytest.raises(ValueError, match=r"^clip_global: max_norm must be"):
      optaxclip.clip_global(-1.0)
    with pytest.raises(ValueError, match=r"^guard: spike_z must be"):
      optaxclip.guard(optax.sgd(1.0), spike_z=0.0)
