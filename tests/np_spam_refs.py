"""Plain-NumPy transcriptions of the SPAM and Stable-SPAM reference classes.

Written from reading the authors' PyTorch code (not copied):
github.com/TianjinYellow/SPAM-Optimizer ``galore_torch/SPAM.py`` class
``AdamW`` (without its random-mask ``density`` option), and
github.com/TianjinYellow/StableSPAM ``galore_torch/stablespam.py`` class
``StableSPAM``. Tensors are float32 NumPy arrays and the optimizers' own
scalars (step counts, bias corrections, cosine factors) Python floats, as in
the references; a float32 array times a Python float stays float32 (NumPy 2).
``dtype=np.float64`` runs the same arithmetic in float64, to measure how far
a float32 implementation is from exact.
Each ``step(grads)`` updates ``self.params`` in place of the references'
``p.grad``/``p`` pair.

Not in the references, for the tests' tolerances only: ``rounding_scale``,
per tensor, is the largest step the first moment would give if its terms had
not cancelled (the moment of ``|g|``, same decay and resets). A float32 moment
rounds relative to that sum of terms, not to its own, possibly cancelled,
value; an update's float32 error scales with this, not with the update.
"""

import math

import numpy as np

F32 = np.float32


class SpamReference:
  """SPAM's ``AdamW`` (correct_bias=True), one tensor per parameter."""

  def __init__(
    self,
    params,
    *,
    lr,
    b1=0.9,
    b2=0.999,
    eps=1e-6,
    weight_decay=0.0,
    warmup_steps=150,
    threshold=5000,
    delta_t=500,
    grad_accu_steps=20,
    dtype=F32,
  ):
    self.dtype = dtype
    self.params = [np.array(p, dtype) for p in params]
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
    self.weight_decay = weight_decay
    self.warmup_steps, self.thres = warmup_steps, threshold
    self.delta_t, self.grad_accu_steps = delta_t, grad_accu_steps
    self.total_step = 0
    self.current_step = warmup_steps + 1
    n = len(self.params)
    self.step_count = [0] * n
    self.exp_avg = [np.zeros_like(p) for p in self.params]
    self.exp_avg_sq = [np.zeros_like(p) for p in self.params]
    self.exp_avg_abs = [np.zeros_like(p) for p in self.params]
    self.rounding_scale = [0.0] * n
    self.clipped = 0  # coordinates clipped on the last step

  def _death_rate(self, c):
    """CosineDecay(0.99, warmup_steps).get_dr(c): the closed form of
    CosineAnnealingLR with period warmup_steps + 1, 0 from warmup_steps on.
    """
    w = self.warmup_steps
    if c >= w:
      return 0.0
    return 0.99 * (1 + math.cos(math.pi * c / (w + 1))) / 2

  def step(self, grads):
    scale = 1 - self._death_rate(self.current_step)
    self.clipped = 0
    for i, grad in enumerate(grads):
      g = np.array(grad, self.dtype)
      if (self.total_step + 1) % self.delta_t == 0:
        self.exp_avg[i] = np.zeros_like(g)
        self.exp_avg_sq[i] = np.zeros_like(g)
        self.exp_avg_abs[i] = np.zeros_like(g)
      m, v = self.exp_avg[i], self.exp_avg_sq[i]
      self.step_count[i] += 1
      if self.thres != 0:
        current = self.total_step + 1
        if current >= self.grad_accu_steps:
          # optaxclip's deviation: a coordinate whose v is 0 is not judged
          # (the reference clips it to 0, for good).
          mask = (g**2 > self.thres * v) & (v > 0)
          if current % self.delta_t >= self.grad_accu_steps:
            g[mask] = np.sign(g[mask]) * np.sqrt(v[mask] * self.thres)
            self.clipped += int(mask.sum())
      m = m * self.b1 + g * (1.0 - self.b1)
      v = v * self.b2 + g * g * (1.0 - self.b2)
      self.exp_avg[i], self.exp_avg_sq[i] = m, v
      a = self.exp_avg_abs[i] * self.b1 + np.abs(g) * (1.0 - self.b1)
      self.exp_avg_abs[i] = a
      denom = np.sqrt(v) + self.eps
      k = self.step_count[i]
      step_size = self.lr * math.sqrt(1.0 - self.b2**k) / (1.0 - self.b1**k)
      self.rounding_scale[i] = float(np.max(a / denom)) * step_size * scale
      p = self.params[i] + (m / denom) * (-step_size * scale)
      if self.weight_decay > 0:
        p = p + p * (-self.lr * self.weight_decay)
      self.params[i] = p.astype(self.dtype)
    self.total_step += 1
    self.current_step += 1
    if self.total_step != 0 and (self.total_step + 1) % self.delta_t == 0:
      self.current_step = 0
    return scale


class StableSpamReference:
  """Stable-SPAM's ``StableSPAM`` (amsgrad=False), one tensor per parameter.

  ``rebind=True`` keeps the reference's handling of a reset: new zero
  moments are put in the state, but the step is taken from the old ones
  (still bound to local names), updated with this gradient. ``rebind=False``
  resets before the update, as the paper's Algorithm 1 writes it.
  """

  def __init__(
    self,
    params,
    *,
    lr,
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    weight_decay=0.0,
    gamma1=0.7,
    gamma2=0.9,
    gamma3=0.999,
    total_t=None,
    eta_min=0.5,
    update_proj_gap=1000,
    rebind=True,
    dtype=F32,
  ):
    self.dtype = dtype
    self.params = [np.array(p, dtype) for p in params]
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
    self.weight_decay = weight_decay
    self.gamma1, self.gamma2, self.theta = gamma1, gamma2, gamma3
    self.total_t, self.eta_min = total_t, eta_min
    self.update_proj_gap, self.rebind = update_proj_gap, rebind
    self.total_steps = 0
    n = len(self.params)
    self.step_count = [0] * n
    self.exp_avg = [np.zeros_like(p) for p in self.params]
    self.exp_avg_sq = [np.zeros_like(p) for p in self.params]
    self.m_norm = [0] * n
    self.v_norm = [0] * n
    self.m_max = [0] * n
    self.exp_avg_abs = [np.zeros_like(p) for p in self.params]
    self.rounding_scale = [0.0] * n
    self.clipped = 0

  def _cosine(self, t):
    """CosineDecay(1.0, total_t, eta_min).get_dr(t): CosineAnnealingLR's
    closed form with period total_t + 1, no clamp.
    """
    period = self.total_t + 1
    return (
      self.eta_min
      + (1 - self.eta_min) * (1 + math.cos(math.pi * t / period)) / 2
    )

  def step(self, grads):
    self.total_steps += 1
    scale = 1.0 if self.total_t is None else self._cosine(self.total_steps)
    self.clipped = 0
    for i, grad in enumerate(grads):
      self.params[i] = self.params[i] * (1 - self.lr * self.weight_decay)
      g = np.array(grad, self.dtype)
      m, v = self.exp_avg[i], self.exp_avg_sq[i]
      a = self.exp_avg_abs[i]
      max_gradient = np.max(np.abs(g))
      self.step_count[i] += 1
      k = self.step_count[i]
      m_max = self.theta * self.m_max[i] + (1 - self.theta) * max_gradient
      m_max_hat = m_max / (1 - self.theta**k)
      mask = np.abs(g) > m_max_hat
      if mask.sum() > 0:
        g[mask] = g[mask] / max_gradient * m_max_hat
        self.clipped += int(mask.sum())
      self.m_max[i] = self.dtype(m_max)
      grad_norm = self.dtype(np.sqrt(np.sum(g.astype(np.float64) ** 2)))
      g1 = self.gamma1 * scale
      m_norm = g1 * self.m_norm[i] + (1 - g1) * grad_norm
      v_norm = self.gamma2 * self.v_norm[i] + (1 - self.gamma2) * grad_norm**2
      m_norm_hat = m_norm / (1 - g1**k)
      v_norm_hat = v_norm / (1 - self.gamma2**k)
      c_norm = m_norm_hat / (np.sqrt(v_norm_hat) + self.eps)
      if grad_norm > 0:
        g = g / grad_norm * c_norm
      self.m_norm[i], self.v_norm[i] = self.dtype(m_norm), self.dtype(v_norm)
      reset = (
        self.update_proj_gap and self.total_steps % self.update_proj_gap == 0
      )
      if reset:
        self.exp_avg[i] = np.zeros_like(g)
        self.exp_avg_sq[i] = np.zeros_like(g)
        self.step_count[i] = 1
        self.exp_avg_abs[i] = np.zeros_like(g)
        if not self.rebind:
          m, v = self.exp_avg[i], self.exp_avg_sq[i]
          a = self.exp_avg_abs[i]
      k = self.step_count[i]
      beta1 = self.b1 * scale
      bias_correction1 = 1 - beta1**k
      bias_correction2 = 1 - self.b2**k
      m = m * beta1 + g * (1 - beta1)
      v = v * self.b2 + g * g * (1 - self.b2)
      a = a * beta1 + np.abs(g) * (1 - beta1)
      if not (reset and self.rebind):
        self.exp_avg[i], self.exp_avg_sq[i] = m, v
        self.exp_avg_abs[i] = a
      denom = np.sqrt(v) / math.sqrt(bias_correction2) + self.eps
      step_size = self.lr / bias_correction1
      self.rounding_scale[i] = float(np.max(a / denom, initial=0.0)) * step_size
      self.params[i] = (self.params[i] + (m / denom) * (-step_size)).astype(
        self.dtype
      )
    return scale


def spam_reference(params, *, reset_interval, dtype=F32, **kwargs):
  """A :class:`SpamReference` given ``optaxclip.spam``'s argument names
  (``reset_interval`` is the reference's ``delta_t``).
  """
  return SpamReference(params, delta_t=reset_interval, dtype=dtype, **kwargs)


def stable_spam_reference(
  params, *, reset_interval, total_steps, dtype=F32, **kwargs
):
  """A :class:`StableSpamReference` given ``optaxclip.stable_spam``'s
  argument names (``reset_interval`` is the reference's ``update_proj_gap``,
  ``total_steps`` its ``total_t``).
  """
  return StableSpamReference(
    params,
    update_proj_gap=reset_interval,
    total_t=total_steps,
    dtype=dtype,
    **kwargs,
  )
