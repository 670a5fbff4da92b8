"""Property: inside shard_map, with per-leaf sharding specs, the clippers give
one device's numbers.

For random small trees, each leaf split over a random subset of the mesh's
axes along random dimensions (1, 2 or 8 devices, 1-D and 2-D meshes), the
updates and statistics of clip_global, clip_norm (whole leaves and
``axis=0``; both also with ``ord=inf``), clip_block_rms, clip_unitwise and
Stable-SPAM's per-leaf parts
(clip_spikes_adaptive, scale_by_norm_ema, stable_spam: two steps, the second
a spike) with ``sharded`` given as the leaves' PartitionSpecs (or, where the
form allows, as tuples of axis names) equal those of the same clipper on one
device; so do the updates of the element-wise clip_spikes and spam, without
``axis_name`` (leaves that vary across devices beside replicated ones). A
NaN or inf is sometimes put on one device (the non-finite policy).
Every example compiles two programs, so the examples are few
(tests/fast_compile.py compiles them cheaply).
"""

import functools
import math

import hypothesis
import hypothesis.strategies as st
import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from fast_compile import compile_fast
import fuzz_strategies as fz
import optaxclip
from sharded_runs import assert_updates_close
from sharded_runs import put

MESHES = {
  "1 device": ((1,), ("d",)),
  "2 devices": ((2,), ("d",)),
  "8 devices": ((8,), ("d",)),
  "2x4 devices": ((2, 4), ("data", "fsdp")),
}
TOL = 2e-5


# The ci profile draws the values into these layouts only, each once (each
# compiles a program; the one-device program is shared by every layout here,
# whose leaves have one set of shapes): per mesh, leaves split along their
# first, last or both dimensions, over one axis or two (one dimension over
# both axes of the 2-D mesh, in either order), and replicated leaves. The
# first (one device) is left to the release profile, which draws layouts
# freely: a mesh of one device splits nothing (tests/test_fuzz.py draws
# one-device shard_maps under ci).
LAYOUT_SHAPES = {"w0": (8, 4), "w1": (16,), "w2": (4, 8)}
LAYOUTS = (
  ("1 device", {"w0": P("d", None), "w1": P("d"), "w2": P(None, "d")}),
  ("2 devices", {"w0": P(None, "d"), "w1": P(), "w2": P("d", None)}),
  ("8 devices", {"w0": P("d"), "w1": P("d"), "w2": P(None, "d")}),
  (
    "2x4 devices",
    {
      "w0": P("data", "fsdp"),
      "w1": P(("data", "fsdp")),
      "w2": P("fsdp", ("data",)),
    },
  ),
  (
    "2x4 devices",
    {"w0": P(None, "fsdp"), "w1": P(), "w2": P(None, ("fsdp", "data"))},
  ),
)


@st.composite
def palette_trees(draw, layout):
  """(mesh name, {leaf: array}, {leaf: PartitionSpec}) of ``layout`` (one
  of :data:`LAYOUTS`), the values drawn.
  """
  mesh_name, specs = layout
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  tree = {}
  for k, shape in LAYOUT_SHAPES.items():
    scale = draw(st.sampled_from([0.1, 1.0, 10.0]))
    tree[k] = (scale * rng.normal(size=shape)).astype(np.float32)
  return mesh_name, _with_special(draw, rng, tree), dict(specs)


def _with_special(draw, rng, tree):
  """``tree`` with, sometimes, one NaN or inf at a random element of a
  random leaf: every device must come to the non-finite policy's result as
  one device does. It found two bugs: XLA:CPU's all-reduce max dropped a NaN
  held by one device (ord=inf norms read finite), and devices that
  disagreed on the unit norms' recompute branch hung the step.
  """
  special = draw(st.sampled_from([None, None, np.nan, np.inf, -np.inf]))
  if special is not None:
    key = draw(st.sampled_from(sorted(tree)))
    flat = tree[key].reshape(-1)
    flat[rng.integers(flat.size)] = special
  return tree


@st.composite
def sharded_trees(draw):
  """(mesh name, {leaf: array}, {leaf: PartitionSpec})."""
  mesh_name = draw(st.sampled_from(sorted(MESHES)))
  sizes, names = MESHES[mesh_name]
  size_of = dict(zip(names, sizes))
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  tree, specs = {}, {}
  for i in range(draw(st.integers(1, 3))):
    rank = draw(st.integers(1, 2))
    free = list(names)
    dims, entries = [], []
    for _ in range(rank):
      split = tuple(n for n in free if draw(st.booleans()))
      free = [n for n in free if n not in split]
      entries.append(
        None if not split else split[0] if len(split) == 1 else split
      )
      dims.append(
        draw(st.integers(1, 2)) * math.prod(size_of[n] for n in split)
      )
    scale = draw(st.sampled_from([0.1, 1.0, 10.0]))
    tree[f"w{i}"] = (scale * rng.normal(size=dims)).astype(np.float32)
    specs[f"w{i}"] = P(*entries)
  return mesh_name, _with_special(draw, rng, tree), specs


def _names(spec):
  return tuple(
    n for e in spec if e for n in ((e,) if isinstance(e, str) else e)
  )


def _clippers(specs, axis_name):
  """Factories ``mapped -> clipper``: on one device or sharded, by name."""
  axes = {k: _names(s) or False for k, s in specs.items()}

  def kw(mapped, sharded):
    return {"axis_name": axis_name, "sharded": sharded} if mapped else {}

  return {
    "clip_global": lambda m: optaxclip.clip_global(1.0, **kw(m, axes)),
    "clip_global_inf": lambda m: optaxclip.clip_global(
      1.0, ord=math.inf, **kw(m, axes)
    ),
    "clip_norm_inf": lambda m: optaxclip.clip_norm(
      0.5, ord=math.inf, **kw(m, specs)
    ),
    "clip_norm": lambda m: optaxclip.clip_norm(0.5, **kw(m, specs)),
    "clip_norm_axis0": lambda m: optaxclip.clip_norm(
      0.5, axis=0, **kw(m, specs)
    ),
    "clip_block_rms": lambda m: optaxclip.clip_block_rms(0.3, **kw(m, axes)),
    "clip_unitwise": lambda m: optaxclip.clip_unitwise(0.05, **kw(m, specs)),
    # Stable-SPAM's per-leaf largest magnitude and norm, and all of it.
    "clip_spikes_adaptive": lambda m: optaxclip.clip_spikes_adaptive(
      0.5, **kw(m, specs)
    ),
    "scale_by_norm_ema": lambda m: optaxclip.scale_by_norm_ema(**kw(m, axes)),
    "stable_spam": lambda m: optaxclip.stable_spam(0.1, **kw(m, specs)),
    # Element-wise: no axis_name, each device clips its own coordinates;
    # their counts are per device (not compared).
    "clip_spikes": lambda m: optaxclip.clip_spikes(
      2.0, b2=0.5, grad_accu_steps=1
    ),
    "spam": lambda m: optaxclip.spam(
      0.1, threshold=2.0, b2=0.5, grad_accu_steps=1, warmup_steps=1
    ),
  }


# Clippers with state that moves: two steps, the second a spike (3x).
TWO_STEPS = ("clip_spikes_adaptive", "scale_by_norm_ema", "stable_spam")
LOCAL_STATS = ("clip_spikes", "spam")


_COMPILED = {}


def _compiled(key, fn, *args):
  if key not in _COMPILED:
    _COMPILED[key] = compile_fast(jax.jit(fn).lower(*args))
  return _COMPILED[key]


@pytest.mark.parametrize(
  "layout",
  fz.ci_or(LAYOUTS[1:], (None,)),
  ids=lambda layout: layout[0].replace(" ", "_") if layout else "free",
)
@fz.examples(1)
@hypothesis.given(data=st.data())
def test_sharded_clippers_equal_one_device(layout, data):
  mesh_name, grads, specs = data.draw(
    palette_trees(layout) if layout else sharded_trees()
  )
  sizes, names = MESHES[mesh_name]
  mesh = jax.make_mesh(
    sizes, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(sizes)
  )
  params = jax.tree.map(lambda g: np.float32(np.cos(g) + 0.5), grads)
  clippers = _clippers(specs, names if len(names) > 1 else names[0])

  def run(grads, params, mapped):
    out = {}
    for name, make in clippers.items():
      tx = make(mapped)
      state = tx.init(params)
      if name in TWO_STEPS or name in LOCAL_STATS:
        _, state = tx.update(grads, state, params)
        grads_now = jax.tree.map(lambda g: 3 * g, grads)
      else:
        grads_now = grads
      updates, state = tx.update(grads_now, state, params)
      stats = {} if name in LOCAL_STATS else optaxclip.stats(state)
      out[name] = (updates, stats)
    return out

  out_specs = {name: (specs, P()) for name in clippers}
  # Each program compiled once (fast options) and reused by the examples
  # that repeat its layout: the one-device one by its shapes, the mapped one
  # by its mesh, specs and shapes.
  shapes = tuple((k, x.shape) for k, x in sorted(grads.items()))
  want = _compiled(
    ("one device", shapes),
    functools.partial(run, mapped=False),
    grads,
    params,
  )(grads, params)
  mapped = jax.shard_map(
    functools.partial(run, mapped=True),
    mesh=mesh,
    in_specs=(specs, specs),
    out_specs=out_specs,
  )
  placed = put(grads, mesh, specs), put(params, mesh, specs)
  key = (mesh_name, tuple(sorted(specs.items())), shapes)
  got = _compiled(key, mapped, *placed)(*placed)
  assert_updates_close(got, want, grads, TOL)
  for name in clippers:
    for key, value in want[name][1].items():
      np.testing.assert_allclose(
        got[name][1][key], value, rtol=TOL, atol=TOL, err_msg=f"{name} {key}"
      )
