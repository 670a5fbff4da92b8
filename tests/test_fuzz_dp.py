"""Properties of the DP aggregation over the whole float32 range.

Every example moves the clipped sum by at most the clip norm (the DP
sensitivity bound), whatever its magnitude (subnormal to near the largest
float32) and whatever other examples hold (NaN, Inf): a float64 NumPy oracle
gives the sum of the finite examples (every element finite, whatever the
norm: one beyond float32's range included), each clipped along its
direction. Under x64 the same holds for float64 examples and clip norms over
float64's whole range (a clip norm is not rounded to float32), and
``clipped_grad``'s sensitivity is the L2 norm of any float64 bounds.
"""

import functools
import math

import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np

from fast_compile import compile_fast
import fuzz_strategies as fz
import optaxclip

BATCH = 4
SHAPES = {"w": (3, 2), "b": (2,)}


def _magnitudes():
  # Powers of ten over the whole float32 range, and the odd non-finite.
  finite = st.builds(
    lambda e, m, s: s * m * 10.0**e,
    st.integers(-44, 38),
    st.floats(1.0, 3.4),
    st.sampled_from([-1.0, 1.0]),
  )
  return st.one_of(
    finite,
    finite,
    finite,
    st.just(0.0),
    st.sampled_from([float("nan"), float("inf")]),
  )


@st.composite
def _batches(draw):
  out = {}
  for k, shape in SHAPES.items():
    size = BATCH * int(np.prod(shape))
    values = draw(st.lists(_magnitudes(), min_size=size, max_size=size))
    with np.errstate(over="ignore"):
      out[k] = (
        np.array(values, np.float64).astype(np.float32).reshape(BATCH, *shape)
      )
  return out


def _oracle(tree, clip):
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
  flat = np.concatenate([x.reshape(BATCH, -1) for x in leaves], axis=1)
  finite = np.all(np.isfinite(flat), axis=1)
  safe = np.where(finite[:, None], flat, 0.0)
  big = np.max(np.abs(safe), axis=1, keepdims=True)
  scaled = safe / np.where(big > 0, big, 1.0)
  norms = big[:, 0] * np.sqrt(np.sum(scaled**2, axis=1))
  # A finite example whose norm exceeds float32's range is clipped like
  # any other (only an Inf or NaN element leaves an example out).
  safe = np.where(finite[:, None], safe, 0.0)
  norms = np.where(finite, norms, 0.0)
  factor = np.where(norms > clip, clip / np.where(norms > 0, norms, 1.0), 1.0)
  contributions = safe * factor[:, None]
  return contributions.sum(0), contributions, finite


@functools.cache
def _step():
  """``(tree, clip) -> (sum, state)`` of ``clip_per_example(clip)`` from
  its initial state, the clip norm traced: one program for every clip
  drawn (fast options: compiles dominate).
  """

  def run(tree, clip):
    tx = optaxclip.clip_per_example(clip, reduce="sum")
    return tx.update(tree, tx.init(None))

  return fz.FastJit(run)


@fz.examples(25)
@hypothesis.given(tree=_batches(), clip=st.sampled_from([1e-3, 1.0, 1e4]))
def test_each_example_moves_the_sum_by_at_most_the_clip(tree, clip):
  out, state = _step()(tree, np.float32(clip))
  got = np.concatenate(
    [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(out)]
  )
  want, contributions, finite = _oracle(tree, clip)
  assert np.all(np.isfinite(got))
  # The oracle sums the same finite, clipped examples.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * clip)
  assert np.linalg.norm(got) <= finite.sum() * clip * (1 + 1e-5) + 1e-30
  assert np.all(np.linalg.norm(contributions, axis=1) <= clip * (1 + 1e-5))
  assert float(state.nonfinite) == BATCH - finite.sum()


@functools.cache
def _step64(scope):
  """``clip_per_example(clip, scope=scope)`` on float64 examples: the sum,
  the clipped fraction, and the clip norm ``dp_noise`` noises and counts by.
  """

  def run(tree, clip, norms):
    tx = optaxclip.clip_per_example(clip, scope=scope, reduce="sum")
    out, state = tx.update(tree, tx.init(None))
    noise = optaxclip.dp_noise(clip, noise_multiplier=0.0, reduce="sum")
    _, noise_state = noise.update(tree, noise.init(None), example_norms=norms)
    return out, state.clip_fraction, noise_state.clip_fraction

  return fz.FastJit(run)


@fz.examples(10)
@hypothesis.given(
  exponent=st.integers(-990, 990),
  mantissa=st.floats(0.5, 1.0),
  offsets=st.lists(st.integers(-4, 4), min_size=BATCH, max_size=BATCH),
  scope=st.sampled_from(["global", "leaf"]),
  seed=st.integers(0, 2**16),
)
@hypothesis.example(
  exponent=-3, mantissa=0.8, offsets=[2] * BATCH, scope="global", seed=0
)
def test_float64_examples_are_bounded_by_the_float64_clip(
  exponent, mantissa, offsets, scope, seed
):
  """Under x64, a float64 clip norm bounds each float64 example as given,
  over float64's whole range: ``l2_clip=0.1`` bounded examples at
  0.10000000149 (the clip norm was rounded to float32), and one beyond
  float32's range (1e-200, 1e200) zeroed every example or clipped none.
  Each example moves the sum by at most the clip; the clipped fractions
  of clip_per_example and dp_noise are the oracle's.
  """
  clip = math.ldexp(mantissa, exponent)
  rng = np.random.default_rng(seed)
  with jax.enable_x64(True):
    tree = {
      "a": np.stack(
        [np.ldexp(rng.uniform(-1, 1, 3), exponent + o) for o in offsets]
      ),
      "b": np.stack(
        [np.ldexp(rng.uniform(-1, 1, (2, 2)), exponent + o) for o in offsets]
      ),
    }
    flat = np.concatenate([x.reshape(BATCH, -1) for x in tree.values()], 1)
    norms = np.sqrt(np.sum(np.ldexp(flat, -exponent) ** 2, 1))
    norms = np.ldexp(norms, exponent)
    out, fraction, noise_fraction = _step64(scope)(
      fz.to_jax(tree), np.float64(clip), norms
    )
    assert all(x.dtype == np.float64 for x in jax.tree.leaves(out))
    # Each example alone: its contribution's norm is at most the clip.
    for i in range(BATCH):
      one = {k: v[i : i + 1] for k, v in tree.items()}
      alone, _, _ = _step64(scope)(
        fz.to_jax(one), np.float64(clip), norms[i : i + 1]
      )
      got = np.concatenate([np.ravel(np.asarray(x)) for x in alone.values()])
      size = np.ldexp(np.linalg.norm(np.ldexp(got, -exponent)), exponent)
      assert size <= clip * (1 + 4e-16), (i, size, clip)
  if scope == "global":
    want = np.mean(norms > clip)
    assert float(fraction) == want, (float(fraction), want)
  assert float(noise_fraction) == np.mean(norms > clip)


@fz.examples(10)
@hypothesis.given(
  clips=st.lists(
    st.builds(math.ldexp, st.floats(0.5, 1.0), st.integers(-1070, 1020)),
    min_size=1,
    max_size=3,
  )
)
def test_sensitivity_of_any_float64_bound_is_its_l2_norm(clips):
  """``clipped_grad(...).sensitivity`` of per-layer bounds anywhere in
  float64's range is their L2 norm (twice it for replace-one): the squares
  overflowed (``OverflowError`` above about 1.3e154) or underflowed (0
  below about 1e-162).
  """
  l2_clip = (
    clips[0] if len(clips) == 1 else {f"l{i}": c for i, c in enumerate(clips)}
  )
  got = optaxclip.clipped_grad(
    lambda w, x: jnp.sum((x * w) ** 2), l2_clip, method="vmap"
  ).sensitivity
  big = max(clips)
  want = big * math.sqrt(sum((c / big) ** 2 for c in clips))
  assert math.isclose(got.add_remove, want, rel_tol=1e-15), (got, want)
  assert math.isclose(got.replace_one, 2 * want, rel_tol=1e-15)


# ------------------------------------------------- clipped_grad, ghost method


class _ScanModel(nn.Module):
  """An embedding, a float input, a scanned Dense stack, a LayerNorm and a
  read-out: every layer kind the one-pass book-keeping catches, under
  ``nn.scan`` and outside it.
  """

  @nn.compact
  def __call__(self, tokens, x):
    h = nn.Embed(7, 4)(tokens) + nn.Dense(4)(x)

    class Block(nn.Module):
      @nn.compact
      def __call__(self, h, _):
        return jnp.tanh(nn.Dense(4)(h)), None

    stack = nn.scan(
      Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2
    )
    h, _ = stack()(h, None)
    return nn.Dense(1)(nn.LayerNorm()(h))[..., 0].mean(-1)


_MODEL = _ScanModel()


@functools.cache
def _params():
  """The model's parameters, drawn on the host at first use (an eager
  ``init`` at import cost every test process about 3 s of CPU).
  """
  shapes = jax.eval_shape(
    _MODEL.init,
    jax.ShapeDtypeStruct((2,), jnp.uint32),
    jax.ShapeDtypeStruct((1, 3), jnp.int32),
    jax.ShapeDtypeStruct((1, 3, 2), jnp.float32),
  )
  rng = np.random.default_rng(0)
  return jax.tree.map(
    lambda s: (0.5 * rng.normal(size=s.shape)).astype(s.dtype), shapes
  )


_COMPILED = {}


def _ghost_loss(p, tokens, x):
  return (_MODEL.apply(p, tokens, x) - 0.5) ** 2


def _compiled(key, fn, *args):
  if key not in _COMPILED:
    _COMPILED[key] = compile_fast(jax.jit(fn).lower(*args))
  return _COMPILED[key]


@st.composite
def _ghost_batches(draw):
  # Under ci the batch of 70 only (above the recompute's 64 chunks; each
  # batch size compiles the ghost and oracle programs again); release draws
  # 6 too.
  batch = draw(fz.ci_or(st.just(70), st.sampled_from([6, 70])))
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  tokens = rng.integers(0, 7, size=(batch, 3)).astype(np.int32)
  scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
  x = (scale * rng.normal(size=(batch, 3, 2))).astype(np.float32)
  bad = draw(st.lists(st.integers(0, batch - 1), max_size=2))
  for b in bad:
    x[b, 0, 0] = draw(st.sampled_from([np.nan, np.inf]))
  pad = np.array(draw(st.lists(st.booleans(), min_size=batch, max_size=batch)))
  return tokens, x, pad


@fz.examples(10)
@hypothesis.given(
  data=_ghost_batches(),
  clip=st.sampled_from([1e-2, 0.3, 1e3]),
  bookkeeping=st.booleans(),
)
def test_ghost_clipped_sum_matches_the_per_example_oracle(
  data, clip, bookkeeping
):
  # Covers a layer nested in a block under the same name as a top-level
  # one (both "Dense_0"), which must be tapped and counted; the rare
  # recompute (an example with a non-finite gradient), which runs in up to
  # 64 chunks, or in microbatch_size ones, to bound its memory; and the
  # one-pass book-keeping sum (caught layer inputs and output gradients,
  # also under nn.scan). Whatever the batch, padding, non-finite examples
  # and chunking, the clipped sum is the float64 oracle's over the finite,
  # non-padding examples.
  tokens, x, pad = data
  params = _params()
  batch = len(tokens)
  micro = 2 if bookkeeping else None  # both divide the batches drawn
  fn = optaxclip.clipped_grad(
    _ghost_loss,
    1.0,
    batch_argnums=(1, 2),
    bookkeeping=bookkeeping,
    microbatch_size=micro,
  )
  step = _compiled(
    ("ghost", batch, bookkeeping),
    lambda p, t, x, pad, c: fn(p, t, x, is_padding_example=pad, l2_clip=c),
    params,
    tokens,
    x,
    pad,
    np.float32(clip),
  )
  grads, norms = step(params, tokens, x, pad, np.float32(clip))

  def one(p, t, x):
    return _ghost_loss(p, t[None], x[None])[0]

  per_example = _compiled(
    ("oracle", batch), jax.vmap(jax.grad(one), (None, 0, 0)), params, tokens, x
  )(params, tokens, x)
  leaves = [
    np.asarray(v, np.float64).reshape(batch, -1)
    for v in jax.tree.leaves(per_example)
  ]
  flat = np.concatenate(leaves, axis=1)
  finite = np.all(np.isfinite(flat), axis=1)
  keep = finite & ~pad
  want_norms = np.sqrt(np.sum(np.where(keep[:, None], flat, 0) ** 2, axis=1))
  factor = np.where(
    keep, np.minimum(1.0, clip / np.maximum(want_norms, 1e-30)), 0
  )
  want = np.sum(np.where(keep[:, None], flat, 0) * factor[:, None], axis=0)
  got = np.concatenate(
    [np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(grads)]
  )
  assert np.all(np.isfinite(got))
  scale = max(np.max(np.abs(want)), clip * 1e-3)
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale)
  np.testing.assert_allclose(
    np.asarray(norms)[keep], want_norms[keep], rtol=1e-4
  )
  assert np.all(np.asarray(norms)[pad] == 0)
  assert not np.any(np.isfinite(np.asarray(norms)[~finite & ~pad]))


_TINY_MODEL = nn.Dense(2)


def _tiny_loss(p, x):
  return jnp.sum(_TINY_MODEL.apply(p, x) ** 2, axis=-1)


@functools.cache
def _tiny_programs():
  x = jax.ShapeDtypeStruct((4, 3), jnp.float32)
  params = jax.eval_shape(_TINY_MODEL.init, jax.random.key(0), x)
  ghost = optaxclip.clipped_grad(_tiny_loss, 1.0, batch_argnums=1)

  def one(p, x_b):
    return _tiny_loss(p, x_b[None])[0]

  return (
    compile_fast(jax.jit(ghost).lower(params, x)),
    compile_fast(jax.jit(jax.vmap(jax.grad(one), (None, 0))).lower(params, x)),
  )


@fz.examples(6)
@hypothesis.given(exponent=st.integers(-32, -12), seed=st.integers(0, 2**16))
def test_ghost_norms_of_tiny_examples_are_exact(exponent, seed):
  """Examples whose gradients are tiny (squares below float32's smallest
  normal number) get their norms exactly, as with method="vmap": the ghost
  method's fast squares underflow there, so that underflow, not only
  overflow, sends a step to the exact recompute (else an example of norm
  4.5e-20 reads 0).
  """
  rng = np.random.default_rng(seed)
  params = {
    "params": {
      "kernel": rng.normal(size=(3, 2)).astype(np.float32),
      "bias": np.zeros(2, np.float32),
    }
  }
  x = rng.normal(size=(4, 3)).astype(np.float32)
  x[1:] *= np.float32(10.0**exponent)  # one ordinary example, three tiny
  ghost, oracle = _tiny_programs()
  _, norms = ghost(params, x)
  flat = np.concatenate(
    [
      np.asarray(v, np.float64).reshape(4, -1)
      for v in jax.tree.leaves(oracle(params, x))
    ],
    axis=1,
  )
  want = np.sqrt(np.sum(flat**2, axis=1))
  np.testing.assert_allclose(np.asarray(norms, np.float64), want, rtol=1e-4)
