"""Clipper states that carry their statistics, and ``stats()`` to read them.

Every clipper's state is a NamedTuple declared next to its transformation and
registered with :func:`register`, so that :func:`stats` can find it anywhere
in a nested optimizer state.
"""

from __future__ import annotations

import collections
from typing import Any, Optional

import jax
import jax.numpy as jnp

from optaxclip import _telemetry

# The fields every clipper state starts with.
CLIP_FIELDS = ("norm", "clipped_norm", "clip_fraction")

# The per-leaf telemetry fields a state may end with (leaf_stats=True).
TELEMETRY_FIELDS = ("leaf_norms", "top_leaf_share", "top_leaf")

# State class -> (short name used in stats keys, stat names, where each stat
# name lives in the state when not in a field of its own name).
_REGISTRY: dict[type, tuple[str, tuple[str, ...], dict[str, tuple[str, ...]]]]
_REGISTRY = {}


def register(
  short: str,
  stat_fields: tuple[str, ...] = CLIP_FIELDS,
  *,
  paths: Optional[dict[str, tuple[str, ...]]] = None,
):
  """Class decorator: registers a clipper's state class for :func:`stats`.

  Args:
    short: the name used in stats keys, the transformation's name
      (``"clip_global"``).
    stat_fields: the statistics :func:`stats` reports (scalars), by the
      names its keys end with.
    paths: for a state that groups its fields, where a statistic lives:
      ``{"skipped": ("counts", "skipped")}``; a name not in it is a field of
      the state itself.

  Returns:
    The decorator, which returns the class unchanged (but for its
    ``__module__``, set to ``optaxclip``, where the class is public).
  """
  paths = dict(paths or {})

  def decorate(cls: type) -> type:
    missing = [
      f for f in stat_fields if paths.get(f, (f,))[0] not in cls._fields
    ]
    if missing:
      raise TypeError(f"{cls.__name__} lacks the stat fields {missing}.")
    cls.__module__ = "optaxclip"
    _REGISTRY[cls] = (short, tuple(stat_fields), paths)
    return cls

  return decorate


def short_name(state_cls: type) -> str:
  """The name a registered state class is reported under (``"clip_global"``)."""
  return _REGISTRY[state_cls][0]


def follow(node: Any, path: tuple[str, ...]) -> Any:
  """The value at ``path`` (attribute names) below ``node``; ``None`` when
  a group on the way is ``None`` (a part the configuration does not use).
  """
  for name in path:
    if node is None:
      return None
    node = getattr(node, name)
  return node


def stat_value(state: Any, name: str) -> Any:
  """The statistic ``name`` of a registered state (``None`` when unused)."""
  return follow(state, _REGISTRY[type(state)][2].get(name, (name,)))


def zeros(n: int = len(CLIP_FIELDS)) -> tuple[jax.Array, ...]:
  """``n`` float32 zero scalars, the initial value of the statistics."""
  return tuple(jnp.zeros((), jnp.float32) for _ in range(n))


def as_stat(x: Any) -> jax.Array:
  """A statistic as a float32 scalar (stable dtype: no retrace)."""
  return jnp.asarray(x, jnp.float32).reshape(())


def _path_part(entry: Any) -> str:
  """One entry of a state's path as it appears in a key: ``"/"`` and ``"%"``
  are percent-encoded, so that the parts of a key can be told apart (an
  ``optax.named_chain`` name ``"a/0"`` is not the path ``("a", 0)``).
  """
  for attr in ("name", "key", "idx"):
    if hasattr(entry, attr):
      text = str(getattr(entry, attr))
      break
  else:
    text = str(entry)
  return text.replace("%", "%25").replace("/", "%2F")


def _unwrap(value: Any) -> Any:
  """The array inside an ``nnx`` Variable, or the value itself."""
  if isinstance(value, jax.Array):
    return value
  get_value = getattr(value, "get_value", None)  # flax >= 0.12: .value is
  if callable(get_value):  # deprecated.
    return get_value()
  return getattr(value, "value", value)


def _registered_states(tree: Any, path: tuple = ()):
  """``(path, state)`` of every registered state in ``tree``, in tree order.

  One walk: the tree is flattened once, stopping at registered states, and
  only a state's own fields are walked further (a guard holds the clippers
  it guards).
  """
  classes = tuple(_REGISTRY)
  is_state = lambda node: isinstance(node, classes)
  found = []
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state)
  for sub_path, node in flat:
    if not is_state(node):
      continue
    where = path + tuple(sub_path)
    found.append((where, node))
    fields = _REGISTRY[type(node)][1]
    for name in node._fields:
      # Statistics and per-leaf norms are arrays: nothing inside.
      if name not in fields and name not in TELEMETRY_FIELDS:
        found += _registered_states(
          getattr(node, name), where + (jax.tree_util.GetAttrKey(name),)
        )
  return found


def _keyed_states(opt_state: Any) -> list[tuple[str, Any]]:
  """``(key prefix, state)`` of every registered state, in tree order."""
  return [(key, state) for key, _, state in named_states(opt_state)]


def stat_fields(state: Any) -> tuple[str, ...]:
  """The fields :func:`stats` reports for a registered state."""
  return _REGISTRY[type(state)][1]


def named_states(opt_state: Any) -> list[tuple[str, tuple, Any]]:
  """``(key prefix, path, state)`` of every registered state, in tree order:
  the walk and the names that :func:`stats` and :func:`optaxclip.explain`
  share.
  """
  found = _registered_states(opt_state)
  counts = collections.Counter(_REGISTRY[type(s)][0] for _, s in found)
  prefixes = []
  for path, state in found:
    short = _REGISTRY[type(state)][0]
    prefixes.append(
      short
      if counts[short] == 1
      else "/".join([_path_part(e) for e in path] + [short])
    )
  repeated = {p for p, n in collections.Counter(prefixes).items() if n > 1}
  for i, (path, state) in enumerate(found):
    if prefixes[i] in repeated:
      prefixes[i] = (
        f"{jax.tree_util.keystr(tuple(path))}/{_REGISTRY[type(state)][0]}"
      )
  clashes = [p for p, n in collections.Counter(prefixes).items() if n > 1]
  if clashes:
    raise ValueError(
      f"stats: the states at {clashes[0]!r} must have distinct paths; got "
      "paths that render alike."
    )
  return [(p, path, state) for p, (path, state) in zip(prefixes, found)]


def _check_prefix(who: str, prefix: Any) -> None:
  if not isinstance(prefix, str):
    raise TypeError(f"{who}: prefix must be a str; got {prefix!r}.")


def _with_prefix(prefix: str, key: str) -> str:
  return f"{prefix.rstrip('/')}/{key}" if prefix else key


def batch_shape(state: Any) -> tuple[int, ...]:
  """The leading axes a registered state was batched over (``vmap``,
  ``pmap``): the shape of its first statistic, a scalar per step; ``()``
  for a state of one run.
  """
  value = stat_value(state, _REGISTRY[type(state)][1][0])
  return tuple(jnp.shape(_unwrap(value))) if value is not None else ()


def _leaf_norm_items(key: str, state: Any) -> list[tuple[str, jax.Array]]:
  """``(key, value)`` per leaf (or layer) of a state's ``leaf_norms``; a
  value holds the batch axes of a batched state (:func:`batch_shape`).
  """
  tree = getattr(state, "leaf_norms", None)
  if tree is None:
    return []
  if isinstance(tree, _telemetry.LeafNorms):
    values = _unwrap(tree.values)
    return [
      (
        f"{key}/leaf_norm/{name}" if name else f"{key}/leaf_norm",
        values[..., i],
      )
      for i, name in enumerate(tree.names())
    ]
  batch = len(batch_shape(state))
  items = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = jax.tree_util.keystr(tuple(path), simple=True, separator="/")
    base = f"{key}/leaf_norm/{name}" if name else f"{key}/leaf_norm"
    value = _unwrap(leaf)
    if jnp.ndim(value) == batch:
      items.append((base, value))
    else:
      items.extend(
        (f"{base}/{k}", value[..., k]) for k in range(value.shape[-1])
      )
  return items


def stats(opt_state: Any, *, prefix: str = "") -> dict[str, jax.Array]:
  """One flat dict of every clipper's statistics found in an optimizer state.

  Walks any nesting of optax states -- ``optax.chain``, ``optax.named_chain``,
  ``optax.masked``, ``optax.inject_hyperparams``, a :func:`guard`, a Flax
  ``TrainState`` (pass the TrainState or its ``opt_state``) or the state of an
  ``nnx.Optimizer`` -- and returns ``{"<clipper>/<field>": value}``, e.g.
  ``"clip_global/norm"``. States are found by type (the declared state
  classes, such as :class:`ClipGlobalState`), once each, in one walk of the
  state. Fields that are ``None`` are left out.

  Keys are unique. When one state holds the same clipper more than once,
  each key is prefixed by its path in the state, its parts joined by ``"/"``
  (``"0/clip_global/norm"``, ``"2/clip_global/norm"``); a ``"/"`` or ``"%"``
  inside a part (an ``optax.named_chain`` name) is written ``"%2F"`` or
  ``"%25"``, so two paths never give one key. If two paths still render
  alike (a dict with both ``1`` and ``"1"`` as keys), those states are keyed
  by their full path as ``jax.tree_util.keystr`` writes it.

  A clipper built with ``leaf_stats=True`` adds ``"<clipper>/top_leaf_share"``
  and one key per leaf, ``"<clipper>/leaf_norm/<path>"``, with ``<path>`` the
  leaf's path in the updates as
  ``jax.tree_util.keystr(path, simple=True, separator="/")`` (e.g.
  ``"clip_global/leaf_norm/params/Dense_0/kernel"``), and per layer for a
  leaf with a ``layer_axis`` (``".../params/blocks/kernel/3"``). For a
  histogram, :func:`leaf_norm_table` gives the same norms as one array.

  The dict is flat, with str keys and scalar values: it goes as it is to
  ``clu.metric_writers`` (``writer.write_scalars(step, stats)``), to
  TensorBoard (one ``add_scalar``/``tf.summary.scalar`` per item) and to
  ``wandb.log(stats, step=step)`` (see the docs' "Logging" page).

  It reads values already in the state: calling it inside a jitted step adds
  no pass over the gradients. A state batched by ``vmap`` or ``pmap`` gives
  the same keys, each value with the batch axes (one entry per index).

  Args:
    opt_state: any pytree holding optaxclip states.
    prefix: put before every key, joined by ``"/"`` (``prefix="grads"``
      gives ``"grads/clip_global/norm"``); empty for none.

  Returns:
    A dict from names to scalar arrays, in the order the states appear in the
    tree. Each value has its state field's dtype: the statistics (``norm``,
    ``clipped_norm``, ``clip_fraction``, ``threshold``, ``clip_norm``,
    ``top_leaf_share`` and the leaf norms) are float32 (float64 for the
    adaptive clippers and :func:`guard` when the parameters given to
    ``init`` are float64, :func:`guard`'s ``z_score`` too; leaf norms stay
    float32); the counters (:func:`guard`'s ``skipped``, ``nonfinite``,
    ``consecutive_skips``, ``restarts`` and ``skipped_*`` cause counters,
    :func:`clip_zscore`'s and :func:`clip_relative`'s ``restarts``,
    :func:`clip_per_example`'s ``nonfinite``) are int32, exact at any step
    count.

  Example:
    >>> import jax.numpy as jnp, optax, optaxclip
    >>> tx = optax.chain(optaxclip.clip_global(1.0), optax.sgd(0.1))
    >>> params = {"w": jnp.ones(4)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({"w": jnp.full(4, 2.0)}, state, params)
    >>> {k: round(float(v), 3) for k, v in optaxclip.stats(state).items()}
    {'clip_global/norm': 4.0, 'clip_global/clipped_norm': 1.0,
     'clip_global/clip_fraction': 1.0, 'clip_global/threshold': 1.0}
    >>> tx = optaxclip.clip_global(1.0, leaf_stats=True)
    >>> g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.0])}
    >>> _, state = tx.update(g, tx.init(g))
    >>> s = optaxclip.stats(state, prefix="train")
    >>> float(s["train/clip_global/leaf_norm/a"]), float(
    ...   s["train/clip_global/top_leaf_share"])
    (5.0, 1.0)
  """
  _check_prefix("stats", prefix)
  out: dict[str, jax.Array] = {}
  for key, state in _keyed_states(opt_state):
    key = _with_prefix(prefix, key)
    for field in _REGISTRY[type(state)][1]:
      value = stat_value(state, field)
      if value is not None:
        out[f"{key}/{field}"] = _unwrap(value)
    share = getattr(state, "top_leaf_share", None)
    if share is not None:
      out[f"{key}/top_leaf_share"] = _unwrap(share)
    out.update(_leaf_norm_items(key, state))
    # A state with per-leaf statistics of its own names their keys.
    items: Any = getattr(state, "stats_items", None)
    if items is not None:
      out.update(items(key))
  return out


def leaf_norm_table(
  opt_state: Any, *, prefix: str = ""
) -> tuple[list[str], jax.Array]:
  """Every per-leaf (and per-layer) norm in a state, as names and one array.

  The norms that :func:`stats` gives one key each (clippers built with
  ``leaf_stats=True``), as ``(names, values)``: ``names`` are those keys,
  ``values`` one float32 vector in the same order. It is a histogram one
  call away: ``writer.write_histograms(step, {"leaf_norms": values})``
  (``clu.metric_writers``), ``wandb.log({"leaf_norms":
  wandb.Histogram(np.asarray(values))})``, ``tf.summary.histogram`` or
  TensorBoardX's ``add_histogram``. Works inside ``jit`` (``names`` are
  Python strings, known when tracing).

  Args:
    opt_state: any pytree holding optaxclip states.
    prefix: as for :func:`stats`.

  A state batched by ``vmap`` or ``pmap`` (every field with leading batch
  axes) gives one table per index: ``values`` then has those axes in front,
  ``values[i]`` the norms of index ``i`` (states batched differently raise
  a ``ValueError``).

  Returns:
    ``(names, values)``; an empty list and a ``(0,)`` array when no state
    keeps leaf norms.

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> tx = optaxclip.clip_global(1.0, leaf_stats=True, layer_axis=0)
    >>> g = {"blocks": jnp.array([[3.0, 4.0], [0.0, 1.0]])}
    >>> _, state = tx.update(g, tx.init(g))
    >>> names, values = optaxclip.leaf_norm_table(state)
    >>> names, values
    (['clip_global/leaf_norm/blocks/0', 'clip_global/leaf_norm/blocks/1'],
     Array([5., 1.], dtype=float32))
  """
  _check_prefix("leaf_norm_table", prefix)
  names, values, batch, first = [], [], None, ""
  for key, state in _keyed_states(opt_state):
    if getattr(state, "leaf_norms", None) is None:
      continue
    shape = batch_shape(state)
    if batch is None:
      batch, first = shape, key
    elif shape != batch:
      raise ValueError(
        f"leaf_norm_table: every state must be batched alike (one table per "
        f"index); got {first!r} batched {batch} and {key!r} {shape}."
      )
    names += [n for n, _ in _leaf_norm_items(_with_prefix(prefix, key), state)]
    values += [
      jnp.reshape(_unwrap(x), shape + (-1,)).astype(jnp.float32)
      for x in jax.tree.leaves(state.leaf_norms)
    ]
  if not values:
    return [], jnp.zeros((0,), jnp.float32)
  return names, jnp.concatenate(values, axis=-1)


_MISSING = object()


def _child(saved: Any, entry: Any) -> Any:
  """The child of a saved node (a dict, list, tuple or NamedTuple) at one
  entry of a path, or _MISSING.
  """
  if saved is None or saved is _MISSING:
    return _MISSING
  if isinstance(saved, dict):
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        name = getattr(entry, attr)
        if name in saved:
          return saved[name]
        return saved.get(str(name), _MISSING)
    return _MISSING
  if hasattr(entry, "name"):
    return getattr(saved, entry.name, _MISSING)
  index = getattr(entry, "idx", getattr(entry, "key", None))
  if isinstance(saved, (list, tuple)) and isinstance(index, int):
    return saved[index] if index < len(saved) else _MISSING
  return _MISSING


def _regrouped(saved: Any, paths: dict[str, tuple[str, ...]]) -> Any:
  """A saved state of a registered class that groups its fields, as nested
  dicts of today's layout when it was saved flat (a field at the top for
  each statistic); as it is when it holds today's groups.
  """
  if isinstance(saved, dict):
    items = dict(saved)
  elif hasattr(saved, "_asdict"):
    items = saved._asdict()
  else:
    return saved
  groups = {path[0] for path in paths.values() if len(path) > 1}
  if groups & set(items) or not set(paths) & set(items):
    return saved
  out: dict[str, Any] = {k: v for k, v in items.items() if k not in paths}
  for name, path in paths.items():
    if name in items:
      node = out
      for part in path[:-1]:
        node = node.setdefault(part, {})
      node[path[-1]] = items[name]
  return out


def upgrade_state(saved: Any, template: Any, *, _path: str = "") -> Any:
  """An optimizer state saved by an earlier version, in today's layout.

  Later versions may add fields to a state (a new counter) or change a
  field's dtype; a checkpoint written before then no longer has the layout
  of ``tx.init(params)``, so a restore into that target fails. Restore the
  checkpoint without a target (orbax then returns dicts and lists) and pass
  it here with today's freshly initialised state as ``template``: every
  value the checkpoint holds is kept, cast to today's dtype; a field it
  lacks takes the template's (initial) value. A state whose fields are now
  grouped (:class:`GuardState`) is read from its earlier flat layout too.

  Args:
    saved: the restored state: nested dicts (keyed by field names), lists,
      tuples or the state classes themselves.
    template: today's state for the same optimizer, e.g. ``tx.init(params)``.

  Returns:
    A pytree of ``template``'s structure and classes.

  Raises:
    ValueError: when a saved array's shape differs from the template's (a
      different optimizer or parameters), naming the path.

  Example:
    >>> import jax.numpy as jnp, optaxclip
    >>> tx = optaxclip.clip_per_example(1.0)
    >>> template = tx.init({"w": jnp.zeros(2)})
    >>> saved = {"norm": 2.0, "clipped_norm": 1.0, "clip_fraction": 0.5,
    ...          "clip_norm": 1.0, "key": [0, 3]}  # saved without `nonfinite`
    >>> state = optaxclip.upgrade_state(saved, template)
    >>> type(state).__name__, float(state.norm), int(state.nonfinite)
    ('ClipPerExampleState', 2.0, 0)
  """
  if type(template) in _REGISTRY and saved is not _MISSING:
    saved = _regrouped(saved, _REGISTRY[type(template)][2])
  flat, treedef = jax.tree_util.tree_flatten_with_path(
    template, is_leaf=lambda node: node is not template
  )
  if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # a leaf
    if saved is _MISSING or saved is None or not hasattr(template, "shape"):
      return template
    value = jnp.asarray(saved)
    if value.shape != template.shape:
      raise ValueError(
        f"upgrade_state: the saved value at {_path or '<root>'} must have "
        f"the template's shape {template.shape}; got {value.shape}."
      )
    return value.astype(template.dtype)
  children = []
  for path, child in flat:
    entry = path[0]
    children.append(
      upgrade_state(
        _child(saved, entry),
        child,
        _path=_path + jax.tree_util.keystr((entry,)),
      )
    )
  return jax.tree_util.tree_unflatten(treedef, children)
