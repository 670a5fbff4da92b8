"""What a per-example loss does with its parameters and its batch, read from
its traced program (the jaxpr).

Two questions decide whether a clipped per-example gradient is sound, and
both are answered from the program, never from the model's code:

* **Which parameters the ghost method may cover.** Every supported layer
  call is traced behind a *marker* (an identity ``jax.jit`` call with a name
  of its own) that takes the layer's parameters and its input. A parameter
  may be ghosted only when the program reads it in exactly one place: as an
  operand of exactly one marker, in the shape the layer saw, with that
  layer's input batched along its leading axis (a float cast or a copy of
  it on the way, as for mixed precision, is still the parameter). A
  parameter read anywhere else (by attribute, transformed before use,
  shared by every step of a loop, applied under ``vmap``, inside a ``cond``
  or ``while``) is reported with the first such use, and takes the exact
  per-example path.
* **Whether the loss mixes examples.** The batch axis of every value is
  followed from the batch arguments (their leading axis) through the
  program. An operation that reduces, contracts, sorts, convolves or scans
  across that axis makes one example's loss depend on another's data
  (batch normalisation with batch statistics, a loss divided by a batch
  mean, a time-major sequence scanned along its leading axis): a
  per-example gradient then has no meaning, and :func:`audit` refuses the
  loss, naming the operation and where it was traced.

What it can never do: refuse a loss whose examples do not interact. Where
it cannot follow the batch axis (an unknown layout after a scatter, a
``while`` loop, an operation it does not model) it stops following it
(``LOST``) and refuses nothing downstream; a layer whose input it cannot
follow is not ghosted. So every refusal names a real cross-example
operation, and some mixing (inside a ``while`` loop, through a gather
with batched indices into a batched operand) goes undetected: the guarantee
is "never a wrong ghost norm", not "every mixing model refused".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import itertools
import math
import os
from typing import Any, NamedTuple, Optional

import jax
from jax.extend import core as jex_core
import jax.numpy as jnp

# A value's batch axis: None (the value does not depend on the batch), an
# axis index (the example index is the outermost factor of that axis), or
# LOST (it depends on the batch in a layout that is not followed).
LOST = -1

MARK_PREFIX = "_optaxclip_ghost_mark_"
_PACKAGE = os.path.dirname(os.path.abspath(__file__))

_marker_ids = itertools.count()

_ROWS = (
  "its input is shared by the examples (it does not depend on the batch) "
  "and the program does not keep its rows apart, one per example"
)


class MixesExamples(ValueError):
  """The loss lets one example's data reach another example's loss."""


@dataclasses.dataclass(frozen=True)
class MarkerSpec:
  """One marked operand of a layer call: the call's id, the operand (a
  parameter's name, or ``"x"`` for the input) and its shape as the layer
  saw it.
  """

  call: int
  operand: str
  shape: tuple


X = "x"


def new_call() -> int:
  """A new layer call's id (its markers' names carry it)."""
  return next(_marker_ids)


def marker(call: int, operand: str, shape: tuple, specs: dict):
  """A fresh identity ``jax.jit`` function for one operand of a layer call,
  registered in ``specs`` (its name -> :class:`MarkerSpec`). One operand a
  marker: a transformation that splits a call's known and unknown operands
  (a lifted scan hoisting loop-invariant work) keeps each marker whole.
  """

  def mark(value):
    return value

  name = f"{MARK_PREFIX}{call}_{len(specs)}"
  mark.__name__ = mark.__qualname__ = name
  specs[name] = MarkerSpec(call, operand, tuple(shape))
  return jax.jit(mark)


@dataclasses.dataclass
class Audit:
  """What :func:`audit` read.

  Attributes:
    uses: per parameter leaf, the markers that read it: ``(call, name,
      same_shape)``.
    repeated: per marked call applied more than once per example (its
      marked parameters broadcast over the steps of a loop), why.
    other_use: per parameter leaf, its first use outside a marker (a
      sentence), or None.
    x_batched: per marked call, None where its input is batched along its
      leading axis in the shape the layer saw, else why not (a sentence).
    loss_axis: the batch axis of the losses (0, None or LOST).
  """

  uses: list
  repeated: dict
  other_use: list
  x_batched: dict
  loss_axis: Any


def _where(eqn) -> str:
  """Where ``eqn`` was traced: the user's file and line, when JAX says."""
  try:
    from jax._src import source_info_util

    summary = source_info_util.summarize(eqn.source_info)
  except Exception:  # noqa: BLE001 (a best-effort location)
    return ""
  if not summary or _PACKAGE in summary:
    return ""  # inside optaxclip's own tracing: no user line to name
  return f" at {summary}"


def _sub(eqn, key: str):
  """``eqn.params[key]`` as an open jaxpr (its consts do not depend on the
  batch or the parameters).
  """
  value = eqn.params.get(key)
  if value is None:
    return None
  if isinstance(value, jex_core.ClosedJaxpr):
    return value.jaxpr
  return value


_CALLS = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint")
_CALL_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_CUSTOM = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")
_IDENTITY = (
  "copy",
  "copy_p",
  "sharding_constraint",
  "reshard",
  "mesh_cast",
  "optimization_barrier",
  "pvary",
)
_REDUCE = (
  "reduce_sum",
  "reduce_max",
  "reduce_min",
  "reduce_prod",
  "reduce_and",
  "reduce_or",
  "reduce_xor",
  "argmax",
  "argmin",
)
_CUMULATIVE = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
# Parameters of an operation that does more than act element by element.
_SHAPED = frozenset(
  {
    "axes",
    "axis",
    "dimension",
    "dimensions",
    "dimension_numbers",
    "permutation",
    "new_sizes",
    "broadcast_dimensions",
    "slice_sizes",
    "start_indices",
    "limit_indices",
    "padding_config",
    "window_dimensions",
    "shape",
    "sizes",
    "k",
  }
)


class _V(NamedTuple):
  """What the walk knows of one value of the program."""

  axis: Any = None  # its batch axis: None, an axis index, or LOST
  leaf: Optional[int] = None  # the parameter leaf it is (or a step's slice)
  marks: frozenset = frozenset()  # marked calls whose parameters it carries
  # (call, axis): the rows of a marked call's batch-free input it carries
  rows: frozenset = frozenset()


_NONE = _V()
MIXED = -2


class _Walker:
  """An abstract interpretation of a jaxpr (see :class:`_V`)."""

  def __init__(self, batch_size: int, specs: dict, n_params: int):
    self.batch = batch_size
    self.specs = specs
    self.uses: list = [[] for _ in range(n_params)]
    self.other: list = [None] * n_params
    self.repeated: dict = {}
    self.x_batched: dict = {}
    self.soft = False

  def misuse(self, value: _V, why: str) -> None:
    """Records ``why`` for the parameter and the marked calls in ``value``
    (the first reason each is kept).
    """
    if value.leaf is not None and self.other[value.leaf] is None:
      self.other[value.leaf] = why
    for call in value.marks:
      self.repeated.setdefault(call, why)
    for call, _ in value.rows:
      self.repeated.setdefault(call, _ROWS)

  def run(self, jaxpr, ins: list) -> list:
    env: dict = {}

    def read(v):
      if isinstance(v, jex_core.Literal):
        return _NONE
      return env.get(v, _NONE)

    for v, value in zip(jaxpr.invars, ins):
      env[v] = value
    for eqn in jaxpr.eqns:
      outs = self.eqn(eqn, [read(v) for v in eqn.invars])
      for v, value in zip(eqn.outvars, outs):
        env[v] = value
    return [read(v) for v in jaxpr.outvars]

  def eqn(self, eqn, vals: list) -> list:
    name = eqn.primitive.name
    if name in ("jit", "pjit") and str(eqn.params.get("name", "")).startswith(
      MARK_PREFIX
    ):
      return self.marker(eqn, vals)
    if name in _CALLS or name in _CUSTOM:
      for key in _CALL_KEYS:
        sub = _sub(eqn, key)
        if sub is not None:
          return self.run(sub, vals)
    if name == "scan":
      return self.scan(eqn, vals)
    if name == "cond":
      return self.cond(eqn, vals)
    if name == "while":
      for value in vals:
        self.misuse(value, "read inside a `while` loop")
      lost = any(v.axis is not None for v in vals)
      return [_V(LOST) if lost else _NONE for _ in eqn.outvars]
    if name == "convert_element_type" or name in _IDENTITY:
      # A cast between float dtypes (mixed precision) or a copy is the
      # parameter itself to the taps: its gradient is the same values.
      return self.passthrough(eqn, vals)
    for v in vals:
      if v.leaf is not None and self.other[v.leaf] is None:
        self.other[v.leaf] = f"read by `{name}`{_where(eqn)}"
    marks = frozenset().union(*(v.marks for v in vals))
    outs = self.batch_rule(eqn, [v.axis for v in vals])
    rows = self.follow_rows(eqn, vals, outs)
    # A computation on marked parameters alone (hoisted out of a loop by
    # a lifted transform) carries their marks; one that involves the batch
    # is the layer's output, which may go anywhere.
    return [
      _V(a, None, marks if a is None else frozenset(), r)
      for a, r in zip(outs, rows)
    ]

  def passthrough(self, eqn, vals: list) -> list:
    """Each output is its operand (a float cast or a copy): the parameter,
    the marks and the rows go through; a cast to a non-float dtype is a
    read of the parameter.
    """
    outs = []
    for v, out in zip(vals, eqn.outvars):
      dtype = getattr(out.aval, "dtype", None)
      leaf = v.leaf
      floating = dtype is not None and jnp.issubdtype(dtype, jnp.floating)
      if leaf is not None and not floating:
        if self.other[leaf] is None:
          self.other[leaf] = f"read by `{eqn.primitive.name}`{_where(eqn)}"
        leaf = None
      outs.append(_V(v.axis, leaf, v.marks, v.rows))
    return outs

  def follow_rows(self, eqn, vals: list, outs: list) -> list:
    """Each output's rows (see :class:`_V`): a call's rows keep to one axis
    until they meet the batch on that same axis.
    """
    calls = {c for v in vals for c, _ in v.rows}
    rows: list = [set() for _ in outs]
    for call in calls:
      axes = [dict(v.rows).get(call) for v in vals]
      self.soft = True
      try:
        moved = self.batch_rule(eqn, axes)
      finally:
        self.soft = False
      for j, (r, a) in enumerate(zip(moved, outs)):
        if r is None or r == a:
          continue  # gone, or met the batch where the rows are
        if r in (LOST, MIXED) or a is not None:
          self.repeated.setdefault(call, _ROWS)
        else:
          rows[j].add((call, r))
    return [frozenset(r) for r in rows]

  def marker(self, eqn, vals: list) -> list:
    spec = self.specs[str(eqn.params["name"])]
    if not vals:
      return []
    value = vals[0]
    shape = tuple(eqn.invars[0].aval.shape)
    if spec.operand == X:
      rows = value.rows
      if shape != spec.shape:
        why = "its layer is applied under a vectorising transformation (vmap)"
      elif value.axis is None and shape[:1] == (self.batch,):
        # An input shared by the examples (positions): its rows must stay
        # apart, one per example, to the loss.
        why, rows = None, rows | {(spec.call, 0)}
      elif value.axis != 0:
        why = "its layer's input is not batched along its leading axis"
      else:
        why = None
      self.x_batched[spec.call] = why
      return [_V(value.axis, None, frozenset(), rows)]
    if value.leaf is not None:
      same = shape == spec.shape and value.axis is None
      self.uses[value.leaf].append((spec.call, spec.operand, same))
    if value.axis is not None:
      return [_V(value.axis)]
    return [_V(None, None, frozenset({spec.call}))]

  def scan(self, eqn, vals: list) -> list:
    p = eqn.params
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
    body = p["jaxpr"].jaxpr
    consts = list(vals[:n_consts])
    carry = list(vals[n_consts : n_consts + n_carry])
    xs = list(vals[n_consts + n_carry :])
    for i, value in enumerate(consts):
      if length != 1:
        self.misuse(
          value,
          f"shared by all {length} steps of a `scan`{_where(eqn)} (a "
          "parameter broadcast over a loop, as in nn.scan with "
          "variable_broadcast or nn.RNN)",
        )
        consts[i] = _V(value.axis)
    for i, value in enumerate(carry):
      self.misuse(value, f"carried through a `scan`{_where(eqn)}")
      carry[i] = _V(value.axis)
    for value in xs:
      if value.rows:
        self.misuse(_V(rows=value.rows), "")
    over_batch = self.batch > 1 and any(v.axis == 0 for v in xs)
    if over_batch and n_carry:
      raise MixesExamples(
        f"a `scan`{_where(eqn)} runs along the batch axis with a carry, so "
        "each example's loss depends on the examples before it (is a batch "
        "argument time-major? Every batch argument's leading axis must be "
        "the batch)"
      )
    body_xs = []
    for v in xs:
      axis = v.axis
      if axis is not None and axis != LOST:
        axis = None if axis == 0 else axis - 1
      body_xs.append(_V(axis, v.leaf, v.marks))
    carry_axes = [v.axis for v in carry]
    for _ in range(4):
      outs = self.run_quiet(body, consts + carry + body_xs)
      new = [_merge(a, b.axis) for a, b in zip(carry_axes, outs[:n_carry])]
      if new == carry_axes:
        break
      carry_axes = new
      carry = [_V(a) for a in carry_axes]
    else:
      carry = [_V(None if a is None else LOST) for a in carry_axes]
    outs = self.run(body, consts + carry + body_xs)
    result = [_V(v.axis) for v in outs[:n_carry]]
    batched_consts = any(v.axis is not None for v in consts)
    for v in outs[n_carry:]:
      axis = v.axis
      if over_batch:
        axis = LOST if batched_consts else 0
      elif axis is not None and axis != LOST:
        axis += 1
      result.append(_V(axis))
    return result

  def run_quiet(self, jaxpr, ins: list) -> list:
    """A walk that records nothing (a loop's fixed point)."""
    saved = self.uses, self.other, self.repeated, self.x_batched
    self.uses = [[] for _ in saved[0]]
    self.other = list(saved[1])
    self.repeated, self.x_batched = {}, {}
    try:
      return self.run(jaxpr, ins)
    finally:
      self.uses, self.other, self.repeated, self.x_batched = saved

  def cond(self, eqn, vals: list) -> list:
    ops = vals[1:]
    for value in ops:
      self.misuse(value, f"read inside a `cond`{_where(eqn)}")
    ops = [_V(v.axis) for v in ops]
    merged = None
    for branch in eqn.params["branches"]:
      outs = [v.axis for v in self.run(branch.jaxpr, ops)]
      merged = (
        outs if merged is None else [_merge(a, b) for a, b in zip(merged, outs)]
      )
    return [_V(a) for a in merged or []]

  # -- the batch axis ---------------------------------------------------------

  def mixes(self, eqn, what: str):
    if self.soft:
      return MIXED
    if self.batch > 1:
      raise MixesExamples(
        f"`{eqn.primitive.name}`{_where(eqn)} {what}, so one example's data "
        "reaches another example's loss"
      )
    return LOST

  def batch_rule(self, eqn, axes: list) -> list:
    n_out = len(eqn.outvars)
    if all(a is None for a in axes):
      return [None] * n_out
    if any(a in (LOST, MIXED) for a in axes):
      return [LOST] * n_out
    name = eqn.primitive.name
    p = eqn.params
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    rule = _RULES.get(name)
    if rule is not None:
      return rule(self, eqn, axes, shapes, p)
    if name in _IDENTITY:
      return list(axes[:n_out]) + [LOST] * (n_out - len(axes))
    if name in _REDUCE:
      return [self.reduced(eqn, axes[0], p["axes"], "reduces over")] * n_out
    if name in _CUMULATIVE:
      if axes[0] == p["axis"]:
        return [self.mixes(eqn, "accumulates along the batch axis")] * n_out
      return [axes[0]] * n_out
    return [self.elementwise(eqn, axes, shapes)] * n_out

  def reduced(self, eqn, axis, reduced_axes, verb: str):
    if axis is None:
      return None
    reduced_axes = tuple(int(a) for a in reduced_axes)
    if axis in reduced_axes:
      return self.mixes(eqn, f"{verb} the batch axis")
    return axis - sum(1 for a in reduced_axes if a < axis)

  def elementwise(self, eqn, axes: list, shapes: list):
    if _SHAPED & set(eqn.params):
      return LOST
    out_shape = tuple(getattr(eqn.outvars[0].aval, "shape", ()))
    found = {a for a in axes if a is not None}
    if len(found) != 1:
      return LOST
    axis = found.pop()
    # Operands broadcast along axes of size 1; a batched one keeps its
    # batch axis whole.
    for a, s in zip(axes, shapes):
      if a is not None and (len(s) != len(out_shape) or s[a] != out_shape[a]):
        return LOST
    return axis


def _merge(a, b):
  """The batch axis of a value that is ``a`` on one path and ``b`` on
  another (a loop's carry, a ``cond``'s branches).
  """
  if a is None:
    return b
  if b is None or a == b:
    return a
  return LOST


def _transpose(w, eqn, axes, shapes, p):
  del w, eqn, shapes
  return [list(p["permutation"]).index(axes[0])]


def _broadcast(w, eqn, axes, shapes, p):
  del w
  a = axes[0]
  out = int(p["broadcast_dimensions"][a])
  if shapes[0][a] != eqn.outvars[0].aval.shape[out]:
    return [LOST]
  return [out]


def _reshape(w, eqn, axes, shapes, p):
  a = axes[0]
  if p.get("dimensions") is not None:
    return [LOST]
  new = tuple(eqn.outvars[0].aval.shape)
  prefix = math.prod(shapes[0][:a])
  for j in range(len(new)):
    if math.prod(new[:j]) == prefix and new[j] % w.batch == 0 and new[j]:
      return [j]
  return [LOST]


def _squeeze(w, eqn, axes, shapes, p):
  del w, eqn, shapes
  a, dims = axes[0], tuple(int(d) for d in p["dimensions"])
  if a in dims:
    return [LOST]
  return [a - sum(1 for d in dims if d < a)]


def _dot_general(w, eqn, axes, shapes, p):
  (lc, rc), (lb, rb) = p["dimension_numbers"]
  la, ra = axes
  out = []
  if la is not None:
    if la in lc:
      return [w.mixes(eqn, "contracts over the batch axis")]
    if la in lb:
      out.append(("batch", list(lb).index(la)))
    else:
      free = [d for d in range(len(shapes[0])) if d not in lc and d not in lb]
      out.append(("lhs", free.index(la)))
  if ra is not None:
    if ra in rc:
      return [w.mixes(eqn, "contracts over the batch axis")]
    if ra in rb:
      out.append(("batch", list(rb).index(ra)))
    else:
      free = [d for d in range(len(shapes[1])) if d not in rc and d not in rb]
      out.append(("rhs", free.index(ra)))
  if len(out) == 2 and (out[0] != out[1] or out[0][0] != "batch"):
    return [w.mixes(eqn, "multiplies every example by every other")]
  kind, i = out[0]
  n_batch = len(lb)
  n_lhs_free = len(shapes[0]) - len(lc) - len(lb)
  if kind == "batch":
    return [i]
  if kind == "lhs":
    return [n_batch + i]
  return [n_batch + n_lhs_free + i]


def _conv(w, eqn, axes, shapes, p):
  del shapes
  la, ra = axes
  if ra is not None or p.get("batch_group_count", 1) != 1:
    return [LOST]
  lhs_spec, _, out_spec = p["dimension_numbers"]
  if la == lhs_spec[0]:
    return [int(out_spec[0])]
  return [w.mixes(eqn, "convolves across the batch axis")]


def _reduce_window(w, eqn, axes, shapes, p):
  del shapes
  a = axes[0]
  window = p["window_dimensions"][a]
  stride = p["window_strides"][a]
  padding = tuple(p["padding"][a])
  if window == 1 and stride == 1 and padding == (0, 0):
    return [a] * len(eqn.outvars)
  return [w.mixes(eqn, "pools across the batch axis")] * len(eqn.outvars)


def _slice(w, eqn, axes, shapes, p):
  del w, eqn
  a = axes[0]
  strides = p.get("strides") or (1,) * len(shapes[0])
  whole = (
    p["start_indices"][a] == 0
    and p["limit_indices"][a] == shapes[0][a]
    and strides[a] == 1
  )
  return [a if whole else LOST]


def _dynamic_slice(w, eqn, axes, shapes, p):
  del w, eqn
  a = axes[0]
  if a is None or any(x is not None for x in axes[1:]):
    return [LOST]
  return [a if p["slice_sizes"][a] == shapes[0][a] else LOST]


def _dynamic_update_slice(w, eqn, axes, shapes, p):
  del w, eqn, p
  a, u = axes[0], axes[1]
  if any(x is not None for x in axes[2:]):
    return [LOST]
  axis = a if a is not None else u
  same = (a is None or a == axis) and (u is None or u == axis)
  return [axis if same and shapes[1][axis] == shapes[0][axis] else LOST]


def _concatenate(w, eqn, axes, shapes, p):
  del w, eqn, shapes
  found = {a for a in axes if a is not None}
  if len(found) != 1:
    return [LOST]
  a = found.pop()
  return [LOST if a == p["dimension"] else a]


def _pad(w, eqn, axes, shapes, p):
  del w, eqn, shapes
  a = axes[0]
  if a is None or axes[1] is not None:
    return [LOST]
  return [a if tuple(p["padding_config"][a]) == (0, 0, 0) else LOST]


def _split(w, eqn, axes, shapes, p):
  del w, shapes
  a = axes[0]
  return [LOST if a == p["axis"] else a] * len(eqn.outvars)


def _sort(w, eqn, axes, shapes, p):
  del shapes
  found = {a for a in axes if a is not None}
  n = len(eqn.outvars)
  if len(found) != 1:
    return [LOST] * n
  a = found.pop()
  if a == p["dimension"]:
    return [w.mixes(eqn, "sorts along the batch axis")] * n
  return [a] * n


def _top_k(w, eqn, axes, shapes, p):
  del p
  a = axes[0]
  if a == len(shapes[0]) - 1:
    return [w.mixes(eqn, "ranks along the batch axis")] * 2
  return [a, a]


def _gather(w, eqn, axes, shapes, p):
  del w
  dn = p["dimension_numbers"]
  op, idx = axes
  out_rank = len(eqn.outvars[0].aval.shape)
  offset = tuple(dn.offset_dims)
  batch_out = [d for d in range(out_rank) if d not in offset]
  index_rank = len(shapes[1])
  # jax.numpy puts the index vector in the last axis of the indices.
  idx_axes = list(range(index_rank - 1))
  op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
  idx_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
  if idx is not None and idx not in idx_axes:
    return [LOST]
  if op is None and idx is not None:
    return [batch_out[idx_axes.index(idx)]]
  if idx is None:
    kept = [
      d
      for d in range(len(shapes[0]))
      if d not in dn.collapsed_slice_dims and d not in op_batching
    ]
    if (
      op in kept
      and op not in dn.start_index_map
      and p["slice_sizes"][op] == shapes[0][op]
    ):
      return [offset[kept.index(op)]]
    return [LOST]
  if op in op_batching and idx_batching[op_batching.index(op)] == idx:
    return [batch_out[idx_axes.index(idx)]]
  return [LOST]


_RULES: dict[str, Callable] = {
  "transpose": _transpose,
  "broadcast_in_dim": _broadcast,
  "reshape": _reshape,
  "squeeze": _squeeze,
  "dot_general": _dot_general,
  "conv_general_dilated": _conv,
  "reduce_window_sum": _reduce_window,
  "reduce_window_max": _reduce_window,
  "reduce_window_min": _reduce_window,
  "reduce_window": _reduce_window,
  "slice": _slice,
  "dynamic_slice": _dynamic_slice,
  "dynamic_update_slice": _dynamic_update_slice,
  "concatenate": _concatenate,
  "pad": _pad,
  "split": _split,
  "sort": _sort,
  "top_k": _top_k,
  "gather": _gather,
}


def _live(jaxpr):
  """``jaxpr`` without the work its outputs do not need (an auxiliary
  output's batch mean is no use of the batch by the loss), its inputs kept.
  """
  try:
    from jax._src.interpreters import partial_eval

    return partial_eval.dce_jaxpr(
      jaxpr, [True] * len(jaxpr.outvars), instantiate=True
    )[0]
  except Exception:  # noqa: BLE001 (without it, all the work is read)
    return jaxpr


def audit(
  closed_jaxpr,
  n_params: int,
  batch_axes: Sequence[Optional[int]],
  batch_size: int,
  specs: dict,
) -> Audit:
  """Reads ``closed_jaxpr``, a program ``(params..., batch...) -> losses``.

  Args:
    closed_jaxpr: from ``jax.make_jaxpr`` of the marked loss, with the
      parameters' leaves as its first ``n_params`` inputs.
    n_params: the number of parameter leaves.
    batch_axes: per remaining input, its batch axis (0 for a leaf of a
      batch argument, None for any other).
    batch_size: ``B``.
    specs: the markers (:func:`marker`).

  Returns:
    The :class:`Audit`.

  Raises:
    MixesExamples: an operation crosses examples (see the module's
      docstring).
  """
  walker = _Walker(batch_size, specs, n_params)
  ins = [_V(None, i) for i in range(n_params)]
  ins += [_V(a) for a in batch_axes]
  outs = walker.run(_live(closed_jaxpr.jaxpr), ins)
  return Audit(
    uses=walker.uses,
    repeated=walker.repeated,
    other_use=walker.other,
    x_batched=walker.x_batched,
    loss_axis=outs[0].axis if outs else None,
  )
