"""explain(): one exact sentence per clipper and guard, from the state alone.

Most states are written out by hand (explain reads nothing but the state);
a few real steps check the walk through guard, inject_hyperparams and
named_chain.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxclip
from optaxclip import _explain
from optaxclip import _stats

NAN, INF = math.nan, math.inf


def _f(*values):
  return [jnp.float32(v) for v in values]


def _i(n):
  return jnp.int32(n)


def _clip(cls, norm, clipped, fraction, threshold):
  """A static clipper's state: statistics, threshold, step count."""
  return cls(*_f(norm, clipped, fraction, threshold), _i(1))


def _key():
  return jax.random.key_data(jax.random.key(0))


def _guard(
  norm,
  threshold,
  skipped,
  streak,
  mean,
  var,
  causes=(0, 0, 0),
  z=0.0,
  cause=None,
):
  """A guard's state; ``cause`` its skip_cause (None: a state without)."""
  nonfinite, max_norm, spike = causes
  return optaxclip.GuardState(
    inner_state=(),
    step=_i(30),
    verdict=optaxclip.GuardVerdict(
      norm=jnp.float32(norm),
      threshold=jnp.float32(threshold),
      z_score=jnp.float32(z),
      skip_cause=None if cause is None else _i(cause),
      skipped_leaves=None,
    ),
    counts=optaxclip.GuardCounts(
      skipped=_i(skipped),
      consecutive_skips=_i(streak),
      nonfinite=_i(nonfinite),
      restarts=_i(0),
      skipped_nonfinite=_i(nonfinite),
      skipped_max_norm=_i(max_norm),
      skipped_spike=_i(spike),
      skipped_loss_spike=_i(0),
    ),
    norm_moments=optaxclip.Moments(
      count=_i(25),
      mean=jnp.float32(mean),
      var=jnp.float32(var),
      consecutive_spikes=_i(0),
      window=None,
    ),
    loss_monitor=None,
  )


CASES = [
  (
    _clip(optaxclip.ClipGlobalState, 76.2, 1.0, 1.0, 1.0),
    "clip_global scaled the update by 0.0131 (norm 76.2 > 1.0)",
  ),
  (
    _clip(optaxclip.ClipGlobalState, 0.8, 0.8, 0.0, 1.0),
    "clip_global left the update unchanged (norm 0.8 <= 1.0)",
  ),
  (
    _clip(optaxclip.ClipGlobalState, NAN, NAN, 1.0, 1.0),
    (
      "clip_global saw a non-finite gradient (norm nan): the whole update "
      "came out NaN, so that a guard (or optax.apply_if_finite) can skip the "
      "step"
    ),
  ),
  (
    _clip(optaxclip.ClipNormState, 5.0, 1.2, 0.5, 1.0),
    "clip_norm scaled down 50% of its units (norm 5.0 -> 1.2; max_norm 1.0)",
  ),
  (
    _clip(optaxclip.ClipNormState, 0.5, 0.5, 0.0, 1.0),
    "clip_norm left every one of its units unchanged (norm 0.5; max_norm 1.0)",
  ),
  (
    _clip(optaxclip.ClipBlockRMSState, 5.0, 1.2, 0.25, 1.0),
    (
      "clip_block_rms scaled down 25% of its leaves (norm 5.0 -> 1.2; RMS "
      "limit 1.0)"
    ),
  ),
  (
    _clip(optaxclip.ClipUnitwiseState, INF, NAN, 0.25, 1.0),
    (
      "clip_unitwise saw a non-finite gradient (norm inf): the units holding "
      "it came out NaN, so that a guard (or optax.apply_if_finite) can skip "
      "the step"
    ),
  ),
  (
    _clip(optaxclip.ClipValueState, 3.0, 1.0, 2 / 3, 1.0),
    "clip_value clipped 67% of the elements (largest magnitude 3.0 > 1.0)",
  ),
  (
    _clip(optaxclip.ClipValueState, 0.3, 0.3, 0.0, 1.0),
    "clip_value left every element unchanged (largest magnitude 0.3 <= 1.0)",
  ),
  (
    _clip(optaxclip.ClipValueState, INF, NAN, 0.5, 1.0),
    (
      "clip_value saw a non-finite gradient (largest magnitude inf): the "
      "leaves holding it came out NaN (50% of the elements)"
    ),
  ),
  (
    optaxclip.ClipZscoreState(
      *_f(76.2, 5.3, 1.0, 5.3), _i(25), *_f(4.2, 0.16), _i(0), _i(0), _i(30)
    ),
    (
      "clip_zscore scaled the update by 0.0696 (norm 76.2 -> 5.3; threshold "
      "5.3, from the norm's running mean 4.2 and standard deviation 0.4)"
    ),
  ),
  # Beyond 2**40 the state keeps the variance scaled by 4**-e, e the mean's
  # binary exponent less 40: a mean of 2**100 (e = 61) with a stored
  # variance of 0.25 has the standard deviation 0.5 * 2**61 = 1.15e18.
  (
    optaxclip.ClipZscoreState(
      *_f(2.0**100, 2.0**100, 0.0, 2.0**101),
      _i(25),
      *_f(2.0**100, 0.25),
      _i(0),
      _i(0),
      _i(30),
    ),
    (
      "clip_zscore left the update unchanged (norm 1.27e+30; threshold "
      "2.54e+30, from the norm's running mean 1.27e+30 and standard "
      "deviation 1.15e+18)"
    ),
  ),
  (
    optaxclip.ClipZscoreState(
      *_f(3.0, 3.0, 0.0, INF), _i(3), *_f(4.2, 0.16), _i(0), _i(0), _i(3)
    ),
    (
      "clip_zscore left the update unchanged (norm 3.0; no threshold yet: "
      "warming up)"
    ),
  ),
  (
    optaxclip.ClipPercentileState(
      *_f(9.0, 3.0, 1.0, 3.0),
      _i(40),
      _i(40),
      jnp.zeros(64),
      jnp.zeros(64),
      _i(40),
    ),
    (
      "clip_percentile scaled the update by 0.333 (norm 9.0 -> 3.0; threshold "
      "3.0, the percentile of the last 40 norms)"
    ),
  ),
  # After the warm-up (fewer finite steps than steps: count is held at
  # warmup_steps): the leaves clipped this step are in a clipping streak.
  (
    optaxclip.ClipRelativeState(
      *_f(9.0, 3.0, 0.4, 3.0),
      _i(100),
      jnp.zeros(5),
      jnp.array([1, 3, 0, 0, 0], jnp.int32),
      _i(0),
      _i(150),
    ),
    (
      "clip_relative scaled down 40% of its leaves (norm 9.0 -> 3.0; "
      "threshold 3.0; each leaf's limit is a factor times its own EMA norm)"
    ),
  ),
  # A finite step for every step so far: the warm-up, one global clip.
  (
    optaxclip.ClipRelativeState(
      *_f(9.0, 3.0, 1.0, 3.0),
      _i(100),
      jnp.zeros(5),
      jnp.zeros(5, jnp.int32),
      _i(0),
      _i(100),
    ),
    (
      "clip_relative scaled the whole update by 0.333 in its warm-up (norm "
      "9.0 > warmup_max_norm 3.0)"
    ),
  ),
  (
    optaxclip.ClipRelativeState(
      *_f(2.0, 2.0, 0.0, 3.0),
      _i(100),
      jnp.zeros(5),
      jnp.zeros(5, jnp.int32),
      _i(0),
      _i(150),
    ),
    "clip_relative left every leaf unchanged (norm 2.0; threshold 3.0)",
  ),
  (
    optaxclip.ClipPerExampleState(*_f(2.3, 0.9, 0.3, 1.0), _key(), _i(2)),
    (
      "clip_per_example scaled down 30% of the examples (mean per-example "
      "norm 2.3 -> 0.9); 2 examples with a NaN or Inf gradient were left "
      "out; the next step clips to 1.0"
    ),
  ),
  (
    optaxclip.DpNoiseState(
      *_f(2.3, 0.9, 0.3, 1.0), _key(), _i(0), jnp.float32(1.0), _i(1)
    ),
    (
      "dp_noise scaled down 30% of the examples (mean per-example norm 2.3 "
      "-> 0.9); the next step clips to 1.0"
    ),
  ),
  (
    _guard(812.0, 12.6, 5, 3, 4.2, 1.4, causes=(1, 0, 4), z=9.1, cause=3),
    (
      "guard skipped the step: the norm 812 was 9.1 standard deviations "
      "above its mean (now 4.2; threshold 12.6); 3 skips in a row, 5 in all "
      "(1 non-finite, 4 spike)"
    ),
  ),
  (
    _guard(812.0, 100.0, 3, 1, 4.2, 1.4, causes=(0, 3, 0), z=9.1, cause=2),
    (
      "guard skipped the step: the norm 812 was above max_norm (threshold "
      "100); 1 skip in a row, 3 in all"
    ),
  ),
  # A state without skip_cause: one cause counter alone counted every skip.
  (
    _guard(812.0, 100.0, 3, 1, 4.2, 1.4, causes=(0, 3, 0), z=9.1),
    (
      "guard skipped the step: the norm 812 was above max_norm (threshold "
      "100); 1 skip in a row, 3 in all"
    ),
  ),
  # ... and with two counters moved, it does not say which.
  (
    _guard(812.0, 12.6, 5, 3, 4.2, 1.4, causes=(1, 0, 4), z=9.1),
    (
      "guard skipped the step: the norm was 812 and the threshold 12.6; "
      "this state does not record which cause skipped it; 3 skips in a row, "
      "5 in all (1 non-finite, 4 spike)"
    ),
  ),
  (
    _guard(NAN, 12.6, 2, 2, 4.2, 1.4, causes=(2, 0, 0), cause=1),
    (
      "guard skipped the step: the gradient norm was nan (a NaN or Inf in the "
      "gradient); 2 skips in a row"
    ),
  ),
  (
    _guard(3.0, 12.6, 2, 0, 4.2, 1.4, causes=(2, 0, 0)),
    "guard let the step through (norm 3.0 <= 12.6)",
  ),
  (
    _guard(3.0, INF, 0, 0, 0.0, 0.0),
    "guard let the step through (norm 3.0; no threshold this step)",
  ),
]


_PARAMS = {"w": jnp.zeros(3)}
_SPIKES = optaxclip.clip_spikes().init(_PARAMS)
_SPAM = optaxclip.spam(0.1).init(_PARAMS)[0]
_STABLE = optaxclip.stable_spam(0.1).init(_PARAMS)
_NORM_EMA = optaxclip.scale_by_norm_ema().init(_PARAMS)
CASES += [
  (
    _SPIKES._replace(clipped=jnp.float32(2), clip_fraction=jnp.float32(0.5)),
    (
      "clip_spikes clipped 2 coordinates (50%) that spiked above their "
      "running second moment"
    ),
  ),
  (
    optaxclip.clip_spikes_adaptive().init(_PARAMS),
    "clip_spikes_adaptive clipped no coordinate",
  ),
  (
    _SPAM._replace(scale=jnp.float32(0.25), resets=_i(1)),
    (
      "spam clipped no coordinate; the step size's warm-up factor is 0.25; 1 "
      "moment reset so far"
    ),
  ),
  (
    _STABLE[2]._replace(scale=jnp.float32(0.5)),
    "stable_spam ran; the cosine factor on b1 and gamma1 is 0.5",
  ),
  (
    _NORM_EMA._replace(
      norm=jnp.float32(8.0),
      scaled_norm=jnp.float32(2.0),
      scale=jnp.float32(0.25),
    ),
    "scale_by_norm_ema scaled the update by 0.25 (norm 8.0 -> 2.0)",
  ),
]


@pytest.mark.parametrize("state, sentence", CASES)
def test_one_sentence_per_state(state, sentence):
  assert optaxclip.explain(state) == [sentence]


def test_every_state_class_has_a_sentence():
  described = {entry[0] for entry in _stats._REGISTRY.values()}
  assert described <= set(_explain._SENTENCES), described
  covered = {_stats.short_name(type(state)) for state, _ in CASES}
  assert described <= covered, described - covered


def test_numbers_read_plainly():
  assert [_explain._num(x) for x in (1, 76.2, 812, 0.013, 1.2e6, NAN)] == [
    "1.0",
    "76.2",
    "812",
    "0.013",
    "1.2e+06",
    "nan",
  ]


def test_the_walk_through_guard_chain_and_injected_hyperparameters():
  params = {"w": jnp.zeros(2)}
  tx = optaxclip.guard(
    optax.chain(optaxclip.clip_global(1.0), optax.sgd(0.1)), max_norm=100.0
  )
  state = tx.init(params)
  _, state = tx.update({"w": jnp.array([3.0, 4.0])}, state, params)
  assert optaxclip.explain(state) == [
    "guard let the step through (norm 5.0 <= 100)",
    "clip_global scaled the update by 0.2 (norm 5.0 > 1.0)",
  ]
  _, state = tx.update({"w": jnp.array([300.0, 400.0])}, state, params)
  assert optaxclip.explain(state) == [
    (
      "guard skipped the step: the norm 500 was above max_norm (threshold "
      "100); 1 skip in a row"
    ),
    (
      "clip_global did not run this step (the guard around it skipped the "
      "step); its statistics are from the last step it ran"
    ),
  ]
  # Under inject_hyperparams the limit is the state's own; named_chain names
  # repeat as stats() keys do.
  tx = optax.named_chain(
    ("a", optax.inject_hyperparams(optaxclip.clip_global)(max_norm=1.0)),
    ("b", optaxclip.clip_global(0.1)),
  )
  state = tx.init(params)
  _, state = tx.update({"w": jnp.array([0.3, 0.4])}, state)
  assert optaxclip.explain(state) == [
    "a/inner_state/clip_global left the update unchanged (norm 0.5 <= 1.0)",
    "b/clip_global scaled the update by 0.2 (norm 0.5 > 0.1)",
  ]
  assert optaxclip.explain({"nothing": jnp.zeros(2)}) == []


def test_leaf_stats_name_the_leaf_and_layer():
  params = {
    "params": {
      "lstm": {"hf": {"kernel": jnp.zeros((4, 3, 3))}},
      "dense": {"kernel": jnp.zeros((3, 2))},
    }
  }
  grads = jax.tree.map(jnp.ones_like, params)
  grads["params"]["lstm"]["hf"]["kernel"] = (
    grads["params"]["lstm"]["hf"]["kernel"].at[3].set(10.0)
  )
  tx = optaxclip.clip_global(
    1.0, leaf_stats=True, layer_axis={"params": {"lstm": 0, "dense": None}}
  )
  _, state = tx.update(grads, tx.init(params))
  assert optaxclip.explain(state) == [
    (
      "clip_global scaled the update by 0.0327 (norm 30.5 > 1.0); 96% of the "
      "squared norm came from params/lstm/hf/kernel (layer 3)"
    )
  ]


_STABLE_ADAMW = optaxclip.stable_adamw(0.1).init(_PARAMS)
CASES += [
  (
    _STABLE_ADAMW._replace(
      max_rms=jnp.float32(3.0), scaled=_i(1), clip_fraction=jnp.float32(0.5)
    ),
    (
      "stable_adamw divided the learning rate of 1 tensor (50%) by their RMS "
      "(largest 3.0)"
    ),
  ),
  (_STABLE_ADAMW, "stable_adamw scaled no tensor's step (largest RMS 0.0)"),
  (
    optaxclip.watch()
    .init(_PARAMS)
    ._replace(
      update_norm=jnp.float32(0.5),
      param_norm=jnp.float32(10.0),
      update_to_param=jnp.float32(0.05),
    ),
    "watch saw an update of norm 0.5 on parameters of norm 10 (ratio 0.05)",
  ),
]


# --- Every sentence true ----------------------------------------------------


def _steady(rng, n=4):
  return {"w": jnp.asarray(1.0 + 0.1 * rng.standard_normal(n), jnp.float32)}


def test_a_loss_spike_skip_is_explained_by_the_loss():
  # A spike of the norm earlier, a spike of the loss now (the norm steady):
  # the loss is the cause, whatever the norm's z-score.
  tx = optaxclip.guard(
    optax.sgd(0.1), spike_z=3.0, loss_spike_z=3.0, warmup_steps=5
  )
  params = {"w": jnp.zeros(4)}
  state = tx.init(params)
  rng = np.random.default_rng(0)
  for t in range(30):
    g = {"w": jnp.full(4, 50.0)} if t == 20 else _steady(rng)
    loss = 10.0 if t == 29 else 2.0 + 0.01 * rng.standard_normal()
    _, state = tx.update(g, state, params, value=loss)
  assert (
    int(state.counts.skipped_spike) == 1
    and int(state.counts.skipped_loss_spike) == 1
  )
  z = float(state.loss_monitor.z_score)
  mean = float(state.loss_monitor.moments.mean)
  assert optaxclip.explain(state) == [
    (
      f"guard skipped the step: the loss 10 was {_explain._num(z)} standard "
      f"deviations above its mean {_explain._num(mean)}; 1 skip in a row, 2 in "
      "all (1 spike, 1 loss spike)"
    )
  ]
  assert z > 100


def test_an_injected_hyperparameter_is_not_the_guards():
  # max_norm goes to clip_global; the guard has none: its spike skip is
  # explained by the spike.
  tx = optax.inject_hyperparams(
    lambda max_norm: optaxclip.guard(
      optax.chain(optaxclip.clip_global(max_norm), optax.adam(0.1)),
      spike_z=3,
    )
  )(max_norm=1.0)
  params = {"w": jnp.zeros(4)}
  state = tx.init(params)
  rng = np.random.default_rng(1)
  for t in range(30):
    g = {"w": jnp.full(4, 15.0)} if t == 29 else _steady(rng)
    _, state = tx.update(g, state, params)
  verdict = state.inner_state.verdict
  moments = state.inner_state.norm_moments
  num = lambda x: _explain._num(float(x))
  assert optaxclip.explain(state) == [
    (
      f"guard skipped the step: the norm 30 was {num(verdict.z_score)} "
      f"standard deviations above its mean (now {num(moments.mean)}; "
      f"threshold {num(verdict.threshold)}); 1 skip in a row"
    ),
    (
      "clip_global did not run this step (the guard around it skipped the "
      "step); its statistics are from the last step it ran"
    ),
  ]


@pytest.mark.parametrize(
  "ord, phrase",
  [
    # a holds 9/17 = 53% of the squared norm, b 4/7 = 57% of the 1-norm.
    (2, "53% of the squared norm came from a"),
    (1, "57% of the 1-norm came from b"),
    (math.inf, "the largest magnitude (3.0) was in a"),
  ],
)
def test_the_leaf_share_names_what_was_measured(ord, phrase):
  g = {"a": jnp.array([3.0]), "b": jnp.array([2.0, 2.0])}
  tx = optaxclip.clip_global(1.0, ord=ord, leaf_stats=True)
  _, state = tx.update(g, tx.init(g))
  (sentence,) = optaxclip.explain(state)
  assert sentence.endswith("; " + phrase), sentence


def _seeds():
  """Three seeds' gradients, all clipped by clip_global(1.0)."""
  return {
    "a": jnp.array([[8.0, 3.0], [4.0, 1.0], [7.0, 0.5]]),
    "b": jnp.array([[1.0], [0.8], [1.0]]),
  }


def test_a_vmapped_state_gets_one_sentence_per_index():
  tx = optaxclip.clip_global(1.0, leaf_stats=True)
  g = _seeds()
  state = jax.vmap(lambda g: tx.update(g, tx.init(g))[1])(g)
  norms = np.asarray(state.norm)
  assert np.all(norms > 1)
  sentences = optaxclip.explain(state)
  assert len(sentences) == 3
  for i, sentence in enumerate(sentences):
    one = jax.tree.map(lambda x, i=i: x[i], state)
    (expected,) = optaxclip.explain(one)
    assert sentence == expected.replace("clip_global", f"clip_global[{i}]", 1)
    assert f"(norm {_explain._num(norms[i])} > 1.0)" in sentence
  # One leaf-norm table per index.
  names, values = optaxclip.leaf_norm_table(state)
  assert names == ["clip_global/leaf_norm/a", "clip_global/leaf_norm/b"]
  assert values.shape == (3, 2)
  for i in range(3):
    _, row = optaxclip.leaf_norm_table(jax.tree.map(lambda x, i=i: x[i], state))
    np.testing.assert_array_equal(values[i], row)
  stats = optaxclip.stats(state)
  np.testing.assert_array_equal(stats["clip_global/leaf_norm/b"], values[:, 1])


def test_a_replicated_state_gets_one_sentence_per_device():
  params = {"w": jnp.zeros(2)}
  tx = optax.chain(
    optaxclip.clip_global(1.0, axis_name="d", sharded=False), optax.sgd(0.1)
  )
  g = jnp.broadcast_to(jnp.array([3.0, 4.0]), (2, 2))
  state = jax.pmap(
    lambda g: tx.update({"w": g}, tx.init(params), params)[1],
    axis_name="d",
    devices=jax.devices()[:2],
  )(g)
  assert optaxclip.explain(state) == [
    "clip_global[0] scaled the update by 0.2 (norm 5.0 > 1.0)",
    "clip_global[1] scaled the update by 0.2 (norm 5.0 > 1.0)",
  ]


def test_a_batched_guard_judges_each_index_for_its_inner_states():
  tx = optaxclip.guard(
    optax.chain(optaxclip.clip_global(1.0), optax.sgd(0.1)), max_norm=10.0
  )
  params = {"w": jnp.zeros(2)}
  g = jnp.array([[3.0, 4.0], [30.0, 40.0]])
  state = jax.vmap(lambda g: tx.update({"w": g}, tx.init(params), params)[1])(g)
  assert optaxclip.explain(state) == [
    "guard[0] let the step through (norm 5.0 <= 10)",
    (
      "guard[1] skipped the step: the norm 50 was above max_norm (threshold "
      "10); 1 skip in a row"
    ),
    "clip_global[0] scaled the update by 0.2 (norm 5.0 > 1.0)",
    (
      "clip_global[1] did not run this step (the guard around it skipped the "
      "step); its statistics are from the last step it ran"
    ),
  ]


def test_a_state_batched_in_some_fields_only_is_refused():
  tx = optaxclip.clip_global(1.0)
  state = tx.init({"w": jnp.zeros(2)})
  state = state._replace(norm=jnp.zeros(3), clipped_norm=jnp.zeros(2))
  with pytest.raises(ValueError, match=r"^explain: every field of a batched"):
    optaxclip.explain(state)


def test_guard_leaf_stats_names_the_leaf_that_blew_up():
  params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
  tx = optaxclip.guard(optax.sgd(0.1), leaf_stats=True, max_norm=10.0)
  bad = {"a": jnp.ones(2), "b": jnp.array([jnp.nan, 1.0])}
  _, state = tx.update(bad, tx.init(params), params)
  assert optaxclip.explain(state) == [
    (
      "guard skipped the step: the gradient norm was nan (a NaN or Inf in the "
      "gradient); 1 skip in a row; b is the first leaf whose norm is nan (a "
      "NaN or Inf in it)"
    )
  ]
  big = {"a": jnp.array([30.0, 40.0]), "b": jnp.ones(2)}
  _, state = tx.update(big, tx.init(params), params)
  assert optaxclip.explain(state) == [
    (
      "guard skipped the step: the norm 50 was above max_norm (threshold 10); "
      "1 skip in a row; 100% of the squared norm came from a"
    )
  ]


def test_clip_relative_says_its_warm_up_clip_is_global():
  tx = optaxclip.clip_relative(warmup_steps=2, warmup_max_norm=1.0)
  g = {"a": jnp.array([3.0]), "b": jnp.array([4.0])}
  state = tx.init(g)
  said = []
  for a in (3.0, 3.0, 30.0):
    _, state = tx.update({"a": jnp.array([a]), "b": jnp.array([4.0])}, state)
    said += optaxclip.explain(state)
  assert (
    said[:2]
    == [
      (
        "clip_relative scaled the whole update by 0.2 in its warm-up (norm 5.0 "
        "> warmup_max_norm 1.0)"
      )
    ]
    * 2
  )
  # After the warm-up each leaf is held to 1.05 times its own EMA norm.
  assert said[2].startswith("clip_relative scaled down 100% of its leaves")
  assert "each leaf's limit is a factor times its own EMA norm" in said[2]


def test_multisteps_between_updates_says_the_clipper_did_not_run():
  tx = optax.MultiSteps(
    optax.chain(optaxclip.clip_global(1.0), optax.sgd(0.1)), every_k_schedule=2
  )
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  assert optaxclip.explain(state) == [
    (
      "clip_global did not run this step (optax.MultiSteps has not run its "
      "inner optimizer yet); its statistics are from the last step it ran"
    )
  ]
  _, state = tx.update({"w": jnp.array([3.0, 4.0])}, state, params)
  assert optaxclip.explain(state) == [
    (
      "clip_global did not run this step (optax.MultiSteps is accumulating "
      "gradients, 1 so far in this group); its statistics are from the last "
      "step it ran"
    )
  ]
  _, state = tx.update({"w": jnp.array([3.0, 4.0])}, state, params)
  assert optaxclip.explain(state) == [
    "clip_global scaled the update by 0.2 (norm 5.0 > 1.0)"
  ]


def test_apply_if_finite_skip_says_the_clipper_did_not_run():
  tx = optax.apply_if_finite(
    optax.chain(optaxclip.clip_global(1.0), optax.sgd(0.1)), 3
  )
  params = {"w": jnp.zeros(2)}
  _, state = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(params), params)
  assert optaxclip.explain(state) == [
    "clip_global scaled the update by 0.2 (norm 5.0 > 1.0)"
  ]
  _, state = tx.update({"w": jnp.array([jnp.nan, 4.0])}, state, params)
  assert optaxclip.explain(state) == [
    (
      "clip_global did not run this step (optax.apply_if_finite skipped the "
      "step: a non-finite gradient); its statistics are from the last step it "
      "ran"
    )
  ]
