"""The clipping numerics as plain functions on pytrees, for custom loops.

TensorFlow's ``tf.clip_by_global_norm(grads, c, use_norm=)`` and PyTorch's
``get_total_norm`` / ``clip_grads_with_norm_`` split "measure" from "scale",
so that a norm can be logged, reduced across meshes or reused. These are the
same, with :mod:`optaxclip._norms`' numerics (float32 accumulation,
overflow-safe, ``axis_name`` inside ``shard_map``/``pmap``) and its
non-finite policy. The transformations of :mod:`optaxclip._static` are built
on the private pieces below (``global_clip``, ``unit_norms_of``,
``scale_units``, ``clip_leaf_to_range``): one code path for both.

Every function here is traceable: call it inside ``jax.jit`` (eager calls
work, and trace at each call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip import _checks
from optaxclip import _norms
from optaxclip import _sharding
from optaxclip._typing import Axis
from optaxclip._typing import AxisName
from optaxclip._typing import Ord
from optaxclip._typing import Scalar

Sharded = Union[bool, Any, Callable[[Any, jax.Array], bool]]


# --- The pieces the transformations share -----------------------------------


def flatten(tree: Any, who: str) -> tuple[list[jax.Array], Any]:
  """The float leaves of ``tree`` as arrays, and its treedef.

  Raises a TypeError naming the first leaf that is not float or complex.
  """
  leaves, treedef = jax.tree.flatten(tree)
  _checks.check_float_leaves(tree, f"{who}: updates")
  # Python or NumPy scalars are valid leaves too (optax accepts them).
  return [jnp.asarray(x) for x in leaves], treedef


def sharded_flags(
  updates: Any, sharded: Sharded, who: str, axis_name: Any = None
) -> list[tuple[str, ...]]:
  """Per leaf of ``updates``, the names of ``axis_name`` it is split over.

  ``sharded`` is an entry for all leaves, a pytree prefix of entries or a
  callable ``(path, leaf) -> entry``; an entry is ``True`` (every axis of
  ``axis_name``), ``False``/``None`` (none), a tuple of axis names or a
  ``PartitionSpec`` (see :mod:`optaxclip._sharding`). The result is what
  ``_norms``' ``sharded=`` takes. Without ``axis_name``, nothing is split.
  """
  return [s.axes for s in _sharding.resolve(updates, sharded, axis_name, who)]


def global_clip(
  leaves: list[jax.Array],
  max_norm: Any,
  p: float,
  *,
  axis_name: AxisName,
  flags: Optional[list[tuple[str, ...]]],
  norm: Optional[Any] = None,
) -> tuple[list[jax.Array], _norms.Scaled, _norms.Scaled]:
  """Every leaf times ``min(1, max_norm / norm)``: ``(out, norm, factor)``.

  ``norm`` (a number, or a :class:`_norms.Scaled` the caller measured)
  defaults to the leaves' global ``p``-norm; the norm and the factor
  returned are :class:`_norms.Scaled` (exact beyond the dtype's range).
  """
  if norm is None:
    scaled = _norms.global_norm_scaled(
      leaves, p, axis_name=axis_name, sharded=flags
    )
  elif isinstance(norm, _norms.Scaled):  # measured by the caller
    scaled = norm
  else:
    dtype = _norms.tree_accumulation_dtype(leaves)
    scaled = _norms.as_scaled(jnp.asarray(norm).astype(dtype).reshape(()))
  factor = _norms.clip_scale(scaled, max_norm)
  smallest = _norms.smallest_clip_factor(leaves, max_norm, axis_name)
  return _norms.scale_all(leaves, factor, smallest=smallest), scaled, factor


def unit_norms_of(
  updates: Any,
  leaves: list[jax.Array],
  p: float,
  axis: Optional[tuple[int, ...]],
  axis_name: AxisName,
  sharded: Sharded,
  who: str,
) -> tuple[_norms.UnitLayout, list[_norms.Scaled]]:
  """The norm of each leaf (or each slice spanning ``axis``), packed.

  Returns ``_norms.unit_norms_packed``'s ``(layout, norms per part)``; the
  layout's keys are ``(sharded, across)``, ``across`` the mapped axes over
  which devices hold other units of a leaf.
  """
  paths = [path for path, _ in _checks.leaves_with_paths(updates)]
  axes = [
    _checks.leaf_axes(who, axis, x, path) for x, path in zip(leaves, paths)
  ]
  splits = _sharding.resolve(updates, sharded, axis_name, who)
  return _norms.unit_norms_packed(
    leaves,
    p,
    axes,
    axis_name=axis_name,
    sharded=[_sharding.axes_of(s, a) for s, a in zip(splits, axes)],
    keys=[_sharding.other_axes(s, a) for s, a in zip(splits, axes)],
    several_units=True,
  )


def scale_units(
  leaves: list[jax.Array],
  layout: _norms.UnitLayout,
  norms: list[_norms.Scaled],
  limits: list[Any],
  smallest: float = 0.0,
) -> tuple[list[jax.Array], list[_norms.Scaled]]:
  """Each unit scaled to its limit: ``(out, factors per part)``.

  ``norms`` and ``limits`` are per part of ``layout``; the factors are
  computed on the few parts, and each leaf is scaled by its own entries.
  ``smallest``: a bound on the factors known when tracing (see
  ``_norms.scale_leaf``), or 0.
  """
  factors = _norms.clip_scale_parts(norms, limits, layout.keys)
  return layout.scale(leaves, factors, smallest), factors


def clip_leaf_to_range(
  x: jax.Array, low: jax.Array, high: jax.Array, poison: jax.Array
) -> jax.Array:
  """``x`` clipped element-wise into ``[low, high]`` (in their dtype, then
  back to x's); a complex ``x`` has its modulus clipped to ``high`` (which
  needs ``low == -high``) and keeps its phase.

  ``poison`` is 0, or NaN to make the whole leaf NaN (the non-finite
  policy), or an array of x's shape that is NaN where an element is to be
  NaN; computed from the leaf, it also makes the clip wait for the leaf's
  own statistics, so that XLA computes them while it is in cache.
  """
  low, high = low + poison, high + poison
  if jnp.iscomplexobj(x):
    # min(1, high / |x|) exactly: a plain quotient would be flushed to zero
    # below 2**-126 (a modulus of 1e37 clipped to 1e-7), and a modulus may
    # exceed the range while both parts are finite.
    return _norms.scale_leaf(x, _norms.clip_scale(_norms.modulus(x), high))
  return jnp.clip(x.astype(high.dtype), low, high).astype(x.dtype)


# --- The public functions ---------------------------------------------------


def global_norm(
  tree: Any,
  *,
  ord: Ord = 2,
  axis_name: AxisName = None,
  sharded: Sharded = True,
) -> jax.Array:
  """The ``ord``-norm of all leaves of ``tree`` taken together, as one vector.

  What :func:`clip_global` measures, and PyTorch's
  ``torch.nn.utils.get_total_norm``, ``optax.global_norm`` and
  ``tf.linalg.global_norm`` return: accumulated in float32 (or float64 for
  float64 leaves) whatever the leaf dtype, so a bfloat16 tree gets its true
  norm; overflow-safe (1e30-sized float32 gradients have a norm of 1e30, not
  inf); complex leaves count ``|x|``. A norm of finite values beyond the
  dtype's range is ``inf`` here (:func:`clip_by_global_norm` still clips
  such a tree exactly). A NaN anywhere gives NaN; an inf, inf.

  Args:
    tree: a pytree of float or complex arrays (``None`` leaves and empty
      trees count as zero).
    ord: the norm's order: any p >= 1, or ``inf`` (torch's ``norm_type``);
      ``None`` means 2.
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split; their partial sums are summed across
      devices, so every device gets the norm of the whole tree.
    sharded: per leaf, which axes of ``axis_name`` split it, as for
      :func:`clip_global`: ``True`` (all; the default), ``False``/``None``
      (replicated: counted once), a tuple of axis names or a
      ``PartitionSpec``; one for all leaves, a pytree prefix of them or a
      callable ``(path, leaf) -> entry``.

  Returns:
    A scalar in the accumulation dtype (float32 unless a leaf is float64).

  References:
    PyTorch ``torch.nn.utils.get_total_norm``; Blue, `A portable Fortran
    program to find the Euclidean norm of a vector
    <https://doi.org/10.1145/355769.355771>`_, 1978 (safe scaling)

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> g = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([4.0])}
    >>> optaxclip.global_norm(g)
    Array(5., dtype=float32)
    >>> optaxclip.global_norm(g, ord="inf")
    Array(4., dtype=float32)
    >>> optaxclip.global_norm({"w": jnp.full(4, 1e30)})  # no overflow
    Array(2.e+30, dtype=float32)
  """
  who = "global_norm"
  p = _checks.check_ord("ord", ord, who=who)
  axis_name = _checks.check_sharding(who, axis_name, sharded)
  leaves, _ = flatten(tree, who)
  return _norms.global_norm_scaled(
    leaves,
    p,
    axis_name=axis_name,
    sharded=sharded_flags(tree, sharded, who, axis_name),
  ).as_float()


def leaf_norms(
  tree: Any,
  *,
  ord: Ord = 2,
  axis_name: AxisName = None,
  sharded: Sharded = True,
) -> Any:
  """The ``ord``-norm of each leaf: a pytree of scalars shaped like ``tree``.

  The per-tensor norms that :func:`clip_norm` measures (and Lightning's
  ``grad_norm`` logs), with :func:`global_norm`'s numerics; small leaves are
  reduced together, so a tree of thousands of leaves compiles to a few
  reductions. Their ``ord``-norm is the global norm.

  Args:
    tree: a pytree of float or complex arrays.
    ord: the norm's order: any p >= 1, or ``inf``; ``None`` means 2.
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split (each device gets whole-leaf norms).
    sharded: which leaves are split over ``axis_name``, as for
      :func:`global_norm`.

  Returns:
    A pytree of ``tree``'s structure whose leaves are scalars in each
    leaf's accumulation dtype (``inf`` where a norm of finite values
    exceeds it).

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([1.0, -1.0, 1.0])}
    >>> {k: float(v) for k, v in optaxclip.leaf_norms(g).items()}
    {'a': 5.0, 'b': 1.7320507764816284}
  """
  who = "leaf_norms"
  p = _checks.check_ord("ord", ord, who=who)
  axis_name = _checks.check_sharding(who, axis_name, sharded)
  leaves, treedef = flatten(tree, who)
  if not leaves:
    return tree
  layout, norms = unit_norms_of(tree, leaves, p, None, axis_name, sharded, who)
  out = []
  for x, n in zip(leaves, layout.unpack(norms)):
    dtype = _norms.accumulation_dtype(x.dtype)
    # An empty leaf's norm is 0 (its exact recompute may give NaN).
    out.append(
      jnp.zeros((), dtype) if x.size == 0 else n.as_float().reshape(())
    )
  return jax.tree.unflatten(treedef, out)


def _check_not_a_transformation(
  who: str, tree: Any, limit: Any, transformation: str
) -> None:
  """A functional clip called as optax's transformation of the same name
  (a number where the tree goes, no limit) is pointed to the optaxclip
  transformation.
  """
  if limit is not None:
    return
  if isinstance(tree, (int, float)) or (
    hasattr(tree, "shape") and np.ndim(tree) == 0
  ):
    raise TypeError(
      f"optaxclip.{who}(tree, limit) clips a tree of gradients and returns "
      f"it; got the number {tree!r} and no limit. The transformation to "
      f"chain before the optimizer is optaxclip.{transformation}({tree!r})"
      f"{_OPTAX_TWIN.get(who, '')}."
    )
  raise TypeError(f"{who}: the limit is required after the tree.")


# optax's transformations spelled as optaxclip's functions.
_OPTAX_TWIN = {
  "clip_by_global_norm": ", the counterpart of optax.clip_by_global_norm"
}


def clip_by_global_norm(
  tree: Any,
  max_norm: Optional[Scalar] = None,
  *,
  norm: Optional[Scalar] = None,
  ord: Ord = 2,
  axis_name: AxisName = None,
  sharded: Sharded = True,
) -> tuple[Any, jax.Array]:
  """Scales ``tree`` to a global norm of at most ``max_norm``; returns the
  norm too.

  ``grads, norm = optaxclip.clip_by_global_norm(grads, 5.0)`` is
  ``tf.clip_by_global_norm``: every leaf times ``max_norm / max(norm,
  max_norm)``, so the tree keeps its direction. With ``norm=`` (TF's
  ``use_norm``, the second half of torch's ``clip_grads_with_norm_``) that
  norm is used instead of measuring the tree: one computed over a larger
  tree, reduced across hosts, or reused. It is the computation inside
  :func:`clip_global`, whose state keeps the same norm.

  Non-finite policy (as every clipper's): a NaN or inf norm makes every
  value NaN, so the failure shows. A tree whose norm exceeds the dtype's
  range is still clipped exactly along its direction (the returned norm is
  then ``inf``).

  Args:
    tree: a pytree of float or complex arrays.
    max_norm: the largest global norm the tree may keep (>= 0); required.
      (``optaxclip.clip_by_global_norm(1.0)``, optax's transformation
      spelling, raises a TypeError that points to :func:`clip_global`.)
    norm: the norm to clip by; ``None`` measures the tree's ``ord``-norm.
    ord: the norm's order when measured: any p >= 1, or ``inf``; ``None``
      means 2.
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split (see :func:`global_norm`).
    sharded: which leaves are split over ``axis_name`` (see
      :func:`global_norm`).

  Returns:
    ``(clipped, norm)``: the tree (each leaf in its own dtype) and the norm
    clipped by, a scalar in the accumulation dtype.

  References:
    Pascanu et al., `On the difficulty of training Recurrent Neural Networks
    <https://arxiv.org/abs/1211.5063>`_, 2013; TensorFlow
    ``tf.clip_by_global_norm``; PyTorch ``clip_grads_with_norm_``.

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> g = {"a": jnp.array([6.0, 8.0]), "b": jnp.array([0.0])}
    >>> clipped, norm = optaxclip.clip_by_global_norm(g, 5.0)
    >>> clipped["a"], float(norm)
    (Array([3., 4.], dtype=float32), 10.0)
    >>> clipped, _ = optaxclip.clip_by_global_norm(g, 5.0, norm=20.0)
    >>> clipped["a"]
    Array([1.5, 2. ], dtype=float32)
  """
  who = "clip_by_global_norm"
  _check_not_a_transformation(who, tree, max_norm, "clip_global")
  _checks.check_number("max_norm", max_norm, who=who, low=0.0, allow_inf=True)
  _checks.check_number(
    "norm", norm, who=who, low=0.0, allow_inf=True, allow_none=True
  )
  p = _checks.check_ord("ord", ord, who=who)
  axis_name = _checks.check_sharding(who, axis_name, sharded)
  leaves, treedef = flatten(tree, who)
  flags = sharded_flags(tree, sharded, who, axis_name) if norm is None else None
  out, scaled, _ = global_clip(
    leaves, max_norm, p, axis_name=axis_name, flags=flags, norm=norm
  )
  return jax.tree.unflatten(treedef, out), scaled.as_float()


def clip_by_norm(
  tree: Any,
  max_norm: Optional[Scalar] = None,
  *,
  ord: Ord = 2,
  axis: Axis = None,
  axis_name: AxisName = None,
  sharded: Sharded = True,
) -> Any:
  """Clips each leaf (or each slice of it) to ``ord``-norm at most ``max_norm``.

  ``tf.clip_by_norm(t, max_norm, axes=axis)`` on every leaf: each is scaled
  by ``min(1, max_norm / ||leaf||)`` on its own; with ``axis``, the norm
  spans those axes and each slice across the others is clipped on its own.
  The computation inside :func:`clip_norm`. A leaf (or slice) whose norm is
  NaN or infinite comes out NaN; the others are clipped as usual.

  Args:
    tree: a pytree of float or complex arrays.
    max_norm: the largest norm a leaf (or slice) may keep (>= 0); required
      (``optaxclip.clip_by_norm(1.0)`` points to :func:`clip_norm`).
    ord: the norm's order: any p >= 1, or ``inf``; ``None`` means 2.
    axis: the axis or axes a norm spans; ``None`` for the whole leaf.
    axis_name: inside ``shard_map``/``pmap``, the mapped axis name(s) over
      which sharded leaves are split (see :func:`clip_norm`).
    sharded: which leaves are split over ``axis_name`` (see
      :func:`clip_norm`).

  Returns:
    The clipped tree, each leaf in its own dtype.

  References:
    TensorFlow ``tf.clip_by_norm``.

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.6, 0.0])}
    >>> clipped = optaxclip.clip_by_norm(g, 1.0)
    >>> clipped["a"], clipped["b"]
    (Array([0.6, 0.8], dtype=float32), Array([0.6, 0. ], dtype=float32))
    >>> optaxclip.clip_by_norm(jnp.array([[3.0, 1.0], [4.0, 0.0]]), 1.0,
    ...                        axis=0)
    Array([[0.6, 1. ],
           [0.8, 0. ]], dtype=float32)
  """
  who = "clip_by_norm"
  _check_not_a_transformation(who, tree, max_norm, "clip_norm")
  _checks.check_number("max_norm", max_norm, who=who, low=0.0, allow_inf=True)
  p = _checks.check_ord("ord", ord, who=who)
  axis = _checks.check_axis("axis", axis, who=who)
  axis_name = _checks.check_sharding(who, axis_name, sharded)
  leaves, treedef = flatten(tree, who)
  layout, norms = unit_norms_of(tree, leaves, p, axis, axis_name, sharded, who)
  out, _ = scale_units(leaves, layout, norms, [max_norm] * len(norms))
  return jax.tree.unflatten(treedef, out)


def clip_by_value(tree: Any, min_value: Scalar, max_value: Scalar) -> Any:
  """Clips each element of ``tree`` into ``[min_value, max_value]``.

  ``tf.clip_by_value`` and ``torch.nn.utils.clip_grad_value_`` (with
  ``min_value = -max_value``), as a function; :func:`clip_value` is the
  symmetric transformation built on it. Complex elements keep their phase
  and have their modulus clipped to ``max_value`` (then ``min_value`` must
  be ``-max_value``).

  Non-finite policy (as every clipper's): a leaf that holds a NaN or an inf
  comes out all NaN, where TF would clip an inf to a bound and hide it.

  Args:
    tree: a pytree of float or complex arrays.
    min_value: the smallest value an element may keep.
    max_value: the largest value an element may keep (>= ``min_value``).

  Returns:
    The clipped tree, each leaf in its own dtype.

  References:
    TensorFlow ``tf.clip_by_value``; PyTorch ``clip_grad_value_``.

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> optaxclip.clip_by_value({"w": jnp.array([-3.0, 0.5, 2.0])}, -1.0, 0.0)
    {'w': Array([-1.,  0.,  0.], dtype=float32)}
  """
  who = "clip_by_value"
  _checks.check_number("min_value", min_value, who=who, allow_inf=True)
  _checks.check_number("max_value", max_value, who=who, allow_inf=True)
  leaves, treedef = flatten(tree, who)
  concrete = not isinstance(min_value, jax.Array) and not isinstance(
    max_value, jax.Array
  )
  if concrete:
    low, high = float(np.asarray(min_value)), float(np.asarray(max_value))
    if high < low:
      raise ValueError(
        f"{who}: max_value must be >= min_value; got "
        f"min_value={min_value!r}, max_value={max_value!r}."
      )
    if any(jnp.iscomplexobj(x) for x in leaves) and low != -high:
      raise ValueError(
        f"{who}: min_value must be -max_value for complex leaves (their "
        f"modulus is clipped); got min_value={min_value!r}, "
        f"max_value={max_value!r}."
      )
  out = []
  for x in leaves:
    if x.size == 0:
      out.append(x)
      continue
    biggest = _norms.largest_part(x)  # finite exactly when x is
    dtype = biggest.dtype
    out.append(
      clip_leaf_to_range(
        x,
        jnp.asarray(min_value, dtype),
        jnp.asarray(max_value, dtype),
        0 * biggest,  # NaN for a leaf with a NaN or inf: all NaN
      )
    )
  return jax.tree.unflatten(treedef, out)
