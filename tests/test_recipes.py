"""The recipes of docs/update_side.md: clipping the update, and gradient
accumulation (``optax.MultiSteps``, ``optax.microbatching``) with every
family of clipper (static, adaptive, guard, SPAM).

Accumulation: the statistics advance once per optimizer step; ``k``
microbatches of equal size give the full batch's step (1e-6); a non-finite
microbatch is kept out by ``should_skip_update_fn=optax.skip_not_finite``
(the guard never sees it), and without it reaches the guard, whose counters
say so.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.microbatching
import pytest

import optaxclip

K = 4  # microbatches per optimizer step
BATCH = 8
STEPS = 3
LR = 1e-2


def _loss(params, x, y):
  pred = x @ params["w"] + params["b"]
  return jnp.mean((pred - y) ** 2)


_grad = jax.jit(jax.grad(_loss))


def _params():
  return {"w": jnp.asarray([0.5, -0.2, 0.1]), "b": jnp.asarray(0.3)}


def _batches(seed=0, steps=STEPS):
  """Full batches; the second one is a spike (targets 100x larger)."""
  rng = np.random.default_rng(seed)
  out = []
  for t in range(steps):
    x = rng.normal(size=(BATCH, 3)).astype(np.float32)
    y = rng.normal(size=BATCH).astype(np.float32) * (100.0 if t == 1 else 1.0)
    out.append((jnp.asarray(x), jnp.asarray(y)))
  return out


def _micro(x, y):
  size = BATCH // K
  return [
    (x[i * size : (i + 1) * size], y[i * size : (i + 1) * size])
    for i in range(K)
  ]


FAMILIES = {
  "static": lambda: optax.chain(optaxclip.clip_global(1.0), optax.adam(LR)),
  "adaptive": lambda: optax.chain(
    optaxclip.clip_zscore(warmup_steps=1, spike_z=1.0), optax.adam(LR)
  ),
  "guard": lambda: optaxclip.guard(optax.adam(LR), max_norm=1e3),
  "spam": lambda: optaxclip.spam(
    LR, threshold=1.0, reset_interval=100, warmup_steps=0, grad_accu_steps=0
  ),
}


def _counter(state) -> int:
  """Steps the family's state has seen (its own count)."""
  found = []

  def visit(node):
    for name in ("count", "step"):
      value = getattr(node, name) if name in node._fields else None
      if isinstance(value, jax.Array) and value.shape == ():
        found.append(int(value))
        return

  for node in jax.tree.leaves(
    state,
    is_leaf=lambda n: (
      hasattr(n, "_fields") and type(n).__name__ != "MultiStepsState"
    ),
  ):
    visit(node)
  return max(found)


def _full_run(tx, batches):
  params, state = _params(), tx.init(_params())
  for x, y in batches:
    updates, state = tx.update(_grad(params, x, y), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _close(a, b, tol=1e-6):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol)


def _close_stats(a, b, tol=1e-6):
  assert list(a) == list(b)
  for key in a:
    np.testing.assert_allclose(
      np.asarray(a[key], np.float64),
      np.asarray(b[key], np.float64),
      rtol=tol,
      atol=tol,
      err_msg=key,
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_multisteps_k_microbatches_equal_one_full_batch(family):
  batches = _batches()
  want_params, want_state = _full_run(FAMILIES[family](), batches)
  tx = optax.MultiSteps(FAMILIES[family](), every_k_schedule=K)
  params, state = _params(), tx.init(_params())
  update = jax.jit(tx.update)
  for x, y in batches:
    for xm, ym in _micro(x, y):
      updates, state = update(_grad(params, xm, ym), state, params)
      params = optax.apply_updates(params, updates)
  _close(params, want_params)
  # The statistics advanced once per optimizer step, not per microbatch.
  assert _counter(state.inner_opt_state) == STEPS
  _close_stats(optaxclip.stats(state), optaxclip.stats(want_state))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_microbatching_gives_the_full_batch_gradient(family):
  batches = _batches()
  want_params, want_state = _full_run(FAMILIES[family](), batches)
  grad_fn = optax.microbatching.microbatch(
    jax.grad(_loss),
    argnums=(1, 2),
    microbatch_size=BATCH // K,
    accumulator=optax.microbatching.AccumulationType.MEAN,
  )
  tx = FAMILIES[family]()
  params, state = _params(), tx.init(_params())
  for x, y in batches:
    g = jax.jit(grad_fn)(params, x, y)
    _close(g, _grad(params, x, y), tol=1e-5)
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  _close(params, want_params, tol=1e-5)
  assert _counter(state) == STEPS
  _close_stats(optaxclip.stats(state), optaxclip.stats(want_state), tol=1e-5)


def _with_a_nan_microbatch(x, y):
  micro = _micro(x, y)
  bad = (micro[0][0].at[0, 0].set(jnp.nan), micro[0][1])
  return [micro[0], bad, *micro[1:]]  # K finite ones and a NaN one


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_skip_not_finite_keeps_a_nan_microbatch_out(family):
  batches = _batches()
  want_params, want_state = _full_run(FAMILIES[family](), batches)
  tx = optax.MultiSteps(
    FAMILIES[family](),
    every_k_schedule=K,
    should_skip_update_fn=optax.skip_not_finite,
  )
  params, state = _params(), tx.init(_params())
  update = jax.jit(tx.update)
  skipped = 0
  for x, y in batches:
    for xm, ym in _with_a_nan_microbatch(x, y):
      updates, state = update(_grad(params, xm, ym), state, params)
      params = optax.apply_updates(params, updates)
      skipped += int(state.skip_state["should_skip"])
  assert skipped == STEPS  # one NaN microbatch a step, each kept out
  _close(params, want_params)
  _close_stats(optaxclip.stats(state), optaxclip.stats(want_state))
  if family == "guard":  # the guard never saw a non-finite gradient
    guard = state.inner_opt_state
    assert (int(guard.counts.skipped), int(guard.counts.nonfinite)) == (0, 0)


def test_without_skip_the_guard_skips_the_step_and_counts_it():
  batches = _batches()
  tx = optax.MultiSteps(FAMILIES["guard"](), every_k_schedule=K + 1)
  params, state = _params(), tx.init(_params())
  for x, y in batches[:1]:
    for xm, ym in _with_a_nan_microbatch(x, y):
      updates, state = tx.update(_grad(params, xm, ym), state, params)
      params = optax.apply_updates(params, updates)
  _close(params, _params())  # the accumulated step was skipped
  logs = optaxclip.stats(state)
  assert int(logs["guard/skipped"]) == 1
  assert int(logs["guard/nonfinite"]) == 1
  assert "non-finite" in " ".join(
    optaxclip.explain(state)
  ) or "nan" in " ".join(optaxclip.explain(state))


# --- Clipping the update ----------------------------------------------------


def test_a_clipper_after_the_optimizer_clips_the_update():
  params = _params()
  g = _grad(params, *_batches()[1])
  tx = optax.chain(optax.adam(LR), optaxclip.clip_global(1e-3))
  updates, state = tx.update(g, tx.init(params), params)
  raw, _ = optax.adam(LR).update(g, optax.adam(LR).init(params), params)
  raw_norm = float(optax.global_norm(raw))
  assert raw_norm > 1e-3
  np.testing.assert_allclose(float(optax.global_norm(updates)), 1e-3, 1e-6)
  _close(updates, jax.tree.map(lambda u: u * 1e-3 / raw_norm, raw))
  np.testing.assert_allclose(
    float(optaxclip.stats(state)["clip_global/norm"]), raw_norm, 1e-6
  )


def test_adafactor_style_rms_clipping_of_the_update():
  """optax.adafactor clips the update's RMS with optax.clip_by_block_rms
  after its second-moment scaling; clip_block_rms in its place gives the
  same steps, and its statistics.
  """
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)}
  theirs = optax.adafactor(
    LR, clipping_threshold=1.0, multiply_by_parameter_scale=False
  )
  ours = optax.chain(
    optax.scale_by_factored_rms(),
    optaxclip.clip_block_rms(1.0),
    optax.scale_by_learning_rate(LR),
  )
  p_theirs, s_theirs = params, theirs.init(params)
  p_ours, s_ours = params, ours.init(params)
  for t in range(4):
    g = {"w": jnp.asarray(rng.normal(size=(6, 4)) * (50 if t == 2 else 1))}
    u, s_theirs = theirs.update(g, s_theirs, p_theirs)
    p_theirs = optax.apply_updates(p_theirs, u)
    u, s_ours = ours.update(g, s_ours, p_ours)
    p_ours = optax.apply_updates(p_ours, u)
    _close(p_ours, p_theirs)
  assert "clip_block_rms/clip_fraction" in optaxclip.stats(s_ours)


def test_two_clippers_in_one_chain_are_told_apart():
  params = _params()
  g = _grad(params, *_batches()[1])
  tx = optax.chain(
    optaxclip.clip_global(1.0),
    optax.adam(LR),
    optaxclip.clip_global(1e-3),
    optaxclip.watch(),
  )
  _, state = tx.update(g, tx.init(params), params)
  logs = optaxclip.stats(state)
  assert {
    "0/clip_global/norm",
    "2/clip_global/norm",
    "watch/update_norm",
  } <= set(logs)
  named = optax.named_chain(
    ("grads", optaxclip.clip_global(1.0)),
    ("adam", optax.adam(LR)),
    ("update", optaxclip.clip_global(1e-3)),
  )
  _, state = named.update(g, named.init(params), params)
  logs = optaxclip.stats(state)
  assert {"grads/clip_global/norm", "update/clip_global/norm"} <= set(logs)
  assert logs["update/clip_global/norm"] < logs["grads/clip_global/norm"]
