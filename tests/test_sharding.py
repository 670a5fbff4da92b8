"""Clippers on many devices: sharded params under jit, and axis_name inside
shard_map / pmap.

The root conftest.py gives the CPU eight devices before jax is imported. Each
test compiles one program that runs every clipper side by side (compiling one
program per clipper would take minutes on a small CI machine).
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from fast_compile import compile_fast
from fast_compile import run_fast
import optaxclip
from sharded_runs import assert_updates_close
from sharded_runs import one_device_and_mapped
from sharded_runs import put

# Every clipper checked on sharded trees, by name: a factory of the clipper
# that is chained before adam. A new clipper is checked by adding it here.
CLIPPERS = {
  "clip_value": lambda: optaxclip.clip_value(0.5),
  "clip_norm": lambda: optaxclip.clip_norm(1.0),
  "clip_norm_axis0": lambda: optaxclip.clip_norm(1.0, axis=0),
  "clip_global": lambda: optaxclip.clip_global(2.0),
  "clip_global_inf": lambda: optaxclip.clip_global(0.5, ord="inf"),
  "clip_block_rms": lambda: optaxclip.clip_block_rms(0.5),
  "clip_unitwise": lambda: optaxclip.clip_unitwise(0.1),
  "clipped": lambda: optaxclip.clipped(optax.identity(), clipnorm=1.0),
  # Adaptive: short warm-ups so that three steps exercise the adaptation.
  "clip_zscore": lambda: optaxclip.clip_zscore(warmup_steps=1),
  "clip_zscore_leaf": lambda: optaxclip.clip_zscore(
    warmup_steps=1, scope="leaf"
  ),
  "clip_percentile": lambda: optaxclip.clip_percentile(50.0, history=4),
  "clip_percentile_leaf": lambda: optaxclip.clip_percentile(
    50.0, history=4, scope="leaf"
  ),
  "clip_relative": lambda: optaxclip.clip_relative(
    warmup_steps=1, warmup_max_norm=2.0
  ),
  "guard": lambda: optaxclip.guard(
    optaxclip.clip_global(2.0), spike_z=1.0, warmup_steps=1
  ),
  # The SPAM family (whole optimizers chained before adam here too): on an
  # Explicit mesh their selects of a state by a scalar must give the scalar
  # a sharding when broadcasting it (without one, a ShardingTypeError).
  "clip_spikes": lambda: optaxclip.clip_spikes(2.0, b2=0.5, grad_accu_steps=1),
  "clip_spikes_adaptive": lambda: optaxclip.clip_spikes_adaptive(0.5),
  "scale_by_norm_ema": optaxclip.scale_by_norm_ema,
  "spam": lambda: optaxclip.spam(
    1e-2, threshold=2.0, grad_accu_steps=1, warmup_steps=1, reset_interval=2
  ),
  "stable_spam": lambda: optaxclip.stable_spam(1e-2, reset_interval=2),
}

# A small FSDP-style layout: kernels split along one axis or the other, and a
# replicated bias. Every leaf is a matrix so that clip_norm's axis=0 fits all.
LAYOUT = {
  "kernel_in": ((16, 8), P("d", None)),
  "kernel_out": ((8, 24), P(None, "d")),
  "bias": ((1, 3), P()),
}
STEP_SCALES = (1.0, 5.0, 0.2)  # three steps: the adaptive clippers move.
TOL = 1e-5


def _is_layout_leaf(x):
  return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], P)


def _tree(seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda leaf: (scale * rng.normal(size=leaf[0])).astype(np.float32),
    LAYOUT,
    is_leaf=_is_layout_leaf,
  )


def _specs():
  return jax.tree.map(lambda leaf: leaf[1], LAYOUT, is_leaf=_is_layout_leaf)


def _mesh(kind):
  assert jax.device_count() >= 8, "conftest.py must set 8 host devices"
  if kind == "auto":
    return jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
  return jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))


def _put(tree, mesh):
  return put(tree, mesh, _specs())


def collectives(hlo_text):
  """(all-reduce instructions, their result types, all-gather mentions)."""
  reduces = re.findall(r"= (\S+|\([^)]*\)) all-reduce(?:-start)?\(", hlo_text)
  return len(reduces), reduces, hlo_text.count("all-gather")


def _optimizers():
  return {
    name: optax.chain(make(), optax.adam(1e-2))
    for name, make in CLIPPERS.items()
  }


def _run(params, grads_per_step):
  """Every optimizer, len(grads_per_step) steps, in one compiled program.

  The steps run in a ``lax.scan`` (compiled once), starting from states made
  in the same program: the state's shardings are those the step gives them.
  """
  txs = _optimizers()

  def train(params, stacked_grads):
    def step(states, grads):
      outs = {}
      for name, tx in txs.items():
        updates, state = tx.update(grads, states[name], params)
        outs[name] = (updates, optax.apply_updates(params, updates), state)
      return {name: out[2] for name, out in outs.items()}, outs

    states = {name: tx.init(params) for name, tx in txs.items()}
    _, outs = jax.lax.scan(step, states, stacked_grads)
    return jax.tree.map(lambda x: x[-1], outs)

  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *grads_per_step)
  compiled = compile_fast(jax.jit(train).lower(params, stacked))
  return compiled(params, stacked), compiled.as_text()


@functools.cache
def _single_device_result():
  params = _tree(0)
  grads = [_tree(1, s) for s in STEP_SCALES]
  return _run(params, grads)[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_every_clipper_on_an_fsdp_tree(kind):
  mesh = _mesh(kind)
  params = _put(_tree(0), mesh)
  grads = [_put(_tree(1, s), mesh) for s in STEP_SCALES]
  with jax.set_mesh(mesh):
    outs, hlo = _run(params, grads)
  n_reduce, _, n_gather = collectives(hlo)
  assert n_gather == 0, "a clipper gathers sharded leaves"
  assert n_reduce > 0  # norms and statistics are reduced across devices.
  reference = _single_device_result()
  for name, (updates, new_params, state) in outs.items():
    ref_updates, _, ref_state = reference[name]
    np.testing.assert_allclose(
      np.concatenate([np.ravel(x) for x in jax.tree.leaves(updates)]),
      np.concatenate([np.ravel(x) for x in jax.tree.leaves(ref_updates)]),
      rtol=TOL,
      atol=TOL,
      err_msg=name,
    )
    got, want = optaxclip.stats(state), optaxclip.stats(ref_state)
    assert got.keys() == want.keys() and got, name
    for key in got:
      np.testing.assert_allclose(
        got[key], want[key], rtol=TOL, atol=TOL, err_msg=f"{name}: {key}"
      )
    for tree in (updates, new_params):
      for out, inp in zip(jax.tree.leaves(tree), jax.tree.leaves(params)):
        assert out.sharding.is_equivalent_to(inp.sharding, inp.ndim), (
          name,
          out.sharding,
          inp.sharding,
        )


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_clip_global_sends_scalars_only(kind):
  mesh = _mesh(kind)
  grads = _put(_tree(1), mesh)
  tx = optaxclip.clip_global(1.0)
  with jax.set_mesh(mesh):
    compiled = jax.jit(tx.update).lower(grads, tx.init(grads)).compile()
  hlo = compiled.as_text()
  n_reduce, types, n_gather = collectives(hlo)
  assert n_gather == 0
  assert all(re.fullmatch(r"\(?(f32\[\](, )?)+\)?", t) for t in types), types
  # The ordinary step runs the entry computation; the rescaling fallback,
  # taken only on overflow or underflow, lives in a conditional branch.
  entry = hlo[hlo.index("\nENTRY") :]
  entry = entry[: entry.index("\n}")]
  assert collectives(entry)[0] == 1, entry
  assert n_reduce >= 1


# ---------------------------------------------------------------- shard_map

# Inside shard_map each device holds a local shard. `sharded` says which
# leaves are split along an axis their norm spans; the rest are replicated
# (or, for unit-wise clipping, split along the units' other axis).
SHARD_SPECS = {"w_in": P("d", None), "w_out": P(None, "d"), "b": P()}


def _shard_map_cases():
  def by_path(path, leaf):
    del leaf
    return path[0].key != "b"

  return {
    "clip_global": (
      lambda **kw: optaxclip.clip_global(2.0, **kw),
      {"sharded": {"w_in": True, "w_out": True, "b": False}},
    ),
    "clip_global_inf": (
      lambda **kw: optaxclip.clip_global(0.5, ord="inf", **kw),
      {"sharded": by_path},
    ),
    "clip_norm": (
      lambda **kw: optaxclip.clip_norm(1.0, **kw),
      {"sharded": by_path},
    ),
    "clip_norm_axis0": (
      lambda **kw: optaxclip.clip_norm(1.0, axis=0, **kw),
      {"sharded": {"w_in": True, "w_out": False, "b": False}},
    ),
    "clip_block_rms": (
      lambda **kw: optaxclip.clip_block_rms(0.5, **kw),
      {"sharded": by_path},
    ),
    # Dense kernels: units span axis 0, so w_out holds whole units.
    "clip_unitwise": (
      lambda **kw: optaxclip.clip_unitwise(0.1, **kw),
      {"sharded": {"w_in": True, "w_out": False, "b": False}},
    ),
  }


def _shard_tree(seed, scale=1.0):
  rng = np.random.default_rng(seed)
  shapes = {"w_in": (16, 4), "w_out": (4, 16), "b": (1, 3)}
  return {
    k: (scale * rng.normal(size=s)).astype(np.float32)
    for k, s in shapes.items()
  }


def test_axis_name_inside_shard_map_matches_one_device():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
  cases = _shard_map_cases()
  params, grads = _shard_tree(0), _shard_tree(1, 3.0)
  # Statistics that only count local units (see clip_unitwise's docstring).
  local_stats = {"clip_unitwise", "clip_norm_axis0"}

  def run(grads, params, mapped):
    out = {}
    for name, (make, kwargs) in cases.items():
      tx = make(axis_name="d", **kwargs) if mapped else make()
      updates, state = tx.update(grads, tx.init(params), params)
      if name in local_stats and mapped:
        state = None
      out[name] = (updates, state)
    return out

  out_specs = {
    name: (SHARD_SPECS, None if name in local_stats else P()) for name in cases
  }
  got, want = one_device_and_mapped(
    run, mesh, SHARD_SPECS, out_specs, grads, params
  )
  assert_updates_close(got, want, grads, TOL)
  for name in cases:
    if name not in local_stats:
      for field in ("norm", "clipped_norm", "clip_fraction"):
        np.testing.assert_allclose(
          getattr(got[name][1], field),
          getattr(want[name][1], field),
          rtol=TOL,
          atol=TOL,
          err_msg=f"{name}: {field}",
        )
    # The clipping changes something in every case (not a vacuous check).
    assert not np.allclose(want[name][0]["w_in"], grads["w_in"]), name


def test_max_norms_keep_one_devices_nan_inside_shard_map():
  """A NaN on one device makes ord=inf norms NaN on every device, as on one
  device (the non-finite policy: its leaf NaN, for clip_global the whole
  tree). XLA:CPU's all-reduce max drops a NaN, so ``clip_global(ord=inf)``
  and ``clip_norm(ord=inf)`` read the norm of the other devices' values and
  clipped them as usual.
  """
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
  params, grads = _shard_tree(0), _shard_tree(1, 3.0)
  grads["w_in"][5, 1] = np.nan  # on the third of eight devices
  cases = {
    "clip_global": lambda **kw: optaxclip.clip_global(0.5, ord=math.inf, **kw),
    "clip_norm": lambda **kw: optaxclip.clip_norm(0.5, ord=math.inf, **kw),
  }

  def by_path(path, leaf):
    del leaf
    return path[0].key != "b"

  def run(grads, params, mapped):
    out = {}
    for name, make in cases.items():
      tx = make(axis_name="d", sharded=by_path) if mapped else make()
      updates, state = tx.update(grads, tx.init(params), params)
      out[name] = (updates, state.norm)
    return out

  out_specs = {name: (SHARD_SPECS, P()) for name in cases}
  got, want = one_device_and_mapped(
    run, mesh, SHARD_SPECS, out_specs, grads, params
  )
  assert_updates_close(got, want, grads, TOL)  # NaN where one device's are
  for name in cases:
    assert np.isnan(want[name][1]) and np.isnan(got[name][1]), name
    # The NaN's leaf is NaN (clip_global: the whole tree).
    assert np.isnan(got[name][0]["w_in"]).all(), name
  assert np.isnan(got["clip_global"][0]["w_out"]).all()


def test_replicated_leaves_are_counted_once():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
  b = np.full((3,), 4.0, np.float32)  # norm sqrt(48) on every device.

  def norm(sharded):
    tx = optaxclip.clip_global(1.0, axis_name="d", sharded=sharded)
    f = jax.shard_map(
      lambda g: tx.update(g, tx.init(g))[1].norm,
      mesh=mesh,
      in_specs=(P(),),
      out_specs=P(),
      check_vma=False,
    )
    return float(jax.jit(f)({"b": b}))

  np.testing.assert_allclose(norm(False), math.sqrt(48), rtol=TOL)
  np.testing.assert_allclose(norm(True), math.sqrt(8 * 48), rtol=TOL)


def test_tuple_axis_name_and_pmap():
  g = _shard_tree(1, 3.0)
  want, want_state = run_fast(
    optaxclip.clip_global(2.0).update, g, optaxclip.clip_global(2.0).init(g)
  )
  # A 2x4 mesh, the kernel split over both axes at once.
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
  specs = {"w_in": P(("a", "b"), None), "w_out": P(None, ("a", "b")), "b": P()}
  tx = optaxclip.clip_global(
    2.0, axis_name=("a", "b"), sharded={"w_in": True, "w_out": True, "b": False}
  )
  f = jax.shard_map(
    lambda g: tx.update(g, tx.init(g)),
    mesh=mesh,
    in_specs=(specs,),
    out_specs=(specs, P()),
  )
  got, state = run_fast(
    f,
    put(g, mesh, specs),
  )
  for key in g:
    np.testing.assert_allclose(got[key], want[key], rtol=TOL, atol=TOL)
  np.testing.assert_allclose(state.norm, want_state.norm, rtol=TOL)
  # pmap: the leading axis of w_in split over 8 devices, b replicated.
  tx = optaxclip.clip_global(
    2.0, axis_name="i", sharded={"w_in": True, "b": False}
  )
  local = {
    "w_in": g["w_in"].reshape(8, 2, 4),
    "b": np.broadcast_to(g["b"], (8, 1, 3)),
  }
  out, state = jax.pmap(lambda g: tx.update(g, tx.init(g)), axis_name="i")(
    local
  )
  ref_tx = optaxclip.clip_global(2.0)
  ref, ref_state = ref_tx.update(
    {"w_in": g["w_in"], "b": g["b"]}, ref_tx.init(g)
  )
  np.testing.assert_allclose(
    out["w_in"].reshape(16, 4), ref["w_in"], rtol=TOL, atol=TOL
  )
  np.testing.assert_allclose(out["b"][3], ref["b"], rtol=TOL, atol=TOL)
  np.testing.assert_allclose(state.norm, np.full(8, ref_state.norm), rtol=TOL)


def test_axis_name_is_checked():
  with pytest.raises(TypeError, match="axis_name"):
    optaxclip.clip_global(1.0, axis_name=3)
  with pytest.raises(TypeError, match="axis_name"):
    optaxclip.clip_block_rms(1.0, axis_name=("a", 1))


# ------------------------------------------- adaptive clippers and guard

# Each judges a norm: with axis_name every device must see the global one,
# take the same decision and hold the same state as one device.
ADAPTIVE_CASES = {
  "clip_zscore": lambda **kw: optaxclip.clip_zscore(warmup_steps=2, **kw),
  "clip_zscore_leaf": lambda **kw: optaxclip.clip_zscore(
    warmup_steps=2, scope="leaf", **kw
  ),
  "clip_percentile": lambda **kw: optaxclip.clip_percentile(
    50.0, history=3, **kw
  ),
  "clip_percentile_leaf": lambda **kw: optaxclip.clip_percentile(
    50.0, history=3, scope="leaf", **kw
  ),
  "clip_relative": lambda **kw: optaxclip.clip_relative(
    warmup_steps=1, warmup_max_norm=20.0, **kw
  ),
  "guard": lambda **kw: optaxclip.guard(
    optax.sgd(1.0), max_norm=25.0, spike_z=1.0, warmup_steps=2, **kw
  ),
  # Per leaf, over a window, loss-aware: Adam's moments split by leaf.
  "guard_leaf": lambda **kw: optaxclip.guard(
    optax.adam(0.1),
    max_norm=25.0,
    spike_z=1.0,
    warmup_steps=2,
    window=3,
    scope="leaf",
    loss_spike_z=3.0,
    **kw,
  ),
  # Stable-SPAM's per-leaf largest magnitude and norm, and the whole of it.
  "clip_spikes_adaptive": lambda **kw: optaxclip.clip_spikes_adaptive(
    0.5, **kw
  ),
  "scale_by_norm_ema": optaxclip.scale_by_norm_ema,
  "stable_spam": lambda **kw: optaxclip.stable_spam(0.1, **kw),
}
# What shows that each case acted on the spike (not vacuous).
ADAPTIVE_ACTED = {
  "guard": "guard/skipped",
  "guard_leaf": "guard/skipped",
  "stable_spam": "clip_spikes_adaptive/clip_fraction",
  "scale_by_norm_ema": "scale_by_norm_ema/scale",
}
# Norm scales of the steps: warm-up, ordinary, a spike the clippers cut and
# guard skips (global norm above 25), then ordinary again.
ADAPTIVE_SCALES = (1.0, 1.2, 9.0, 1.1)


def _adaptive_run(grads_per_step, mapped_kwargs=None):
  """Every adaptive case, all steps: the last updates and every stats()."""

  def run(stacked, params):
    out = {}
    for name, make in ADAPTIVE_CASES.items():
      tx = make(**(mapped_kwargs or {}))

      def step(state, g, tx=tx, name=name):
        extra = {}
        if name == "guard_leaf":
          # w_out of norm 4 at every step: only some leaves are skipped. A
          # loss every device sees alike (b is replicated), that does not
          # spike with the gradients' scale.
          g = dict(g, w_out=0.5 * jnp.sign(g["w_out"]))
          extra["value"] = jnp.sum(g["b"]) / jnp.max(jnp.abs(g["b"]))
        updates, state = tx.update(g, state, params, **extra)
        return state, (updates, optaxclip.stats(state))

      _, (updates, stats) = jax.lax.scan(step, tx.init(params), stacked)
      out[name] = (updates, stats)
    return out

  return run


def _stack(trees):
  return jax.tree.map(lambda *xs: np.stack(xs), *trees)


def _check_adaptive(got, want, leaf_view=lambda x: x):
  for name in ADAPTIVE_CASES:
    (g_updates, g_stats), (w_updates, w_stats) = got[name], want[name]
    for key in w_updates:
      np.testing.assert_allclose(
        leaf_view(g_updates[key]),
        w_updates[key],
        rtol=TOL,
        atol=TOL,
        err_msg=f"{name}: {key}",
      )
    assert g_stats.keys() == w_stats.keys(), name
    for key in w_stats:
      np.testing.assert_allclose(
        g_stats[key], w_stats[key], rtol=TOL, atol=TOL, err_msg=f"{name}: {key}"
      )
  # Not vacuous: the spike was cut or skipped everywhere.
  for name in ADAPTIVE_CASES:
    stats = want[name][1]
    key = ADAPTIVE_ACTED.get(name, f"{name.replace('_leaf', '')}/clip_fraction")
    acted = stats[key] - 1.0 if key.endswith("/scale") else stats[key]
    assert np.max(np.abs(acted)) > 0, name


@functools.cache
def _adaptive_single_device():
  params = _shard_tree(0)
  stacked = _stack([_shard_tree(1, s) for s in ADAPTIVE_SCALES])
  return params, stacked, run_fast(_adaptive_run(None), stacked, params)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)])
def test_adaptive_clippers_inside_shard_map_match_one_device(mesh_shape):
  params, stacked, want = _adaptive_single_device()
  names = ("d",) if len(mesh_shape) == 1 else ("a", "b")
  axis = names[0] if len(names) == 1 else names
  mesh = jax.sharding.Mesh(
    np.array(jax.devices()[:8]).reshape(mesh_shape), names
  )
  specs = {"w_in": P(axis, None), "w_out": P(None, axis), "b": P()}
  stacked_specs = {k: P(None, *s) for k, s in specs.items()}
  kwargs = dict(
    axis_name=axis, sharded={"w_in": True, "w_out": True, "b": False}
  )
  out_specs = {name: (stacked_specs, P()) for name in ADAPTIVE_CASES}
  # Default check_vma=True: guard's cond branches must agree on their types.
  mapped = jax.shard_map(
    _adaptive_run(None, kwargs),
    mesh=mesh,
    in_specs=(stacked_specs, specs),
    out_specs=out_specs,
  )
  got = run_fast(
    mapped, put(stacked, mesh, stacked_specs), put(params, mesh, specs)
  )
  _check_adaptive(got, want)


@pytest.mark.slow
def test_adaptive_clippers_under_pmap_match_one_device():
  params, stacked, want = _adaptive_single_device()
  # pmap: w_in split along its rows over 8 devices, w_out along its
  # columns, b replicated (the device axis leads every local array).
  local = lambda t: {
    "w_in": np.moveaxis(
      t["w_in"].reshape(t["w_in"].shape[:-2] + (8, 2, 4)), -3, 0
    ),
    "w_out": np.moveaxis(
      t["w_out"].reshape(t["w_out"].shape[:-1] + (8, 2)), -2, 0
    ),
    "b": np.broadcast_to(t["b"], (8,) + t["b"].shape),
  }
  kwargs = dict(
    axis_name="i", sharded={"w_in": True, "w_out": True, "b": False}
  )
  got = jax.pmap(_adaptive_run(None, kwargs), axis_name="i")(
    local(stacked), local(params)
  )
  for name in ADAPTIVE_CASES:  # every device holds the same statistics
    for key, value in got[name][1].items():
      np.testing.assert_array_equal(
        value, np.broadcast_to(value[:1], value.shape), key
      )
  # (device, step, ...) -> (step, whole leaf)
  merge = lambda x, axis, shape: np.moveaxis(x, 0, axis).reshape(
    (x.shape[1],) + shape
  )
  unlocal = {
    "w_in": lambda x: merge(x, -3, (16, 4)),
    "w_out": lambda x: merge(x, -2, (4, 16)),
    "b": lambda x: x[3],
  }
  got = {
    name: (
      {k: unlocal[k](np.asarray(v)) for k, v in u.items()},
      {k: np.asarray(v)[0] for k, v in s.items()},
    )
    for name, (u, s) in got.items()
  }
  _check_adaptive(got, want)


def test_guard_takes_one_decision_for_all_devices_under_pmap():
  # An FSDP-split kernel (8, 2), global norm 13.4: the rows' norms straddle
  # max_norm, so decisions from local norms would differ between devices.
  rows = np.linspace(0.5, 8.0, 8)
  kernel = (
    np.stack([rows, np.zeros(8)], axis=1) * 13.4 / np.linalg.norm(rows)
  ).astype(np.float32)
  local_norms = np.linalg.norm(kernel, axis=1)
  assert local_norms.min() < 5.0 < local_norms.max()

  def steps(tx):
    def run(g):
      state = tx.init(g)
      _, state = tx.update(g, state, g)  # norm 13.4: skipped
      _, state = tx.update(g / 10, state, g)  # norm 1.34: applied
      return state.inner_state[0].count, state.counts.skipped

    return jax.pmap(run, axis_name="i")(kernel.reshape(8, 1, 2))

  counts, skipped = steps(
    optaxclip.guard(optax.adam(1e-3), max_norm=5.0, axis_name="i")
  )
  np.testing.assert_array_equal(counts, np.ones(8))
  np.testing.assert_array_equal(skipped, np.ones(8))


def test_adaptive_axis_name_is_checked():
  for make in (
    lambda: optaxclip.clip_zscore(axis_name=3),
    lambda: optaxclip.clip_percentile(axis_name=("a", 1)),
    lambda: optaxclip.clip_relative(axis_name=1.0),
    lambda: optaxclip.guard(optax.sgd(1.0), axis_name=2),
    lambda: optaxclip.clip_spikes_adaptive(axis_name=2),
    lambda: optaxclip.scale_by_norm_ema(axis_name=("a", 1)),
    lambda: optaxclip.stable_spam(1e-3, axis_name=2.0),
  ):
    with pytest.raises(TypeError, match="axis_name"):
      make()

  with pytest.raises(ValueError, match="clip_norm: axis_name must not be"):
    optaxclip.clip_norm(1.0, axis_name="")
  with pytest.raises(ValueError, match="axis_name must name each axis once"):
    optaxclip.clip_global(1.0, axis_name=("a", "a"))


@pytest.mark.parametrize(
  "bad, error",
  [
    ("no", TypeError),  # a truthy string is not True
    ({"w": "yes"}, TypeError),
    ({"w": 1}, TypeError),
    (("fsdp",), ValueError),  # not an axis of axis_name
    (P("d", "d"), ValueError),
  ],
)
def test_sharded_is_checked_when_built(bad, error):
  for make in (
    optaxclip.clip_global,
    optaxclip.clip_norm,
    optaxclip.clip_block_rms,
    optaxclip.clip_unitwise,
  ):
    with pytest.raises(error, match=f"{make.__name__}: sharded"):
      make(1.0, axis_name="d", sharded=bad)
  for make in (optaxclip.clip_spikes_adaptive, optaxclip.scale_by_norm_ema):
    with pytest.raises(error, match=f"{make.__name__}: sharded"):
      make(axis_name="d", sharded=bad)
  with pytest.raises(error, match="stable_spam: sharded"):
    optaxclip.stable_spam(1e-3, axis_name="d", sharded=bad)


# ------------------------------------------- per-leaf axes on a 2-D mesh

# A ("data", "fsdp") mesh with leaves split over both axes (on one dimension
# or on two), over fsdp only (replicated over data), along a kernel's output
# axis, and replicated.
MESH_2D_SPECS = {
  "both": P(("data", "fsdp"), None),
  "both_2d": P("data", "fsdp"),
  "fsdp": P("fsdp", None),
  "out": P(None, "fsdp"),
  "rep": P(),
}
MESH_2D_AXES = {
  "both": ("data", "fsdp"),
  "both_2d": ("data", "fsdp"),
  "fsdp": ("fsdp",),
  "out": ("fsdp",),
  "rep": False,
}


def _tree_2d(seed, scale=1.0):
  rng = np.random.default_rng(seed)
  shapes = {
    "both": (16, 6),
    "both_2d": (8, 8),
    "fsdp": (8, 6),
    "out": (6, 8),
    "rep": (1, 3),
  }
  return {
    k: (scale * rng.normal(size=s)).astype(np.float32)
    for k, s in shapes.items()
  }


def _cases_2d():
  names = ("data", "fsdp")
  specs, axes = MESH_2D_SPECS, MESH_2D_AXES
  return {
    "clip_global/spec": lambda m: optaxclip.clip_global(
      2.0, **({"axis_name": names, "sharded": specs} if m else {})
    ),
    "clip_global/axes": lambda m: optaxclip.clip_global(
      2.0, **({"axis_name": names, "sharded": axes} if m else {})
    ),
    "clip_norm/spec": lambda m: optaxclip.clip_norm(
      1.0, **({"axis_name": names, "sharded": specs} if m else {})
    ),
    "clip_norm/axes": lambda m: optaxclip.clip_norm(
      1.0, **({"axis_name": names, "sharded": axes} if m else {})
    ),
    "clip_norm_axis0/spec": lambda m: optaxclip.clip_norm(
      1.0, axis=0, **({"axis_name": names, "sharded": specs} if m else {})
    ),
    "clip_block_rms/axes": lambda m: optaxclip.clip_block_rms(
      0.3, **({"axis_name": names, "sharded": axes} if m else {})
    ),
    "clip_unitwise/spec": lambda m: optaxclip.clip_unitwise(
      0.1, **({"axis_name": names, "sharded": specs} if m else {})
    ),
  }


@pytest.mark.slow
def test_per_leaf_axes_on_a_2d_mesh_match_one_device():
  mesh = jax.make_mesh(
    (2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2
  )
  cases = _cases_2d()
  params, grads = _tree_2d(0), _tree_2d(1, 3.0)

  def run(grads, params, mapped):
    out = {}
    for name, make in cases.items():
      tx = make(mapped)
      out[name] = tx.update(grads, tx.init(params), params)
    return out

  out_specs = {name: (MESH_2D_SPECS, P()) for name in cases}
  got, want = one_device_and_mapped(
    run, mesh, MESH_2D_SPECS, out_specs, grads, params
  )
  assert_updates_close(got, want, grads, TOL)
  for name in cases:
    got_stats, want_stats = (
      optaxclip.stats(got[name][1]),
      optaxclip.stats(want[name][1]),
    )
    for key in want_stats:
      np.testing.assert_allclose(
        got_stats[key],
        want_stats[key],
        rtol=TOL,
        atol=TOL,
        err_msg=f"{name}: {key}",
      )
    assert (
      want_stats[f"{name.split('/')[0].replace('_axis0', '')}/clip_fraction"]
      > 0
    ), name  # something is clipped


@pytest.mark.slow
def test_a_nan_in_one_devices_units_takes_every_device_to_one_branch():
  """A NaN in units that one device holds: that device's unit sums leave
  the trusted range, the others' do not. Every device takes the branch of
  the norms' recompute ``lax.cond`` that one needs (a device taking its own
  would leave the others' collectives waiting until XLA aborts the process,
  as for ``clip_norm(axis=0)`` and ``clip_unitwise``), and the updates equal
  one device's (NaN in the NaN's unit).
  """
  mesh = jax.make_mesh(
    (2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2
  )
  cases = {
    k: v
    for k, v in _cases_2d().items()
    if k in ("clip_norm_axis0/spec", "clip_unitwise/spec", "clip_norm/spec")
  }
  params, grads = _tree_2d(0), _tree_2d(1, 3.0)
  grads["both_2d"][4, 1] = np.nan  # rows 4-7 on data 1, columns 0-1 on fsdp 0

  def run(grads, params, mapped):
    out = {}
    for name, make in cases.items():
      tx = make(mapped)
      out[name] = tx.update(grads, tx.init(params), params)[0]
    return out

  got, want = one_device_and_mapped(
    run, mesh, MESH_2D_SPECS, dict.fromkeys(cases, MESH_2D_SPECS), grads, params
  )
  for name in cases:
    for key in grads:
      np.testing.assert_allclose(
        got[name][key], want[name][key], rtol=TOL, atol=TOL, err_msg=name
      )
    assert np.isnan(want[name]["both_2d"][:, 1]).all(), name
  # Units along axis 0: only the NaN's column (clip_norm: the whole leaf).
  for name in ("clip_norm_axis0/spec", "clip_unitwise/spec"):
    assert not np.isnan(want[name]["both_2d"][:, 0]).any(), name


def test_global_norm_with_leaves_on_different_axes():
  """One kernel split over both axes, one over fsdp only, a replicated bias:
  of the four single-bool settings none is right; per-leaf axes are.
  """
  mesh = jax.make_mesh(
    (2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2
  )
  rng = np.random.default_rng(3)
  g = {
    "a": np.float32(rng.normal(size=(8, 4))),
    "b": np.float32(rng.normal(size=(4, 4))),
    "c": np.float32(rng.normal(size=(3,))),
  }
  specs = {"a": P(("data", "fsdp")), "b": P("fsdp"), "c": P()}
  want = np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in g.values()))

  def norm(sharded):
    tx = optaxclip.clip_global(1.0, axis_name=("data", "fsdp"), sharded=sharded)
    # Wrong settings give a different norm per device: no vma check.
    f = jax.shard_map(
      lambda g: tx.update(g, tx.init(g))[1].norm,
      mesh=mesh,
      in_specs=(specs,),
      out_specs=P(),
      check_vma=False,
    )
    return float(jax.jit(f)(put(g, mesh, specs)))

  np.testing.assert_allclose(norm(specs), want, rtol=TOL)
  np.testing.assert_allclose(
    norm({"a": ("data", "fsdp"), "b": ("fsdp",), "c": None}), want, rtol=TOL
  )
  np.testing.assert_allclose(
    norm(lambda path, leaf: specs[path[0].key]), want, rtol=TOL
  )
  for a in (False, True):
    for b in (False, True):
      assert not np.isclose(
        norm({"a": a, "b": b, "c": False}), want, rtol=1e-3
      ), (a, b)


def test_unitwise_units_come_from_the_global_shape():
  """A Dense kernel (8, 2) split 8 ways along its inputs is (1, 2) locally:
  its units are still its 2 columns.
  """
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
  rng = np.random.default_rng(5)
  w = {"k": np.float32(rng.normal(size=(8, 2)))}
  g = {"k": np.float32(rng.normal(size=(8, 2)) * [[1.0, 0.01]])}
  ref = optaxclip.clip_unitwise(0.1)
  want, want_state = run_fast(ref.update, g, ref.init(w), w)
  specs = {"k": P("d", None)}

  def mapped(tx):
    return jax.shard_map(
      lambda g, w: tx.update(g, tx.init(w), w),
      mesh=mesh,
      in_specs=(specs, specs),
      out_specs=(specs, P()),
    )

  for tx in (
    optaxclip.clip_unitwise(0.1, axis_name="d", sharded=specs),
    optaxclip.clip_unitwise(0.1, axis_name="d", axis=0),
  ):
    got, state = run_fast(mapped(tx), g, w)
    np.testing.assert_allclose(got["k"], want["k"], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(state.clip_fraction, want_state.clip_fraction)
  assert want_state.clip_fraction == 0.5  # one column clipped, one not
  tx = optaxclip.clip_unitwise(0.1, axis_name="d", sharded=True)
  with pytest.raises(
    ValueError,
    match=r"clip_unitwise: sharded must give "
    r"the leaf \['k'\] as a PartitionSpec",
  ):
    jax.jit(mapped(tx))(g, w)
  # pmap: the same kernel, one row per device.
  local_g, local_w = g["k"].reshape(8, 1, 2), w["k"].reshape(8, 1, 2)
  tx = optaxclip.clip_unitwise(0.1, axis_name="i", sharded={"k": P("i")})
  out, state = jax.pmap(
    lambda g, w: tx.update(g, tx.init(w), w), axis_name="i"
  )({"k": local_g}, {"k": local_w})
  np.testing.assert_allclose(
    out["k"].reshape(8, 2), want["k"], rtol=TOL, atol=TOL
  )
  np.testing.assert_allclose(state.clip_fraction, np.full(8, 0.5))


def test_sharded_prefix_survives_masked_and_frozen_dict():
  from flax.core import FrozenDict

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
  rng = np.random.default_rng(7)
  g = {
    "enc": {"k": np.float32(rng.normal(size=(16, 2)))},
    "dec": {
      "k": np.float32(rng.normal(size=(8, 4))),
      "b": np.float32(rng.normal(size=(4,))),
    },
  }
  specs = {"enc": {"k": P("d")}, "dec": {"k": P("d"), "b": P()}}
  mask = {"enc": False, "dec": True}  # the whole "enc" subtree masked out
  inner = lambda **kw: optaxclip.clip_global(1.0, **kw)
  ref = optax.masked(inner(), mask)
  want, _ = ref.update(g, ref.init(g))
  sharded = {"enc": {"k": True}, "dec": {"k": True, "b": False}}
  tx = optax.masked(inner(axis_name="d", sharded=sharded), mask)
  f = jax.shard_map(
    lambda g: tx.update(g, tx.init(g))[0],
    mesh=mesh,
    in_specs=(specs,),
    out_specs=specs,
  )
  got = jax.jit(f)(put(g, mesh, specs))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)
  # FrozenDict updates with a plain-dict prefix.
  tx = inner(axis_name="d", sharded=sharded)
  f = jax.shard_map(
    lambda g: tx.update(FrozenDict(g), tx.init(g))[1].norm,
    mesh=mesh,
    in_specs=(specs,),
    out_specs=P(),
  )
  want_norm = np.sqrt(sum(np.sum(x**2) for x in jax.tree.leaves(g)))
  np.testing.assert_allclose(
    jax.jit(f)(put(g, mesh, specs)), want_norm, rtol=TOL
  )
  with pytest.raises(
    ValueError,
    match=r"clip_global: sharded must be a "
    r"pytree prefix .* \['dec'\]\['b'\]",
  ):
    bad = inner(axis_name="d", sharded={"enc": True, "dec": {"k": True}})
    jax.eval_shape(lambda g: bad.update(g, bad.init(g)), g)


def test_spike_clipping_inside_shard_map_is_per_coordinate():
  """clip_spikes and spam clip each coordinate against its own moment: inside
  shard_map (vma checked) on leaves split over the axis and replicated ones
  (small ones packed together, large ones alone), each device's updates are
  its part of one device's. Their counts (``clipped``) stay per device.
  The packing keeps varying and replicated leaves apart: a spike count
  stacked over both would make the replicated leaves' updates vary across
  devices, and shard_map would refuse the program.
  """
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
  rng = np.random.default_rng(3)
  layout = {
    "a": ((16, 8), P("d", None)),
    "b": ((16, 8), P("d", None)),
    "c": ((5,), P()),
    "d": ((5,), P()),
    "e": ((8, 8192), P("d", None)),
    "f": ((5000,), P()),
  }
  specs = {k: s for k, (_, s) in layout.items()}
  steps = [
    {
      k: (
        rng.normal(size=shape) * 10.0 ** rng.integers(0, 3, size=shape)
      ).astype(np.float32)
      for k, (shape, _) in layout.items()
    }
    for _ in range(3)
  ]
  makers = {
    "clip_spikes": lambda: optaxclip.clip_spikes(
      2.0, b2=0.5, grad_accu_steps=1, reset_interval=2
    ),
    "spam": lambda: optaxclip.spam(
      1e-2, threshold=2.0, b2=0.5, grad_accu_steps=1, warmup_steps=1
    ),
  }
  for name, make in makers.items():

    def run(steps_, make=make):
      tx = make()
      state = tx.init(steps_[0])
      outs = []
      for g in steps_:
        u, state = tx.update(g, state, steps_[0])
        outs.append(u)
      return outs

    want = jax.jit(run)(steps)
    if name == "clip_spikes":  # not vacuous: later steps clip coordinates
      assert any(
        not np.array_equal(np.asarray(want[t][k]), steps[t][k])
        for t in (1, 2)
        for k in layout
      )
    mapped = jax.shard_map(
      run, mesh=mesh, in_specs=([specs] * 3,), out_specs=[specs] * 3
    )
    got = jax.jit(mapped)([put(g, mesh, specs) for g in steps])
    for t in range(3):
      for k in layout:
        np.testing.assert_allclose(
          np.asarray(got[t][k]),
          np.asarray(want[t][k]),
          rtol=TOL,
          atol=0,
          err_msg=f"{name}, step {t}, leaf {k}",
        )


def test_a_leaf_split_along_its_layer_axis_is_named_in_the_error():
  """leaf_stats with layer_axis inside shard_map, the state built outside on
  the global shapes and the leaf split along its layer axis (the default
  sharded=True): each device sees one layer of eight. The error names the
  leaf and asks for the split's dimensions.
  """
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  w = np.arange(24, dtype=np.float32).reshape(8, 3)
  tx = optaxclip.clip_global(1.0, axis_name="d", leaf_stats=True, layer_axis=0)
  state = tx.init({"w": w})

  @jax.jit
  @functools.partial(
    jax.shard_map, mesh=mesh, in_specs=(P("d", None), P()), out_specs=P()
  )
  def step(w_, state_):
    return tx.update({"w": w_}, state_)[1].norm

  with pytest.raises(
    ValueError,
    match=r"^clip_global: layer_axis on the leaf \['w'\], which is split "
    r"over \('d',\) along dimensions not declared .* as a PartitionSpec",
  ):
    step(w, state)


# 4 stacked layers of 3 values on a 2-device "stage" axis.
STAGE_W = np.arange(1, 13, dtype=np.float32).reshape(4, 3)


def _stage_leaf_norms(make, in_spec, w=STAGE_W):
  """The leaf norms of ``make()``'s state, built and updated inside
  shard_map over a 2-device ``stage`` axis, the leaf split by ``in_spec``.
  """
  mesh = jax.make_mesh(
    (2,), ("stage",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2]
  )

  @jax.jit
  @functools.partial(
    jax.shard_map, mesh=mesh, in_specs=(in_spec,), out_specs=P()
  )
  def step(w_):
    tx = make()
    return tx.update({"w": w_}, tx.init({"w": w_}))[1].leaf_norms.values

  return np.asarray(step(w))


LAYER_CLIPPERS = {
  "clip_global": lambda **kw: optaxclip.clip_global(100.0, **kw),
  "clip_relative": lambda **kw: optaxclip.clip_relative(warmup_steps=1, **kw),
  "guard": lambda **kw: optaxclip.guard(optax.sgd(1.0), max_norm=1e3, **kw),
}


@pytest.mark.parametrize("name", sorted(LAYER_CLIPPERS))
def test_layers_split_over_a_stage_axis_are_refused_not_mixed(name):
  """4 layers on a 2-device "stage" axis, init and update inside shard_map
  with the default sharded=True: each device holds layers (0, 1) or (2, 3),
  and the per-layer norms would be two, sqrt(L0**2 + L2**2) and sqrt(L1**2
  + L3**2). A clear error instead, and with a PartitionSpec the right
  numbers where every device holds every layer (the split on another axis)
  and an error where the layer axis is the split one.
  """
  make = LAYER_CLIPPERS[name]
  default = functools.partial(
    make, axis_name="stage", leaf_stats=True, layer_axis=0
  )
  with pytest.raises(
    ValueError, match=rf"^{name}: layer_axis on the leaf \['w'\], which is"
  ):
    _stage_leaf_norms(default, P("stage", None))
  split_layers = functools.partial(default, sharded=P("stage", None))
  with pytest.raises(
    ValueError,
    match=rf"^{name}: layer_axis must not be an axis split across devices; "
    r"got axis 0 of leaf \['w'\], split over \('stage',\)",
  ):
    _stage_leaf_norms(split_layers, P("stage", None))
  w = np.concatenate(
    [STAGE_W, STAGE_W[:, :1]], axis=1
  )  # (4, 4): 2 columns each
  split_columns = functools.partial(default, sharded=P(None, "stage"))
  np.testing.assert_allclose(
    _stage_leaf_norms(split_columns, P(None, "stage"), w),
    np.linalg.norm(w.astype(np.float64), axis=1),
    rtol=1e-6,
  )
