"""``explain()``: what each clipper and guard did this step, in sentences.

It reads the optimizer state only (the statistics each state carries), on
the host, after the step: no gradients, no extra pass, nothing to set up.
States are found by the walk :func:`optaxclip.stats` uses, and named as its
keys name them.

Every fact a sentence states comes from one function below that reads it
from the state (``_clip_stats``, ``_top_leaf``, ``_skip_cause``,
``_relative_phase``, ``_not_run``, ...), and from nowhere else: not from
the hyperparameters ``optax.inject_hyperparams`` keeps, which a state cannot
tie to the transformation that uses them (``inject_hyperparams(lambda
max_norm: guard(chain(clip_global(max_norm), ...)))`` gives ``max_norm`` to
``clip_global``, not to the guard around it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import math
from typing import Any, NamedTuple, Optional

import jax
import numpy as np
import optax

from optaxclip import _guard
from optaxclip import _stats
from optaxclip import _telemetry
from optaxclip._moments import spread_exponent_of


def _num(x: float) -> str:
  """A number for a sentence: three significant digits (``1.0``, ``76.2``,
  ``812``, ``0.013``, ``1.2e+06``).
  """
  if math.isnan(x):
    return "nan"
  if math.isinf(x):
    return "inf" if x > 0 else "-inf"
  text = f"{x:.3g}"
  if abs(x) < 10 and not any(c in text for c in ".e"):
    text += ".0"
  return text


def _pct(share: float) -> str:
  return f"{100 * share:.0f}%" if share >= 0.01 or share == 0 else "<1%"


def _plural(n: int, word: str) -> str:
  return f"{n} {word}{'' if n == 1 else 's'}"


# --- Reading one state (one index of a batched one) on the host --------------


@dataclasses.dataclass
class _View:
  """One index of a state, read on the host.

  A state batched by ``vmap`` or ``pmap`` holds every field with the same
  leading axes (``batch``, :func:`_stats.batch_shape`); a view reads the
  slice at ``index``. Each field is fetched from the device once (``cache``
  is shared by the views of one state).
  """

  state: Any
  index: tuple[int, ...] = ()
  batch: tuple[int, ...] = ()
  cache: dict = dataclasses.field(default_factory=dict)

  def has(self, *names: str) -> bool:
    return self._field(names) is not None

  def _field(self, names: Sequence[str]) -> Any:
    value = self.state
    for name in names:
      value = getattr(value, name, None)
      if value is None:
        return None
    return value

  def array(self, *names: str) -> Optional[np.ndarray]:
    """The field at ``names`` (``"loss_moments", "mean"``) as a NumPy
    array of this index; None when the state lacks it or it is None.
    """
    key = tuple(names)
    if key not in self.cache:
      value = self._field(names)
      if isinstance(value, _telemetry.LeafNorms):
        value = value.values
      self.cache[key] = (
        None
        if value is None
        else np.asarray(jax.device_get(_stats._unwrap(value)))  # noqa: SLF001
      )
    value = self.cache[key]
    if value is None or not self.batch:
      return value
    if value.shape[: len(self.batch)] != self.batch:
      raise ValueError(
        f"explain: every field of a batched {type(self.state).__name__} must "
        f"have its batch axes {self.batch} in front; got "
        f"{'.'.join(names)} of shape {value.shape}."
      )
    return value[self.index]

  def scalar(self, *names: str) -> Optional[float]:
    """A per-step scalar field as a float (None when absent)."""
    value = self.array(*names)
    if value is None:
      return None
    if value.size != 1:
      raise ValueError(
        f"explain: {'.'.join(names)} of a {type(self.state).__name__} must "
        f"hold one value per step; got shape {value.shape} (a state batched "
        "in some fields only?)."
      )
    return float(value.reshape(()))

  def stat(self, *names: str) -> float:
    """A statistic every state of its kind keeps."""
    value = self.scalar(*names)
    if value is None:
      raise ValueError(
        f"explain: a {type(self.state).__name__} must hold "
        f"{'.'.join(names)}; got None."
      )
    return value

  def integer(self, *names: str) -> int:
    value = self.scalar(*names)
    return 0 if value is None else int(value)


# --- Fact: what a clipper measured and did -----------------------------------


class _ClipStats(NamedTuple):
  norm: float  # what it measured before clipping
  clipped: float  # the norm of what it returned
  fraction: float  # share of its units scaled down
  threshold: Optional[float]  # the limit this step (None if not kept)


def _clip_stats(view: _View) -> _ClipStats:
  return _ClipStats(
    view.stat("norm"),
    view.stat("clipped_norm"),
    view.stat("clip_fraction"),
    view.scalar("threshold"),
  )


# --- Fact: which leaf carried the norm (leaf_stats=True) ---------------------


class _TopLeaf(NamedTuple):
  where: str  # the leaf's path, and its layer
  share: float  # top_leaf_share
  norm: float  # its entry of leaf_norms
  norms: np.ndarray  # every entry of leaf_norms (float64)
  at: int  # top_leaf


def _leaf_entries(view: _View) -> Optional[tuple[list[str], np.ndarray]]:
  """The name (``path`` or ``path (layer k)``) and norm of every entry of
  the state's ``leaf_norms``; None without them.
  """
  norms = view.state.leaf_norms if view.has("leaf_norms") else None
  if norms is None:
    return None
  if isinstance(norms, _telemetry.LeafNorms):
    values = view.array("leaf_norms")
    assert values is not None
    skeleton = jax.tree.unflatten(
      norms.treedef, [1 if n is None else -n for n in norms.layers]
    )
    names = []
    for path, n in jax.tree_util.tree_flatten_with_path(skeleton)[0]:
      name = _leaf_name(path)
      names += [name] if n == 1 else [f"{name} (layer {k})" for k in range(-n)]
    return names, np.asarray(values, np.float64).reshape(-1)
  names, values = [], []
  for path, leaf in jax.tree_util.tree_flatten_with_path(norms)[0]:
    value = np.asarray(jax.device_get(_stats._unwrap(leaf)))  # noqa: SLF001
    if view.batch:
      value = value[view.index]
    name = _leaf_name(path)
    if value.ndim == 0:
      names.append(name)
    else:
      names += [f"{name} (layer {k})" for k in range(value.shape[0])]
    values.append(np.ravel(value).astype(np.float64))
  return names, np.concatenate(values) if values else np.zeros(0)


def _leaf_name(path: tuple) -> str:
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def _top_leaf(view: _View) -> Optional[_TopLeaf]:
  """The entry ``top_leaf`` names, with its share and every leaf norm;
  None when the state keeps no leaf statistics.
  """
  share, index = view.scalar("top_leaf_share"), view.scalar("top_leaf")
  entries = _leaf_entries(view)
  if share is None or index is None or entries is None:
    return None
  names, norms = entries
  i = int(index)
  if not 0 <= i < len(names):
    return None
  return _TopLeaf(names[i], share, float(norms[i]), norms, i)


# A share read back from float32 statistics agrees with the one recomputed
# from the float32 leaf norms to a few ulps; a gap above this tells two
# orders apart.
_SHARE_TOL = 1e-5


def _share_for(norms: np.ndarray, index: int, p: float) -> float:
  """The share of ``sum(norms**p)`` carried by ``norms[index]``."""
  top = norms[index]
  if math.isinf(p):
    return 1.0
  scaled = norms / top
  return float(1.0 / np.sum(scaled**p))


def _share_order(top: _TopLeaf) -> Optional[float]:
  """The order ``p`` whose ``norm**p`` the state's ``top_leaf_share`` is a
  share of (1, 2 or inf), read from the leaf norms themselves; None when
  they cannot tell (every other leaf negligible) or it is another order.
  """
  others = np.delete(top.norms, top.at)
  if not np.all(np.isfinite(top.norms)) or top.norm <= 0:
    return None
  if top.share == 1.0 and others.size and np.max(others) >= 0.5 * top.norm:
    return math.inf  # a finite order would give a share below 1 - 1e-6
  fits = [
    p
    for p in (1.0, 2.0)
    if abs(_share_for(top.norms, top.at, p) - top.share) <= _SHARE_TOL
  ]
  return fits[0] if len(fits) == 1 else None


def _top_leaf_phrase(view: _View) -> str:
  """``"; 53% of the squared norm came from a"`` and the like: which leaf
  (or layer) carried the norm, in the measure the clipper used.
  """
  top = _top_leaf(view)
  if top is None or top.share == 0:
    return ""
  if math.isnan(top.share):
    return (
      f"; {top.where} is the first leaf whose norm is nan (a NaN or Inf in it)"
    )
  if not math.isfinite(top.norm):
    return f"; the largest leaf norm ({_num(top.norm)}) was {top.where}'s"
  others = np.delete(top.norms, top.at)
  if not np.any(others):
    return f"; all of the norm came from {top.where}"
  p = _share_order(top)
  if p == 2:
    return f"; {_pct(top.share)} of the squared norm came from {top.where}"
  if p == 1:
    return f"; {_pct(top.share)} of the 1-norm came from {top.where}"
  if p is not None:
    return f"; the largest magnitude ({_num(top.norm)}) was in {top.where}"
  if top.share >= 1 - 1e-4:
    return f"; nearly all of the norm came from {top.where}"
  return f"; the largest leaf norm ({_num(top.norm)}) was {top.where}'s"


# --- Fact: whether the state ran this step (the wrappers around it) ----------


def _child(node: Any, entry: Any) -> Any:
  if hasattr(entry, "name"):
    return getattr(node, entry.name)
  if hasattr(entry, "key"):
    return node[entry.key]
  return node[entry.idx]


def _ancestors(tree: Any, path: tuple) -> list[tuple[Any, str]]:
  """``(node, entry name)`` of every node on ``path`` above the state that
  can keep its inner state from running: a guard, ``optax.MultiSteps``,
  ``optax.apply_if_finite``.
  """
  found, node = [], tree
  for entry in path:
    name = getattr(entry, "name", None)
    if isinstance(
      node, (_guard.GuardState, optax.MultiStepsState, optax.ApplyIfFiniteState)
    ):
      found.append((node, name))
    try:
      node = _child(node, entry)
    except (AttributeError, KeyError, IndexError, TypeError):
      break
  return found


def _held_by(view: _View, entry: str) -> str:
  """Why the wrapper read by ``view`` kept its ``entry`` (the inner state
  on the path) from running this step, or "".
  """
  state = view.state
  if isinstance(state, _guard.GuardState) and entry == "inner_state":
    if view.integer("counts", "consecutive_skips") and _guard_skipped_all(view):
      return "the guard around it skipped the step"
  elif isinstance(state, optax.MultiStepsState) and entry == "inner_opt_state":
    mini = view.integer("mini_step")
    if mini:
      return (
        f"optax.MultiSteps is accumulating gradients, {mini} so far in this "
        "group"
      )
    if not view.integer("gradient_step"):
      return "optax.MultiSteps has not run its inner optimizer yet"
  elif (
    isinstance(state, optax.ApplyIfFiniteState)
    and entry == "inner_state"
    and not view.scalar("last_finite")
  ):
    return "optax.apply_if_finite skipped the step: a non-finite gradient"
  return ""


def _not_run(ancestors: list[tuple[_View, str]]) -> str:
  """Why the state did not run this step (the outermost wrapper that held
  it back), or "" when it ran.
  """
  for view, entry in ancestors:
    held = _held_by(view, entry)
    if held:
      return held
  return ""


# --- One sentence per kind of state ------------------------------------------


def _nonfinite(who: str, norm: float, what: str) -> str:
  return (
    f"{who} saw a non-finite gradient (norm {_num(norm)}): {what} came out "
    "NaN, so that a guard (or optax.apply_if_finite) can skip the step"
  )


def _global(who: str, view: _View) -> str:
  s = _clip_stats(view)
  if not math.isfinite(s.norm):
    return _nonfinite(who, s.norm, "the whole update") + _top_leaf_phrase(view)
  blame = _top_leaf_phrase(view)
  if s.fraction > 0:
    bound = s.clipped if s.threshold is None else s.threshold
    factor = s.clipped / s.norm if s.norm > 0 else 0.0
    return (
      f"{who} scaled the update by {_num(factor)} (norm {_num(s.norm)} > "
      f"{_num(bound)})" + blame
    )
  if s.threshold is None:
    return f"{who} left the update unchanged (norm {_num(s.norm)})" + blame
  return (
    f"{who} left the update unchanged (norm {_num(s.norm)} <= "
    f"{_num(s.threshold)})" + blame
  )


def _per_unit(units: str, label: str) -> Callable[[str, _View], str]:
  """Clippers of many units; ``label`` names their ``threshold``."""

  def sentence(who: str, view: _View) -> str:
    s = _clip_stats(view)
    if not math.isfinite(s.norm):
      return _nonfinite(
        who, s.norm, f"the {units} holding it"
      ) + _top_leaf_phrase(view)
    limit = "" if s.threshold is None else f"; {label} {_num(s.threshold)}"
    if s.fraction > 0:
      return (
        f"{who} scaled down {_pct(s.fraction)} of its {units} (norm "
        f"{_num(s.norm)} -> {_num(s.clipped)}{limit})" + _top_leaf_phrase(view)
      )
    return (
      f"{who} left every one of its {units} unchanged (norm {_num(s.norm)}"
      f"{limit})" + _top_leaf_phrase(view)
    )

  return sentence


def _value_clip(who: str, view: _View) -> str:
  s = _clip_stats(view)
  largest = s.norm
  if not math.isfinite(largest) or math.isnan(s.clipped):
    return (
      f"{who} saw a non-finite gradient (largest magnitude {_num(largest)}): "
      f"the leaves holding it came out NaN ({_pct(s.fraction)} of the "
      "elements)"
    )
  if s.fraction > 0:
    bound = s.clipped if s.threshold is None else s.threshold
    return (
      f"{who} clipped {_pct(s.fraction)} of the elements (largest magnitude "
      f"{_num(largest)} > {_num(bound)})"
    )
  tail = "" if s.threshold is None else f" <= {_num(s.threshold)}"
  return (
    f"{who} left every element unchanged (largest magnitude "
    f"{_num(largest)}{tail})"
  )


def _std(view: _View, mean: float, var: float) -> float:
  """The standard deviation of a state's ``(mean, var)`` (the variance is
  kept scaled outside ``2**-41`` to ``2**40``: ``_moments.spread``).
  """
  dtype = np.asarray(view.array("mean")).dtype
  e = spread_exponent_of(mean, dtype)
  return math.ldexp(math.sqrt(max(var, 0.0)), e)


def _spread(view: _View) -> str:
  mean, var = view.scalar("mean"), view.scalar("var")
  if mean is None or var is None:
    return ""
  return (
    f", from the norm's running mean {_num(mean)} and standard deviation "
    f"{_num(_std(view, mean, var))}"
  )


def _units(view: _View) -> int:
  """How many units an adaptive clipper judges apart: one (the tree), or
  one per leaf (``scope="leaf"``), from its per-unit statistics.
  """
  for name in ("mean", "history"):
    value = view.array(name)
    if value is not None:
      return int(value.size // (value.shape[0] if name == "history" else 1))
  return 1


def _nonfinite_statistics(who: str, norm: float, view: _View) -> str:
  """An adaptive clipper's non-finite step: its statistics stay put."""
  return (
    _nonfinite(who, norm, "the units")
    + "; its statistics did not move"
    + _top_leaf_phrase(view)
  )


def _adaptive(kind: str) -> Callable[[str, _View], str]:
  def sentence(who: str, view: _View) -> str:
    s = _clip_stats(view)
    if not math.isfinite(s.norm):
      return _nonfinite_statistics(who, s.norm, view)
    if kind == "zscore":
      source = _spread(view)
    else:
      filled = view.scalar("filled")
      source = (
        ""
        if filled is None
        else f", the percentile of the last {_plural(int(filled), 'norm')}"
      )
    if s.threshold is not None and not math.isinf(s.threshold):
      bound = f"threshold {_num(s.threshold)}{source}"
    elif s.fraction > 0:
      # Per-unit thresholds whose norm is inf: some unit has none yet,
      # while others clipped.
      bound = "some units have no threshold yet"
    else:
      bound = "no threshold yet: warming up"
    if s.fraction > 0:
      if _units(view) == 1:
        action = f"scaled the update by {_num(s.clipped / s.norm)}"
      else:
        action = f"scaled down {_pct(s.fraction)} of its units"
      return (
        f"{who} {action} (norm {_num(s.norm)} -> {_num(s.clipped)}; {bound})"
        + _top_leaf_phrase(view)
      )
    return (
      f"{who} left the update unchanged (norm {_num(s.norm)}; {bound})"
      + _top_leaf_phrase(view)
    )

  return sentence


def _relative_phase(view: _View) -> Optional[str]:
  """Which rule ``clip_relative`` applied this step: ``"warm-up"`` (the
  whole tree clipped to ``warmup_max_norm``), ``"per-leaf"`` (each leaf
  against its own EMA norm), or None when the state cannot tell.

  Read from the state: ``count`` (finite steps, held at ``warmup_steps``)
  equal to ``step`` (every step) means no step so far has come after the
  warm-up; a clipped leaf after the warm-up has a ``consecutive_clips`` of
  at least 1, while during the warm-up they all stay 0.
  """
  s = _clip_stats(view)
  consecutive = view.array("consecutive_clips")
  any_run = bool(np.any(consecutive)) if consecutive is not None else None
  count, step = view.scalar("count"), view.scalar("step")
  clipped = s.fraction > 0
  warm = (count is not None and count == step) or (
    clipped and any_run is False and (s.threshold or 0) > 0
  )
  per_leaf = clipped and bool(any_run)
  if warm == per_leaf:
    return None
  return "warm-up" if warm else "per-leaf"


def _relative(who: str, view: _View) -> str:
  s = _clip_stats(view)
  if not math.isfinite(s.norm):
    return _nonfinite_statistics(who, s.norm, view)
  phase = _relative_phase(view)
  blame = _top_leaf_phrase(view)
  limit = "inf" if s.threshold is None else _num(s.threshold)
  if phase == "warm-up":
    if s.fraction > 0:
      factor = s.clipped / s.norm if s.norm > 0 else 0.0
      return (
        f"{who} scaled the whole update by {_num(factor)} in its warm-up "
        f"(norm {_num(s.norm)} > warmup_max_norm {limit})" + blame
      )
    return (
      f"{who} left the update unchanged in its warm-up (norm "
      f"{_num(s.norm)} <= warmup_max_norm {limit})" + blame
    )
  if s.threshold is not None and math.isinf(s.threshold):
    bound = "some units have no threshold yet (no nonzero norm so far)"
  else:
    bound = f"threshold {limit}"
  if phase == "per-leaf":
    return (
      f"{who} scaled down {_pct(s.fraction)} of its leaves (norm "
      f"{_num(s.norm)} -> {_num(s.clipped)}; {bound}; each leaf's limit is a "
      "factor times its own EMA norm)" + blame
    )
  if s.fraction > 0:
    return (
      f"{who} scaled down {_pct(s.fraction)} of its leaves (norm "
      f"{_num(s.norm)} -> {_num(s.clipped)}; {bound})" + blame
    )
  return f"{who} left every leaf unchanged (norm {_num(s.norm)}; {bound})" + (
    blame
  )


def _examples(who: str, view: _View) -> str:
  s = _clip_stats(view)
  clip_norm = view.scalar("clip_norm")
  nonfinite = view.integer("nonfinite")
  text = (
    f"{who} scaled down {_pct(s.fraction)} of the examples (mean "
    f"per-example norm {_num(s.norm)} -> {_num(s.clipped)})"
  )
  if nonfinite:
    text += (
      f"; {_plural(nonfinite, 'example')} with a NaN or Inf gradient "
      f"{'was' if nonfinite == 1 else 'were'} left out"
    )
  if clip_norm is not None:
    text += f"; the next step clips to {_num(clip_norm)}"
  return text


# --- guard -------------------------------------------------------------------

_CAUSE_LABELS = {
  "skipped_nonfinite": "non-finite",
  "skipped_max_norm": "above max_norm",
  "skipped_spike": "spike",
  "skipped_loss_spike": "loss spike",
}


def _skip_cause(view: _View) -> Optional[str]:
  """The cause counter this step's skip was counted in
  (``"skipped_spike"``, ...); None when the step went through or the state
  does not say (a state without ``skip_cause`` whose counters name more
  than one cause).
  """
  if not view.integer("counts", "consecutive_skips"):
    return None
  index = view.scalar("verdict", "skip_cause")
  if index is not None and 0 < int(index) < len(_guard.SKIP_CAUSES):
    return _guard.SKIP_CAUSES[int(index)]
  # Without a recorded cause: the counters add up to `skipped`, so one that
  # alone is nonzero counted every skip, this one included.
  moved = [field for field in _CAUSE_LABELS if view.integer("counts", field)]
  return moved[0] if len(moved) == 1 else None


def _guard_leaves(view: _View) -> Optional[tuple[int, int]]:
  """``(skipped, of)`` leaves this step for ``scope="leaf"``; else None."""
  skipped = view.scalar("verdict", "skipped_leaves")
  counts = view.array("norm_moments", "count")
  if skipped is None or counts is None:
    return None
  return int(skipped), int(counts.size)


def _guard_skipped_all(view: _View) -> bool:
  leaves = _guard_leaves(view)
  return leaves is None or leaves[0] == leaves[1]


def _guard_tally(view: _View) -> str:
  """The streak and total, e.g. "3 skips in a row, 5 in all (1 non-finite,
  4 spike)".
  """
  streak, skipped = (
    view.integer("counts", "consecutive_skips"),
    view.integer("counts", "skipped"),
  )
  text = f"{_plural(streak, 'skip')} in a row"
  causes = [
    f"{n} {label}"
    for field, label in _CAUSE_LABELS.items()
    if (n := view.integer("counts", field))
  ]
  if streak != skipped or len(causes) > 1:
    text += f", {skipped} in all"
    if len(causes) > 1:
      text += f" ({', '.join(causes)})"
  return text


def _guard_why(view: _View, cause: Optional[str]) -> str:
  """This step's cause, as the facts the state holds about it."""
  norm, threshold = (
    view.stat("verdict", "norm"),
    view.stat("verdict", "threshold"),
  )
  z = view.stat("verdict", "z_score")
  per_leaf = _guard_leaves(view) is not None
  subject = "a leaf's norm" if per_leaf else f"the norm {_num(norm)}"
  if cause == "skipped_nonfinite":
    loss = view.scalar("loss_monitor", "value")
    if loss is not None and not math.isfinite(loss):
      tail = "" if math.isfinite(norm) else f"; the gradient norm {_num(norm)}"
      return f"the loss was {_num(loss)}{tail}"
    return f"the gradient norm was {_num(norm)} (a NaN or Inf in the gradient)"
  if cause == "skipped_max_norm":
    limit = "" if per_leaf else f" (threshold {_num(threshold)})"
    return f"{subject} was above max_norm{limit}"
  if cause == "skipped_spike":
    if math.isnan(threshold):
      return "the spike bound was nan (spike_z's schedule gave NaN)"
    if z > 0:
      mean = None if per_leaf else view.scalar("norm_moments", "mean")
      now = "" if mean is None else f"now {_num(mean)}; "
      limit = "" if per_leaf else f"{now}threshold {_num(threshold)}"
      limit = f" ({limit})" if limit else ""
      return (
        f"{subject} was {_num(z)} standard deviations above its mean{limit}"
      )
    return f"{subject} was above the spike bound (threshold {_num(threshold)})"
  if cause == "skipped_loss_spike":
    loss, loss_z = (
      view.scalar("loss_monitor", "value"),
      view.scalar("loss_monitor", "z_score"),
    )
    mean = view.scalar("loss_monitor", "moments", "mean")
    if loss is None or loss_z is None or loss_z <= 0:
      return "the loss's spike bound was nan (loss_spike_z's schedule gave NaN)"
    of = "" if mean is None else f" {_num(mean)}"
    return (
      f"the loss {_num(loss)} was {_num(loss_z)} standard deviations above "
      f"its mean{of}"
    )
  return (
    f"the norm was {_num(norm)} and the threshold {_num(threshold)}; this "
    "state does not record which cause skipped it"
  )


def _guard_step(who: str, view: _View) -> str:
  norm, threshold = (
    view.stat("verdict", "norm"),
    view.stat("verdict", "threshold"),
  )
  leaves = _guard_leaves(view)
  blame = _top_leaf_phrase(view)
  if not view.integer("counts", "consecutive_skips"):
    what = "every leaf" if leaves is not None else "the step"
    if math.isnan(norm):
      return (
        f"{who} let {what} through with a non-finite gradient (norm nan): "
        "skip_nonfinite is off" + blame
      )
    if math.isinf(threshold):
      return (
        f"{who} let {what} through (norm {_num(norm)}; no threshold this "
        "step)" + blame
      )
    return (
      f"{who} let {what} through (norm {_num(norm)} <= {_num(threshold)})"
      + blame
    )
  if leaves is None or leaves[0] == leaves[1]:
    what = "the step"
  else:
    what = f"{leaves[0]} of its {leaves[1]} leaves"
  why = _guard_why(view, _skip_cause(view))
  return f"{who} skipped {what}: {why}; {_guard_tally(view)}" + blame


def _spikes(scale_phrase: str = "") -> Callable[[str, _View], str]:
  """The SPAM family: coordinates clipped against their second moment;
  ``scale_phrase`` says what the state's ``scale`` is, when below 1.
  """

  def sentence(who: str, view: _View) -> str:
    clipped = view.scalar("clipped")
    fraction = view.scalar("clip_fraction") or 0.0
    resets = view.scalar("resets")
    scale = view.scalar("scale")
    if clipped is None:
      text = f"{who} ran"
    elif clipped == 0:
      text = f"{who} clipped no coordinate"
    else:
      text = (
        f"{who} clipped {_plural(int(clipped), 'coordinate')} "
        f"({_pct(fraction)}) that spiked above their running second moment"
      )
    if scale_phrase and scale is not None and scale < 1:
      text += f"; {scale_phrase} {_num(scale)}"
    if resets:
      text += f"; {_plural(int(resets), 'moment reset')} so far"
    return text

  return sentence


def _norm_ema(who: str, view: _View) -> str:
  norm = view.stat("norm")
  scaled = view.stat("scaled_norm")
  scale = view.scalar("scale")
  if not math.isfinite(norm):
    return _nonfinite(who, norm, "the update")
  if scale is not None and scale < 1:
    return (
      f"{who} scaled the update by {_num(scale)} (norm {_num(norm)} -> "
      f"{_num(scaled)})"
    )
  return f"{who} left the update unchanged (norm {_num(norm)})"


def _stable_adamw(who: str, view: _View) -> str:
  scaled = view.integer("scaled")
  fraction = view.stat("clip_fraction")
  largest = view.stat("max_rms")
  if not scaled:
    return f"{who} scaled no tensor's step (largest RMS {_num(largest)})"
  return (
    f"{who} divided the learning rate of {_plural(scaled, 'tensor')} "
    f"({_pct(fraction)}) by their RMS (largest {_num(largest)})"
  )


def _watch(who: str, view: _View) -> str:
  return (
    f"{who} saw an update of norm {_num(view.stat('update_norm'))} on "
    f"parameters of norm {_num(view.stat('param_norm'))} (ratio "
    f"{_num(view.stat('update_to_param'))})" + _top_leaf_phrase(view)
  )


# State short name -> sentence(who, view).
_SENTENCES: dict[str, Callable[[str, _View], str]] = {
  "clip_global": _global,
  "clip_norm": _per_unit("units", "max_norm"),
  "clip_block_rms": _per_unit("leaves", "RMS limit"),
  "clip_unitwise": _per_unit("units", "ratio limit"),
  "clip_value": _value_clip,
  "clip_zscore": _adaptive("zscore"),
  "clip_percentile": _adaptive("percentile"),
  "clip_relative": _relative,
  "clip_per_example": _examples,
  "dp_noise": _examples,
  "guard": _guard_step,
  "clip_spikes": _spikes(),
  "clip_spikes_adaptive": _spikes(),
  "spam": _spikes("the step size's warm-up factor is"),
  "stable_spam": _spikes("the cosine factor on b1 and gamma1 is"),
  "scale_by_norm_ema": _norm_ema,
  "stable_adamw": _stable_adamw,
  "watch": _watch,
}


def _reported(who: str, view: _View) -> str:
  """A state registered elsewhere: its statistics."""
  values = [
    f"{field} {_num(v)}"
    for field in _stats.stat_fields(view.state)
    if (v := view.scalar(field)) is not None
  ]
  return f"{who} reported {', '.join(values)}"


def _batch_of(view_batch: tuple, node: Any, name: str) -> tuple[int, ...]:
  """The batch axes of a wrapper around a state batched as ``view_batch``."""
  if isinstance(node, _guard.GuardState):
    field = node.counts.consecutive_skips
  elif isinstance(node, optax.MultiStepsState):
    field = node.mini_step
  else:
    field = node.last_finite
  shape = np.shape(_stats._unwrap(field))  # noqa: SLF001
  if tuple(shape) != tuple(view_batch):
    raise ValueError(
      f"explain: the state at {name!r} is batched {tuple(view_batch)} but "
      f"the {type(node).__name__} around it {tuple(shape)}; explain each "
      "index on its own."
    )
  return tuple(shape)


# --- The walk ----------------------------------------------------------------


def explain(opt_state: Any) -> list[str]:
  """One plain sentence per clipper and guard: what it did this step, and why.

  Reads the statistics the states already carry (the ones :func:`stats`
  returns), on the host, after a step: "clip_global scaled the update by
  0.013 (norm 76.2 > 1.0)", "guard skipped the step: the gradient norm was
  nan (a NaN or Inf in the gradient); 2 skips in a row". States are found as
  :func:`stats` finds them -- in any nesting of ``optax.chain``,
  ``named_chain``, ``masked``, ``multi_transform``, ``inject_hyperparams``,
  ``MultiSteps``, :func:`guard` or a ``TrainState`` -- and named as its
  keys name them. A clipper that did not run this step (inside a guard
  that skipped it, ``optax.apply_if_finite`` that did, or ``MultiSteps``
  between its updates) gets a sentence that says so.

  Every number and cause is read from the state: a guard says which cause
  it counted the skip under (a NaN or Inf, ``max_norm``, a spike of the
  norm, a spike of the loss) with the values that show it. Hyperparameters
  kept by ``optax.inject_hyperparams`` are not read (a state cannot tell
  which transformation inside the injected one uses them); a sentence
  gives the limit the state recorded (``threshold``).

  When a state keeps per-leaf statistics (``leaf_stats=True``), the
  sentence names the leaf (and layer) that carried the largest share of the
  norm, in the measure the clipper used: "53% of the squared norm came from
  a" (L2), "57% of the 1-norm" (``ord=1``), "the largest magnitude (4.0)
  was in b" (``ord=inf``); on a skipped or non-finite step, the first leaf
  whose norm is NaN.

  A state batched by ``vmap`` or ``pmap`` (its statistics with leading
  axes: several seeds, or one replica per device) gets one sentence per
  index, named ``clip_global[0]``, ``clip_global[1]``, ...

  Args:
    opt_state: any pytree holding optaxclip states.

  Returns:
    A list of sentences, one per state (per index of a batched state), in
    the order of the state's tree. Values are fetched from the device: call
    it outside ``jit``, e.g. on the steps you log.

  Raises:
    ValueError: for a state batched in some fields only, or batched unlike
      the guard (or ``MultiSteps``) around it.

  Example:
    >>> import jax.numpy as jnp, optax, optaxclip
    >>> tx = optax.chain(optaxclip.clip_global(1.0), optax.sgd(0.1))
    >>> params = {"w": jnp.zeros(4)}
    >>> _, state = tx.update({"w": jnp.full(4, 2.0)}, tx.init(params), params)
    >>> optaxclip.explain(state)
    ['clip_global scaled the update by 0.25 (norm 4.0 > 1.0)']
  """
  sentences = []
  for name, path, state in _stats.named_states(opt_state):
    batch = _stats.batch_shape(state)
    sentence = _SENTENCES.get(_stats.short_name(type(state)), _reported)
    wrappers = [
      (node, entry, _batch_of(batch, node, name), {})
      for node, entry in _ancestors(opt_state, path)
    ]
    cache: dict = {}
    for index in np.ndindex(*batch):
      who = f"{name}[{', '.join(map(str, index))}]" if batch else name
      around = [
        (_View(node, index, shape, c), entry)
        for node, entry, shape, c in wrappers
      ]
      held = _not_run(around)
      if held:
        sentences.append(
          f"{who} did not run this step ({held}); its statistics are from "
          "the last step it ran"
        )
      else:
        sentences.append(sentence(who, _View(state, index, batch, cache)))
  return sentences
