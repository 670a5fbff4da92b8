"""Hypothesis properties of every static clipper.

For gradients spanning 1e-28 to 1e28 (float32 squares overflow and underflow
at both ends) and limits below and above the gradient's size:

* the result's measure (|x|, norm, RMS, unit norm) is at most the limit;
* each unit keeps its direction: the result is the gradient times one factor
  in [0, 1] per unit, the factor ``min(1, limit / measure)`` (for clip_global
  the unit is the whole tree);
* clipping twice gives the same as clipping once;
* below the limit the gradient passes through bit for bit.

Each clipper is jitted once, with the limit as a traced argument, so the
examples only run it.
"""

import functools
import math

from absl.testing import parameterized
import hypothesis
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import jax
import numpy as np

import np_refs
import optaxclip

SHAPES = {"a": (3, 4), "b": (5,), "c": (2, 3, 2)}
TOL = 2e-5
# Limits as multiples of the gradient's size: zero, well below, just below,
# on and above it (hypothesis' float strategy piles up at its bounds).
RATIOS = (0.0, 0.01, 0.3, 0.9, 0.99999, 1.0, 1.5, 3.0)


def _keep(x, axes):
  return axes if axes is not None else tuple(range(np.ndim(x)))


def _pnorm_units(x, p, axes):
  a = np.abs(np_refs.f64(x))
  axes = _keep(x, axes)
  if math.isinf(p):
    return np.max(a, axis=axes, keepdims=True, initial=0.0)
  return np.sum(a**p, axis=axes, keepdims=True) ** (1 / p)


def _value_units(leaves, limit, params):
  del params
  return [np.abs(np_refs.f64(x)) for x in leaves], [limit] * len(leaves)


def _norm_units(p, axis):
  def units(leaves, limit, params):
    del params
    return [_pnorm_units(x, p, axis) for x in leaves], [limit] * len(leaves)

  return units


def _global_units(p):
  def units(leaves, limit, params):
    del params
    total = np_refs.tree_norm(leaves, p)
    return [np.full((1,) * np.ndim(x), total) for x in leaves], [limit] * len(
      leaves
    )

  return units


def _rms_units(leaves, limit, params):
  del params
  return (
    [
      np.sqrt(np.mean(np.abs(np_refs.f64(x)) ** 2, keepdims=True))
      for x in leaves
    ],
    [limit] * len(leaves),
  )


def _unitwise_units(leaves, limit, params):
  measures, limits = [], []
  for x, w in zip(leaves, params):
    axes = np_refs.unit_axes(x)
    measures.append(_pnorm_units(x, 2.0, axes))
    limits.append(limit * np.maximum(_pnorm_units(w, 2.0, axes), 1e-3))
  return measures, limits


CONFIGS = {
  "clip_value": (optaxclip.clip_value, _value_units),
  "clip_norm": (optaxclip.clip_norm, _norm_units(2.0, None)),
  "clip_norm_axis": (
    functools.partial(optaxclip.clip_norm, axis=-1),
    _norm_units(2.0, (-1,)),
  ),
  "clip_norm_ord_inf": (
    functools.partial(optaxclip.clip_norm, ord="inf"),
    _norm_units(math.inf, None),
  ),
  "clip_global": (optaxclip.clip_global, _global_units(2.0)),
  "clip_global_ord1": (
    functools.partial(optaxclip.clip_global, ord=1),
    _global_units(1.0),
  ),
  "clip_global_ord3": (
    functools.partial(optaxclip.clip_global, ord=3),
    _global_units(3.0),
  ),
  "clip_global_ord_inf": (
    functools.partial(optaxclip.clip_global, ord=math.inf),
    _global_units(math.inf),
  ),
  "clip_block_rms": (optaxclip.clip_block_rms, _rms_units),
  "clip_unitwise": (optaxclip.clip_unitwise, _unitwise_units),
}


@functools.cache
def _clip_twice(name):
  """A jitted (g, limits, params) -> (clip(g), clip(clip(g))) for a config,
  mapped over a vector of limits.
  """
  factory, _ = CONFIGS[name]

  def run(g, limit, params):
    tx = factory(limit)
    once, _ = tx.update(g, tx.init(g), params)
    twice, _ = tx.update(once, tx.init(g), params)
    return once, twice

  return jax.jit(jax.vmap(run, (None, 0, None)))


_MAGNITUDES = st.one_of(
  st.just(0.0),
  st.floats(1 / 1024, 1024, width=32),
  st.floats(-1024, -1 / 1024, width=32),
)


@st.composite
def _trees(draw):
  """A tree of float32 leaves at a power-of-ten scale (each leaf off by up to
  1e2 from the tree's), so that whole trees underflow or overflow too.
  """
  scale = draw(st.sampled_from((-26, -21, -10, 0, 10, 21, 26)))
  tree = {}
  for key, shape in SHAPES.items():
    x = draw(hnp.arrays(np.float32, shape, elements=_MAGNITUDES))
    exponent = scale + draw(st.integers(-2, 2))
    tree[key] = x * np.float32(10.0**exponent)
  return tree


def _leaves(tree):
  return [tree[k] for k in sorted(tree)]


class PropertyTest(parameterized.TestCase):
  @parameterized.named_parameters((name, name) for name in CONFIGS)
  # Each example checks all eight limits, so 20 examples cover 160 cases.
  @hypothesis.settings(max_examples=20)
  @hypothesis.given(g=_trees(), params=_trees())
  def test_properties(self, name, g, params):
    _, units = CONFIGS[name]
    g_leaves, p_leaves = _leaves(g), _leaves(params)
    # The limits: multiples of the gradient's largest unit measure, so that
    # both sides of the limit are checked on every tree (for AGC, the ratios
    # are the clipping values; the limits follow the params).
    if name == "clip_unitwise":
      limits = np.array(RATIOS, np.float32)
    else:
      measures, _ = units(g_leaves, 1.0, None)
      size = max(float(np.max(m)) for m in measures)
      limits = np.array([r * size for r in RATIOS], np.float32)
    # No limit is subnormal, which XLA on CPU would flush to zero.
    self.assertTrue(
      np.all((limits == 0) | (limits >= np.finfo(np.float32).tiny))
    )
    onces, twices = _clip_twice(name)(
      g, limits, params if name == "clip_unitwise" else None
    )
    onces, twices = jax.tree.map(np.asarray, (onces, twices))
    for i, limit in enumerate(limits.astype(np.float64)):
      once = {k: v[i] for k, v in onces.items()}
      twice = {k: v[i] for k, v in twices.items()}
      measures, lims = units(g_leaves, limit, p_leaves)
      out_measures, _ = units(_leaves(once), limit, p_leaves)
      for key, x, out, m, lim, om in zip(
        sorted(g), g_leaves, _leaves(once), measures, lims, out_measures
      ):
        msg = f"{key}, limit {limit}"
        lim = np.broadcast_to(lim, m.shape)
        # 1. The result is within the limit.
        self.assertTrue(
          np.all(om <= lim * (1 + TOL)), f"{msg}: {om.max()} > {np.max(lim)}"
        )
        # 2. Each unit is the gradient times min(1, limit / measure): the
        # direction is kept.
        factor = np.where(m > lim, lim / np.where(m > 0, m, 1), 1.0)
        expected = np_refs.f64(x) * factor
        np.testing.assert_allclose(
          out,
          expected,
          rtol=TOL,
          atol=1e-6 * np.max(np.abs(expected), initial=0) + 1e-37,
          err_msg=msg,
        )
        # 3. Units below the limit pass through bit for bit.
        below = np.broadcast_to(m < lim * (1 - TOL), x.shape)
        np.testing.assert_array_equal(out[below], x[below], err_msg=msg)
        # 4. Clipping twice is clipping once.
        np.testing.assert_allclose(
          twice[key],
          out,
          rtol=TOL,
          atol=1e-6 * np.max(np.abs(out), initial=0) + 1e-37,
          err_msg=msg,
        )
