"""``explain()``: what each clipper and guard did this step, in sentences.

It reads the optimizer state only (the statistics each state carries), on
the host, after the step: no gradients, no extra pass, nothing to set up.
States are found by the walk :func:`optaxclip.stats` uses, and named as its
keys name them.
"""

from __future__ import annotations

from collections.abc import Callable
import math
from typing import Any, Optional

import jax
import numpy as np

from optaxclip import _stats
from optaxclip import _telemetry
from optaxclip._adaptive import spread_exponent_of


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


def _value(state: Any, field: str) -> Optional[np.ndarray]:
  """A field of the state as a NumPy array (None when the state lacks it or
  it is None).
  """
  value = getattr(state, field, None)
  if value is None:
    return None
  return np.asarray(jax.device_get(_stats._unwrap(value)))  # noqa: SLF001


def _scalar(state: Any, field: str) -> Optional[float]:
  value = _value(state, field)
  if value is None or value.size != 1:
    return None
  return float(value.reshape(()))


def _plural(n: int, word: str) -> str:
  return f"{n} {word}{'' if n == 1 else 's'}"


# --- Which leaf (telemetry's leaf_norms / top_leaf / top_leaf_share) ---------


def _leaf_name(path: tuple) -> str:
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def top_leaf(state: Any) -> Optional[tuple[str, Optional[int], float]]:
  """``(leaf path, layer or None, share)`` of the largest leaf (or layer)
  from a state's ``leaf_norms``, ``top_leaf`` and ``top_leaf_share``; None
  when the state does not keep them.
  """
  share = _scalar(state, "top_leaf_share")
  index = _scalar(state, "top_leaf")
  norms = getattr(state, "leaf_norms", None)
  if share is None or index is None or norms is None:
    return None
  if isinstance(norms, _telemetry.LeafNorms):
    norms = norms.tree()
  flat = jax.tree_util.tree_flatten_with_path(norms)[0]
  index = int(index)
  for path, leaf in flat:
    size = int(np.size(leaf))
    if index < size:
      layer = index if np.ndim(leaf) > 0 else None
      return _leaf_name(path), layer, share
    index -= size
  return None


def _blame(state: Any) -> str:
  top = top_leaf(state)
  if top is None or not math.isfinite(top[2]):
    return ""
  name, layer, share = top
  where = name if layer is None else f"{name} (layer {layer})"
  return f"; {_pct(share)} of the squared norm came from {where}"


# --- One sentence per kind of state ------------------------------------------


def _limit(state: Any, hyper: dict[str, float], *names: str):
  """The clipper's limit: its ``threshold`` field, else a hyperparameter
  that ``optax.inject_hyperparams`` keeps, else None.
  """
  value = _scalar(state, "threshold")
  if value is not None:
    return value
  for name in names:
    if name in hyper:
      return hyper[name]
  return None


def _nonfinite(who: str, norm: float, what: str) -> str:
  return (
    f"{who} saw a non-finite gradient (norm {_num(norm)}): {what} came out "
    "NaN, so that a guard (or optax.apply_if_finite) can skip the step"
  )


def _global(who: str, state: Any, hyper: dict[str, float]) -> str:
  norm = _scalar(state, "norm") or 0.0
  clipped = _scalar(state, "clipped_norm") or 0.0
  fraction = _scalar(state, "clip_fraction") or 0.0
  if not math.isfinite(norm):
    return _nonfinite(who, norm, "the whole update")
  limit = _limit(state, hyper, "max_norm")
  if fraction > 0:
    bound = clipped if limit is None else limit
    factor = clipped / norm if norm > 0 else 0.0
    return (
      f"{who} scaled the update by {_num(factor)} (norm {_num(norm)} > "
      f"{_num(bound)})" + _blame(state)
    )
  if limit is None:
    return f"{who} left the update unchanged (norm {_num(norm)})" + _blame(
      state
    )
  return (
    f"{who} left the update unchanged (norm {_num(norm)} <= {_num(limit)})"
    + _blame(state)
  )


def _per_unit(units: str, label: str, *limit_names: str) -> Callable:
  """Clippers of many units; ``label`` names their ``threshold``."""

  def sentence(who: str, state: Any, hyper: dict[str, float]) -> str:
    norm = _scalar(state, "norm") or 0.0
    clipped = _scalar(state, "clipped_norm") or 0.0
    fraction = _scalar(state, "clip_fraction") or 0.0
    if not math.isfinite(norm):
      return _nonfinite(who, norm, f"the {units} holding it")
    limit = _limit(state, hyper, *limit_names)
    limit_text = "" if limit is None else f"; {label} {_num(limit)}"
    if fraction > 0:
      return (
        f"{who} scaled down {_pct(fraction)} of its {units} (norm "
        f"{_num(norm)} -> {_num(clipped)}{limit_text})" + _blame(state)
      )
    return (
      f"{who} left every one of its {units} unchanged (norm {_num(norm)}"
      f"{limit_text})" + _blame(state)
    )

  return sentence


def _value_clip(who: str, state: Any, hyper: dict[str, float]) -> str:
  largest = _scalar(state, "norm") or 0.0
  clipped = _scalar(state, "clipped_norm")
  fraction = _scalar(state, "clip_fraction") or 0.0
  if not math.isfinite(largest) or clipped is None or math.isnan(clipped):
    return (
      f"{who} saw a non-finite gradient (largest magnitude {_num(largest)}): "
      f"the leaves holding it came out NaN ({_pct(fraction)} of the "
      "elements)"
    )
  limit = _limit(state, hyper, "max_delta")
  if fraction > 0:
    bound = clipped if limit is None else limit
    return (
      f"{who} clipped {_pct(fraction)} of the elements (largest magnitude "
      f"{_num(largest)} > {_num(bound)})"
    )
  tail = "" if limit is None else f" <= {_num(limit)}"
  return (
    f"{who} left every element unchanged (largest magnitude "
    f"{_num(largest)}{tail})"
  )


def _std(state: Any, mean: float, var: float) -> float:
  """The standard deviation of a state's ``(mean, var)`` (the variance is
  kept scaled outside ``2**-41`` to ``2**40``: ``_adaptive.spread``).
  """
  e = spread_exponent_of(mean, np.asarray(_value(state, "mean")).dtype)
  return math.ldexp(math.sqrt(max(var, 0.0)), e)


def _spread(state: Any) -> str:
  mean, var = _scalar(state, "mean"), _scalar(state, "var")
  if mean is None or var is None:
    return ""
  return (
    f", from the norm's running mean {_num(mean)} and standard deviation "
    f"{_num(_std(state, mean, var))}"
  )


def _adaptive(kind: str) -> Callable:
  def sentence(who: str, state: Any, hyper: dict[str, float]) -> str:
    norm = _scalar(state, "norm") or 0.0
    clipped = _scalar(state, "clipped_norm") or 0.0
    fraction = _scalar(state, "clip_fraction") or 0.0
    threshold = _scalar(state, "threshold")
    if not math.isfinite(norm):
      return (
        _nonfinite(who, norm, "the units") + "; its statistics did not move"
      )
    if kind == "zscore":
      source = _spread(state)
    elif kind == "percentile":
      filled = _scalar(state, "filled")
      source = (
        ""
        if filled is None
        else f", the percentile of the last {_plural(int(filled), 'norm')}"
      )
    else:
      source = ", each leaf's limit a factor times its own EMA norm"
    if threshold is not None and not math.isinf(threshold):
      bound = f"threshold {_num(threshold)}{source}"
    elif fraction > 0 or kind == "relative":
      # Per-unit thresholds whose norm is inf: some unit has none yet (a
      # leaf still warming up, or one whose gradient has been zero so far),
      # while others may have clipped.
      bound = (
        "some units have no threshold yet (warming up, or no nonzero norm "
        "so far)"
      )
    else:
      bound = "no threshold yet: warming up"
    if fraction > 0:
      if math.isclose(fraction, 1.0) and kind != "relative":
        action = f"scaled the update by {_num(clipped / norm)}"
      else:
        action = f"scaled down {_pct(fraction)} of its units"
      return (
        f"{who} {action} (norm {_num(norm)} -> {_num(clipped)}; {bound})"
        + _blame(state)
      )
    return f"{who} left the update unchanged (norm {_num(norm)}; {bound})" + (
      _blame(state)
    )

  return sentence


def _examples(who: str, state: Any, hyper: dict[str, float]) -> str:
  norm = _scalar(state, "norm") or 0.0
  clipped = _scalar(state, "clipped_norm") or 0.0
  fraction = _scalar(state, "clip_fraction") or 0.0
  clip_norm = _scalar(state, "clip_norm")
  nonfinite = int(_scalar(state, "nonfinite") or 0)
  text = (
    f"{who} scaled down {_pct(fraction)} of the examples (mean per-example "
    f"norm {_num(norm)} -> {_num(clipped)})"
  )
  if nonfinite:
    text += (
      f"; {_plural(nonfinite, 'example')} with a NaN or Inf gradient "
      f"{'was' if nonfinite == 1 else 'were'} left out"
    )
  if clip_norm is not None:
    text += f"; the next step clips to {_num(clip_norm)}"
  return text


_CAUSES = (
  ("skipped_nonfinite", "non-finite"),
  ("skipped_max_norm", "above max_norm"),
  ("skipped_spike", "spike"),
  ("skipped_loss_spike", "loss spike"),
)


def _guard_tally(state: Any, streak: int, skipped: int) -> str:
  """The streak and total, e.g. "3 skips in a row, 5 in all (1 non-finite,
  4 spike)".
  """
  text = f"{_plural(streak, 'skip')} in a row"
  causes = [
    f"{int(n)} {label}"
    for field, label in _CAUSES
    if (n := _scalar(state, field))
  ]
  if streak != skipped or len(causes) > 1:
    text += f", {skipped} in all"
    if len(causes) > 1:
      text += f" ({', '.join(causes)})"
  return text


def _guard_cause(state: Any, norm: float, hyper: dict[str, float]) -> str:
  """This step's cause among the finite ones: "max_norm" or "spike" when
  the state (or the injected hyperparameters) tell, else "".
  """
  max_norm = hyper.get("max_norm")
  if max_norm is not None and norm > max_norm:
    return "max_norm"
  moved = [
    label
    for field, label in (
      ("skipped_max_norm", "max_norm"),
      ("skipped_spike", "spike"),
      ("skipped_loss_spike", "loss"),
    )
    if _scalar(state, field)
  ]
  return moved[0] if len(moved) == 1 else ""


def _guard(who: str, state: Any, hyper: dict[str, float]) -> str:
  norm = _scalar(state, "norm") or 0.0
  threshold = _scalar(state, "threshold")
  skipped = int(_scalar(state, "skipped") or 0)
  streak = int(_scalar(state, "consecutive_skips") or 0)
  mean = _scalar(state, "mean")
  z = _scalar(state, "z_score")
  limit = "inf" if threshold is None else _num(threshold)
  if streak == 0:
    if threshold is None or math.isinf(threshold):
      return f"{who} let the step through (norm {_num(norm)}; no limit yet)"
    return f"{who} let the step through (norm {_num(norm)} <= {limit})"
  tally = _guard_tally(state, streak, skipped)
  if not math.isfinite(norm):
    return (
      f"{who} skipped the step: the gradient norm was {_num(norm)} (a NaN "
      f"or Inf in the gradient); {tally}"
    )
  cause = _guard_cause(state, norm, hyper)
  if cause == "max_norm":
    bound = hyper.get("max_norm", threshold)
    return (
      f"{who} skipped the step: the norm {_num(norm)} was above max_norm "
      f"{_num(bound if bound is not None else math.inf)}; {tally}"
    )
  if cause == "loss":
    loss, loss_z = _scalar(state, "loss"), _scalar(state, "loss_z_score")
    if loss is None or loss_z is None:
      return f"{who} skipped the step: the loss spiked; {tally}"
    return (
      f"{who} skipped the step: the loss {_num(loss)} was {_num(loss_z)} "
      f"standard deviations above its mean; {tally}"
    )
  if z is not None and z > 0 and mean is not None:
    spike_z = hyper.get("spike_z")
    why = (
      f"spike_z={_num(spike_z)}"
      if spike_z is not None
      else (f"threshold {limit}")
    )
    return (
      f"{who} skipped the step: the norm {_num(norm)} was {_num(z)} "
      f"standard deviations above its mean (now {_num(mean)}; {why}); "
      f"{tally}"
    )
  return (
    f"{who} skipped the step: the norm {_num(norm)} was above its "
    f"threshold {limit}; {tally}"
  )


def _spikes(scale_phrase: str = "") -> Callable:
  """The SPAM family: coordinates clipped against their second moment;
  ``scale_phrase`` says what the state's ``scale`` is, when below 1.
  """

  def sentence(who: str, state: Any, hyper: dict[str, float]) -> str:
    clipped = _scalar(state, "clipped")
    fraction = _scalar(state, "clip_fraction") or 0.0
    resets = _scalar(state, "resets")
    scale = _scalar(state, "scale")
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


def _norm_ema(who: str, state: Any, hyper: dict[str, float]) -> str:
  norm = _scalar(state, "norm") or 0.0
  scaled = _scalar(state, "scaled_norm") or 0.0
  scale = _scalar(state, "scale")
  if not math.isfinite(norm):
    return _nonfinite(who, norm, "the update")
  if scale is not None and scale < 1:
    return (
      f"{who} scaled the update by {_num(scale)} (norm {_num(norm)} -> "
      f"{_num(scaled)})"
    )
  return f"{who} left the update unchanged (norm {_num(norm)})"


# State short name -> sentence(who, state, hyperparameters).
_SENTENCES: dict[str, Callable[[str, Any, dict[str, float]], str]] = {
  "clip_global": _global,
  "clip_norm": _per_unit("units", "max_norm", "max_norm"),
  "clip_block_rms": _per_unit("leaves", "RMS limit", "threshold"),
  "clip_unitwise": _per_unit("units", "ratio limit", "clipping"),
  "clip_value": _value_clip,
  "clip_zscore": _adaptive("zscore"),
  "clip_percentile": _adaptive("percentile"),
  "clip_relative": _adaptive("relative"),
  "clip_per_example": _examples,
  "dp_noise": _examples,
  "guard": _guard,
  "clip_spikes": _spikes(),
  "clip_spikes_adaptive": _spikes(),
  "spam": _spikes("the step size's warm-up factor is"),
  "stable_spam": _spikes("the cosine factor on b1 and gamma1 is"),
  "scale_by_norm_ema": _norm_ema,
}


# --- The walk ----------------------------------------------------------------


def _child(node: Any, entry: Any) -> Any:
  if hasattr(entry, "name"):
    return getattr(node, entry.name)
  if hasattr(entry, "key"):
    return node[entry.key]
  return node[entry.idx]


def _hyperparameters(tree: Any, path: tuple) -> dict[str, float]:
  """The scalar hyperparameters ``optax.inject_hyperparams`` keeps in the
  innermost ``InjectHyperparamsState`` around ``path``.
  """
  found: dict[str, float] = {}
  node = tree
  for entry in path:
    hyper = getattr(node, "hyperparams", None)
    if isinstance(hyper, dict) and hasattr(node, "inner_state"):
      found = {}
      for name, value in hyper.items():
        try:
          array = np.asarray(jax.device_get(value))
        except TypeError:
          continue
        if array.size == 1 and np.issubdtype(array.dtype, np.number):
          found[name] = float(array.reshape(()))
    try:
      node = _child(node, entry)
    except (AttributeError, KeyError, IndexError, TypeError):
      break
  return found


def explain(opt_state: Any) -> list[str]:
  """One plain sentence per clipper and guard: what it did this step, and why.

  Reads the statistics the states already carry (the ones :func:`stats`
  returns), on the host, after a step: "clip_global scaled the update by
  0.013 (norm 76.2 > 1.0)", "guard skipped the step: the gradient norm was
  nan (a NaN or Inf in the gradient); 2 skips in a row". States are found as
  :func:`stats` finds them -- in any nesting of ``optax.chain``,
  ``named_chain``, ``masked``, ``inject_hyperparams`` (whose
  hyperparameters fill in a limit the state does not keep), :func:`guard`
  or a ``TrainState`` -- and named as its keys name them. A clipper inside a
  guard that skipped the step did not run: its sentence says so.

  When a clipper keeps per-leaf statistics (``leaf_stats=True``), the
  sentence names the leaf (and layer) that carried the largest share of the
  squared norm. Where a state does not keep a hyperparameter (the limit of
  ``clip_global`` before it clips, ``guard``'s ``spike_z``), the sentence
  says what the state has (the norm, the threshold).

  Args:
    opt_state: any pytree holding optaxclip states.

  Returns:
    A list of sentences, one per state, in the order of the state's tree.
    Values are fetched from the device: call it outside ``jit``, e.g. on
    the steps you log.

  Example:
    >>> import jax.numpy as jnp, optax, optaxclip
    >>> tx = optax.chain(optaxclip.clip_global(1.0), optax.sgd(0.1))
    >>> params = {"w": jnp.zeros(4)}
    >>> _, state = tx.update({"w": jnp.full(4, 2.0)}, tx.init(params), params)
    >>> optaxclip.explain(state)
    ['clip_global scaled the update by 0.25 (norm 4.0 > 1.0)']
  """
  found = _stats.named_states(opt_state)
  skipped_guards = [
    path
    for _, path, state in found
    if _stats.short_name(type(state)) == "guard"
    and int(_scalar(state, "consecutive_skips") or 0) > 0
  ]
  sentences = []
  for name, path, state in found:
    inside = [
      g for g in skipped_guards if len(g) < len(path) and path[: len(g)] == g
    ]
    if inside:
      sentences.append(
        f"{name} did not run this step (the guard around it skipped the "
        "step); its statistics are from the last step it ran"
      )
      continue
    sentence = _SENTENCES.get(_stats.short_name(type(state)))
    hyper = _hyperparameters(opt_state, path)
    if sentence is None:  # a state registered elsewhere: its statistics
      values = [
        f"{field} {_num(v)}"
        for field in _stats.stat_fields(state)
        if (v := _scalar(state, field)) is not None
      ]
      sentences.append(f"{name} reported {', '.join(values)}")
    else:
      sentences.append(sentence(name, state, hyper))
  return sentences
