"""Properties of the ghost method's compiled memory (XLA memory analysis).

The two-pass ghost step holds what a plain ``jax.grad`` holds: on a model
whose logits dominate the activations, its temporary memory stays within a
small share of one logits-sized buffer of the plain gradient's. (It used to
hold one more: its second backward pass ran inside the non-finite
``lax.cond``, whose operands, the forward's residuals, XLA keeps whole for
the branch, so the logits' cotangent could not overwrite the softmax as in a
plain ``jax.grad``.)
"""

import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import optax

import optaxclip


class _Readout(nn.Module):
  vocab: int

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.vocab)(nn.gelu(nn.Dense(16)(x)))


def _temp_bytes(fn, *args):
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@hypothesis.settings(max_examples=2, deadline=None)
@hypothesis.given(
  batch=st.sampled_from([8, 16]),
  length=st.sampled_from([4, 8]),
  vocab=st.sampled_from([1024, 2048]),
)
def test_two_pass_ghost_holds_no_extra_logits_buffer(batch, length, vocab):
  net = _Readout(vocab)
  x = jax.random.normal(jax.random.PRNGKey(0), (batch, length, 8))
  y = jax.random.randint(jax.random.PRNGKey(1), (batch, length), 0, vocab)
  params = net.init(jax.random.PRNGKey(2), x[:1])

  def loss_fn(p, x, y):
    logits = net.apply(p, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(1)

  def plain(p, x, y):
    return jax.grad(lambda p: loss_fn(p, x, y).mean())(p)

  grad_fn = optaxclip.clipped_grad(
    loss_fn, 1.0, batch_argnums=(1, 2), bookkeeping=False
  )
  logits_bytes = batch * length * vocab * 4
  extra = _temp_bytes(
    lambda p, x, y: grad_fn(p, x, y)[0], params, x, y
  ) - _temp_bytes(plain, params, x, y)
  assert extra < 0.25 * logits_bytes, (extra, logits_bytes)
