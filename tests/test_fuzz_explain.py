"""explain() re-derived: random chains on random streams, every number and
cause a sentence states read back out of it and checked against the state.

The chains nest guard (in guard, and with scope="leaf"),
optax.inject_hyperparams, optax.masked, optax.multi_transform and
optax.MultiSteps around the clippers; the streams mix steady steps with
spikes of one leaf, NaNs, zero leaves, huge steps and spikes of the loss.
The truths the sentences are checked against come from the states before
and after the step, not from explain's own reading: a guard's cause is the
counter that moved, a clipper "did not run" exactly when its state did not
change, clip_relative's warm-up is the step before its count reached
warmup_steps, and the measure of a leaf's share is the ord the chain was
built with. A batched (vmap) run must read, index by index, as each run on
its own. Each chain is compiled once (fz.FastJit); what varies between
examples is the stream.
"""

from __future__ import annotations

import math
import re

import hypothesis
from hypothesis import strategies as st
import jax
import numpy as np
import optax

import fuzz_strategies as fz
import optaxclip
from optaxclip import _stats
from optaxclip import _telemetry

WARMUP = 3
SHAPES = {"a": (3,), "b": (2, 2), "c": (4,)}
PARAMS = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}


def _nested_guard():
  inner = optaxclip.guard(
    optax.chain(
      optaxclip.clip_zscore(warmup_steps=WARMUP, leaf_stats=True),
      optax.sgd(0.1),
    ),
    spike_z=2.0,
    warmup_steps=WARMUP,
  )
  return optaxclip.guard(
    optax.chain(optaxclip.clip_global(1.0, leaf_stats=True), inner),
    spike_z=3.0,
    max_norm=60.0,
    loss_spike_z=3.0,
    warmup_steps=WARMUP,
    leaf_stats=True,
  )


def _injected():
  # max_norm goes to clip_global; the guard has none of its own.
  return optax.inject_hyperparams(
    lambda max_norm: optaxclip.guard(
      optax.chain(
        optaxclip.clip_global(max_norm, ord=1, leaf_stats=True),
        optax.adam(0.1),
      ),
      spike_z=2.0,
      warmup_steps=WARMUP,
    )
  )(max_norm=1.0)


def _masked_multi():
  return optax.chain(
    optax.masked(
      optaxclip.clip_relative(warmup_steps=WARMUP, leaf_stats=True),
      {"a": True, "b": True, "c": False},
    ),
    optax.multi_transform(
      {
        "x": optaxclip.clip_global(2.0, ord=math.inf, leaf_stats=True),
        "y": optaxclip.clip_norm(1.0, leaf_stats=True),
      },
      {"a": "x", "b": "x", "c": "y"},
    ),
  )


def _multisteps():
  # (A guard with scope="leaf" splits its inner state by leaf: only
  # scalars and per-parameter slots inside, so clip_percentile's history
  # and leaf norms stay outside it.)
  return optax.MultiSteps(
    optax.chain(
      optaxclip.clip_percentile(history=8, leaf_stats=True),
      optaxclip.guard(
        optax.chain(optaxclip.clip_value(0.5), optax.sgd(0.1)),
        scope="leaf",
        max_norm=30.0,
        spike_z=2.0,
        warmup_steps=WARMUP,
        leaf_stats=True,
      ),
    ),
    every_k_schedule=2,
  )


CHAINS = {
  "nested_guard": (_nested_guard, True),
  "injected": (_injected, False),
  "masked_multi": (_masked_multi, False),
  "multisteps": (_multisteps, False),
}
# The ord of each clipper's norm (and so of its leaf shares), by state kind
# and chain; every other one measures the L2 norm.
ORDS = {
  ("injected", "clip_global"): 1.0,
  ("masked_multi", "clip_global"): math.inf,
}


class _Runner:
  """A chain built once, its step compiled once (and once vmapped)."""

  def __init__(self, name):
    make, self.loss_aware = CHAINS[name]
    self.tx = make()
    if self.loss_aware:
      step = lambda g, s, v: self.tx.update(g, s, PARAMS, value=v)[1]
    else:
      step = lambda g, s, v: self.tx.update(g, s, PARAMS)[1]
    self.step = fz.FastJit(step)
    self.batched = fz.FastJit(jax.vmap(step))
    self.init = fz.FastJit(self.tx.init)


_RUNNERS: dict[str, _Runner] = {}


def runner(name) -> _Runner:
  if name not in _RUNNERS:
    _RUNNERS[name] = _Runner(name)
  return _RUNNERS[name]


EVENTS = ("steady",) * 5 + ("spike", "nan", "zero", "huge", "loss", "loss")


@st.composite
def streams(draw, min_steps=WARMUP + 1, max_steps=WARMUP + 8):
  """``(gradients, losses, events)``: one tree and one loss per step."""
  events = draw(
    st.lists(st.sampled_from(EVENTS), min_size=min_steps, max_size=max_steps)
  )
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  level = float(np.exp(draw(st.floats(-2.0, 2.0))))
  grads, losses = [], []
  for event in events:
    scale = level * float(np.exp(0.1 * rng.standard_normal()))
    g = {
      k: (scale * (1 + 0.1 * rng.standard_normal(s))).astype(np.float32)
      for k, s in SHAPES.items()
    }
    leaf = ("a", "b", "c")[int(rng.integers(3))]
    if event == "spike":
      g[leaf] = g[leaf] * np.float32(50)
    elif event == "nan":
      g[leaf].flat[0] = np.nan
    elif event == "zero":
      g[leaf] = np.zeros_like(g[leaf])
    elif event == "huge":
      g = {k: v * np.float32(1e3) for k, v in g.items()}
    loss = 2.0 + 0.01 * rng.standard_normal()
    losses.append(np.float32(50.0 if event == "loss" else loss))
    grads.append(g)
  return grads, losses, events


# --- Reading a sentence back -------------------------------------------------

N = r"(-?(?:\d+(?:\.\d+)?(?:e[+-]\d+)?|nan|inf))"
PCT = r"(\d+%|<1%)"


def _close(token: str, value: float, what: str, sentence: str) -> None:
  got = float(token)
  ok = (
    (math.isnan(got) and math.isnan(value))
    or got == value
    or abs(got - value) <= 5e-3 * abs(value) + 1e-300
  )
  assert ok, (
    f"{what}: the sentence says {token}, the state {value!r}: {sentence}"
  )


def _close_pct(token: str, share: float, what: str, sentence: str) -> None:
  if token == "<1%":
    assert 0 < share < 0.01, (what, share, sentence)
  else:
    assert abs(float(token[:-1]) - 100 * share) <= 0.5 + 1e-9, (
      what,
      share,
      sentence,
    )


# Where a guard's sentence reads each value, by its stats() key.
GUARD_PATHS = {
  "norm": ("verdict", "norm"),
  "threshold": ("verdict", "threshold"),
  "z_score": ("verdict", "z_score"),
  "skipped_leaves": ("verdict", "skipped_leaves"),
  "mean": ("norm_moments", "mean"),
  "count": ("norm_moments", "count"),
  "loss": ("loss_monitor", "value"),
  "loss_z_score": ("loss_monitor", "z_score"),
  "loss_moments": ("loss_monitor", "moments"),
  **{
    name: ("counts", name)
    for name in (
      "skipped",
      "consecutive_skips",
      "skipped_nonfinite",
      "skipped_max_norm",
      "skipped_spike",
      "skipped_loss_spike",
    )
  },
}


def _f(state, *names) -> float:
  if isinstance(state, optaxclip.GuardState):
    names = GUARD_PATHS.get(names[0], names[:1]) + names[1:]
  value = state
  for name in names:
    value = getattr(value, name)
  return float(np.asarray(value).reshape(()))


def _arrays(state) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(state)]


def _changed(old, new) -> bool:
  return any(
    not np.array_equal(a, b, equal_nan=True)
    for a, b in zip(_arrays(old), _arrays(new))
  )


BLAMES = [
  ("share2", rf"; {PCT} of the squared norm came from (?P<leaf>[^;]+)$"),
  ("share1", rf"; {PCT} of the 1-norm came from (?P<leaf>[^;]+)$"),
  ("inf", rf"; the largest magnitude \({N}\) was in (?P<leaf>[^;]+)$"),
  ("all", r"; all of the norm came from (?P<leaf>[^;]+)$"),
  ("nearly", r"; nearly all of the norm came from (?P<leaf>[^;]+)$"),
  (
    "nan",
    (
      r"; (?P<leaf>[^;]+) is the first leaf whose norm is nan \(a NaN or Inf "
      r"in it\)$"
    ),
  ),
  ("largest", rf"; the largest leaf norm \({N}\) was (?P<leaf>[^;]+)'s$"),
]


def _check_blame(sentence: str, state, ord_: float) -> str:
  """Checks the leaf a sentence names against the state's leaf statistics;
  returns the sentence without that clause.
  """
  if getattr(state, "leaf_norms", None) is None:
    return sentence
  names = _telemetry.leaf_norm_names(state.leaf_norms)
  norms = np.asarray(state.leaf_norms.values, np.float64)
  share, top = _f(state, "top_leaf_share"), int(_f(state, "top_leaf"))
  for kind, pattern in BLAMES:
    m = re.search(pattern, sentence)
    if m is None:
      continue
    leaf = m.group("leaf")
    assert leaf == names[top], (leaf, names, top, sentence)
    others = np.delete(norms, top)
    if kind in ("share2", "share1"):
      assert ord_ == (2.0 if kind == "share2" else 1.0), (ord_, sentence)
      _close_pct(m.group(1), share, "share", sentence)
    elif kind == "inf":
      assert ord_ == math.inf, (ord_, sentence)
      _close(m.group(1), norms[top], "largest magnitude", sentence)
      assert norms[top] == np.max(norms), sentence
    elif kind == "all":
      assert not np.any(others), sentence
    elif kind == "nearly":
      assert share >= 1 - 1e-4, sentence
    elif kind == "nan":
      assert math.isnan(norms[top]) and not np.any(np.isnan(norms[:top]))
    else:
      _close(m.group(1), norms[top], "leaf norm", sentence)
      assert norms[top] >= np.nanmax(norms), sentence
    return sentence[: m.start()]
  # No clause: nothing measured (an all-zero update).
  assert share == 0 or not np.any(norms), sentence
  return sentence


LABELS = {
  # pattern -> the state's field (or a function of the state)
  rf"\(norm {N}[ ;)>-]": lambda s: _f(s, "norm"),
  rf"\(largest magnitude {N}": lambda s: _f(s, "norm"),
  rf"-> {N}": lambda s: _f(s, "clipped_norm"),
  rf"[(;] threshold {N}": lambda s: _f(s, "threshold"),
  rf"warmup_max_norm {N}": lambda s: _f(s, "threshold"),
  rf"(?:max_norm|RMS limit|ratio limit) {N}\)": lambda s: _f(s, "threshold"),
  rf"> {N}\)": lambda s: _f(s, "threshold"),
  rf"<= {N}\)": lambda s: _f(s, "threshold"),
  rf"scaled the (?:whole )?update by {N}": lambda s: (
    _f(s, "clipped_norm") / _f(s, "norm") if _f(s, "norm") > 0 else 0.0
  ),
}


def _check_numbers(body: str, state, sentence: str) -> None:
  for pattern, field in LABELS.items():
    for m in re.finditer(pattern, body):
      _close(m.group(1), field(state), pattern, sentence)
  m = re.search(rf"(?:scaled down|clipped) {PCT} of", body)
  if m:
    _close_pct(m.group(1), _f(state, "clip_fraction"), "fraction", sentence)
  scaled = re.search(r" (scaled|clipped \d)", body) is not None
  if "non-finite" not in body:
    assert scaled == (_f(state, "clip_fraction") > 0), sentence


CAUSES = {
  "skipped_nonfinite": r": the (?:gradient norm was|loss was) ",
  "skipped_max_norm": r" was above max_norm",
  "skipped_spike": (
    r" (?:standard deviations above its mean(?! -?\d)|spike bound)"
  ),
  "skipped_loss_spike": r": the loss \S+ was \S+ standard deviations",
}


def _check_guard(who: str, body: str, old, new, sentence: str) -> None:
  streak = int(_f(new, "consecutive_skips"))
  if not streak:
    assert body.startswith(f"{who} let "), sentence
    if "no threshold this step" in body:
      assert math.isinf(_f(new, "threshold")), sentence
    else:
      _close(
        re.search(rf"norm {N}", body).group(1), _f(new, "norm"), "norm", body
      )
    return
  moved = [c for c in CAUSES if _f(new, c) != _f(old, c)]
  assert len(moved) == 1, (moved, sentence)
  for cause, pattern in CAUSES.items():
    said = re.search(pattern, body) is not None
    assert said == (cause == moved[0]), (cause, moved, sentence)
  m = re.search(r"(\d+) skips? in a row(?:, (\d+) in all)?", body)
  assert int(m.group(1)) == streak, sentence
  assert int(m.group(2) or streak) == int(_f(new, "skipped")), sentence
  if new.verdict.skipped_leaves is not None and _f(
    new, "skipped_leaves"
  ) < np.size(new.norm_moments.count):
    m = re.search(r"skipped (\d+) of its (\d+) leaves", body)
    assert int(m.group(1)) == int(_f(new, "skipped_leaves")), sentence
    assert int(m.group(2)) == np.size(new.norm_moments.count), sentence
  checks = {
    rf"the norm {N} was": lambda s: _f(s, "norm"),
    rf"gradient norm was {N}": lambda s: _f(s, "norm"),
    rf"was {N} standard deviations above its mean \(": lambda s: _f(
      s, "z_score"
    ),
    rf"now {N}": lambda s: _f(s, "mean"),
    rf"threshold {N}": lambda s: _f(s, "threshold"),
    rf"the loss {N}": lambda s: _f(s, "loss"),
    rf"the loss was {N}": lambda s: _f(s, "loss"),
    rf"the loss \S+ was {N}": lambda s: _f(s, "loss_z_score"),
    rf"deviations above its mean {N}": lambda s: _f(s, "loss_moments", "mean"),
  }
  for pattern, field in checks.items():
    for m in re.finditer(pattern, body):
      _close(m.group(1), field(new), pattern, sentence)


def _check_relative(body: str, old, new, sentence: str) -> None:
  if not math.isfinite(_f(new, "norm")):
    return
  warm = _f(old, "count") < WARMUP  # this step clipped by the warm-up rule
  said_warm = "in its warm-up" in body
  said_per_leaf = "each leaf's limit is a factor times its own EMA norm" in body
  clipped = _f(new, "clip_fraction") > 0
  assert not (said_warm and not warm), sentence
  assert not (said_per_leaf and warm), sentence
  if clipped and _f(new, "threshold") > 0:
    assert said_warm == warm and said_per_leaf == (not warm), sentence


def _wrappers(tree, path):
  """The guards and MultiSteps on ``path`` above a state, outermost first."""
  out, node = [], tree
  for entry in path:
    if isinstance(node, (optaxclip.GuardState, optax.MultiStepsState)):
      out.append(node)
    for attr in ("name", "key", "idx"):
      if hasattr(entry, attr):
        key = getattr(entry, attr)
        node = getattr(node, key) if attr == "name" else node[key]
        break
  return out


def check_step(chain: str, old_tree, new_tree, sentences) -> None:
  """Every sentence of ``explain(new_tree)`` against the states."""
  found = _stats.named_states(new_tree)
  before = _stats.named_states(old_tree)
  assert len(sentences) == len(found)
  for (name, path, new), (_, _, old), sentence in zip(found, before, sentences):
    short = _stats.short_name(type(new))
    m = re.fullmatch(
      rf"{re.escape(name)} did not run this step \((.*)\); its statistics "
      "are from the last step it ran",
      sentence,
    )
    if m is not None or not _changed(old, new):
      assert m is not None and not _changed(old, new), sentence
      why, around = m.group(1), _wrappers(new_tree, path)
      if why.startswith("the guard"):
        assert any(
          isinstance(w, optaxclip.GuardState) and _f(w, "consecutive_skips")
          for w in around
        ), sentence
      else:
        k = re.search(r"accumulating gradients, (\d+) so far", why)
        (multi,) = [w for w in around if isinstance(w, optax.MultiStepsState)]
        assert int(k.group(1)) == int(_f(multi, "mini_step")), sentence
      continue
    assert sentence.startswith(name + " "), (name, sentence)
    body = _check_blame(sentence, new, ORDS.get((chain, short), 2.0))
    if short == "guard":
      _check_guard(name, body, old, new, sentence)
      continue
    _check_numbers(body, new, sentence)
    if short == "clip_relative":
      _check_relative(body, old, new, sentence)


@fz.examples(12, deadline=None)
@hypothesis.given(chain=st.sampled_from(sorted(CHAINS)), stream=streams())
def test_every_sentence_reads_back_from_the_state(chain, stream):
  run = runner(chain)
  grads, losses, _ = stream
  state = run.init(fz.to_jax(PARAMS))
  for g, loss in zip(grads, losses):
    new = run.step(fz.to_jax(g), state, jax.device_put(loss))
    check_step(chain, state, new, optaxclip.explain(new))
    state = new


@fz.examples(4, deadline=None)
@hypothesis.given(streams=st.lists(streams(), min_size=2, max_size=2))
def test_a_batched_run_reads_as_each_run_on_its_own(streams):
  run = runner("nested_guard")
  steps = min(len(s[0]) for s in streams)
  stack = lambda *xs: np.stack(xs)
  state = run.init(fz.to_jax(PARAMS))
  batched = jax.tree.map(lambda x: np.stack([x, x]), jax.device_get(state))
  batched = fz.to_jax(batched)
  for t in range(steps):
    g = jax.tree.map(stack, streams[0][0][t], streams[1][0][t])
    loss = np.stack([streams[0][1][t], streams[1][1][t]])
    batched = run.batched(fz.to_jax(g), batched, jax.device_put(loss))
  said = optaxclip.explain(batched)
  per_state = len(_stats.named_states(state))
  assert len(said) == 2 * per_state
  for i in range(2):
    one = jax.tree.map(lambda x, i=i: np.asarray(x)[i], batched)
    alone = optaxclip.explain(one)
    for k, sentence in enumerate(alone):
      name = _stats.named_states(one)[k][0]
      assert said[2 * k + i] == sentence.replace(name, f"{name}[{i}]", 1)
    names, table = optaxclip.leaf_norm_table(batched)
    one_names, one_table = optaxclip.leaf_norm_table(one)
    assert names == one_names
    np.testing.assert_array_equal(np.asarray(table)[i], one_table)
