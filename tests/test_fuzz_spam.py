"""Hypothesis properties for SPAM and Stable-SPAM.

Both optimizers match the float64 NumPy transcriptions of the authors'
classes (tests/np_spam_refs.py) step for step, for any reset schedule,
warm-up, clipping threshold, decay rates and gradient sequence with spikes
-- Stable-SPAM in the paper's reset order (see :func:`optaxclip.stable_spam`).
Its per-leaf parts give each leaf its own statistics on trees whose small
leaves are stacked for them (compile time), in every dtype, a non-finite
leaf kept to itself. At the edges of the range: scale_by_norm_ema rescales a
stream of norms scaled by a power of two as the stream itself and equals a
float64 oracle after long runs of zero norms, and a square beyond the
dtype's range leaves the second moment finite.

The hyperparameters are traced: each optimizer runs in one program, compiled
once (module level), whatever an example draws. The decay rates are drawn
from values exact in float32, so that a traced rate carries no rounding of
its own into ``1 - rate`` (a float32 ``0.999`` is 1.3e-5 off there).
"""

import functools
import math
import pathlib

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fuzz_strategies as fz
import np_spam_refs
import optaxclip

SHAPES = ((3, 4), (5,), ())
STEPS = 12
LR = 1e-2
TOL = 2e-5  # each step's update, relative to its size
DECAYS = (0.5, 0.75, 0.875, 0.9375, 0.96875)


def _scan(tx, grads, params):
  """Updates and elements clipped at each step (float32 ones)."""

  def body(carry, g):
    p, state = carry
    u, state = tx.update(g, state, p)
    return (optax.apply_updates(p, u), state), (u, state[0].clipped)

  _, out = jax.lax.scan(body, (params, tx.init(params)), grads)
  return out


@jax.jit
def _spam(grads, params, hyper):
  tx = optaxclip.spam(
    LR,
    b1=0.9,
    b2=0.999,
    eps=1e-6,
    weight_decay=hyper["weight_decay"],
    threshold=hyper["threshold"],
    reset_interval=hyper["reset_interval"],
    warmup_steps=hyper["warmup_steps"],
    grad_accu_steps=hyper["grad_accu_steps"],
  )
  return _scan(tx, grads, params)


@jax.jit
def _stable(grads, params, hyper):
  tx = optaxclip.stable_spam(LR, eps=1e-8, **hyper)
  return _scan(tx, grads, params)


@functools.cache
def _params():
  rng = np.random.default_rng(0)
  return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


@st.composite
def gradient_runs(draw):
  """STEPS gradients of the SHAPES tensors, some coordinates spiking."""
  seed = draw(st.integers(0, 2**31 - 1))
  spikes = draw(st.sets(st.integers(0, STEPS - 1), max_size=4))
  size = draw(st.sampled_from([10.0, 1e3, 1e5]))
  rng = np.random.default_rng(seed)
  run = []
  for t in range(STEPS):
    step = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    if t in spikes:
      for g in step:
        g.reshape(-1)[rng.integers(0, g.size)] *= size
    run.append(step)
  return run


def _stacked(run):
  return tuple(
    jax.device_put(np.stack([step[i] for step in run]))
    for i in range(len(SHAPES))
  )


def _reference_updates(ref, run, weight_decay):
  """Per step: the updates, the elements clipped, and each update's scale:
  the larger of its largest element and the step its first moment's terms
  would give uncancelled (``ref.rounding_scale``: a float32 moment rounds
  relative to its terms), plus the largest weight-decay term (the two may
  cancel).
  """
  updates, clipped, scales = [], [], []
  for g in run:
    before = [p.copy() for p in ref.params]
    ref.step(g)
    updates.append([a - b for a, b in zip(ref.params, before)])
    clipped.append(ref.clipped)
    scales.append(
      [
        max(np.max(np.abs(u)), r) + LR * weight_decay * np.max(np.abs(p))
        for u, p, r in zip(updates[-1], before, ref.rounding_scale)
      ]
    )
  return updates, clipped, scales


def _check(ours, clipped, ref_updates, ref_clipped, scales):
  np.testing.assert_array_equal(np.asarray(clipped), ref_clipped)
  for t, expected in enumerate(ref_updates):
    for i, want in enumerate(expected):
      got = np.asarray(ours[i][t], np.float64)
      bound = TOL * scales[t][i] + 1e-12
      assert np.max(np.abs(got - want)) <= bound, (t, i)


def _ours(program, run, hyper):
  """``program`` on ``run``'s gradients, the hyperparameters traced."""
  return program(
    _stacked(run),
    tuple(jax.device_put(np.asarray(p)) for p in _params()),
    {k: jax.device_put(np.asarray(v)) for k, v in hyper.items()},
  )


def _saved_case(name):
  """An example kept in tests/data: the run and the hyperparameters."""
  saved = np.load(pathlib.Path(__file__).parent / "data" / name)
  flat = [saved[f"arr_{j}"] for j in range(STEPS * len(SHAPES))]
  run = [flat[t * len(SHAPES) : (t + 1) * len(SHAPES)] for t in range(STEPS)]
  hyper = {k: saved[k].item() for k in saved.files if not k.startswith("arr_")}
  return dict(run=run, **hyper)


@hypothesis.given(
  run=gradient_runs(),
  threshold=st.sampled_from([0.0, 2.0, 50.0, 5000.0]),
  reset_interval=st.integers(1, 6),
  warmup_steps=st.integers(0, 5),
  grad_accu_steps=st.integers(0, 4),
  weight_decay=st.sampled_from([0.0, 0.5]),
)
# An explicit example (rarely drawn under the ci profile): a scalar's first
# moment cancelled to 6e-6 of a step; float32 rounds it relative to its terms.
@hypothesis.example(**_saved_case("spam_cancelled_moment.npz"))
def test_spam_matches_the_reference(
  run, threshold, reset_interval, warmup_steps, grad_accu_steps, weight_decay
):
  hyper = dict(
    threshold=threshold,
    reset_interval=reset_interval,
    warmup_steps=warmup_steps,
    grad_accu_steps=grad_accu_steps,
    weight_decay=weight_decay,
  )
  ours, clipped = _ours(_spam, run, hyper)
  ref = np_spam_refs.spam_reference(
    _params(), lr=LR, eps=1e-6, dtype=np.float64, **hyper
  )
  _check(ours, clipped, *_reference_updates(ref, run, weight_decay))


@hypothesis.given(
  run=gradient_runs(),
  gamma1=st.sampled_from(DECAYS),
  gamma2=st.sampled_from(DECAYS),
  gamma3=st.sampled_from(DECAYS),
  b1=st.sampled_from(DECAYS),
  b2=st.sampled_from(DECAYS),
  eta_min=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
  total_steps=st.integers(1, 2 * STEPS),
  reset_interval=st.integers(1, 6),
  weight_decay=st.sampled_from([0.0, 0.5]),
)
# An explicit example, as for SPAM above.
@hypothesis.example(**_saved_case("stable_spam_cancelled_moment.npz"))
def test_stable_spam_matches_the_reference_in_the_paper_order(
  run,
  gamma1,
  gamma2,
  gamma3,
  b1,
  b2,
  eta_min,
  total_steps,
  reset_interval,
  weight_decay,
):
  # The reference's cosine rises again after total_steps; ours holds.
  hypothesis.assume(total_steps >= STEPS)
  hyper = dict(
    b1=b1,
    b2=b2,
    gamma1=gamma1,
    gamma2=gamma2,
    gamma3=gamma3,
    eta_min=eta_min,
    total_steps=total_steps,
    reset_interval=reset_interval,
    weight_decay=weight_decay,
  )
  ours, clipped = _ours(_stable, run, hyper)
  ref = np_spam_refs.stable_spam_reference(
    _params(), lr=LR, eps=1e-8, rebind=False, dtype=np.float64, **hyper
  )
  _check(ours, clipped, *_reference_updates(ref, run, weight_decay))


# --- Stable-SPAM's per-leaf parts on stacked leaves -------------------------

G3, G1, G2, EPS = 0.75, 0.5, 0.875, 1e-8  # exact in float32
PARTS_STEPS = 3

# Under ci the tree's layout is this one (one program to compile): leaves
# of one size and accumulation dtype stacked together (float32, bfloat16,
# float16 of 5 and of 6 elements, two scalars), an empty leaf, a float64
# leaf under x64. Other profiles (release) draw layouts freely.
PARTS_LAYOUT = (
  ((5,), "float32"),
  ((5,), "bfloat16"),
  ((2, 3), "float32"),
  ((5,), "float16"),
  ((6,), "float32"),
  ((), "float32"),
  ((0,), "float32"),
  ((), "float32"),
  ((4, 4), "float64"),
)


def _parts_program(steps):
  tx = optax.chain(
    optaxclip.clip_spikes_adaptive(G3),
    optaxclip.scale_by_norm_ema(G1, G2, eps=EPS),
  )
  state = tx.init(steps[0])
  outs, clipped = [], []
  for g in steps:
    u, state = tx.update(g, state)
    outs.append(u)
    clipped.append(state[0].clipped)
  return outs, clipped


_PARTS = fz.FastJit(_parts_program)


@st.composite
def _parts_runs(draw):
  """PARTS_STEPS trees of one layout; at most one leaf holds NaN or inf."""
  layout = draw(
    fz.ci_or(
      st.just(PARTS_LAYOUT),
      st.lists(
        st.tuples(fz.shapes(), st.sampled_from(fz.REAL)), min_size=1, max_size=9
      ),
    )
  )
  bad = draw(st.sampled_from([None, *range(len(layout))]))
  steps = []
  for _ in range(PARTS_STEPS):
    steps.append(
      [
        draw(fz.arrays(dtype, shape, nonfinite=i == bad, magnitudes="ordinary"))
        for i, (shape, dtype) in enumerate(layout)
      ]
    )
  return steps


def _parts_oracle(steps):
  """Per step and leaf, in float64 from the leaves as stored: the output,
  and the elements clipped at least (strictly above the limit) and at most
  (within 1e-5 of it, where float32 may judge either way). A leaf holding a
  NaN or inf that step comes out NaN (the output None), all its elements
  counted as clipped, and leaves its statistics as they were.

  The limit ``T_hat`` is kept as it is stored (a weighted sum of the last
  ``T_hat`` and ``max|g|``, the reference's ``T / (1 - G3**t)`` while no
  step was left out).
  """
  n_leaves = len(steps[0])
  t_hat, mu, nu = np.zeros(n_leaves), np.zeros(n_leaves), np.zeros(n_leaves)
  out, counts = [], []
  for t, step in enumerate(steps, start=1):
    outs, low, high = [], 0, 0
    c, c_before = 1 - G3**t, 1 - G3 ** (t - 1)
    for i, g in enumerate(step):
      x = np.asarray(g, np.float64)
      if not np.all(np.isfinite(x)):
        outs.append(None)
        low, high = low + x.size, high + x.size
        continue
      a = np.abs(x)
      largest = float(np.max(a)) if a.size else 0.0
      t_hat[i] = G3 * c_before / c * t_hat[i] + (1 - G3) / c * largest
      limit = t_hat[i]
      factor = limit / largest if largest > 0 else limit
      ties = np.abs(a - limit) <= 1e-5 * limit
      strict = (a > limit) & ~ties
      low, high = low + int(strict.sum()), high + int((strict | ties).sum())
      # A tie may be clipped or not: both outputs are accepted below.
      kept = np.where(strict, x * factor, x)
      both = np.where(ties, x * factor, kept)
      results = []
      for y in (kept, both):
        y = y.astype(g.dtype).astype(np.float64)  # the chain's leaf dtype
        n = float(np.sqrt(np.sum(y * y)))
        m = G1 * mu[i] + (1 - G1) * n
        v = G2 * nu[i] + (1 - G2) * n * n
        target = (m / (1 - G1**t)) / (np.sqrt(v / (1 - G2**t)) + EPS)
        results.append((y * (target / n if n > 0 else 1.0), m, v))
      mu[i], nu[i] = results[0][1], results[0][2]
      outs.append((results[0][0], results[1][0], ties.any()))
    out.append(outs)
    counts.append((low, high))
  return out, counts


@fz.examples(8)
@hypothesis.given(steps=_parts_runs())
def test_stable_spam_parts_per_leaf_on_stacked_leaves(steps):
  with fz.x64([str(x.dtype) for x in steps[0]]):
    outs, clipped = _PARTS(
      [[jax.device_put(x) for x in step] for step in steps]
    )
    want, counts = _parts_oracle(steps)
    for t in range(PARTS_STEPS):
      low, high = counts[t]
      assert low <= float(clipped[t]) <= high, (t, low, high)
      for i, w in enumerate(want[t]):
        raw = np.asarray(outs[t][i])
        if w is None:  # a NaN or inf in the leaf: all of it NaN
          assert np.all(np.isnan(raw.astype(np.float64))), (t, i)
          continue
        assert raw.dtype == steps[t][i].dtype
        assert raw.shape == steps[t][i].shape
        got = raw.astype(np.float64)
        tol = 8 * fz.round_tol(steps[t][i].dtype) + 1e-5
        atol = 4 * fz.flush_atol(steps[t][i].dtype)
        scale = max(np.max(np.abs(w[0]), initial=0.0), atol)
        close = [
          np.max(np.abs(got - c), initial=0.0) <= tol * scale for c in w[:2]
        ]
        # A tie judged differently changes the norm of the whole leaf.
        assert close[0] or (w[2] and close[1]), (t, i)


# --- clip_spikes on stacked leaves equals clip_spikes leaf by leaf ----------

# Leaves of one size stacked for the count (also a bfloat16 gradient whose
# moment is float32: stacked apart), scalars, an empty leaf.
SPIKES_LAYOUT = (
  ((5,), "float32", "float32"),
  ((5,), "float32", "float32"),
  ((5,), "bfloat16", "bfloat16"),
  ((5,), "bfloat16", "float32"),
  ((2, 3), "float16", "float16"),
  ((6,), "float16", "float16"),
  ((), "float32", "float32"),
  ((0,), "float32", "float32"),
)
SPIKES_STEPS = 4  # reset_interval 4: steps 1 and 4 start from a zero moment
SPIKES_THRESHOLD = 3.0


def _spikes_program(steps, params, make=None):
  def run(steps_, params_):
    if make is None:
      tx = optaxclip.clip_spikes(
        SPIKES_THRESHOLD, b2=0.5, reset_interval=4, grad_accu_steps=1
      )
    else:
      tx = make()
    state = tx.init(params_)
    outs, counts = [], []
    for g in steps_:
      u, state = tx.update(g, state)
      outs.append(u)
      counts.append(state.clipped)
    return outs, counts

  whole = run(steps, params)
  alone = [
    run([[step[i]] for step in steps], [params[i]]) for i in range(len(params))
  ]
  return whole, alone


_SPIKES = fz.FastJit(_spikes_program)
# A decay that lets a spike through its EMA's limit: the leaves' largest
# magnitudes vary by ``spread`` from step to step.
_ADAPTIVE = fz.FastJit(
  functools.partial(
    _spikes_program, make=lambda: optaxclip.clip_spikes_adaptive(0.5)
  )
)


def _spike_steps(values, spread):
  steps = []
  for seed in values:
    rng = np.random.default_rng(seed)
    steps.append(
      [
        (rng.normal(size=s) * spread ** rng.random(size=s)).astype(fz.DTYPES[g])
        for s, g, _ in SPIKES_LAYOUT
      ]
    )
  params = [np.zeros(s, fz.DTYPES[p]) for s, _, p in SPIKES_LAYOUT]
  return (
    [[jax.device_put(x) for x in step] for step in steps],
    [jax.device_put(p) for p in params],
  )


def _check_as_each_leaf_alone(outs, counts, alone, ulps=0, threshold=None):
  """Counts equal; outputs equal, or within ``ulps`` units in the last
  place of their dtype.

  With ``threshold`` (clip_spikes' ``sqrt(threshold * nu)`` limit), a
  float16 element may also differ by one unit of its own and by what two
  units of its float16 moment move its limit: XLA:CPU on hosts with
  AVX512-FP16 computes some float16 kernels natively and others through
  float32, and the moment comes out a unit apart between the packed and
  the per-leaf program (seen on an Intel Xeon: 0.006699 against 0.006687,
  a subnormal moment, values=[0, 0, 0, 0]; -0.02092 against -0.02094,
  values=[5337, 5337, 0, 0]; bit-equal on AMD EPYC).
  """
  for t in range(SPIKES_STEPS):
    total = sum(float(a[1][t]) for a in alone)
    assert float(counts[t]) == total, (t, float(counts[t]), total)
    for i, a in enumerate(alone):
      got, want = np.asarray(outs[t][i]), np.asarray(a[0][t][0])
      spacing = np.abs(np.spacing(want.astype(got.dtype))).astype(np.float64)
      diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
      allowed = ulps * spacing
      if threshold is not None and got.dtype == np.float16:
        # sqrt(th * (nu + d)) - sqrt(th * nu), d two units of the moment
        # nu = limit**2 / th (subnormal ones at least): th * d / (2 *
        # limit), and sqrt(th * d) at most; and a unit of the output.
        limit = np.abs(want.astype(np.float64))
        nu = (limit**2 / threshold).astype(np.float16)
        moved = threshold * 2 * np.abs(np.spacing(nu)).astype(np.float64)
        with np.errstate(divide="ignore"):
          allowed = (
            allowed + spacing + np.minimum(np.sqrt(moved), moved / (2 * limit))
          )
      if not np.any(allowed):
        np.testing.assert_array_equal(got, want)
        continue
      # Equal (infinities included), NaN in both (a non-finite leaf), or
      # within what is allowed.
      same = (got == want) | (np.isnan(got) & np.isnan(want))
      assert np.all(same | (diff <= allowed)), (t, i, got, want)


@fz.examples(6)
@hypothesis.given(
  values=st.lists(
    st.integers(0, 2**32 - 1), min_size=SPIKES_STEPS, max_size=SPIKES_STEPS
  ),
  spread=st.sampled_from([1.0, 10.0, 1e3]),
)
# A float16 element of 1000 x 100 overflows to inf, and its leaf comes out
# NaN in both programs.
@hypothesis.example(values=[0, 0, 3, 0], spread=1000.0)
@hypothesis.example(values=[5337, 5337, 0, 0], spread=1.0)
def test_clip_spikes_counts_stacked_leaves_as_each_leaf_alone(values, spread):
  steps, params = _spike_steps(values, spread)
  # Step 3 (before the reset at step 4) a spike of 100x, clipped wherever
  # the moment is nonzero: a moment of 0 is not judged, so the first step
  # clips nothing.
  steps[2] = [(100 * x).astype(x.dtype) for x in steps[2]]
  (outs, counts), alone = _SPIKES(steps, params)
  _check_as_each_leaf_alone(outs, counts, alone, threshold=SPIKES_THRESHOLD)
  assert float(counts[0]) == 0
  assert float(counts[2]) > 0


@fz.examples(6)
@hypothesis.given(
  values=st.lists(
    st.integers(0, 2**32 - 1), min_size=SPIKES_STEPS, max_size=SPIKES_STEPS
  ),
  spread=st.sampled_from([1.0, 10.0, 1e3]),
)
def test_clip_spikes_adaptive_counts_stacked_leaves_as_each_leaf_alone(
  values, spread
):
  """Leaves of their own part (the scalar, the empty leaf, a bfloat16
  gradient of its own dtype pair...) are counted next to their clip, the
  stacked ones in their parts: the sum is each leaf's count alone.
  """
  (outs, counts), alone = _ADAPTIVE(*_spike_steps(values, spread))
  # One ulp: compiled as the tests compile (fast_compile, optimization
  # level 0), a float16 output rounded from a tie came out one float16 ulp
  # apart in the stacked and the per-leaf program (values=[916726, 0, 148,
  # 747], spread=10: the element's limit reads 5.7675786 there,
  # 5.767578125 under the default compilation, whose outputs are equal).
  _check_as_each_leaf_alone(outs, counts, alone, ulps=1)


# SPAM and Stable-SPAM own their Adam moments: leaves of one size are stepped
# in packed vectors (compile time), the others one by one; each leaf's
# updates, moments and spikes are those it has alone.
WHOLE_LR = 0.5
_WHOLE = {
  "spam": lambda: optaxclip.spam(
    WHOLE_LR,
    threshold=3.0,
    b2=0.5,
    reset_interval=3,
    warmup_steps=1,
    grad_accu_steps=1,
    weight_decay=0.1,
  ),
  "stable_spam": lambda: optaxclip.stable_spam(
    WHOLE_LR, reset_interval=3, weight_decay=0.1
  ),
}


def _whole_program(steps, params, make):
  def run(steps_, params_):
    tx = make()
    state = tx.init(params_)
    outs = []
    for g in steps_:
      u, state = tx.update(g, state, params_)
      outs.append(u)
    return outs, state

  whole = run(steps, params)
  alone = [
    run([[step[i]] for step in steps], [params[i]]) for i in range(len(params))
  ]
  return whole, alone


_WHOLE_PROGRAMS = {
  name: fz.FastJit(functools.partial(_whole_program, make=make))
  for name, make in _WHOLE.items()
}


@fz.examples(6)
@hypothesis.given(
  name=st.sampled_from(sorted(_WHOLE)),
  values=st.lists(
    st.integers(0, 2**32 - 1), min_size=SPIKES_STEPS, max_size=SPIKES_STEPS
  ),
  spread=st.sampled_from([1.0, 10.0, 1e3]),
)
# An element 18 times smaller than its leaf's largest, 1.1e-6 apart relative
# to itself.
@hypothesis.example(name="spam", values=[0, 0, 8, 0], spread=1.0)
@hypothesis.example(
  name="stable_spam", values=[2475, 2475, 44276179, 65], spread=1000.0
)
def test_whole_optimizers_step_packed_leaves_as_each_leaf_alone(
  name, values, spread
):
  """The SPAM optimizers on SPIKES_LAYOUT (the (5,) float32 pair and the
  float16 leaves of 6 elements packed, the others alone): every update and,
  after the last step, every per-leaf entry of the state (moments, per-leaf
  vectors) equals that leaf's alone, through a reset: up to a few roundings
  of the leaf's largest element (XLA:CPU's vectorized division and square
  root on a packed vector may round an element differently from the scalar
  code of a leaf alone, and the moments carry it to the next steps).
  """

  def check(got, want, floor=0.0, dtype=None, roundings=16):
    # A few roundings of the leaf's largest element: an element near zero
    # may differ by more than a few of its own (1.1e-6 relative on an
    # element 18 times smaller than its leaf's largest).
    # Sixteen: Stable-SPAM's stages divide five times per leaf (the AdaClip
    # ratio, both bias corrections, the target, its quotient by the norm's
    # mantissa); a scalar leaf's update may be 9 float32 roundings apart
    # (values=[29, 0, 524287, 20330596], spread=10).
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype
    want64 = want.astype(np.float64)
    scale = max(np.max(np.abs(want64), initial=0.0), floor)
    np.testing.assert_allclose(
      got.astype(np.float64),
      want64,
      rtol=0,
      atol=roundings * fz.round_tol(dtype or want.dtype) * scale
      + fz.flush_atol(want.dtype),
    )

  (outs, state), alone = _WHOLE_PROGRAMS[name](*_spike_steps(values, spread))
  for t in range(SPIKES_STEPS):
    for i, a in enumerate(alone):
      # An update is -lr (direction + weight_decay p), terms of order lr
      # that may cancel (a scalar leaf's update of 1.8e-3, 1.7e-5 apart
      # relative, values=[1, 2, 0, 23], spread=1): roundings of lr, not of
      # the update.
      check(outs[t][i], a[0][t][0], floor=WHOLE_LR)
  tree = dict(jax.tree_util.tree_flatten_with_path(state)[0])
  compared = 0
  # The state after the last step, relative to itself: the roundings above
  # carried through four steps of the stages and Adam's moments (a scalar
  # leaf's first moment 2.8e-6 apart, 23 float32 roundings, values=[1, 88,
  # 184, 512], spread=1; on an Intel Xeon with
  # AVX-512, whose kernels round apart more often, 154 roundings: a scalar
  # leaf's moment -8.1e-4, 7.5e-9 apart, values=[2475, 2475, 44276179, 65],
  # spread=1000). A packing fault (a wrong row or element) is off by its
  # whole size.
  check = functools.partial(check, roundings=256)
  for i, (_, state_alone) in enumerate(alone):
    for path, v in jax.tree_util.tree_flatten_with_path(state_alone)[0]:
      if isinstance(path[-1], jax.tree_util.SequenceKey):
        # A moment: a list of leaves; the tree's has leaf i at index i.
        check(tree[path[:-1] + (jax.tree_util.SequenceKey(i),)], v)
        compared += 1
      elif np.shape(v) == (1,):  # one entry per leaf
        # Computed from the leaf's clipped gradient, which may differ by a
        # rounding of the leaf's dtype (a float16 output on a tie): as
        # close as that dtype's roundings.
        check(
          np.asarray(tree[path])[i],
          np.asarray(v)[0],
          dtype=fz.DTYPES[SPIKES_LAYOUT[i][1]],
        )
  assert compared >= 2 * len(SPIKES_LAYOUT)


# --------------------------------------------------------------------------
# The moments are updated in place, not copied first
# --------------------------------------------------------------------------


def _moment_copies(tx, tree) -> list[str]:
  """The copies of moments (arrays of a leaf's shape, not scalars) in the
  compiled, donated step. Not of scale_by_norm_ema's vectors ``mu`` and
  ``nu`` (one entry per leaf, a few bytes): ``nu`` is kept at the scale of
  the old ``mu`` and rescaled to the new one's, so that two kernels read
  the old ``mu`` (and ``nu``, kept with the new ``mu``), one writing it,
  and XLA copies it first.
  """

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  text = (
    jax.jit(step, donate_argnums=(0, 1))
    .lower(tree, tx.init(tree), tree)
    .compile()
    .as_text()
  )
  entry = text[text.index("ENTRY") :]
  return [
    line.strip()
    for line in entry.splitlines()
    if " copy(" in line
    and "[]" not in line.split(" copy(")[0]
    and not line.split(" copy(")[1].startswith(("%s_1__mu.", "%s_1__nu."))
  ]


_MAKERS = {
  "clip_spikes": lambda: optax.chain(optaxclip.clip_spikes(), optax.adam(1e-3)),
  "spam": lambda: optaxclip.spam(1e-3),
  "stable_spam": lambda: optaxclip.stable_spam(1e-3),
}


@fz.examples(4)
@hypothesis.given(
  name=st.sampled_from(sorted(_MAKERS)),
  shapes=st.lists(
    st.sampled_from(((3, 4), (5,), (3, 4), (70000,), (2, 3, 4))),
    min_size=1,
    max_size=5,
  ),
  dtype=st.sampled_from(("float32", "bfloat16")),
)
# Stacked small leaves beside a leaf of its own, for both that copied.
@hypothesis.example(
  name="clip_spikes", shapes=[(3, 4), (3, 4), (70000,)], dtype="float32"
)
@hypothesis.example(
  name="spam", shapes=[(3, 4), (3, 4), (70000,)], dtype="bfloat16"
)
def test_donated_moments_are_updated_in_place(name, shapes, dtype):
  """The compiled, donated step of clip_spikes (chained before adam), spam
  and stable_spam copies no array: every read of a stored moment (the
  clip, the count of spikes, stacked or per leaf) comes before its
  in-place update. Were the clip fused into each consumer, each would read
  the old moment again and XLA would copy every moment of clip_spikes and
  spam first (clip_spikes' step on the transformer tree: 3.6x adam's with
  the copies, 2.8x without).
  """
  tree = {
    f"leaf{i}": np.ones(shape, fz.DTYPES[dtype])
    for i, shape in enumerate(shapes)
  }
  copies = _moment_copies(_MAKERS[name](), fz.to_jax(tree))
  assert not copies, copies


# --- the Stable-SPAM stages on finite leaves of any magnitude ---------------


def _stages(steps):
  """clip_spikes_adaptive and scale_by_norm_ema, each alone, over ``steps``
  (one leaf each): the outputs of each stage per step.
  """
  adaptive, norm_ema = (
    optaxclip.clip_spikes_adaptive(),
    optaxclip.scale_by_norm_ema(),
  )
  a_state, n_state = adaptive.init(steps[0]), norm_ema.init(steps[0])
  a_outs, n_outs = [], []
  for g in steps:
    out, a_state = adaptive.update(g, a_state)
    a_outs.append(out)
    out, n_state = norm_ema.update(g, n_state)
    n_outs.append(out)
  return a_outs, n_outs


def _stages_derivative(g):
  """The derivative of the sum of both stages' first update at ``g``."""
  tx = optax.chain(
    optaxclip.clip_spikes_adaptive(), optaxclip.scale_by_norm_ema()
  )
  return jax.grad(lambda x: jax.numpy.sum(tx.update(x, tx.init(x))[0]))(g)


@fz.examples(8)
@hypothesis.given(
  dtype=st.sampled_from(fz.REAL),
  shape=st.sampled_from(((3,), (2, 3), (5,))),
  data=st.data(),
)
def test_stable_spam_stages_keep_finite_leaves_finite(dtype, shape, data):
  """On finite leaves of any magnitude (subnormal to the dtype's largest),
  clip_spikes_adaptive and scale_by_norm_ema give finite updates that keep
  each element's sign, clip_spikes_adaptive passes the first step as it is
  (its limit is then max|g|) and never enlarges an element, and the
  derivative of both stages is finite: clip_spikes_adaptive's limit does
  not underflow (a leaf below about 1e-35 would come out NaN),
  scale_by_norm_ema's bias-corrected EMA does not round to inf (leaves of
  norm above 1.8e19 would come out zero), and their derivatives near 1e-20
  are not NaN or -inf.
  """
  with fz.x64([dtype]):
    steps = [
      data.draw(fz.arrays(dtype, shape, magnitudes="all")) for _ in range(3)
    ]
    a_outs, n_outs = _stages(fz.to_jax(steps))
    for t, (g, a, n) in enumerate(zip(steps, a_outs, n_outs)):
      x = np.asarray(g, np.float64)
      for out in (a, n):
        assert np.asarray(out).dtype == np.asarray(g).dtype
        y = np.asarray(out).astype(np.float64)
        assert np.all(np.isfinite(y)), (t, y)
        assert np.all((np.sign(y) == np.sign(x)) | (y == 0)), (t, x, y)
      y = np.asarray(a).astype(np.float64)
      if t == 0:
        np.testing.assert_array_equal(y, x)
      tol = fz.round_tol(dtype) * np.abs(x) + fz.flush_atol(dtype)
      assert np.all(np.abs(y) - np.abs(x) <= tol), (t, x, y)
    if dtype in ("float32", "float64") and np.all(np.isfinite(steps[0])):
      d = np.asarray(_stages_derivative(fz.to_jax(steps[0])))
      assert np.all(np.isfinite(d)), d


@fz.examples(4)
@hypothesis.given(
  name=st.sampled_from(("clip_spikes", "spam")),
  position=st.integers(0, 2),
  value=st.sampled_from((np.inf, -np.inf)),
)
def test_an_infinite_element_is_not_clipped_to_a_finite_one(
  name, position, value
):
  """clip_spikes and spam do not clip an infinite element to the finite
  ``sqrt(threshold nu)`` (as the reference does), which would hide it from
  guard: by the non-finite policy it comes out NaN, and the other elements
  as they would without it.
  """
  tx = (
    optaxclip.clip_spikes(grad_accu_steps=2)
    if name == "clip_spikes"
    else optaxclip.spam(1e-2, grad_accu_steps=2)
  )
  params = {"w": jax.numpy.zeros(3)}
  state = tx.init(params)
  ordinary = {"w": jax.numpy.array([1.0, -2.0, 3.0])}
  for _ in range(3):
    _, state = tx.update(ordinary, state, params)
  bad = np.array([1.0, -2.0, 3.0], np.float32)
  bad[position] = value
  out, _ = tx.update({"w": jax.numpy.asarray(bad)}, state, params)
  same, _ = tx.update(ordinary, state, params)
  got, want = np.asarray(out["w"]), np.asarray(same["w"])
  assert np.isnan(got[position])
  others = [i for i in range(3) if i != position]
  np.testing.assert_array_equal(got[others], want[others])


@fz.examples(4)
@hypothesis.given(
  name=st.sampled_from(("clip_spikes", "spam")),
  at=st.integers(0, 4),
)
def test_a_nan_threshold_from_a_schedule_gives_a_nan_update(name, at):
  """A NaN from the ``threshold`` schedule makes that step's update NaN,
  every coordinate counted (the rule of every clipper's schedules), and
  the other steps as they would be: the NaN does not switch spike clipping
  off for the step (a spike of 100 would pass).
  """

  def schedule(count):
    return jax.numpy.where(count == at, jax.numpy.nan, 5000.0)

  def make(threshold):
    if name == "clip_spikes":
      return optaxclip.clip_spikes(threshold, grad_accu_steps=2)
    return optaxclip.spam(1e-2, threshold=threshold, grad_accu_steps=2)

  params = {"w": jax.numpy.zeros(2)}
  tx, plain = make(schedule), make(5000.0)
  state, plain_state = tx.init(params), plain.init(params)
  for step in range(5):
    g = {"w": jax.numpy.array([1.0, 100.0 if step == at else 2.0])}
    out, state = tx.update(g, state, params)
    want, plain_state = plain.update(g, plain_state, params)
    got = np.asarray(out["w"])
    if step == at:
      assert np.all(np.isnan(got)), (step, got)
      clipped = state.clipped if name == "clip_spikes" else state[0].clipped
      assert float(clipped) == 2.0
    elif step < at:
      np.testing.assert_array_equal(got, np.asarray(want["w"]))
    elif name == "clip_spikes":
      # Its nu took the NaN in: those coordinates pass unclipped (finite)
      # until the next reset. spam's Adam moments took it in too, as
      # optax.adam's would: its later updates are NaN until the reset.
      assert np.all(np.isfinite(got)), (step, got)


# --- scale_by_norm_ema at every scale -----------------------------------------


@functools.cache
def _norm_ema_step(reset_interval):
  tx = optaxclip.scale_by_norm_ema(
    0.7, 0.9, eps=0.0, reset_interval=reset_interval
  )
  return tx, fz.FastJit(tx.update)


@fz.examples(10)
@hypothesis.given(
  x64=st.booleans(),
  streams=st.lists(
    st.tuples(
      *[st.one_of(st.floats(0.5, 2.0), st.floats(4.0, 1000.0), st.just(0.0))]
      * 2
    ),
    min_size=2,
    max_size=10,
  ),
  k=st.integers(-1000, 1000),
  reset_interval=st.sampled_from([None, 3]),
)
@hypothesis.example(
  x64=False,
  streams=[(1.0, 2.0), (1.1, 2.0), (10.0, 0.5)],
  k=70,
  reset_interval=None,
)
@hypothesis.example(
  x64=False,
  streams=[(1.0, 2.0), (1.1, 2.0), (10.0, 0.5)],
  k=-90,
  reset_interval=None,
)
def test_norm_ema_rescales_a_stream_scaled_by_a_power_of_two_alike(
  x64, streams, k, reset_interval
):
  """scale_by_norm_ema (eps=0) takes each leaf to the norm m_hat /
  sqrt(v_hat) of its recent norms, a ratio: on leaves whose norms are
  ``stream * 2**k`` (within the dtype's range) it returns the updates it
  returns on ``stream``. ``v`` is kept scaled: capped at float32's largest
  value, norms of 1e20 would come out as 5.4 and norms of 1e30 as 5.4e10
  (where norms of 1 come out as 1), and below about 1e-19 every leaf at
  norm 1, spikes included.
  """
  dtype = np.float64 if x64 else np.float32
  info = np.finfo(dtype)
  k = int(np.clip(k, info.minexp + 32, info.maxexp - 13))
  tx, update = _norm_ema_step(reset_interval)

  def run(k):
    state = tx.init({"a": np.zeros(1, dtype), "b": np.zeros(2, dtype)})
    outs = []
    for a, b in streams:
      g = {
        "a": np.asarray([-math.ldexp(a, k)], dtype),
        "b": np.asarray([0.0, math.ldexp(b, k)], dtype),
      }
      u, state = update(g, state)
      outs.append((u, float(state.norm), float(state.scaled_norm)))
    return outs

  with jax.enable_x64(x64):
    want, got = run(0), run(k)
  for step, ((u0, n0, s0), (u1, n1, s1)) in enumerate(zip(want, got)):
    where = str((dtype.__name__, k, streams, step))
    for a, b in zip(jax.tree.leaves(u0), jax.tree.leaves(u1)):
      np.testing.assert_allclose(b, a, rtol=1e-6, atol=0, err_msg=where)
    np.testing.assert_allclose(s1, s0, rtol=1e-6, err_msg=where)
    if abs(k) < 100:  # state.norm is float32 for any dtype
      np.testing.assert_allclose(
        n1, math.ldexp(n0, k), rtol=1e-6, err_msg=where
      )


NORM_EMA_STEPS = 1200


@functools.cache
def _norm_ema_scan(g1, g2, eps):
  """jit(norms -> output norms) of scale_by_norm_ema on a leaf of 4
  elements over NORM_EMA_STEPS steps (lax.scan: one program).
  """
  tx = optaxclip.scale_by_norm_ema(g1, g2, eps=eps)

  def run(norms):
    def step(state, n):
      g = {"a": jnp.full((4,), n / 2, norms.dtype)}
      u, state = tx.update(g, state)
      return state, jnp.linalg.norm(u["a"])

    state = tx.init({"a": jnp.zeros((4,), norms.dtype)})
    return jax.lax.scan(step, state, norms)[1]

  return jax.jit(run)


def _norm_ema_oracle(norms, g1, g2, eps):
  """Per step, the norm scale_by_norm_ema gives the leaf, in float64:
  ``m_hat / (sqrt(v_hat) + eps)`` for a nonzero norm, else 0.
  """
  m = v = 0.0
  out = []
  for t, n in enumerate(norms, 1):
    m = g1 * m + (1 - g1) * n
    v = g2 * v + (1 - g2) * n * n
    m_hat, v_hat = m / (1 - g1**t), v / (1 - g2**t)
    out.append(m_hat / (math.sqrt(v_hat) + eps) if n > 0 else 0.0)
  return np.asarray(out)


@fz.examples(6)
@hypothesis.given(
  gammas=st.sampled_from([(0.7, 0.9), (0.5, 0.999), (0.9, 0.999), (0.9, 0.5)]),
  eps=st.sampled_from([0.0, 1e-8]),
  runs=st.lists(
    st.tuples(
      st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.5, 1000.0]),
      st.integers(1, 400),
    ),
    min_size=1,
    max_size=6,
  ),
  k=st.integers(-40, 40),
)
@hypothesis.example(
  gammas=(0.5, 0.999), eps=0.0, runs=[(1.0, 50), (0.0, 150), (1.0, 5)], k=0
)
def test_norm_ema_after_runs_of_zero_norms_equals_the_oracle(
  gammas, eps, runs, k
):
  """scale_by_norm_ema over runs of constant norms, zeros among them (a
  frozen leaf, a loss switched off by a schedule), equals a float64 oracle.
  With gamma1 < gamma2, m decays faster than v over zero norms; at m = 0
  the scaled v (kept with m's exponent) would saturate and lose its
  history, and the leaf come back at norm 6.7 where it should be 1.03
  (gammas 0.5, 0.999, 150 zero steps). ``m`` is kept at least 2**-22 of
  sqrt(v) above 0: a target within about 2**-21 of the oracle's on the
  first step back.
  """
  g1, g2 = gammas
  norms = [math.ldexp(n, k) for n, r in runs for _ in range(r)]
  norms = (norms + [0.0] * NORM_EMA_STEPS)[:NORM_EMA_STEPS]
  got = np.asarray(
    _norm_ema_scan(g1, g2, eps)(np.asarray(norms, np.float32)), np.float64
  )
  want = _norm_ema_oracle(np.asarray(norms, np.float32), g1, g2, eps)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=2.0**-18)


# --- squares beyond the dtype's range -------------------------------------


@functools.cache
def _square_edge_step(name, dtype):
  tx = {
    "clip_spikes": lambda: optaxclip.clip_spikes(
      4.0, b2=0.5, reset_interval=10**6, grad_accu_steps=2
    ),
    "spam": lambda: optaxclip.spam(
      1e-3, b2=0.5, threshold=4.0, reset_interval=10**6, grad_accu_steps=2
    ),
  }[name]()
  return tx, fz.FastJit(tx.update)


def _nu_of(state):
  """The ``nu`` field of the first state in ``state`` that has one."""
  if hasattr(state, "nu"):
    return state.nu
  return next(
    _nu_of(s) for s in state if hasattr(s, "nu") or isinstance(s, tuple)
  )


@fz.examples(8)
@hypothesis.given(
  name=st.sampled_from(["clip_spikes", "spam"]),
  dtype=st.sampled_from(["float16", "float32"]),
  huge=st.floats(0.0625, 1.0),
  ordinary=st.lists(st.floats(0.5, 2.0), min_size=1, max_size=6),
)
def test_a_square_beyond_the_range_leaves_the_moment_finite(
  name, dtype, huge, ordinary
):
  """A finite element whose square overflows the dtype (above 256 in
  float16, about 1.8e19 in float32), on a step before clipping starts,
  leaves the second moment finite and every update finite (an inf moment
  would make every later ``g^2 > threshold nu`` false: clipping off until
  the next reset).
  """
  np_dtype = fz.DTYPES[dtype]
  big = float(np.finfo(np_dtype).max) * huge
  tx, update = _square_edge_step(name, dtype)
  params = {"w": np.zeros(3, np_dtype)}
  state = tx.init(fz.to_jax(params))
  steps = [big] + ordinary + [100.0]
  for t, value in enumerate(steps):
    g = fz.to_jax({"w": np.asarray([value, -value, value / 2], np_dtype)})
    out, state = update(g, state, params)
    assert np.all(np.isfinite(np.asarray(out["w"], np.float64))), (t, out)
    nu = _nu_of(state)
    assert np.all(np.isfinite(np.asarray(nu["w"], np.float64))), (t, nu)


@fz.examples(6)
@hypothesis.given(
  name=st.sampled_from(["clip_spikes", "spam"]),
  dtype=st.sampled_from(["float16", "float32"]),
  small=st.floats(1e-4, 5e-3),
  steps=st.integers(3, 6),
)
def test_an_element_whose_moment_is_zero_is_not_zeroed(
  name, dtype, small, steps
):
  """Steady float16 elements, the smaller ones too small for their squared
  term to be represented (with this b2 = 0.5, below about 2.4e-4: the
  moment stays 0), and an element that was 0 until the last step, are not
  clipped: SPAM's reference clips a coordinate against a zero moment to 0,
  which zeroes such elements at every step (float16 gradients of 1e-3,
  for clip_spikes).
  """
  np_dtype = fz.DTYPES[dtype]
  tx, update = _square_edge_step(name, dtype)
  params = {"w": np.zeros(3, np_dtype)}
  state = tx.init(fz.to_jax(params))
  for t in range(steps):
    last = small if t == steps - 1 else 0.0
    g = np.asarray([small, -small, last], np_dtype)
    out, state = update(fz.to_jax({"w": g}), state, params)
  if name == "clip_spikes":
    np.testing.assert_array_equal(np.asarray(out["w"]), g)
  else:  # Adam's step: nonzero in every coordinate, with g's sign
    assert np.all(np.sign(np.asarray(out["w"], np.float64)) == -np.sign(g))
