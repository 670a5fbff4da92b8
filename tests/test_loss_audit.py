"""The ghost method's soundness: every parameter the traced loss reads
outside one supported layer call takes the exact path (each model below
broke the per-example bound before the audit), models that mix examples are
refused, and bad input is refused at the call.

Each model is checked against ``method="vmap"`` (the exact reference): the
norms to 1e-5, and with a batch of one the clipped sum's norm within
``l2_clip``.
"""

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fast_compile import run_fast
import optaxclip

RNG = np.random.default_rng(0)


def _norm(tree) -> float:
  return float(
    np.sqrt(
      sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree))
    )
  )


def check_sound(loss, params, batch, clip=1.0):
  """Ghost against vmap: the norms, the clipped sums, and for each example
  alone the clipped gradient's norm within ``clip``. Returns the plan.
  """
  argnums = tuple(range(1, 1 + len(batch)))
  out = {}
  for method in ("ghost", "vmap"):
    fn = optaxclip.clipped_grad(
      loss, clip, method=method, batch_argnums=argnums
    )
    out[method] = run_fast(fn, params, *batch)
  np.testing.assert_allclose(out["ghost"][1], out["vmap"][1], rtol=1e-5)
  want = jax.tree.leaves(out["vmap"][0])
  scale = max(float(np.max(np.abs(w))) for w in want)
  for g, w in zip(jax.tree.leaves(out["ghost"][0]), want):
    np.testing.assert_allclose(g, w, atol=1e-5 * scale)
  one = optaxclip.clipped_grad(loss, clip, batch_argnums=argnums)
  step = jax.jit(one)
  for b in range(batch[0].shape[0]):
    grads, norms = step(params, *(x[b : b + 1] for x in batch))
    assert _norm(grads) <= clip * (1 + 1e-6), (b, _norm(grads), norms)
  return one.plan(params, *batch)


def _exact(plan, *names):
  for name in names:
    hits = [k for k in plan.fallback if name in k]
    assert hits, (name, str(plan))
    for k in hits:
      assert plan.reasons[k], k


class TiedByAttribute(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    emb = nn.Embed(11, 8, name="emb")
    h = nn.Dense(8)(jnp.tanh(emb(tokens)))
    return jnp.sum((h @ emb.embedding.T) ** 2, axis=(1, 2))


def test_tied_embedding_read_by_attribute_linen():
  tokens = RNG.integers(0, 11, (3, 5))
  model = TiedByAttribute()
  params = run_fast(model.init, jax.random.PRNGKey(0), tokens)
  plan = check_sound(model.apply, params, (tokens,))
  _exact(plan, "['emb']['embedding']")
  assert "transpose" in plan.reasons["['params']['emb']['embedding']"]
  assert "['params']['Dense_0']['kernel']" in plan.ghosted


def test_tied_embedding_read_by_attribute_nnx():
  class Tied(nnx.Module):
    def __init__(self, rngs):
      self.emb = nnx.Embed(11, 8, rngs=rngs)
      self.dense = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, tokens):
      h = self.dense(jnp.tanh(self.emb(tokens)))
      return jnp.sum((h @ self.emb.embedding[...].T) ** 2, axis=(1, 2))

  graphdef, params = nnx.split(Tied(nnx.Rngs(0)), nnx.Param)
  tokens = RNG.integers(0, 11, (3, 5))
  plan = check_sound(lambda p, t: nnx.merge(graphdef, p)(t), params, (tokens,))
  _exact(plan, "['emb']['embedding']")
  assert sorted(plan.ghosted) == [
    "['dense']['bias'].value",
    "['dense']['kernel'].value",
  ]


class ScanBroadcast(nn.Module):
  @nn.compact
  def __call__(self, x):
    def body(cell, c, x_t):
      c = jnp.tanh(cell(c) + x_t)
      return c, c

    scan = nn.scan(
      body,
      variable_broadcast="params",
      split_rngs={"params": False},
      in_axes=1,
      out_axes=1,
    )
    _, ys = scan(nn.Dense(4), jnp.zeros((x.shape[0], 4)), x)
    return jnp.sum(ys**2, axis=(1, 2))


def test_scan_with_broadcast_parameters():
  x = 3 * RNG.normal(size=(3, 6, 4)).astype(np.float32)
  model = ScanBroadcast()
  params = run_fast(model.init, jax.random.PRNGKey(1), x)
  plan = check_sound(model.apply, params, (x,))
  _exact(plan, "['Dense_0']['kernel']", "['Dense_0']['bias']")


@pytest.mark.parametrize("cell", [nn.SimpleCell, nn.GRUCell])
def test_rnn_cells(cell):
  x = 3 * RNG.normal(size=(3, 6, 4)).astype(np.float32)
  rnn = nn.RNN(cell(5))
  params = run_fast(rnn.init, jax.random.PRNGKey(2), x)

  def loss(p, x):
    return jnp.sum(rnn.apply(p, x) ** 2, axis=(1, 2))

  plan = check_sound(loss, params, (x,))
  assert plan.ghosted == []
  assert any("scan" in why for why in plan.reasons.values())


class VmapBroadcast(nn.Module):
  per_member: bool = False

  @nn.compact
  def __call__(self, x):
    axes = {"params": 1 if self.per_member else None}
    dense = nn.vmap(
      nn.Dense,
      variable_axes=axes,
      split_rngs={"params": self.per_member},
      in_axes=1,
      out_axes=1,
    )(3)
    return jnp.sum(dense(x) ** 2, axis=(1, 2))


@pytest.mark.parametrize("per_member", [False, True])
def test_vmap_over_a_dense(per_member):
  x = 3 * RNG.normal(size=(3, 4, 5)).astype(np.float32)
  model = VmapBroadcast(per_member)
  params = run_fast(model.init, jax.random.PRNGKey(3), x)
  plan = check_sound(model.apply, params, (x,))
  _exact(plan, "['kernel']")
  assert "vmap" in plan.reasons["['params']['VmapDense_0']['kernel']"]


class _Block(nn.Module):
  @nn.compact
  def __call__(self, c, _):
    return jnp.tanh(nn.Dense(4)(c)), None


class Stacked(nn.Module):
  @nn.compact
  def __call__(self, x):
    scan = nn.scan(
      _Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
    )
    h, _ = scan()(x, None)
    return jnp.sum(h**2, axis=1)


def test_stacked_scan_stays_ghosted():
  x = RNG.normal(size=(3, 4)).astype(np.float32)
  model = Stacked()
  params = run_fast(model.init, jax.random.PRNGKey(4), x)
  plan = check_sound(model.apply, params, (x,))
  assert plan.fallback == []


def test_parameters_transformed_before_use():
  x = RNG.normal(size=(3, 4)).astype(np.float32)
  model = nn.Dense(2)
  params = run_fast(model.init, jax.random.PRNGKey(5), x)

  def loss(p, x):
    p = jax.tree.map(lambda w: 1.5 * w, p)
    return jnp.sum(model.apply(p, x) ** 2, axis=1)

  plan = check_sound(loss, params, (x,))
  assert plan.ghosted == []
  assert "mul" in plan.reasons["['params']['kernel']"]


def test_plan_reads_per_parameter():
  x = RNG.normal(size=(3, 4)).astype(np.float32)
  model = nn.Dense(2)
  params = run_fast(model.init, jax.random.PRNGKey(5), x)
  plan = optaxclip.clipped_grad(
    lambda p, x: jnp.sum(model.apply(p, x) ** 2, axis=1), 1.0
  ).plan(params, x)
  lines = str(plan).splitlines()
  assert len(lines) == 2
  assert all(" ghost: Dense" in line for line in lines)


# --------------------------------------------------------- mixing examples


class BatchStats(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x))
    return jnp.sum(h**2, axis=1)


@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_batch_norm_with_batch_statistics_is_refused(method):
  x = RNG.normal(size=(4, 3)).astype(np.float32)
  model = BatchStats()
  variables = model.init(jax.random.PRNGKey(0), x)

  def loss(p, x):
    out, _ = model.apply(
      {"params": p, "batch_stats": variables["batch_stats"]},
      x,
      mutable=["batch_stats"],
    )
    return out

  fn = optaxclip.clipped_grad(loss, 1.0, method=method)
  with pytest.raises(ValueError, match=r"mixes examples: `reduce_sum`"):
    fn(variables["params"], x)


@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_loss_normalised_by_a_batch_statistic_is_refused(method):
  x = RNG.normal(size=(4, 3)).astype(np.float32)

  def loss(w, x):
    losses = (x @ w) ** 2
    return losses / jnp.mean(losses)

  fn = optaxclip.clipped_grad(loss, 1.0, method=method)
  with pytest.raises(ValueError, match=r"test_loss_audit.py"):
    fn(jnp.ones(3), x)


def test_an_auxiliary_batch_mean_is_no_mixing():
  x = RNG.normal(size=(4, 3)).astype(np.float32)

  def loss(w, x):
    losses = (x @ w) ** 2
    return losses, losses.mean()

  fn = optaxclip.clipped_grad(loss, 1.0, has_aux=True)
  _, norms, aux = run_fast(fn, jnp.ones(3), x)
  assert norms.shape == (4,) and aux.shape == ()


def test_time_major_input_is_refused_with_a_hint():
  # (T, B, d) with T == B: the leading axis looks like the batch.
  x = RNG.normal(size=(4, 4, 3)).astype(np.float32)
  rnn = nn.RNN(nn.SimpleCell(5), time_major=True)
  params = rnn.init(jax.random.PRNGKey(0), x)

  def loss(p, x):
    return jnp.sum(rnn.apply(p, x) ** 2, axis=(0, 2))

  for method in ("ghost", "vmap"):
    fn = optaxclip.clipped_grad(loss, 1.0, method=method)
    with pytest.raises(ValueError, match="time-major"):
      fn(params, x)


# ------------------------------------------------------------- bad input


@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_a_scalar_loss_is_refused(method):
  x = RNG.normal(size=(6, 3)).astype(np.float32)
  fn = optaxclip.clipped_grad(
    lambda w, x: jnp.mean((x @ w) ** 2), 1.0, method=method
  )
  with pytest.raises(ValueError, match=r"shape \(6,\); got shape \(\)"):
    fn(jnp.ones(3), x)


def test_padding_mask_of_the_wrong_length_is_refused():
  x = RNG.normal(size=(6, 3)).astype(np.float32)
  fn = optaxclip.clipped_grad(lambda w, x: (x @ w) ** 2, 1.0)
  with pytest.raises(ValueError, match=r"is_padding_example must have shape"):
    fn(jnp.ones(3), x, is_padding_example=jnp.zeros(5, bool))
  with pytest.raises(TypeError, match=r"is_padding_example must be booleans"):
    fn(jnp.ones(3), x, is_padding_example=jnp.zeros(6))


def test_dp_noise_refuses_bad_norms_and_masks():
  tx = optaxclip.dp_noise(1.0, reduce="sum")
  sums = {"w": jnp.zeros(3)}
  with pytest.raises(ValueError, match=r"example_norms must be the \(B,\)"):
    tx.update(sums, tx.init(sums), example_norms=jnp.ones((4, 2)))
  with pytest.raises(ValueError, match=r"is_padding_example must have shape"):
    tx.update(
      sums,
      tx.init(sums),
      example_norms=jnp.ones(4),
      is_padding_example=jnp.zeros(3, bool),
    )


# ----------------------------------------------------------------- padding


def test_dp_noise_statistics_leave_padding_out():
  # 4 real examples, all clipped, and 4 padding rows: the statistics and
  # the adaptive clip norm are those of the 4 real examples alone.
  tx = optaxclip.dp_noise(1.0, target_quantile=0.5, reduce="sum")
  sums = {"w": jnp.zeros(3)}
  norms = jnp.array([5.0] * 4 + [0.0] * 4)
  padding = jnp.array([False] * 4 + [True] * 4)
  _, padded = tx.update(
    sums, tx.init(sums), example_norms=norms, is_padding_example=padding
  )
  _, alone = tx.update(sums, tx.init(sums), example_norms=norms[:4])
  for field in ("clip_fraction", "norm", "clipped_norm", "clip_norm"):
    np.testing.assert_allclose(
      getattr(padded, field), getattr(alone, field), rtol=1e-6
    )
  assert float(padded.clip_fraction) == 1.0
  assert float(padded.norm) == 5.0
  np.testing.assert_allclose(padded.clip_norm, np.exp(0.2 * 0.5), rtol=1e-6)


def test_clip_per_example_leaves_padding_out():
  tx = optaxclip.clip_per_example(1.0, target_quantile=0.5, reduce="sum")
  grads = {"w": jnp.concatenate([jnp.full((4, 3), 3.0), jnp.full((2, 3), 7.0)])}
  state = tx.init({"w": jnp.zeros(3)})
  padding = jnp.array([False] * 4 + [True] * 2)
  out, padded = tx.update(grads, state, is_padding_example=padding)
  want, alone = tx.update({"w": grads["w"][:4]}, state)
  np.testing.assert_allclose(out["w"], want["w"], rtol=1e-6)
  for field in ("clip_fraction", "norm", "clipped_norm", "clip_norm"):
    np.testing.assert_allclose(
      getattr(padded, field), getattr(alone, field), rtol=1e-6
    )


def test_parameters_cast_for_mixed_precision_stay_ghosted():
  # A float cast is the parameter itself to the taps (its gradient is the
  # same values); a scaled one is not.
  x = RNG.normal(size=(3, 4)).astype(np.float32)
  model = nn.Dense(2, dtype=jnp.bfloat16)
  params = run_fast(model.init, jax.random.PRNGKey(5), x)

  def loss(p, x):
    p = jax.tree.map(lambda w: w.astype(jnp.bfloat16), p)
    out = model.apply(p, x.astype(jnp.bfloat16)).astype(jnp.float32)
    return jnp.sum(out**2, axis=1)

  fn = optaxclip.clipped_grad(loss, 1.0)
  plan = fn.plan(params, x)
  assert plan.fallback == [], str(plan)
  ghost = run_fast(fn, params, x)[1]
  exact = run_fast(optaxclip.clipped_grad(loss, 1.0, method="vmap"), params, x)
  np.testing.assert_allclose(ghost, exact[1], rtol=2e-2)
