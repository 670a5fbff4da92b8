"""Reference formulas in plain NumPy (float64), from each library's docs.

TensorFlow, Keras and PyTorch are not test dependencies: each function below
encodes the formula that library documents, so the tests can compare against
it. Inputs are lists of arrays; outputs are float64 NumPy arrays.
"""

import math

import numpy as np


def f64(x):
  """An array as float64 (complex128 for complex input)."""
  x = np.asarray(x)
  return x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)


def spiky_gradients(shapes, steps, spikes, seed=1, size=1e3):
  """``steps`` lists of float32 Gaussian gradients of ``shapes``; on the
  steps in ``spikes`` (1-based) a few coordinates of each tensor are
  multiplied by ``size`` (the per-tensor RMS then exceeds 1).
  """
  rng = np.random.default_rng(seed)
  out = []
  for t in range(1, steps + 1):
    step = [rng.normal(size=s).astype(np.float32) for s in shapes]
    if t in spikes:
      for g in step:
        flat = g.reshape(-1)
        flat[rng.integers(0, flat.size, size=min(2, flat.size))] *= size
    out.append(step)
  return out


def pnorm(values, ord):
  """The p-norm of a flat array of magnitudes (|x|, so complex uses |x|^2)."""
  a = np.abs(f64(values)).ravel()
  if a.size == 0:
    return 0.0
  if math.isinf(ord):
    return float(a.max())
  return float(np.sum(a**ord) ** (1.0 / ord))


def tree_norm(leaves, ord=2.0):
  """The global p-norm of a list of arrays."""
  flat = [np.abs(f64(x)).ravel() for x in leaves]
  return pnorm(np.concatenate(flat) if flat else np.zeros(0), ord)


# --- TensorFlow ---------------------------------------------------------------


def tf_clip_by_value(t, clip_min, clip_max):
  """tf.clip_by_value: element-wise into [clip_min, clip_max]."""
  return np.clip(f64(t), clip_min, clip_max)


def tf_clip_by_norm(t, clip_norm, axes=None):
  """tf.clip_by_norm: ``t * clip_norm / max(l2norm(t, axes), clip_norm)``."""
  t = f64(t)
  l2 = np.sqrt(np.sum(np.abs(t) ** 2, axis=axes, keepdims=True))
  return t * clip_norm / np.maximum(l2, clip_norm)


def tf_clip_by_global_norm(ts, clip_norm):
  """tf.clip_by_global_norm: ``t * clip_norm / max(global_norm, clip_norm)``.

  Returns the clipped list and the global norm, as TF does.
  """
  gn = tree_norm(ts, 2.0)
  return [f64(t) * clip_norm / max(gn, clip_norm) for t in ts], gn


# --- Keras 3 (Optimizer arguments) --------------------------------------------


def keras_clipvalue(grads, value):
  return [np.clip(f64(g), -value, value) for g in grads]


def keras_clipnorm(grads, norm):
  """Keras 3 ``clipnorm``: each variable's gradient on its own."""
  return [tf_clip_by_norm(g, norm) for g in grads]


def keras_global_clipnorm(grads, norm):
  return tf_clip_by_global_norm(grads, norm)[0]


# --- PyTorch ------------------------------------------------------------------


def torch_clip_grad_norm(grads, max_norm, norm_type=2.0):
  """torch.nn.utils.clip_grad_norm_: returns the clipped grads and total norm.

  total = norm of the per-tensor norms (max for inf); the coefficient
  ``max_norm / (total + 1e-6)`` is clamped to 1.
  """
  per = [pnorm(g, norm_type) for g in grads]
  total = pnorm(np.array(per), norm_type)
  coef = min(max_norm / (total + 1e-6), 1.0)
  return [f64(g) * coef for g in grads], total


def torch_clip_grad_value(grads, clip_value):
  return [np.clip(f64(g), -clip_value, clip_value) for g in grads]


# --- optax (from its documented formulas) -------------------------------------


def block_rms(u, threshold):
  """optax.clip_by_block_rms: ``u / max(1, rms(u) / threshold)``."""
  u = f64(u)
  rms = np.sqrt(np.mean(np.abs(u) ** 2)) if u.size else 0.0
  return u / max(1.0, rms / threshold) if threshold > 0 else u * 0.0


def unit_axes(x):
  """Optax 0.2.8's unit axes for AGC, by rank."""
  x = np.asarray(x)
  if np.squeeze(x).ndim <= 1:
    return None
  if x.ndim in (2, 3):
    return (0,)
  if x.ndim == 4:
    return (0, 1, 2)
  return tuple(range(x.ndim - 1))


def agc(g, w, clipping, eps=1e-3, axes="default"):
  """Adaptive gradient clipping (Brock et al. 2021), unit-wise."""
  g, w = f64(g), f64(w)
  axes = unit_axes(g) if axes == "default" else axes
  gn = np.sqrt(np.sum(np.abs(g) ** 2, axis=axes, keepdims=True))
  wn = np.sqrt(np.sum(np.abs(w) ** 2, axis=axes, keepdims=True))
  limit = clipping * np.maximum(wn, eps)
  factor = np.where(gn > limit, limit / np.where(gn > 0, gn, 1), 1.0)
  return g * factor, gn, factor


def clip_value_complex(x, limit):
  """Complex elements keep their phase; the modulus is clipped."""
  x = f64(x)
  m = np.abs(x)
  return np.where(m > limit, x * limit / np.where(m > 0, m, 1), x)


def guard_raised(mean, std, growth):
  """The level ``guard`` judges a held-back statistic by after a raise:
  ``max(mean, 0) + (growth - 1) * max(|mean|, std)``.
  """
  return max(mean, 0.0) + (growth - 1) * max(abs(mean), std)


class GuardStat:
  """One statistic of ``guard`` (a norm, or the loss), restated in floats.

  ``window=None``: the plain mean and population variance of the first
  ``warmup`` values, then an EMA (mean first, the variance with the new
  mean). An int ``window``: ``np.mean`` and ``np.std(ddof=1)`` of the last
  ``window`` values taken in (OLMo-core's SkipStepOptimizer rule). A value
  above ``mean + z * std`` is a spike (with a variance of 0, any value above
  the mean). After ``patience`` spikes in a row, a further one first raises
  the mean to :func:`guard_raised` (the window's values move with it, the
  variance stays), kept whether the value then enters or not, and is judged
  against ``raised + z * std``. Statistics of only zeros (mean and variance
  0) restart at the first value above 0: the EMA moves to it, or the window
  starts again from it.
  """

  def __init__(
    self, z, window=None, warmup=25, patience=25, alpha=0.97, growth=2.0
  ):
    self.z, self.window, self.warmup = z, window, warmup
    self.patience, self.alpha, self.growth = patience, alpha, growth
    self.count = self.run = 0
    self.values, self.mean, self.var = [], 0.0, 0.0
    self.held = self.raised = False

  def judge(self, x):
    """Returns (bound, spike?, restart?, z-score) of ``x``; a raise moves
    the statistics (``self.raised``), ``self.held`` is the spike before it.
    """
    finite = math.isfinite(x)
    warming = self.count < self.warmup
    std = math.sqrt(self.var)
    self.held = self.raised = False
    bound, spike, restart = math.inf, False, False
    if self.z is not None and not warming:
      bound = self.mean + self.z * std
      spike = finite and x > bound
      restart = spike and self.mean == 0 and self.var == 0
      self.held = spike = spike and not restart
      self.raised = spike and self.run >= self.patience
    if self.raised:
      up = guard_raised(self.mean, std, self.growth)
      self.values = [v + up - self.mean for v in self.values]
      self.mean = up
      bound = up + self.z * std
      spike = x > bound
    z_score = (x - self.mean) / std if finite and not warming and std else 0.0
    return bound, spike, restart, z_score

  def learn(self, x, take, spike, restart):
    """Takes ``x`` in (when finite and ``take``); ``spike`` as judged."""
    del spike  # the streak counts the spikes before any raise
    if not math.isfinite(x):
      return
    self.run = self.run + 1 if self.held else 0
    if self.window is not None:
      if restart:
        self.values, self.count = [x], 1
      elif take:
        self.values = (self.values + [x])[-self.window :]
        self.count = min(self.count + 1, self.warmup)
      else:
        return
      self.mean = float(np.mean(self.values))
      self.var = (
        float(np.var(self.values, ddof=1)) if len(self.values) > 1 else 0.0
      )
      return
    if restart:
      self.var = self.alpha * self.var + (1 - self.alpha) * (x - self.mean) ** 2
      self.mean = x
    elif not take:
      return
    elif self.count < self.warmup:
      self.values.append(x)
      self.count += 1
      self.mean, self.var = (
        float(np.mean(self.values)),
        float(np.var(self.values)),
      )
    else:
      self.mean = self.alpha * self.mean + (1 - self.alpha) * x
      self.var = self.alpha * self.var + (1 - self.alpha) * (x - self.mean) ** 2


# --- optaxclip's per-leaf telemetry ---------------------------------------


def leaf_norms(leaves, ord=2.0, layer_axes=None):
  """Each leaf's p-norm, or per layer (a vector) for a leaf with a layer
  axis: the flat list of every leaf's (or layer's) norm, in leaf order.
  """
  layer_axes = layer_axes or [None] * len(leaves)
  out = []
  for x, axis in zip(leaves, layer_axes):
    x = f64(x)
    if axis is None:
      out.append(pnorm(x, ord))
    else:
      out += [
        pnorm(np.take(x, k, axis=axis), ord) for k in range(x.shape[axis])
      ]
  return np.asarray(out, np.float64)


def top_leaf(norms, ord=2.0):
  """``(share, index)``: the largest entry's share of the ord-th power of
  the whole's norm (1 for ord=inf; 0 for all zeros).
  """
  norms = np.asarray(norms, np.float64)
  if norms.size == 0:
    return 0.0, 0
  index = int(np.argmax(norms))
  if math.isinf(ord):
    return (1.0 if norms[index] > 0 else 0.0), index
  total = np.sum(norms**ord)
  return (float(norms[index] ** ord / total) if total > 0 else 0.0), index


# clip_per_example's and dp_noise's stats() fields (API), spelled out once
# for their tests.
PER_EXAMPLE_STAT_FIELDS = (
  "norm",
  "clipped_norm",
  "clip_fraction",
  "nonfinite",
  "clip_norm",
  "threshold",
)
