"""The ghost method on generated architectures: whatever the model, its
per-example norms equal the exact (vmap) ones, each example alone keeps its
clipped gradient within ``l2_clip``, and over a batch the clipped sums
agree.

A model is a stack of blocks drawn from a palette over ``(B, T, D)``
activations (Dense, Conv, LayerNorm, RMSNorm, attention, a raw
``self.param``, a Dense applied twice, a parameter transformed before use,
``nn.scan`` with broadcast and with stacked parameters, RNN cells,
``nn.vmap`` with shared and with per-member parameters), between an
embedding and an output head (a Dense, or the embedding tied by attribute
or by ``attend``); and the loss may transform every parameter before use.
The nnx palette: Linear, Embed, LayerNorm, a Linear reused, a raw
``nnx.Param``, the embedding tied by attribute.
"""

from flax import nnx
import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import fuzz_strategies as fz
from test_loss_audit import check_sound

B, T, D, V = 3, 4, 4, 7


class _Step(nn.Module):
  @nn.compact
  def __call__(self, c, x_t):
    c = jnp.tanh(nn.Dense(D)(c) + x_t)
    return c, c


class _Layer(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return h + jnp.tanh(nn.Dense(D)(h)), None


class Block(nn.Module):
  kind: str

  @nn.compact
  def __call__(self, h):
    k = self.kind
    if k == "dense":
      return jnp.tanh(nn.Dense(D)(h))
    if k == "conv":
      return nn.Conv(D, (3,))(h)
    if k == "layernorm":
      return nn.LayerNorm()(h)
    if k == "rmsnorm":
      return nn.RMSNorm()(h)
    if k == "attention":
      return h + nn.SelfAttention(num_heads=2, qkv_features=D)(h)
    if k == "raw_param":
      return h * self.param("w", nn.initializers.normal(1.0), (D,))
    if k == "dense_twice":
      dense = nn.Dense(D)
      return dense(jnp.tanh(dense(h)))
    if k == "transformed":
      w = self.param("w", nn.initializers.normal(0.5), (D, D))
      return jnp.tanh(h @ (w * w))
    if k == "scan_broadcast":
      scan = nn.scan(
        _Step,
        variable_broadcast="params",
        split_rngs={"params": False},
        in_axes=1,
        out_axes=1,
      )
      return scan()(jnp.zeros((h.shape[0], D)), h)[1]
    if k == "scan_stacked":
      scan = nn.scan(
        _Layer,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=2,
      )
      return scan()(h, None)[0]
    if k == "rnn":
      return nn.RNN(nn.SimpleCell(D))(h)
    if k == "gru":
      return nn.RNN(nn.GRUCell(D))(h)
    if k in ("vmap_shared", "vmap_member"):
      member = k == "vmap_member"
      dense = nn.vmap(
        nn.Dense,
        variable_axes={"params": 1 if member else None},
        split_rngs={"params": member},
        in_axes=1,
        out_axes=1,
      )(D)
      return jnp.tanh(dense(h))
    raise ValueError(k)


KINDS = (
  "dense",
  "conv",
  "layernorm",
  "rmsnorm",
  "attention",
  "raw_param",
  "dense_twice",
  "transformed",
  "scan_broadcast",
  "scan_stacked",
  "rnn",
  "gru",
  "vmap_shared",
  "vmap_member",
)


class Model(nn.Module):
  kinds: tuple
  head: str

  @nn.compact
  def __call__(self, tokens):
    emb = nn.Embed(V, D)
    h = emb(tokens)
    for i, kind in enumerate(self.kinds):
      h = Block(kind, name=f"block{i}_{kind}")(h)
    if self.head == "tied_attribute":
      logits = h @ emb.embedding.T
    elif self.head == "tied_attend":
      logits = emb.attend(h)
    else:
      logits = nn.Dense(V)(h)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 0] ** 2, axis=1)


@hypothesis.example(
  kinds=["attention", "conv", "dense_twice"],
  head="tied_attend",
  scale_params=False,
  seed=1,
)
@hypothesis.example(
  kinds=["transformed", "rmsnorm", "vmap_member"],
  head="tied_attribute",
  scale_params=False,
  seed=2,
)
@hypothesis.given(
  kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3),
  head=st.sampled_from(("dense", "tied_attribute", "tied_attend")),
  scale_params=st.booleans(),
  seed=st.integers(0, 2**16),
)
@fz.examples(3, deadline=None)
def test_linen_architectures(kinds, head, scale_params, seed):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (B, T))
  model = Model(tuple(kinds), head)
  params = jax.jit(model.init)(jax.random.PRNGKey(seed), tokens)

  def loss(p, tokens):
    if scale_params:
      p = jax.tree.map(lambda w: 1.5 * w, p)
    return model.apply(p, tokens)

  plan = check_sound(loss, params, (tokens,), clip=0.5)
  assert set(plan.reasons) == set(plan.ghosted) | set(plan.fallback)
  if scale_params:
    assert plan.ghosted == []


class NnxModel(nnx.Module):
  def __init__(self, kinds, tied, rngs):
    self.kinds = kinds
    self.tied = tied
    self.emb = nnx.Embed(V, D, rngs=rngs)
    self.layers = nnx.List(
      [
        nnx.LayerNorm(D, rngs=rngs)
        if k == "layernorm"
        else nnx.Param(jnp.ones(D))
        if k == "raw_param"
        else nnx.Linear(D, D, rngs=rngs)
        for k in kinds
      ]
    )
    self.head = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, tokens):
    h = self.emb(tokens)
    for kind, layer in zip(self.kinds, self.layers):
      if kind == "raw_param":
        h = h * layer[...]
      elif kind == "linear_twice":
        h = layer(jnp.tanh(layer(h)))
      else:
        h = jnp.tanh(layer(h))
    logits = h @ self.emb.embedding[...].T if self.tied else self.head(h)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 0] ** 2, axis=1)


@hypothesis.given(
  kinds=st.lists(
    st.sampled_from(("linear", "layernorm", "raw_param", "linear_twice")),
    min_size=1,
    max_size=3,
  ),
  tied=st.booleans(),
  seed=st.integers(0, 2**16),
)
@fz.examples(2, deadline=None)
def test_nnx_architectures(kinds, tied, seed):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (B, T))
  graphdef, params = nnx.split(
    NnxModel(tuple(kinds), tied, nnx.Rngs(seed)), nnx.Param
  )

  def loss(p, tokens):
    return nnx.merge(graphdef, p)(tokens)

  check_sound(loss, params, (tokens,), clip=0.5)
