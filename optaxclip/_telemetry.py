"""Per-leaf and per-layer gradient norms (``leaf_stats=``, ``layer_axis=``).

Every norm-based clipper can keep, next to its statistics, the pre-clip norm
of each leaf of the update (``leaf_norms``: one vector, with the updates'
structure; ``.tree()`` is a pytree shaped like the updates), the share of
the norm that the largest leaf carried (``top_leaf_share``) and that leaf's
index (``top_leaf``). They come from the partial sums the clipper already
computes: the reduction that gives the clipper its norm is run per leaf
(small leaves stacked by size, see ``_norms.UnitLayout``) and the global or
per-unit norms are put together from those per-leaf sums, so no further
pass over the gradients is made.

A stacked leaf (``nn.scan``, ``nnx.scan``, a ``(layers, ...)`` array) hides
which layer exploded behind one norm. ``layer_axis`` names its stacking axis:
the leaf then reports one norm per layer (a ``(L,)`` vector), computed the
same way, per layer instead of per leaf.

Conventions (the state fields, in this order, after the clipper's own):

* ``leaf_norms``: a :class:`LeafNorms`, float32, one entry per leaf (or
  ``L`` for a leaf with a layer axis), kept as one vector with the updates'
  structure as static data (``.tree()`` gives a pytree shaped like the
  updates); a norm beyond float32's range reads ``+inf`` (the clip itself
  stays exact: it uses the norm as ``value * 2**exponent``); NaN for a leaf
  holding a NaN.
* ``top_leaf_share``: float32 in [0, 1], the largest leaf's (or layer's)
  share of the ``ord``-th power of the norm the clipper reports
  (``norm**2`` for L2: its share of the squared norm); 1 for ``ord=inf``;
  0 for an all-zero update; NaN when a leaf holds a NaN.
* ``top_leaf``: int32, the index of that leaf or layer in the flattened
  ``leaf_norms`` (each ``(L,)`` vector flattened in place); a leaf holding
  a NaN or an inf wins (the first one).

All three are ``None`` when ``leaf_stats=False``, so that states of one
configuration keep one pytree structure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
import importlib.util
import math
import numbers
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip import _norms
from optaxclip import _sharding

LayerAxis = Union[None, int, Any, Callable[[Any, Any], Optional[int]]]

FIELDS = ("leaf_norms", "top_leaf_share", "top_leaf")


@jax.tree_util.register_pytree_node_class
class LeafNorms:
  """Each leaf's (or layer's) pre-clip norm: one float32 vector, the entries
  in the order of the updates' leaves (a leaf with a layer axis has one per
  layer, in place), with the updates' structure kept as static data.

  One array, not a pytree of a thousand scalars: every output of a compiled
  step costs compile time (copy insertion, layout assignment), and a state
  with one output per leaf would make compiling a step on a thousand
  leaves markedly slower. The structure travels as the pytree node's
  static data, so the paths are known without storing strings.

  Attributes:
    values: float32 ``(entries,)``, the norms (the node's only child).
    treedef: the structure of the updates (static).
    layers: per leaf, None for one norm, or its number of layers (static).
  """

  def __init__(self, values: Any, treedef: Any, layers: tuple[Any, ...]):
    self.values = values
    self.treedef = treedef
    self.layers = tuple(layers)

  def tree_flatten(self):
    return (self.values,), (self.treedef, self.layers)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def tree(self) -> Any:
    """The norms as a pytree shaped like the updates: a scalar per leaf,
    an ``(L,)`` vector per leaf with a layer axis (with the leading axes of
    a state batched by ``vmap`` or ``pmap`` in front of each).
    """
    out, at = [], 0
    for layers in self.layers:
      if layers is None:
        out.append(self.values[..., at])
        at += 1
      else:
        out.append(self.values[..., at : at + layers])
        at += layers
    return jax.tree.unflatten(self.treedef, out)

  def names(self) -> list[str]:
    """``<path>`` (or ``<path>/<layer>``) of every entry, in order:
    ``jax.tree_util.keystr(path, simple=True, separator="/")``.
    """
    # A string for "one norm" (a leaf of any pytree), not None: a None node
    # of the updates (a frozen leaf) must stay a node without entries.
    skeleton = jax.tree.unflatten(
      self.treedef, ["one" if n is None else n for n in self.layers]
    )
    names = []
    for path, layers in jax.tree_util.tree_flatten_with_path(skeleton)[0]:
      name = jax.tree_util.keystr(tuple(path), simple=True, separator="/")
      if layers == "one":
        names.append(name)
      else:
        names.extend(f"{name}/{k}" for k in range(layers))
    return names

  def __repr__(self) -> str:
    return f"LeafNorms({self.values!r}, layers={self.layers!r})"


class LeafStats(NamedTuple):
  """The telemetry fields of a state (``None`` each when off)."""

  leaf_norms: Any = None
  top_leaf_share: Optional[jax.Array] = None
  top_leaf: Optional[jax.Array] = None


def _is_entry(value: Any) -> bool:
  """One leaf's ``layer_axis`` entry (an int or None), not a prefix node."""
  return value is None or isinstance(value, (numbers.Integral, np.integer))


def _check_entry(who: str, entry: Any, where: str = "") -> None:
  at = f" for the leaf {where}" if where else ""
  if isinstance(entry, (bool, np.bool_)) or not _is_entry(entry):
    raise TypeError(
      f"{who}: layer_axis{at} must be an int or None (a pytree prefix of "
      f"them, or a callable returning one); got {entry!r}."
    )


def check(who: str, leaf_stats: Any, layer_axis: Any) -> bool:
  """Checks ``leaf_stats`` and what can be checked of ``layer_axis`` when a
  transformation is built. Returns ``leaf_stats`` as a bool.
  """
  if not isinstance(leaf_stats, (bool, np.bool_)):
    raise TypeError(f"{who}: leaf_stats must be a bool; got {leaf_stats!r}.")
  if layer_axis is None:
    return bool(leaf_stats)
  if not leaf_stats:
    raise ValueError(
      f"{who}: layer_axis must come with leaf_stats=True (it only splits "
      f"the per-leaf norms); got layer_axis={layer_axis!r} with "
      "leaf_stats=False."
    )
  if isinstance(layer_axis, jax.Array):
    raise TypeError(
      f"{who}: layer_axis must be an int, a pytree prefix of ints/None or a "
      f"callable, not an array; got {layer_axis!r}."
    )
  if callable(layer_axis) and not _is_entry(layer_axis):
    return True
  if _is_entry(layer_axis) or isinstance(layer_axis, (bool, np.bool_)):
    _check_entry(who, layer_axis)
    return True
  for entry in jax.tree_util.tree_leaves(layer_axis, is_leaf=_is_entry):
    _check_entry(who, entry)
  return True


def layer_axes(who: str, tree: Any, layer_axis: LayerAxis) -> list[Any]:
  """Per leaf of ``tree``, its layer axis (non-negative) or ``None``.

  Raises:
    ValueError or TypeError naming the leaf for a bad entry, an axis out of
    the leaf's rank or a prefix without an entry for it.
  """
  if layer_axis is None:
    return [None] * len(jax.tree.leaves(tree))
  out = []
  for path, leaf, entry in _sharding.per_leaf(
    tree, layer_axis, is_entry=_is_entry, who=who, name="layer_axis"
  ):
    where = jax.tree_util.keystr(path) or "<root>"
    _check_entry(who, entry, where)
    if entry is None:
      out.append(None)
      continue
    ndim = np.ndim(leaf)
    if not -ndim <= int(entry) < ndim:
      raise ValueError(
        f"{who}: layer_axis must be an axis of the leaf {where} (rank "
        f"{ndim}, shape {np.shape(leaf)}); got {int(entry)}."
      )
    out.append(int(entry) % ndim)
  return out


def check_unsplit(who: str, splits, layers, paths=None) -> None:
  """A layer axis must not be split across devices: every device must hold
  every layer (its norms are then the same on all devices).

  A leaf split over mapped axes whose dimensions are not declared
  (``sharded=True`` or axis names, not a PartitionSpec) is refused too: its
  layer axis may be the split one, and the per-layer sums of the devices
  would then be added up as if they held the same layers (4 layers on 2
  devices reported as 2 norms, each mixing two layers).
  ``paths``: the leaves' paths, for messages (else their index).
  """
  for i, (s, layer) in enumerate(zip(splits, layers)):
    if layer is None:
      continue
    where = f"leaf {paths[i]}" if paths is not None else f"leaf #{i}"
    if s.dims is None and s.axes:
      raise ValueError(
        f"{who}: layer_axis on the {where}, which is split over "
        f"{s.axes} along dimensions not declared (sharded=True or axis "
        "names): its per-layer norms would add up the layers of different "
        "devices if its layer axis were the split one. Declare the split "
        "with sharded= as a PartitionSpec for this leaf (every device must "
        f"hold every layer: axis {layer} unsplit), or sharded=False if it "
        "is not split."
      )
    if s.dims is None or layer >= len(s.dims):
      continue
    if s.dims[layer]:
      raise ValueError(
        f"{who}: layer_axis must not be an axis split across devices; got "
        f"axis {layer} of {where}, split over {s.dims[layer]}."
      )


@functools.cache
def _register_with_flax() -> None:
  """Lets ``flax.serialization`` (``to_bytes``, a ``TrainState``'s
  checkpoints) save and restore a :class:`LeafNorms`: its values, under
  ``"values"``. Done on the first state that keeps leaf norms, and only where
  flax is installed (it is not a dependency).
  """
  if importlib.util.find_spec("flax") is None:
    return
  from flax import serialization  # pylint: disable=import-outside-toplevel

  serialization.register_serialization_state(
    LeafNorms,
    lambda norms: {"values": norms.values},
    lambda target, state: LeafNorms(
      serialization.from_state_dict(target.values, state["values"]),
      target.treedef,
      target.layers,
    ),
  )


def init(params: Any, on: bool, layers: Sequence[Optional[int]]) -> LeafStats:
  """The telemetry fields of a fresh state for ``params``."""
  if not on:
    return LeafStats()
  _register_with_flax()
  leaves, treedef = jax.tree.flatten(params)
  counts = tuple(
    None if layer is None else int(np.shape(x)[layer])
    for x, layer in zip(leaves, layers)
  )
  entries = sum(1 if n is None else n for n in counts)
  return LeafStats(
    LeafNorms(jnp.zeros((entries,), jnp.float32), treedef, counts),
    jnp.zeros((), jnp.float32),
    jnp.zeros((), jnp.int32),
  )


def init_fields(
  who: str, params: Any, on: bool, layer_axis: LayerAxis
) -> dict[str, Any]:
  """The telemetry fields of a fresh state, by name."""
  layers = layer_axes(who, params, layer_axis) if on else []
  return init(params, on, layers)._asdict()


def fine_axes(
  leaves: Sequence[jax.Array],
  unit_axes: Sequence[Optional[tuple[int, ...]]],
  layers: Sequence[Optional[int]],
) -> list[Optional[tuple[int, ...]]]:
  """The axes of the units the norms are computed on: the clipper's units
  with the layer axis taken out (one unit per layer and clipping unit).
  """
  out = []
  for x, axes, layer in zip(leaves, unit_axes, layers):
    if layer is None:
      out.append(axes)
      continue
    spanned = range(np.ndim(x)) if axes is None else axes
    out.append(tuple(d for d in spanned if d != layer))
  return out


def coarse_norms(
  layout: _norms.UnitLayout,
  norms: Sequence[_norms.Scaled],
  unit_axes: Sequence[Optional[tuple[int, ...]]],
  layers: Sequence[Optional[int]],
  ord: float,  # pylint: disable=redefined-builtin
) -> list[_norms.Scaled]:
  """The clipper's unit norms (per part) from the per-layer ones: a leaf
  whose clipping unit spans its layer axis has its layers' norms combined.
  """
  out = []
  for (kind, what, _), n in zip(layout.parts, norms):
    layer = layers[what] if kind == "leaf" else None
    axes = unit_axes[what] if kind == "leaf" else None
    if layer is None or (axes is not None and layer not in axes):
      out.append(n)
    else:
      out.append(_norms.reduce_norms(n, ord, (layer,), keepdims=True))
  return out


def _flat(n: _norms.Scaled) -> _norms.Scaled:
  return _norms.Scaled(jnp.ravel(n.value), jnp.ravel(n.exponent))


def leaf_vector(
  layout: _norms.UnitLayout,
  norms: Sequence[_norms.Scaled],
  layers: Sequence[Optional[int]],
  ord: float,  # pylint: disable=redefined-builtin
  across: Optional[Sequence[tuple[str, ...]]] = None,
) -> tuple[_norms.Scaled, list[int]]:
  """Every leaf's (or layer's) norm as one flat :class:`Scaled` vector in
  leaf order, and each leaf's number of entries (1, or its layers).

  ``norms`` are per part of ``layout``, on units that never span a layer
  axis; a leaf's units are combined over every axis but its layer axis and,
  with ``across`` (per part), over the devices that hold its other units.
  """
  across = [()] * len(norms) if across is None else list(across)
  pieces: list[_norms.Scaled] = []
  sizes = [1] * len(layout.shapes)
  members: list[int] = []  # leaves in the order of the pieces' entries
  for (kind, what, _), n, names in zip(layout.parts, norms, across):
    if kind == "rows":
      pieces.append(_flat(n))  # one row per member: its whole-leaf norm
      members.extend(i for i, _, _ in what)
      continue
    layer = layers[what]
    axes = tuple(d for d in range(n.value.ndim) if d != layer)
    pieces.append(_flat(_norms.reduce_norms(n, ord, axes, names=names)))
    members.append(what)
    if layer is not None:
      sizes[what] = layout.shapes[what][layer]
  starts, at = {}, 0
  for i in members:
    starts[i] = at
    at += sizes[i]
  perm = [
    k for i in range(len(sizes)) for k in range(starts[i], starts[i] + sizes[i])
  ]
  dtype = _norms.promote_types(
    jnp.float32,
    functools.reduce(
      _norms.promote_types, [p.value.dtype for p in pieces], jnp.float32
    ),
  )
  value = _concat([p.value.astype(dtype) for p in pieces], dtype)
  exponent = _concat([p.exponent for p in pieces], jnp.int32)
  if perm != list(range(len(perm))):
    index = np.asarray(perm, np.int32)
    value, exponent = value[index], exponent[index]
  return _norms.Scaled(value, exponent), sizes


def _concat(parts, dtype) -> jax.Array:
  if not parts:
    return jnp.zeros((0,), dtype)
  parts = [jnp.ravel(p) for p in parts]
  return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def share_of_top(
  vector: _norms.Scaled,
  total: _norms.Scaled,
  ord: float,  # pylint: disable=redefined-builtin
) -> tuple[jax.Array, jax.Array]:
  """``(share, index)`` of the largest entry of ``vector``: its share of
  ``total**ord`` (``total`` the norm of the whole; see the module notes).
  """
  if vector.value.size == 0:
    return jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
  ratio = _norms.ratio(vector, total)
  if not math.isinf(ord):
    ratio = ratio**ord
  finite = jnp.isfinite(vector.value)
  total_ok = jnp.isfinite(total.value) & (total.value > 0)
  share = jnp.where(
    finite,
    jnp.where(total_ok, ratio, 0),
    jnp.where(jnp.isnan(vector.value), jnp.nan, 1),
  )
  index = jnp.argmax(share)  # the first NaN, else the first largest
  return (
    jnp.clip(share[index], 0, 1).astype(jnp.float32),
    index.astype(jnp.int32),
  )


def finish(
  state_norms: Any,
  vector: _norms.Scaled,
  sizes: Sequence[int],
  total: _norms.Scaled,
  ord: float,  # pylint: disable=redefined-builtin
) -> LeafStats:
  """The telemetry fields from the flat per-leaf vector (see leaf_vector),
  ``leaf_norms`` with the structure of the state's (``state_norms``, a
  :class:`LeafNorms`).
  """
  vector = jax.lax.stop_gradient(vector)
  total = jax.lax.stop_gradient(total)
  if not isinstance(state_norms, LeafNorms):
    raise TypeError(
      "leaf_stats: the state's leaf_norms must be a LeafNorms (from the "
      f"clipper's init); got {type(state_norms).__name__}."
    )
  counts = [1 if n is None else n for n in state_norms.layers]
  if counts != list(sizes):
    got = (
      f"{len(counts)} leaves but the updates have {len(sizes)}"
      if len(counts) != len(sizes)
      else f"entries per leaf {counts} but the updates give {list(sizes)}"
    )
    raise ValueError(
      f"leaf_stats: the state was built for {got}; call init with "
      "parameters of the same structure as the updates. Inside shard_map, "
      "a leaf split along its layer_axis also gives other layer counts: "
      "each device must hold every layer of a leaf (declare the split with "
      "sharded= as a PartitionSpec or axis names, which checks it)."
    )
  floats = vector.as_float().astype(jnp.float32)
  share, index = share_of_top(vector, total, ord)
  return LeafStats(
    LeafNorms(floats, state_norms.treedef, state_norms.layers), share, index
  )


def leaf_norm_names(tree: Any) -> list[str]:
  """``<path>`` (or ``<path>/<layer>``) of every entry of ``leaf_norms``
  (a :class:`LeafNorms`, or a pytree of scalars and vectors), in flat
  order: ``jax.tree_util.keystr(path, simple=True, separator="/")``.
  """
  if isinstance(tree, LeafNorms):
    return tree.names()
  names = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = jax.tree_util.keystr(tuple(path), simple=True, separator="/")
    if np.ndim(leaf) == 0:
      names.append(name)
    else:
      names.extend(f"{name}/{k}" for k in range(np.shape(leaf)[0]))
  return names


def _paths(tree: Any) -> list[str]:
  """Each leaf's path, for messages (``jax.tree.leaves`` order)."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [jax.tree_util.keystr(tuple(path)) or "<root>" for path, _ in flat]


def _one_pass(
  who: str,
  leaves: Sequence[jax.Array],
  ord: float,  # pylint: disable=redefined-builtin
  unit_axes: Sequence[Optional[tuple[int, ...]]],
  layers: Sequence[Optional[int]],
  axis_name: Any,
  splits: Optional[Sequence[_sharding.LeafSharding]],
  *,
  keyed: bool = False,
  several_units: bool = False,
  paths: Optional[Sequence[str]] = None,
) -> tuple[_norms.UnitLayout, list[_norms.Scaled]]:
  """The packed pass of :func:`global_norm` and :func:`unit_norms`: the
  norms of the units split per layer (``fine_axes``), each summed over the
  names its leaf is split over. ``keyed``: leaves held whole on other
  devices are not stacked with the others (their leaf norms merge apart).
  """
  if splits is None:
    splits = [_sharding.LeafSharding((), None)] * len(leaves)
  check_unsplit(who, splits, layers, paths)
  fine = fine_axes(leaves, unit_axes, layers)
  return _norms.unit_norms_packed(
    leaves,
    ord,
    fine,
    axis_name=axis_name,
    sharded=[_sharding.axes_of(s, a) for s, a in zip(splits, fine)],
    keys=(
      [_sharding.other_axes(s, a) for s, a in zip(splits, fine)]
      if keyed
      else None
    ),
    several_units=several_units,
  )


def global_norm_with_leaves(
  who: str,
  updates: Any,
  leaves: Sequence[jax.Array],
  ord: float,  # pylint: disable=redefined-builtin
  state_norms: Any,
  layer_axis: LayerAxis,
  *,
  axis_name: Any = None,
  splits: Optional[Sequence[_sharding.LeafSharding]] = None,
) -> tuple[_norms.Scaled, LeafStats]:
  """The global ``ord``-norm of the leaves, put together from per-leaf (or
  per-layer) sums in one pass, and the telemetry fields.

  ``splits``: per leaf, how it is split over ``axis_name`` (from
  ``_sharding.resolve``); ``None`` when nothing is split.
  """
  layers = layer_axes(who, updates, layer_axis)
  layout, norms = _one_pass(
    who,
    leaves,
    ord,
    [None] * len(leaves),
    layers,
    axis_name,
    splits,
    paths=_paths(updates),
  )
  vector, sizes = leaf_vector(layout, norms, layers, ord)
  total = _norms.reduce_norms(vector, ord)
  return total, finish(state_norms, vector, sizes, total, ord)


def unit_norms(
  who: str,
  updates: Any,
  leaves: Sequence[jax.Array],
  ord: float,  # pylint: disable=redefined-builtin
  unit_axes: Sequence[Optional[tuple[int, ...]]],
  *,
  on: bool,
  state_norms: Any = None,
  layer_axis: LayerAxis = None,
  axis_name: Any = None,
  splits: Optional[Sequence[_sharding.LeafSharding]] = None,
) -> tuple[_norms.UnitLayout, list[_norms.Scaled], LeafStats]:
  """The clipping units' norms (per part of the layout) and, when ``on``,
  the telemetry fields, from one pass over the leaves.

  With a layer axis, the pass runs on units split per layer and the
  clipping units' norms are put together from theirs. ``splits``: per leaf,
  how it is split over ``axis_name`` (``_sharding.resolve``); units split
  over some names are summed over them, and devices holding other units of
  a leaf (the other names) are merged for its leaf norm.
  """
  n = len(leaves)
  layers = layer_axes(who, updates, layer_axis) if on else [None] * n
  layout, norms = _one_pass(
    who,
    leaves,
    ord,
    unit_axes,
    layers,
    axis_name,
    splits,
    keyed=True,
    # Leaves of several units stacked (compile time on many leaves) unless
    # the per-leaf statistics below read one value per leaf of a part.
    several_units=not on,
    paths=_paths(updates) if on else None,
  )
  coarse = coarse_norms(layout, norms, unit_axes, layers, ord)
  if not on:
    return layout, coarse, LeafStats()
  across = [key[1] for key in layout.keys]
  vector, sizes = leaf_vector(layout, norms, layers, ord, across)
  total = _norms.reduce_norms(vector, ord)
  return layout, coarse, finish(state_norms, vector, sizes, total, ord)
