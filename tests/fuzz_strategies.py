"""Shared hypothesis strategies and float64 NumPy oracles for the fuzz suite.

``tests/test_fuzz.py`` (the cross-cutting invariants) and every
``tests/test_fuzz_<what>.py`` import this module (``import
fuzz_strategies as fz``; pytest puts ``tests/`` on ``sys.path``). Everything
drawn is plain NumPy on the host; tests move it to JAX themselves, inside
:func:`x64` when a float64 leaf may be present.

API
---
Dtypes and x64
  ``DTYPES``: name -> NumPy dtype for ``"float16"``, ``"bfloat16"``,
  ``"float32"``, ``"float64"``, ``"complex64"``. ``REAL`` (the first four),
  ``LOW`` (float16, bfloat16).
  ``dtype_names(names=DTYPES)``: strategy of dtype names.
  ``x64(tree_or_dtypes)``: context manager, ``jax.enable_x64(True)`` when a
  float64 leaf (or dtype name) is present, else a null context. Why a
  context and not a subprocess: ``jax_enable_x64`` is part of every jit
  cache key (the trace context), so a function jitted once is traced again
  under the other mode instead of reusing a wrong program; the context is
  thread-local and restored on exit, so tests that do not ask for it keep
  float32 defaults. A subprocess would pay a JAX import (~2 s) per example.
  ``uses_x64(tree)``: whether a tree holds a float64 leaf.

Shapes (a small fixed set: each new shape compiles again)
  ``SHAPES``: scalars, vectors, matrices, rank 3, and empty ones.
  ``MATRIX_SHAPES``: rank >= 2 (for ``axis=0``/``-1`` and unit-wise).
  ``SHARD_SHAPES``: leading dimension a multiple of 8 (split over 1, 2 or 8
  devices). ``LARGE_SHAPE``: above ``_norms.SMALL_LEAF_SIZE`` elements (the
  not-concatenated path), CI-cheap (~70k elements).
  ``shapes(choices=SHAPES, large=False)``: strategy.

Values
  ``exponents(dtype, magnitudes="all")``: binary exponents over the whole
  finite range of the dtype, piled up at the edges (subnormal, smallest
  normal, 2**126 and around, near the largest finite); ``"ordinary"``
  (2**-40..2**40, no overflow or underflow) or ``"extreme"`` (edges only).
  ``MAGNITUDES``: the three names. Every value strategy below takes
  ``magnitudes=``.
  ``limits(zero=True, inf=True, magnitudes="all")``: a clip limit as a
  Python float exactly representable in float32 (0, subnormal excluded,
  tiny, ordinary, huge, inf).
  ``arrays(dtype, shape, nonfinite=False, magnitudes="all")``: one leaf.
  Elements are ``sign * 2**(e - spread * u) * mantissa`` from a drawn seed
  (NumPy generates them, so large leaves cost no more to draw), the dtype's
  extremes (0, smallest subnormal, smallest normal, largest finite) put at
  drawn places; ``nonfinite=True`` sprinkles NaN / +inf / -inf (maybe none
  in one leaf; a tree of :func:`trees` then holds at least one, unless all
  its leaves are empty).
  ``trees(dtypes=REAL, shapes=SHAPES, min_leaves=0, max_leaves=4,
  nonfinite=False, large=False, magnitudes="all")``: a pytree of such
  leaves in dict / list nesting (an empty tree when 0 leaves).
  ``like(tree, nonfinite=False, magnitudes="all")``: a strategy of a tree
  of the same structure, shapes and dtypes (params for clip_unitwise).
  ``per_example_trees(batch_sizes=(1, 2, 4, 8), ..., nonfinite=False,
  magnitudes="ordinary", huge=True, palette=True)``: every leaf with a
  leading batch axis; whole examples may be zero, huge (half the dtype's
  largest value) or non-finite; under the ci profile the layout comes from
  ``PER_EXAMPLE_LAYOUTS``.
  ``has_nonfinite(tree)``, ``leaves(tree)``.

Clipper configurations
  ``Config(name, kwargs)``: frozen and hashable (cache jitted runners on it),
  ``.make(limit=None)`` builds the transformation (``limit`` overrides the
  first argument, may be a tracer), ``.limit``, ``.kind`` (``"static"``,
  ``"adaptive"``, ``"guard"``, ``"per_example"``), ``.needs_params``; its
  ``repr`` is the call, so falsifying examples read as code.
  ``static_configs(ords=..., axes=...)``: clip_value, clip_norm (ord, axis),
  clip_global (ord), clip_block_rms, clip_unitwise, clipped(...).
  ``adaptive_configs()``: clip_zscore, clip_percentile, clip_relative with
  short warm-ups and histories. ``guard_configs()``: guard around
  clip_global / identity with spike_z / max_norm. ``per_example_configs()``.

Float64 oracles (NumPy, no JAX)
  ``oracle_static(config, leaves, limit, params=None)`` -> ``Oracle`` with
  ``out`` (float64 / complex128 leaves: the clipped result), ``measures`` and
  ``limits`` (per unit, broadcastable to each leaf), ``factors`` (per unit),
  ``stats`` (``norm``, ``clipped_norm``, ``clip_fraction``),
  ``unit_measure(leaves)`` (the measures of any tree, e.g. of the output)
  and ``clip_fraction_band(rtol, atols=None)`` (the clipped share, ties at
  the limit counted either way).
  ``measure_tree(leaves, ord)``: the tree's global ord-norm in float64.
  ``flush_atol(dtype)``: the absolute tolerance XLA:CPU's flush of
  subnormals to zero needs (the dtype's smallest normal): values below it may
  come back as 0, a platform behaviour, not a clipper's.
  ``round_tol(dtype)``: the relative rounding of one element of that dtype.
  ``as_float32(x)``: ``jnp.asarray(x).astype(jnp.float32)`` on the host.
  ``oracle_per_example(leaves, l2_clip, scope)`` -> ``(sum, contributions,
  nonfinite)`` of ``clip_per_example(..., reduce="sum")`` without noise.

Example counts
  ``examples(n, parent=None, **settings)``: ``hypothesis.settings`` with
  ``n`` examples under the ``ci`` profile (the default; the suite's budget
  of about a minute) and the profile's own count under any other
  (``release``: 1000), so that a longer profile really runs more.
  ``ci_or(ci, other)``: the strategy ``ci`` under the ``ci`` profile, else
  ``other`` (the heavy, rarely failing variety of a draw, e.g. tree layouts
  that each compile a new program, runs under ``release`` only).

Running under JAX
  ``to_jax(tree)``: the host tree as JAX arrays (call inside :func:`x64`).
  ``static_runner(config)``: a cached ``jax.jit`` of ``(g, limit, params) ->
  (updates, state)`` with the limit traced, so examples that repeat shapes
  reuse one compiled program.
  ``step_runner(config)``: cached ``(tx, jit((g, state, params) ->
  (updates, state)))`` for histories of adaptive clippers and guard.
  ``sharded_runner(config, n)``: the same with every leaf split along its
  first axis over ``n`` devices in ``shard_map`` (``axis_name="d"``).
  ``sharded_step_runner(config, n)``: ``(tx, step)`` likewise for
  histories of adaptive clippers and guard (state replicated).
  ``with_axis_name(config)``: the config with ``axis_name="d"`` where its
  clipper takes one.
  ``on_mesh(tree, n)``: the host tree split over ``mesh(n)`` (their input).
  ``mesh(n)``: a 1-D mesh of the first ``n`` devices, axis ``"d"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import os
from typing import Any

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

import fast_compile
import np_refs
import optaxclip

# --------------------------------------------------------------------------
# Example counts: the ci profile's budget, the release profile's own
# --------------------------------------------------------------------------


def ci_profile() -> bool:
  """Whether the ``ci`` hypothesis profile (conftest.py's default) is on."""
  return os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci"


def examples(n: int, parent=None, **kwargs) -> hypothesis.settings:
  """Settings with ``n`` examples under the ``ci`` profile; any other
  profile (``release``) keeps its own ``max_examples``. ``parent`` and
  the other keyword arguments are passed to ``hypothesis.settings`` under
  every profile.
  """
  if ci_profile():
    kwargs["max_examples"] = n
  return hypothesis.settings(parent, **kwargs)


def ci_or(ci, other):
  """The strategy ``ci`` under the ``ci`` profile, else ``other``."""
  return ci if ci_profile() else other


# --------------------------------------------------------------------------
# Dtypes and x64
# --------------------------------------------------------------------------

DTYPES = {
  "float16": np.dtype(np.float16),
  "bfloat16": np.dtype(ml_dtypes.bfloat16),
  "float32": np.dtype(np.float32),
  "float64": np.dtype(np.float64),
  "complex64": np.dtype(np.complex64),
}
REAL = ("float16", "bfloat16", "float32", "float64")
LOW = ("float16", "bfloat16")
ALL = tuple(DTYPES)


def dtype_names(names=ALL):
  return st.sampled_from(tuple(names))


def leaves(tree) -> list:
  return jax.tree.leaves(tree)


def uses_x64(tree_or_names) -> bool:
  if isinstance(tree_or_names, (tuple, list)) and all(
    isinstance(n, str) for n in tree_or_names
  ):
    return "float64" in tree_or_names
  return any(np.asarray(x).dtype == np.float64 for x in leaves(tree_or_names))


def x64(tree_or_names=("float64",)):
  """``jax.enable_x64(True)`` when a float64 leaf is present, else nothing."""
  if uses_x64(tree_or_names):
    return jax.enable_x64(True)
  return contextlib.nullcontext()


def _real(dtype) -> np.dtype:
  dtype = np.dtype(dtype)
  return (
    np.dtype(np.float32)
    if dtype == np.complex64
    else (np.dtype(np.float64) if dtype == np.complex128 else dtype)
  )


def _finfo(dtype):
  return ml_dtypes.finfo(_real(dtype))


def flush_atol(dtype) -> float:
  """Values below the dtype's smallest normal may be flushed to 0 (XLA:CPU)."""
  return float(_finfo(dtype).tiny)


def norm_flush_atol(dtype, size: int, p: float = 2.0) -> float:
  """How far flushing may move the p-norm of ``size`` elements: each may be
  read as 0 (below the smallest normal; a complex one when both its parts
  are, a modulus up to sqrt(2) times that), ``size**(1/p)`` times it in all
  (``sqrt(size)`` for L2, ``size`` for L1, one for the max).

  A complex64 leaf whose parts are all subnormal can have moduli up to
  1.3e-38 (above the smallest normal, 1.18e-38) that XLA:CPU reads as
  zeros: a bound of one smallest normal would be too tight for it.
  """
  n = max(int(size), 1)
  return element_flush_atol(dtype) * (1.0 if math.isinf(p) else n ** (1.0 / p))


def element_flush_atol(dtype) -> float:
  """How far flushing may move one element: both parts of a complex one
  may be flushed, up to sqrt(2) times the smallest normal.
  """
  scale = (
    math.sqrt(2) if np.issubdtype(np.dtype(dtype), np.complexfloating) else 1
  )
  return scale * flush_atol(dtype)


def round_tol(dtype) -> float:
  """The relative rounding error of one element stored in ``dtype``."""
  return float(_finfo(dtype).eps)


# --------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------

SHAPES = ((), (1,), (3,), (2, 3), (4, 4), (2, 2, 3), (0,), (0, 3))
MATRIX_SHAPES = ((2, 3), (4, 4), (2, 2, 3), (1, 5))
SHARD_SHAPES = ((8,), (16,), (8, 3), (16, 2))
LARGE_SHAPE = (70_000,)


def shapes(choices=SHAPES, large=False):
  s = st.sampled_from(tuple(choices))
  if large:
    s = st.one_of(s, st.just(LARGE_SHAPE))
  return s


# --------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------


def _exponent_range(dtype) -> tuple[int, int, int]:
  """(smallest subnormal exponent, smallest normal exponent, largest)."""
  info = _finfo(dtype)
  min_normal = int(info.minexp)
  min_sub = min_normal - int(info.nmant)
  return min_sub, min_normal, int(info.maxexp) - 1


MAGNITUDES = ("all", "ordinary", "extreme")


def exponents(dtype, magnitudes="all"):
  """Binary exponents of the dtype's finite range, piled up at the edges.

  ``magnitudes``: ``"all"`` (the whole range), ``"ordinary"`` (2**-40 to
  2**40 within the dtype's normal range: no overflow or underflow anywhere)
  or ``"extreme"`` (the edges only: subnormals, the smallest normals, 2**126
  and around, the largest finite values).
  """
  lo, normal, hi = _exponent_range(dtype)
  edges = sorted(
    {
      lo,
      lo + 1,
      normal - 1,
      normal,
      normal + 1,
      min(hi, 125),
      min(hi, 126),
      min(hi, 127),
      hi - 1,
      hi,
    }
  )
  ordinary = st.integers(max(normal + 12, -40), min(hi - 2, 40))
  if magnitudes == "ordinary":
    return ordinary
  if magnitudes == "extreme":
    return st.sampled_from(edges)
  return st.one_of(
    st.sampled_from(edges + [-1, 0, 1, min(hi, 63), min(hi, 64)]),
    st.integers(lo, hi),
  )


def _ldexp32(m, e) -> float:
  return float(np.float32(math.ldexp(m, e)))


def limits(zero=True, inf=True, magnitudes="all"):
  """A clip limit, exactly representable in float32 and not subnormal.

  Subnormal limits are left out: XLA:CPU flushes them to zero, a platform
  behaviour that no clipper can change. ``magnitudes="ordinary"``: 2**-40
  to 2**40 (with 0 and inf unless excluded).
  """
  _, normal, hi = _exponent_range(np.float32)
  exps = (
    st.integers(-40, 40)
    if magnitudes == "ordinary"
    else st.one_of(
      st.sampled_from((normal + 1, -20, -1, 0, 1, 2, 20, 64, 100, hi)),
      st.integers(normal + 1, hi),
    )
  )
  finite = st.builds(
    _ldexp32, st.sampled_from((0.5, 0.75, 0.6180339887, 0.9999999)), exps
  )
  options = [finite]
  if zero:
    options.append(st.just(0.0))
  if inf:
    options.append(st.just(math.inf))
  return st.one_of(*options)


def _cast(values: np.ndarray, dtype) -> np.ndarray:
  """float64 magnitudes into ``dtype``, clamped to its largest finite value."""
  top = float(_finfo(dtype).max)
  return np.clip(values, -top, top).astype(_real(dtype))


NONFINITE = (math.nan, math.inf, -math.inf)


@st.composite
def _elements(draw, dtype, size, magnitudes="all"):
  """``size`` float64 values in the finite range of ``dtype`` (real part)."""
  lo, _, hi = _exponent_range(dtype)
  seed = draw(st.integers(0, 2**32 - 1))
  rng = np.random.default_rng(seed)
  kind = draw(st.sampled_from(("spread", "constant", "zeros", "one_hot")))
  top = draw(exponents(dtype, magnitudes))
  spread = draw(
    st.sampled_from(
      (0, 2, 10) if magnitudes == "ordinary" else (0, 2, 10, 60, hi - lo)
    )
  )
  e = top - np.floor(spread * rng.random(size)).astype(np.int64)
  e = np.clip(e, lo, hi)
  mant = 0.5 + 0.5 * rng.random(size)
  sign = np.where(rng.random(size) < 0.5, -1.0, 1.0)
  values = sign * np.ldexp(mant, e)
  if kind == "constant":
    values = np.full(size, math.ldexp(0.75, top))
  elif kind == "zeros":
    values = np.zeros(size)
  elif kind == "one_hot":
    values = np.zeros(size)
    if size:
      values[rng.integers(size)] = math.ldexp(0.75, top)
  if size and magnitudes != "ordinary" and draw(st.booleans()):
    info = _finfo(dtype)
    extremes = (
      0.0,
      math.ldexp(1.0, lo),
      float(info.tiny),
      float(info.max),
      -float(info.max),
    )
    for _ in range(draw(st.integers(1, 3))):
      values[draw(st.integers(0, size - 1))] = draw(st.sampled_from(extremes))
  return values


@st.composite
def arrays(draw, dtype, shape, nonfinite=False, magnitudes="all"):
  """One leaf of ``dtype`` and ``shape`` (see the module docstring)."""
  dtype = np.dtype(DTYPES.get(dtype, dtype))
  size = math.prod(shape)
  real = _cast(draw(_elements(dtype, size, magnitudes)), dtype)
  if np.issubdtype(dtype, np.complexfloating):
    imag = _cast(draw(_elements(dtype, size, magnitudes)), dtype)
    x = (real.astype(dtype) + 1j * imag.astype(dtype)).astype(dtype)
  else:
    x = real.astype(dtype)
  x = x.reshape(shape)
  if nonfinite and size:
    flat = x.reshape(-1)
    for _ in range(draw(st.integers(0, 2))):
      i = draw(st.integers(0, size - 1))
      value = draw(st.sampled_from(NONFINITE))
      if np.issubdtype(dtype, np.complexfloating) and draw(st.booleans()):
        flat[i] = complex(0.0, value)
      else:
        flat[i] = value
  return x


def _nest(draw, items: list) -> Any:
  """The leaves in a drawn dict / list nesting."""
  if not items:
    return draw(st.sampled_from(({}, [], {"a": {}}, {"a": []})))
  if len(items) == 1 and draw(st.booleans()):
    return items[0]
  kind = draw(st.sampled_from(("dict", "list")))
  cut = draw(st.integers(1, len(items)))
  groups = [items[:cut], items[cut:]] if cut < len(items) else [items]
  children = [
    (_nest(draw, g) if len(g) > 1 or draw(st.booleans()) else g[0])
    for g in groups
  ]
  if kind == "list":
    return children
  return {f"k{i}": child for i, child in enumerate(children)}


@st.composite
def trees(
  draw,
  dtypes=REAL,
  shapes=SHAPES,
  min_leaves=0,
  max_leaves=4,  # pylint: disable=redefined-outer-name
  nonfinite=False,
  large=False,
  magnitudes="all",
):
  """A pytree of :func:`arrays` leaves in dict / list nesting; each leaf
  draws its own magnitudes (see :func:`exponents`).
  """
  n = draw(st.integers(min_leaves, max_leaves))
  items = []
  for i in range(n):
    shape = draw(globals()["shapes"](shapes, large=large and i == 0))
    dtype = draw(dtype_names(dtypes))
    items.append(
      draw(arrays(dtype, shape, nonfinite=nonfinite, magnitudes=magnitudes))
    )
  sized = [x for x in items if x.size]
  if nonfinite and sized and not has_nonfinite(items):
    # At least one NaN / Inf somewhere (the other leaves may stay finite).
    x = sized[draw(st.integers(0, len(sized) - 1))].reshape(-1)
    x[draw(st.integers(0, x.size - 1))] = draw(st.sampled_from(NONFINITE))
  return _nest(draw, items)


@st.composite
def like(draw, tree, nonfinite=False, magnitudes="all"):
  """A tree with the structure, shapes and dtypes of ``tree``."""
  flat, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(
    treedef,
    [
      draw(
        arrays(
          np.asarray(x).dtype,
          np.shape(x),
          nonfinite=nonfinite,
          magnitudes=magnitudes,
        )
      )
      for x in flat
    ],
  )


# Under the ci profile :func:`per_example_trees` takes its layout (batch
# size, the examples' leaf shapes, the nesting) from this palette (each
# layout compiles its programs once); other profiles draw layouts freely.
PER_EXAMPLE_LAYOUTS = (
  (4, ((), (3,)), "dict"),
  (8, ((2, 2),), "leaf"),
  (1, ((3,), (2, 2), ()), "list"),
  (2, ((),), "list"),
)


@st.composite
def per_example_trees(
  draw,
  batch_sizes=(1, 2, 4, 8),
  dtypes=("float32",),
  shapes=((), (3,), (2, 2)),
  max_leaves=3,
  nonfinite=False,
  magnitudes="ordinary",
  huge=True,
  palette=True,
):
  """Leaves with a leading batch axis; some whole examples zero, huge (with
  ``huge``: half the dtype's largest value in every element, far above
  2**126) or, with ``nonfinite``, holding a NaN / Inf. ``palette``: under
  the ci profile the layout comes from :data:`PER_EXAMPLE_LAYOUTS` (the
  values, dtypes and kinds of example drawn as usual).
  """
  nesting = None
  if palette and ci_profile():
    batch, leaf_shapes, nesting = draw(st.sampled_from(PER_EXAMPLE_LAYOUTS))
  else:
    batch = draw(st.sampled_from(tuple(batch_sizes)))
    leaf_shapes = [
      draw(st.sampled_from(tuple(shapes)))
      for _ in range(draw(st.integers(1, max_leaves)))
    ]
  items = []
  for leaf_shape in leaf_shapes:
    shape = (batch, *leaf_shape)
    dtype = draw(dtype_names(dtypes))
    items.append(draw(arrays(dtype, shape, magnitudes=magnitudes)))
  kinds = ("keep", "keep", "zero") + (("huge",) if huge else ())
  kinds += ("nonfinite", "nonfinite") if nonfinite else ()
  for b in range(batch):
    what = draw(st.sampled_from(kinds))
    for x in items:
      rows = x.reshape(batch, -1)  # a view: writes go to x
      if what == "zero":
        rows[b] = 0
      elif what == "huge":
        top = float(_finfo(x.dtype).max) * 0.5
        rows[b] = np.where(rows[b].astype(np.float64) < 0, -top, top)
      elif what == "nonfinite" and rows.shape[1]:
        i = draw(st.integers(0, rows.shape[1] - 1))
        rows[b, i] = draw(st.sampled_from(NONFINITE))
  if nesting == "dict":
    return {f"k{i}": x for i, x in enumerate(items)}
  if nesting == "list":
    return items
  if nesting == "leaf":
    return items[0]
  return _nest(draw, items)


def has_nonfinite(tree) -> bool:
  return any(
    not np.all(
      np.isfinite(
        np.asarray(x, np.complex128 if np.iscomplexobj(x) else np.float64)
      )
    )
    for x in leaves(tree)
  )


# --------------------------------------------------------------------------
# Clipper configurations
# --------------------------------------------------------------------------

_FIRST_ARG = {
  "clip_value": "max_delta",
  "clip_norm": "max_norm",
  "clip_global": "max_norm",
  "clip_block_rms": "threshold",
  "clip_unitwise": "clipping",
  "clip_per_example": "l2_clip",
  "clipvalue": "clipvalue",
  "clipnorm": "clipnorm",
  "global_clipnorm": "global_clipnorm",
}
STATIC = (
  "clip_value",
  "clip_norm",
  "clip_global",
  "clip_block_rms",
  "clip_unitwise",
)
ADAPTIVE = ("clip_zscore", "clip_percentile", "clip_relative")
CLIPPED_KINDS = {
  "clipvalue": "clip_value",
  "clipnorm": "clip_norm",
  "global_clipnorm": "clip_global",
}


@dataclasses.dataclass(frozen=True)
class Config:
  """A clipper configuration over the public API: ``name(**kwargs)``.

  ``name`` is a public function of optaxclip, or ``"clipped.<kind>"`` for
  ``clipped(optax.identity(), <kind>=limit)``, or ``"guard.<inner>"``
  (inner: ``"clip_global"`` or ``"identity"``).
  """

  name: str
  kwargs: tuple = ()

  def __repr__(self):
    args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs)
    return f"{self.name}({args})"

  @property
  def kw(self) -> dict:
    return dict(self.kwargs)

  @property
  def kind(self) -> str:
    base = self.name.split(".")[0]
    if base in STATIC or base == "clipped":
      return "static"
    if base in ADAPTIVE:
      return "adaptive"
    return "per_example" if base == "clip_per_example" else base

  @property
  def static_name(self) -> str:
    """The static clipper whose numbers this config has."""
    if self.name.startswith("clipped."):
      return CLIPPED_KINDS[self.name.split(".")[1]]
    return self.name

  @property
  def needs_params(self) -> bool:
    return self.name == "clip_unitwise"

  @property
  def limit(self) -> float | None:
    key = _FIRST_ARG.get(self.name.split(".")[-1]) or _FIRST_ARG.get(self.name)
    return self.kw.get(key)

  def with_limit(self, limit) -> Config:
    key = _FIRST_ARG.get(self.name.split(".")[-1]) or _FIRST_ARG[self.name]
    kw = self.kw
    kw[key] = limit
    return Config(self.name, tuple(sorted(kw.items())))

  def make(self, limit=None) -> optax.GradientTransformation:
    kw = self.kw
    if limit is not None:
      key = _FIRST_ARG.get(self.name.split(".")[-1]) or _FIRST_ARG[self.name]
      kw[key] = limit
    if self.name.startswith("clipped."):
      return optaxclip.clipped(optax.identity(), **kw)
    if self.name.startswith("guard."):
      inner_name = self.name.split(".")[1]
      inner_limit = kw.pop("inner_limit", 1.0)
      inner = (
        optax.identity()
        if inner_name == "identity"
        else optaxclip.clip_global(inner_limit, axis_name=kw.get("axis_name"))
      )
      return optaxclip.guard(inner, **kw)
    return getattr(optaxclip, self.name)(**kw)


def _config(name, **kwargs) -> Config:
  return Config(name, tuple(sorted(kwargs.items())))


ORDS = (None, 1, 2, 3, "inf")
AXES = (None, 0, -1, (0, 1))


def ord_value(o) -> float:
  return (
    2.0 if o is None else (math.inf if o in ("inf", math.inf) else float(o))
  )


@st.composite
def static_configs(
  draw, names=STATIC + ("clipped",), ords=ORDS, axes=(None,), limit=None
):
  """A static clipper; ``limit`` None leaves the first argument at 1.0 (set
  it with ``Config.with_limit`` or pass it to ``static_runner``).
  """
  name = draw(st.sampled_from(tuple(names)))
  lim = 1.0 if limit is None else limit
  if name == "clip_value":
    return _config(name, max_delta=lim)
  if name == "clip_norm":
    return _config(
      name,
      max_norm=lim,
      ord=draw(st.sampled_from(ords)),
      axis=draw(st.sampled_from(tuple(axes))),
    )
  if name == "clip_global":
    return _config(name, max_norm=lim, ord=draw(st.sampled_from(ords)))
  if name == "clip_block_rms":
    return _config(name, threshold=lim)
  if name == "clip_unitwise":
    return _config(name, clipping=lim, eps=draw(st.sampled_from((1e-3, 0.0))))
  kind = draw(st.sampled_from(tuple(CLIPPED_KINDS)))
  return _config(f"clipped.{kind}", **{kind: lim})


@st.composite
def adaptive_configs(draw, names=ADAPTIVE, scopes=("global", "leaf")):
  """An adaptive clipper with a short warm-up / history (cheap histories)."""
  name = draw(st.sampled_from(tuple(names)))
  if name == "clip_zscore":
    mode = draw(st.sampled_from(("zscore", "percentile")))
    return _config(
      name,
      warmup_steps=draw(st.sampled_from((1, 3))),
      alpha=draw(st.sampled_from((0.5, 0.97))),
      spike_z=draw(st.sampled_from((1.0, 2.5))),
      max_norm=draw(st.sampled_from((None, 1.0, 1e30))),
      mode=mode,
      clip_option=draw(st.sampled_from(("adaptive_scaling", "mean"))),
      skip_update_on_spike=draw(st.booleans()),
      scope=draw(st.sampled_from(tuple(scopes))),
    )
  if name == "clip_percentile":
    return _config(
      name,
      percentile=draw(st.sampled_from((0.0, 10.0, 50.0, 100.0))),
      history=draw(st.sampled_from((1, 4))),
      scope=draw(st.sampled_from(tuple(scopes))),
    )
  return _config(
    name,
    factor=draw(st.sampled_from((1.0, 1.05, 2.0))),
    beta=draw(st.sampled_from((0.5, 0.98))),
    warmup_steps=draw(st.sampled_from((1, 3))),
    warmup_max_norm=draw(st.sampled_from((1.0, 1e30, math.inf))),
  )


@st.composite
def guard_configs(draw):
  inner = draw(st.sampled_from(("clip_global", "identity")))
  kw = {
    "spike_z": draw(st.sampled_from((None, 1.0, 3.0))),
    "max_norm": draw(st.sampled_from((None, 1e4, 1e30))),
    "warmup_steps": draw(st.sampled_from((1, 3))),
    "alpha": draw(st.sampled_from((0.5, 0.97))),
  }
  if inner == "clip_global":
    kw["inner_limit"] = 1.0
  return _config(f"guard.{inner}", **kw)


@st.composite
def per_example_configs(draw, l2_clips=None):
  """clip_per_example without noise, ``reduce="sum"`` (the sum each
  example moves by at most ``l2_clip``); ``l2_clip`` drawn from 0, tiny, 1,
  huge and inf unless ``l2_clips`` (a strategy) is given.
  """
  l2 = draw(
    l2_clips
    if l2_clips is not None
    else st.sampled_from((0.0, 1e-30, 1.0, 1e30, math.inf))
  )
  return _config(
    "clip_per_example",
    l2_clip=l2,
    scope=draw(st.sampled_from(("global", "leaf"))),
    reduce="sum",
  )


# --------------------------------------------------------------------------
# Float64 oracles
# --------------------------------------------------------------------------


def _f64(x) -> np.ndarray:
  return np_refs.f64(
    np.asarray(x).astype(np.complex128 if np.iscomplexobj(x) else np.float64)
  )


# The oracle's measures and factors are computed in NumPy's longdouble (80-bit
# extended on x86-64: float64's 53-bit mantissa or more, exponents to 1e4932),
# so that the norm of float64 leaves near their largest value, which float64
# cannot hold, still gives the right factor.
_WIDE = np.longdouble


def _abs_wide(x) -> np.ndarray:
  x = np.asarray(x)
  if np.iscomplexobj(x):
    x = x.astype(np.complex128)
    return np.hypot(x.real.astype(_WIDE), x.imag.astype(_WIDE))
  if x.dtype != _WIDE:
    x = x.astype(np.float64)
  return np.abs(x.astype(_WIDE))


def _unit_pnorm(x, p, axes):
  """The p-norm of each unit of ``x`` (reduced axes kept), in longdouble."""
  a = _abs_wide(x)
  axes = tuple(range(a.ndim)) if axes is None else axes
  if a.size == 0:
    shape = tuple(1 if i in axes else d for i, d in enumerate(a.shape))
    return np.zeros(shape, _WIDE)
  if math.isinf(p):
    return np.max(a, axis=axes, keepdims=True)
  with np.errstate(over="ignore", under="ignore", invalid="ignore"):
    m = np.max(a, axis=axes, keepdims=True)
    safe = np.where((m > 0) & np.isfinite(m), m, 1.0)
    q = np.sum((a / safe) ** p, axis=axes, keepdims=True) ** (_WIDE(1) / p)
    return np.where(np.isfinite(m), np.where(m > 0, m * q, 0.0), m)


def _combine(values, p):
  flat = (
    np.concatenate([np.ravel(v) for v in values]) if values else (np.zeros(0))
  )
  return _unit_pnorm(flat, p, None).reshape(()) if flat.size else _WIDE(0)


def measure_tree(tree_leaves, ord=2.0) -> float:  # pylint: disable=redefined-builtin
  """The global ``ord``-norm of a list of leaves (overflow-safe; may exceed
  float64's range, then returned as a longdouble).
  """
  return _combine(
    [_unit_pnorm(x, ord_value(ord), None) for x in tree_leaves], ord_value(ord)
  )


def _norm_axes(x, axis) -> tuple | None:
  if axis is None:
    return None
  axis = (axis,) if isinstance(axis, int) else tuple(axis)
  return tuple(sorted(a % np.ndim(x) for a in axis))


def _as_read(w):
  """``w`` as the norms read it: magnitudes below the accumulation dtype's
  smallest normal (float32's for float16 and bfloat16) as 0 (a bfloat16
  param of 9.2e-41 has norm 0: with eps=0, a limit of 0).
  """
  w = np.asarray(w)
  acc = np.float64 if w.dtype == np.float64 else np.float32
  return np.where(_abs_wide(w) < np.finfo(acc).tiny, 0, w)


def _factor(measure, limit):
  limit = np.asarray(limit, _WIDE)
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    return np.where(
      measure > limit, limit / np.where(measure > limit, measure, 1.0), 1.0
    )


def _times(x, factor) -> np.ndarray:
  """``x * factor`` in longdouble, returned as float64 / complex128."""
  x = _f64(x)
  if np.iscomplexobj(x):
    return (x.real.astype(_WIDE) * factor).astype(np.float64) + 1j * (
      x.imag.astype(_WIDE) * factor
    ).astype(np.float64)
  return (x.astype(_WIDE) * factor).astype(np.float64)


@dataclasses.dataclass
class Oracle:
  out: list
  measures: list
  limits: list
  factors: list
  stats: dict
  unit_measure: Any
  order: float = 2.0  # p of the measure (inf for clip_value's magnitude)
  one_unit: bool = False  # clip_global's: every leaf holds the tree's unit

  def clip_fraction_band(self, rtol: float, atols=None) -> tuple[float, float]:
    """The share of units this oracle clips, as ``(lo, hi)``: a unit whose
    measure is within ``rtol`` (and its leaf's entry of ``atols``, e.g. a
    flush tolerance) of its limit counts as either clipped or not. The
    clipper's norm, accumulated in float32, cannot tell such a tie apart
    (a float16 tree of global norm 3 + 3.6e-15 against a limit of 3 reads
    3.0, not clipped). A zero
    measure at a zero limit is not clipped.
    """
    measures, limits = self.measures, self.limits
    if atols is None:
      atols = [0.0] * len(measures)
    if self.one_unit:
      measures, limits, atols = measures[:1], limits[:1], atols[:1]
    lo = hi = units = 0
    for m, lim, atol in zip(measures, limits, atols):
      # In the oracle's own (wide) dtype: a float64 tree's norm may exceed
      # float64's range.
      m, lim = np.broadcast_arrays(np.asarray(m), np.asarray(lim))
      if self.one_unit:
        m, lim = m.reshape(-1)[:1], lim.reshape(-1)[:1]
      lo += int(np.sum(m > lim * (1 + rtol) + atol))
      hi += int(np.sum((m >= lim * (1 - rtol)) & ~((m == 0) & (lim == 0))))
      units += m.size
    return lo / max(units, 1), hi / max(units, 1)


def oracle_static(config: Config, tree_leaves, limit, params=None) -> Oracle:
  """What a static clipper must return, in float64 (finite input)."""
  name = config.static_name
  kw = config.kw
  xs = [_f64(x) for x in tree_leaves]
  limit = float(limit)
  if name == "clip_value":

    def unit_measure(ls):
      return [_abs_wide(x) for x in ls]

    measures = unit_measure(xs)
    lims = [np.full(m.shape, limit) for m in measures]
    p = math.inf
  elif name == "clip_global":
    p = ord_value(kw.get("ord"))

    def unit_measure(ls):
      total = measure_tree(ls, p)
      return [np.full((1,) * np.ndim(x), total) for x in ls]

    measures = unit_measure(xs)
    lims = [np.full(m.shape, limit) for m in measures]
  elif name == "clip_norm":
    p = ord_value(
      kw.get("ord") if not config.name.startswith("clipped") else None
    )
    axis = kw.get("axis")

    def unit_measure(ls):
      return [_unit_pnorm(x, p, _norm_axes(x, axis)) for x in ls]

    measures = unit_measure(xs)
    lims = [np.full(m.shape, limit) for m in measures]
  elif name == "clip_block_rms":
    p = 2.0

    def unit_measure(ls):
      return [_unit_pnorm(x, 2.0, None) for x in ls]

    measures = unit_measure(xs)
    lims = [
      np.full(m.shape, _WIDE(limit) * _WIDE(math.sqrt(max(x.size, 1))))
      for m, x in zip(measures, xs)
    ]
  elif name == "clip_unitwise":
    p = 2.0
    axes = [optaxclip.default_unit_axes(np.asarray(x)) for x in xs]

    def unit_measure(ls):
      return [_unit_pnorm(x, 2.0, a) for x, a in zip(ls, axes)]

    measures = unit_measure(xs)
    eps = kw.get("eps", 1e-3)
    # clipping=inf means no limit, also where the params' norm (or eps) is
    # 0: inf, not inf * 0 = NaN.
    lims = [
      np.full(np.shape(m), np.inf)
      if limit == math.inf
      else _WIDE(limit) * np.maximum(_unit_pnorm(_as_read(w), 2.0, a), eps)
      for w, a, m in zip(params, axes, measures)
    ]
  else:
    raise ValueError(f"no static oracle for {config!r}")
  if name == "clip_value":
    out = [
      np.where(m > lim, _times(x, _factor(m, lim)), x)
      for x, m, lim in zip(xs, measures, lims)
    ]
    factors = [_factor(m, lim) for m, lim in zip(measures, lims)]
    total = sum(m.size for m in measures)
    biggest = max((float(m.max()) for m in measures if m.size), default=0.0)
    # clip_value's measure is one element's magnitude: float64 holds it.
    stats = {
      "norm": biggest,
      "clipped_norm": min(biggest, limit),
      "clip_fraction": sum(
        int(np.sum(m > lim)) for m, lim in zip(measures, lims)
      )
      / max(total, 1),
    }
  else:
    factors = [_factor(m, lim) for m, lim in zip(measures, lims)]
    out = [_times(x, f) for x, f in zip(xs, factors)]
    if name == "clip_global":
      norm = measures[0].reshape(-1)[0] if measures else _WIDE(0)
      f = factors[0].reshape(-1)[0] if factors else _WIDE(1)
      stats = {
        "norm": float(norm),
        "clipped_norm": float(norm * f),
        "clip_fraction": float(f < 1),
      }
    else:
      units = sum(m.size for m in measures)
      stats = {
        "norm": float(_combine(measures, p)),
        "clipped_norm": float(
          _combine([m * f for m, f in zip(measures, factors)], p)
        ),
        "clip_fraction": sum(int(np.sum(f < 1)) for f in factors)
        / max(units, 1),
      }
  return Oracle(
    out, measures, lims, factors, stats, unit_measure, p, name == "clip_global"
  )


def oracle_per_example(tree_leaves, l2_clip, scope="global"):
  """What ``clip_per_example(l2_clip, scope=scope, reduce="sum")`` without
  noise must return: ``(sum, contributions, nonfinite)`` with ``sum`` the
  float64 leaves, ``contributions[b]`` example ``b``'s clipped leaves (zero
  for an example holding a NaN / Inf) and ``nonfinite`` their count.
  """
  xs = [_f64(x) for x in tree_leaves]
  batch = xs[0].shape[0] if xs else 0
  k = len(xs)
  contributions, nonfinite = [], 0
  for b in range(batch):
    parts = [x[b] for x in xs]
    if not all(np.all(np.isfinite(p)) for p in parts):
      nonfinite += 1
      contributions.append([np.zeros_like(p) for p in parts])
      continue
    if scope == "global":
      norm = measure_tree(parts)
      f = _factor(norm, l2_clip)
      contributions.append([_times(p, f) for p in parts])
    else:
      limit = _WIDE(l2_clip) / _WIDE(math.sqrt(k))
      contributions.append(
        [_times(p, _factor(_unit_pnorm(p, 2.0, None), limit)) for p in parts]
      )
  total = [
    np.sum([c[i] for c in contributions], axis=0)
    if batch
    else np.zeros(x.shape[1:])
    for i, x in enumerate(xs)
  ]
  return total, contributions, nonfinite


# --------------------------------------------------------------------------
# Running under JAX
# --------------------------------------------------------------------------


def to_jax(tree):
  """The leaves as JAX arrays: ``jnp.asarray``'s arrays, dtypes and bits
  (canonicalised on the host alike), without the small program that
  ``jnp.asarray`` compiles for each new shape and dtype.
  """
  return jax.tree.map(jax.device_put, tree)


class FastJit:
  """``jax.jit(fn)`` compiled with ``fast_compile.OPTIONS`` (no LLVM
  optimisation: about half the compile time of these small programs, which
  dominates a fuzz example), one executable per argument signature (shapes,
  dtypes, x64 mode and tree structure).
  """

  def __init__(self, fn):
    self.jitted = jax.jit(fn)
    self.compiled = {}

  def __call__(self, *args):
    flat, treedef = jax.tree.flatten(args)
    key = (
      treedef,
      tuple((np.shape(x), jnp.result_type(x)) for x in flat),
      jax.config.jax_enable_x64,
    )
    if key not in self.compiled:
      self.compiled[key] = fast_compile.compile_fast(self.jitted.lower(*args))
    return self.compiled[key](*args)


def weighted_sum_grad(fn) -> FastJit:
  """The gradient, with respect to its first two arguments, of the sum of
  ``fn``'s outputs (a list of arrays) weighted 0.25, 0.5, 0.75, ... (so that
  each output's derivative is told apart), fast-compiled.
  """

  def loss(leaves, a, b):
    out = fn(leaves, a, b)
    return sum(
      jnp.sum(y.astype(jnp.float32) * (k + 1) * 0.25) for k, y in enumerate(out)
    )

  return FastJit(jax.grad(loss, argnums=(0, 1)))


def as_float32(x) -> np.ndarray:
  """``jnp.asarray(x).astype(jnp.float32)`` computed on the host (eagerly,
  JAX compiles a program for each new shape and dtype): the real part, and,
  as XLA:CPU's conversion does, a float64 (a JAX array, or any under x64)
  whose float32 is below the smallest normal flushed to a zero of its sign.
  """
  on_device = isinstance(x, jax.Array)
  x = np.asarray(x)
  wide = x.dtype in (np.float64, np.complex128) and (
    on_device or jax.config.jax_enable_x64
  )
  x = (x.real if np.iscomplexobj(x) else x).astype(np.float32)
  if wide:
    tiny = np.finfo(np.float32).tiny
    x = np.where(np.abs(x) < tiny, np.copysign(np.float32(0), x), x)
  return x


def assert_same(got, want, err, exact=True):
  """``got`` equals ``want`` (as float32) bit for bit, or to ``rtol=1e-5``
  when not ``exact``; NaN where, and only where, ``want`` has NaN.
  """
  got = as_float32(got).astype(np.float64)
  want = as_float32(want).astype(np.float64)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=err)
  ok = ~np.isnan(want)
  if exact:
    np.testing.assert_array_equal(got[ok], want[ok], err_msg=err)
  else:
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-5, err_msg=err)


@functools.cache
def static_runner(config: Config):
  """``(g, limit, params) -> (updates, state)`` jitted, the limit traced."""

  def run(g, limit, params):
    tx = config.make(limit)
    return tx.update(g, tx.init(g if params is None else params), params)

  return FastJit(run)


@functools.cache
def step_runner(config: Config):
  """``(tx, step)`` of a concrete config: ``tx.init`` starts a history, the
  jitted ``step(g, state, params) -> (updates, state)`` continues it.
  """
  tx = config.make()
  return tx, FastJit(tx.update)


def with_axis_name(config: Config, axis_name="d") -> Config:
  """``config`` with ``axis_name`` where its clipper takes one (clip_value,
  element-wise, needs none).
  """
  kw = dict(config.kwargs)
  base = config.name.split(".")[0]
  factory = getattr(optaxclip, base, None)
  if (
    factory is not None and "axis_name" in inspect.signature(factory).parameters
  ):
    kw["axis_name"] = axis_name
  return Config(config.name, tuple(sorted(kw.items())))


@functools.cache
def sharded_runner(config: Config, n: int):
  """:func:`static_runner` with every leaf split along its first axis over
  ``n`` devices inside ``shard_map`` (the clipper built with
  ``axis_name="d"``); the statistics come back from device 0.
  """
  with_axis = with_axis_name(config)
  spec = jax.sharding.PartitionSpec

  def local(g, limit):
    tx = with_axis.make(limit)
    return tx.update(g, tx.init(g))

  def mapped(g, limit):
    specs = jax.tree.map(lambda _: spec("d"), g)
    return jax.shard_map(
      local,
      mesh=mesh(n),
      in_specs=(specs, spec()),
      out_specs=(specs, spec()),
      check_vma=False,
    )(g, limit)

  return FastJit(mapped)


@functools.cache
def sharded_step_runner(config: Config, n: int):
  """:func:`step_runner` with every leaf split along its first axis over
  ``n`` devices inside ``shard_map`` (``axis_name="d"``), the state
  replicated (read back from device 0). Returns ``(tx, step)``: ``tx.init``
  takes the whole params.
  """
  tx = with_axis_name(config).make()
  spec = jax.sharding.PartitionSpec

  def mapped(g, state):
    specs = jax.tree.map(lambda _: spec("d"), g)
    return jax.shard_map(
      tx.update,
      mesh=mesh(n),
      in_specs=(specs, spec()),
      out_specs=(specs, spec()),
      check_vma=False,
    )(g, state)

  return tx, FastJit(mapped)


def on_mesh(tree, n: int):
  """The host tree as JAX arrays split along their first axis over
  :func:`mesh` ``(n)``, as :func:`sharded_runner` and
  :func:`sharded_step_runner` take them: put from the host shard by shard
  (a one-device array would be resliced by a program compiled for each
  shape).
  """
  split = jax.sharding.NamedSharding(mesh(n), jax.sharding.PartitionSpec("d"))
  return jax.tree.map(lambda x: jax.device_put(np.asarray(x), split), tree)


def mesh(n: int) -> jax.sharding.Mesh:
  assert jax.device_count() >= n, "conftest.py must set 8 host devices"
  return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("d",))
