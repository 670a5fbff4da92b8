"""SPAM and Stable-SPAM against NumPy transcriptions of the authors' classes.

The references (tests/np_spam_refs.py) run in float32 as the PyTorch classes
do; each test runs enough steps to pass through several moment resets and
warm-ups, with spikes injected so that the clipping triggers. ``python
tests/test_spam.py`` prints the parity figures.
"""

import functools
from typing import NamedTuple

import chex
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import np_refs
import np_spam_refs
import optaxclip

SHAPES = ((4, 5), (7,), ())
STEPS = 40
SPIKE_STEPS = (5, 14, 26, 33)  # 1-based; some right after resets

SPAM_KW = dict(
  b1=0.9,
  b2=0.999,
  eps=1e-6,
  weight_decay=0.1,
  threshold=50.0,
  reset_interval=12,  # resets at t = 12, 24, 36
  warmup_steps=5,
  grad_accu_steps=3,
)
STABLE_KW = dict(
  b1=0.9,
  b2=0.999,
  eps=1e-8,
  weight_decay=0.1,
  gamma1=0.7,
  gamma2=0.9,
  gamma3=0.999,
  total_steps=STEPS,
  eta_min=0.5,
  reset_interval=10,  # resets at t = 10, 20, 30, 40
)
LR = 1e-2
SPAM_TX = optaxclip.spam(LR, **SPAM_KW)
STABLE_TX = optaxclip.stable_spam(LR, **STABLE_KW)


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


def _grads(seed=1, steps=STEPS, spikes=SPIKE_STEPS, size=1e3):
  """This file's gradient stream (``np_refs.spiky_gradients``)."""
  return np_refs.spiky_gradients(SHAPES, steps, spikes, seed, size)


def _as_tree(arrays):
  return {f"p{i}": jnp.asarray(a) for i, a in enumerate(arrays)}


def _from_tree(tree):
  return [np.asarray(tree[f"p{i}"]) for i in range(len(tree))]


def _run(tx, params, grads, update=None):
  """Params after each step, and the states."""
  trajectory, states, _ = _run_with_updates(tx, params, grads, update)
  return trajectory, states


def _run_with_updates(tx, params, grads, update=None):
  update = tx.update if update is None else update
  p = _as_tree(params)
  state = tx.init(p)
  trajectory, states, updates = [], [], []
  for g in grads:
    u, state = update(_as_tree(g), state, p)
    p = optax.apply_updates(p, u)
    trajectory.append(_from_tree(p))
    states.append(state)
    updates.append(_from_tree(u))
  return trajectory, states, updates


def _run_reference(ref, grads):
  """Params after each step, the updates (differences of the params, in the
  reference's dtype) and the count clipped on each step.
  """
  trajectory, updates, clipped = [], [], []
  for g in grads:
    before = [p.copy() for p in ref.params]
    ref.step(g)
    trajectory.append([p.copy() for p in ref.params])
    updates.append([a - b for a, b in zip(ref.params, before)])
    clipped.append(ref.clipped)
  return trajectory, updates, clipped


def _worst(ours, theirs, steps=None):
  """The worst, over the steps (1-based) and tensors, of max |a - b| /
  max |b|: the error relative to the tensor's size.
  """
  worst = 0.0
  for t, (a, b) in enumerate(zip(ours, theirs)):
    if steps is None or t + 1 in steps:
      for x, y in zip(a, b):
        scale = float(np.max(np.abs(y)))
        worst = max(worst, float(np.max(np.abs(x - y))) / scale)
  return worst


class Parity(NamedTuple):
  states: list
  clipped: list  # by the float32 reference, each step
  update_error: list  # per step: ours against the float64 reference
  param_error: list  # per step: ours against the float32 reference


def _parity(tx, make_ref):
  params, grads = _params(), _grads()
  ours, states, updates = _run_with_updates(tx, params, grads)
  ref32, _, clipped = _run_reference(make_ref(params, np.float32), grads)
  _, ref64_updates, clipped64 = _run_reference(
    make_ref(params, np.float64), grads
  )
  assert clipped64 == clipped  # no decision on a float32 rounding edge
  return Parity(
    states,
    clipped,
    [_worst([u], [r]) for u, r in zip(updates, ref64_updates)],
    [_worst([p], [r]) for p, r in zip(ours, ref32)],
  )


def spam_parity():
  kw = SPAM_KW
  return _parity(
    SPAM_TX,
    lambda params, dtype: np_spam_refs.spam_reference(
      params, lr=LR, dtype=dtype, **kw
    ),
  )


def stable_parity(rebind):
  kw = STABLE_KW
  return _parity(
    STABLE_TX,
    lambda params, dtype: np_spam_refs.stable_spam_reference(
      params, lr=LR, rebind=rebind, dtype=dtype, **kw
    ),
  )


# Each step's update within 1e-5 of its size of the float64 reference's, and
# the parameters within 2e-6 of the float32 reference's: float32 precision.
UPDATE_TOL, PARAM_TOL = 1e-5, 2e-6


@functools.cache
def _spam_run():
  return spam_parity()


@functools.cache
def _stable_run(rebind):
  return stable_parity(rebind)


def test_spam_matches_the_reference_through_three_resets():
  run = _spam_run()
  assert max(run.update_error) < UPDATE_TOL
  assert max(run.param_error) < PARAM_TOL
  assert [int(s[0].clipped) for s in run.states] == run.clipped
  assert sum(c > 0 for c in run.clipped) >= 4  # spikes, post-reset steps
  assert int(run.states[-1][0].resets) == 3
  scales = [float(s[0].scale) for s in run.states]
  assert scales[11] == pytest.approx(0.01) and scales[10] == 1.0
  assert scales[16] == 1.0 and 0.01 < scales[13] < 1.0


def test_stable_spam_matches_the_reference_before_its_first_reset():
  run = _stable_run(True)
  assert max(run.update_error[:9]) < UPDATE_TOL
  assert max(run.param_error[:9]) < PARAM_TOL
  # At the reset step the reference steps from its old moments.
  assert run.update_error[9] > 0.1


def test_stable_spam_matches_the_paper_order_through_four_resets():
  run = _stable_run(False)
  assert max(run.update_error) < UPDATE_TOL
  assert max(run.param_error) < PARAM_TOL
  assert [int(s[0].clipped) for s in run.states] == run.clipped
  assert sum(c > 0 for c in run.clipped) >= 4
  assert int(run.states[-1][2].resets) == 4


class VariantsTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_same_updates_with_and_without_jit_and_no_retrace(self):
    params, grads = _params(), _grads(steps=14)
    for tx in (SPAM_TX, STABLE_TX):
      traces = []

      def update(g, state, p, tx=tx, traces=traces):
        traces.append(1)
        return tx.update(g, state, p)

      ref, _ = _run(tx, params, grads)
      ours, _ = _run(tx, params, grads, update=self.variant(update))
      chex.assert_trees_all_close(ours, ref, rtol=1e-6, atol=1e-7)
      # Traced once under jit: the state keeps its dtypes and shapes.
      jitted = self.variant.type == chex.ChexVariantType.WITH_JIT
      assert len(traces) == (1 if jitted else len(grads))


def test_clip_spikes_before_adam_is_spam_without_resets():
  params, grads = _params(), _grads(steps=20)
  kw = dict(threshold=50.0, b2=0.999, reset_interval=1000, grad_accu_steps=3)
  chained = optax.chain(
    optaxclip.clip_spikes(**kw), optax.adam(LR, b1=0.9, b2=0.999, eps=0.0)
  )
  ours, states = _run(chained, params, grads)
  spam, spam_states = _run(
    optaxclip.spam(LR, eps=0.0, warmup_steps=5, **kw), params, grads
  )
  chex.assert_trees_all_close(ours, spam, rtol=1e-5, atol=1e-6)
  assert [float(s[0].clipped) for s in states] == [
    float(s[0].clipped) for s in spam_states
  ]
  assert sum(float(s[0].clipped) for s in states) > 0


def test_stable_spam_parts_chain_before_adam():
  params, grads = _params(), _grads(steps=20)
  chained = optax.chain(
    optaxclip.clip_spikes_adaptive(0.999),
    optaxclip.scale_by_norm_ema(0.7, 0.9, eps=1e-8),
    optax.adam(LR, b1=0.9, b2=0.999, eps=1e-8),
  )
  ours, _ = _run(chained, params, grads)
  stable, _ = _run(
    optaxclip.stable_spam(LR, reset_interval=None), params, grads
  )
  chex.assert_trees_all_close(ours, stable, rtol=1e-5, atol=1e-6)


def test_stats_report_clipped_resets_and_scale():
  p = _as_tree(_params())
  spam, stable = SPAM_TX, STABLE_TX
  s1, s2 = spam.init(p), stable.init(p)
  for g in _grads(steps=13):
    _, s1 = spam.update(_as_tree(g), s1, p)
    _, s2 = stable.update(_as_tree(g), s2, p)
  logs = optaxclip.stats(s1)
  assert set(logs) == {
    "spam/clipped",
    "spam/clip_fraction",
    "spam/resets",
    "spam/scale",
    "spam/threshold",
  }
  assert float(logs["spam/threshold"]) == SPAM_KW["threshold"]
  assert int(logs["spam/resets"]) == 1
  assert float(logs["spam/scale"]) == pytest.approx(
    1 - 0.99 * (1 + np.cos(np.pi / 6)) / 2
  )
  assert set(optaxclip.stats(s2)) == {
    "clip_spikes_adaptive/clipped",
    "clip_spikes_adaptive/clip_fraction",
    "scale_by_norm_ema/norm",
    "scale_by_norm_ema/scaled_norm",
    "scale_by_norm_ema/scale",
    "stable_spam/resets",
    "stable_spam/scale",
  }


def test_learning_rate_schedule_matches_the_reference_lr_per_step():
  params, grads = _params(), _grads(steps=6, spikes=())
  schedule = optax.linear_schedule(LR, 0.0, 6)
  _, _, ours = _run_with_updates(
    optaxclip.spam(schedule, **SPAM_KW), params, grads
  )
  ref = np_spam_refs.spam_reference(params, lr=LR, dtype=np.float64, **SPAM_KW)
  theirs = []
  for t, g in enumerate(grads):
    ref.lr = float(schedule(t))
    before = [p.copy() for p in ref.params]
    ref.step(g)
    theirs.append([a - b for a, b in zip(ref.params, before)])
  assert _worst(ours[:5], theirs[:5]) < UPDATE_TOL


def test_stable_spam_cosine_holds_eta_min_after_total_steps():
  from optaxclip import _spam  # pylint: disable=import-outside-toplevel

  scales = np.asarray(_spam._Cosine(3, 0.25)(jnp.arange(6)))
  expected = 0.25 + 0.75 * np.cos(np.pi * np.arange(1, 4) / 8) ** 2
  np.testing.assert_allclose(scales[:3], expected, rtol=1e-6)
  np.testing.assert_array_equal(scales[3:], [0.25] * 3)
  # The parity run's factors: the reference's cosine at each step.
  run = _stable_run(False)
  ours = [float(s[2].scale) for s in run.states]
  t = np.arange(1, STEPS + 1)
  np.testing.assert_allclose(
    ours, 0.5 + 0.5 * (1 + np.cos(np.pi * t / (STEPS + 1))) / 2, rtol=1e-6
  )


def test_zero_empty_none_and_bfloat16_leaves():
  p = {
    "zero": jnp.zeros(3),
    "none": None,
    "empty": jnp.zeros((0,)),
    "half": jnp.ones((3, 2), jnp.bfloat16),
  }
  for tx in (
    optaxclip.spam(LR, reset_interval=2, grad_accu_steps=1),
    optaxclip.stable_spam(LR, reset_interval=2),
  ):
    state = tx.init(p)
    for _ in range(3):
      u, state = tx.update(p, state, p)
    assert u["none"] is None and u["empty"].shape == (0,)
    assert u["half"].dtype == jnp.bfloat16 and u["zero"].dtype == jnp.float32
    for leaf in (u["zero"], u["half"]):
      assert np.all(np.isfinite(np.asarray(leaf, np.float32)))
  tx = optaxclip.stable_spam(LR)
  assert tx.update({}, tx.init({}), {})[0] == {}


def test_per_leaf_emas_are_vectors_in_leaf_order():
  # clip_spikes_adaptive's max_ema (T bias-corrected) and scale_by_norm_ema's
  # mu and nu hold one float32 entry per leaf, in jax.tree.leaves order (None
  # skipped).
  grads = [
    {"b": jnp.array([3.0, -4.0]), "a": jnp.array([-1.0]), "n": None},
    {"b": jnp.array([6.0, 8.0]), "a": jnp.array([2.0]), "n": None},
  ]
  g3, g1, g2 = 0.5, 0.25, 0.75
  clip = optaxclip.clip_spikes_adaptive(g3)
  scale = optaxclip.scale_by_norm_ema(g1, g2)
  c_state, s_state = clip.init(grads[0]), scale.init(grads[0])
  t, m, v = np.zeros(2), np.zeros(2), np.zeros(2)
  for g in grads:
    _, c_state = clip.update(g, c_state)
    _, s_state = scale.update(g, s_state)
    # Leaf order: "a", then "b".
    leaves = [np.asarray(g["a"], np.float64), np.asarray(g["b"], np.float64)]
    largest = np.array([np.max(np.abs(x)) for x in leaves])
    norms = np.array([np.linalg.norm(x) for x in leaves])
    t = g3 * t + (1 - g3) * largest
    m = g1 * m + (1 - g1) * norms
    v = g2 * v + (1 - g2) * norms**2
  t_hat = t / (1 - g3 ** len(grads))
  for got, want in ((c_state.max_ema, t_hat), (s_state.mu, m), (s_state.nu, v)):
    assert got.dtype == jnp.float32 and got.shape == (2,)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_per_leaf_state_of_another_tree_is_an_error():
  state = optaxclip.clip_spikes_adaptive().init({"a": jnp.ones(2)})
  with pytest.raises(
    ValueError,
    match=r"^clip_spikes_adaptive: state\.max_ema must hold one entry per "
    r"leaf of the updates \(2\); got shape \(1,\)\.",
  ):
    optaxclip.clip_spikes_adaptive().update(
      {"a": jnp.ones(2), "b": jnp.ones(3)}, state
    )
  state = optaxclip.scale_by_norm_ema().init({"a": jnp.ones(2)})
  with pytest.raises(ValueError, match=r"^scale_by_norm_ema: state\.mu must"):
    optaxclip.scale_by_norm_ema().update({}, state)
  # A tree of scalars (the layout of earlier development versions).
  old = state._replace(mu={"a": jnp.zeros(())})
  with pytest.raises(
    ValueError, match=r"^scale_by_norm_ema: state\.mu must .*; got a dict\."
  ):
    optaxclip.scale_by_norm_ema().update({"a": jnp.ones(2)}, old)


@pytest.mark.parametrize(
  "name, make",
  [
    ("spam", lambda: optaxclip.spam(1e-3)),
    ("clip_spikes", optaxclip.clip_spikes),
    ("stable_spam", lambda: optaxclip.stable_spam(1e-3)),
  ],
)
def test_complex_parameters_are_refused_at_init(name, make):
  """The SPAM family's element-wise moments are real: a complex leaf is
  refused when the state is built, with the function and the leaf named
  (not accepted there and refused at the first update).
  """
  params = {"w": jnp.ones(2), "z": jnp.ones(3, jnp.complex64)}
  with pytest.raises(
    TypeError,
    match=rf"^{name}: params leaf \['z'\] must be a real float .*; got "
    r"dtype complex64\.$",
  ):
    make().init(params)


def test_inject_hyperparams_learning_rate():
  p = _as_tree(_params())
  tx = optax.inject_hyperparams(optaxclip.spam)(learning_rate=LR, **SPAM_KW)
  plain = SPAM_TX
  s, s0 = tx.init(p), plain.init(p)
  for g in _grads(steps=3, spikes=()):
    u, s = tx.update(_as_tree(g), s, p)
    u0, s0 = plain.update(_as_tree(g), s0, p)
    # Traced b1, b2 are float32 (the plain ones enter the bias correction
    # through float64 logarithms): 1 - b2 is 1.3e-5 off.
    chex.assert_trees_all_close(u, u0, rtol=3e-5)


if __name__ == "__main__":
  for name, run in (
    ("spam (3 resets)", spam_parity()),
    ("stable_spam, paper order (4 resets)", stable_parity(False)),
    ("stable_spam, reference as written", stable_parity(True)),
  ):
    print(
      f"{name}: {STEPS} steps, {sum(run.clipped)} coordinates clipped on "
      f"{sum(c > 0 for c in run.clipped)} steps; worst update error vs "
      f"float64 {max(run.update_error):.2e} (steps 1-9: "
      f"{max(run.update_error[:9]):.2e}), worst parameter error vs float32 "
      f"{max(run.param_error):.2e}"
    )
