"""Properties of stats(), the argument checks and the shared compiled updates.

Each fix of the "checks" work has a property here: stats() keys are unique
and complete in any nesting of chains, named chains (names with "/" and "%"),
masks, injected hyperparameters and guards; every bad hyperparameter fails at
construction in the one format; step counts and seeds are bounded to what the
state can hold; an injected hyperparameter gives the update of a plain one.
"""

import collections
import math
import re

import hypothesis
from hypothesis import strategies as st
import jax
import ml_dtypes
import numpy as np
import optax
import pytest

import fuzz_strategies as fz
import optaxclip
from optaxclip import _stats

# Put from the host: an eager jnp.ones compiles a program as the module is
# collected, in every xdist worker.
PARAMS = fz.to_jax(
  {"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32)}
)
MASK = {"w": True, "b": False}

# name -> a transformation and the registered state classes it holds.
LEAVES = {
  "clip_value": lambda: optaxclip.clip_value(1.0),
  "clip_norm": lambda: optaxclip.clip_norm(1.0),
  "clip_global": lambda: optaxclip.clip_global(1.0),
  "clip_block_rms": lambda: optaxclip.clip_block_rms(1.0),
  "clip_unitwise": lambda: optaxclip.clip_unitwise(0.1),
  "clip_zscore": lambda: optaxclip.clip_zscore(warmup_steps=1),
  "clip_percentile": lambda: optaxclip.clip_percentile(history=2),
  "clip_relative": lambda: optaxclip.clip_relative(warmup_steps=1),
  "injected": lambda: optax.inject_hyperparams(optaxclip.clip_global)(
    max_norm=1.0
  ),
  "sgd": lambda: optax.sgd(0.1),
  "identity": optax.identity,
}


def _leaf(name):
  return LEAVES[name]()


def _extend(children):
  names = st.text(alphabet="ab/%0", min_size=1, max_size=3)
  return st.one_of(
    st.lists(children, min_size=1, max_size=3).map(
      lambda txs: optax.chain(*txs)
    ),
    st.lists(
      st.tuples(names, children),
      min_size=1,
      max_size=3,
      unique_by=lambda pair: pair[0],
    ).map(lambda pairs: optax.named_chain(*pairs)),
    children.map(lambda tx: optax.masked(tx, MASK)),
    children.map(optaxclip.guard),
  )


OPTIMIZERS = st.recursive(
  st.sampled_from(sorted(LEAVES)).map(_leaf), _extend, max_leaves=6
)


def _registered(tree):
  """Every registered state in ``tree`` (a reference walk, by type)."""
  found = []

  def visit(node):
    if isinstance(node, tuple(_stats._REGISTRY)):
      found.append(node)
    children = jax.tree_util.tree_flatten(
      node, is_leaf=lambda x: x is not node
    )[0]
    if not (len(children) == 1 and children[0] is node):
      for child in children:
        visit(child)

  visit(tree)
  return found


@hypothesis.given(OPTIMIZERS)
def test_stats_keys_are_unique_and_complete(tx):
  state = tx.init(PARAMS)
  logs = optaxclip.stats(state)
  want = collections.Counter()
  for found in _registered(state):
    short, fields = _stats._REGISTRY[type(found)][:2]
    want.update(
      f"{short}/{field}"
      for field in fields
      # None: an option that is off.
      if _stats.stat_value(found, field) is not None
    )
  # No key overwrote another: as many as the states' fields that are set,
  # each field of each state once (its key ends with "<short>/<field>").
  assert len(logs) == sum(want.values())
  got = collections.Counter("/".join(k.split("/")[-2:]) for k in logs)
  assert got == want
  for value in logs.values():
    assert np.shape(value) == ()


# Names and nestings that render alike unless "/" and "%" are encoded:
# ("a/0", clipper) beside ("a", chain(clipper)), "a%2F0" beside "a/0".
ALIKE = st.recursive(
  st.just(None).map(lambda _: optaxclip.clip_global(1.0)),
  lambda children: st.one_of(
    st.lists(children, min_size=1, max_size=2).map(
      lambda txs: optax.chain(*txs)
    ),
    st.lists(
      st.tuples(
        st.sampled_from(["a", "0", "a/0", "a%2F0", "%", "/", "0/0"]), children
      ),
      min_size=2,
      max_size=3,
      unique_by=lambda pair: pair[0],
    ).map(lambda pairs: optax.named_chain(*pairs)),
  ),
  max_leaves=5,
)


@hypothesis.given(ALIKE)
def test_paths_that_look_alike_get_distinct_keys(tx):
  state = tx.init(PARAMS)
  logs = optaxclip.stats(state)
  # clip_global's four statistics: norm, clipped_norm, clip_fraction and
  # threshold.
  assert len(logs) == 4 * len(_registered(state))


# (clipper, argument, keyword arguments it needs, the smallest valid value,
# whether that bound is excluded).
NUMERIC = [
  ("clip_value", "max_delta", {}, 0.0, False),
  ("clip_norm", "max_norm", {}, 0.0, False),
  ("clip_global", "max_norm", {}, 0.0, False),
  ("clip_block_rms", "threshold", {}, 0.0, False),
  ("clip_unitwise", "clipping", {}, 0.0, False),
  ("clip_unitwise", "eps", {}, 0.0, False),
  ("clip_zscore", "alpha", {}, 0.0, True),
  ("clip_zscore", "spike_z", {}, 0.0, True),
  ("clip_zscore", "eps", {}, 0.0, False),
  ("clip_zscore", "clip_factor", {}, 0.0, True),
  ("clip_percentile", "percentile", {}, 0.0, False),
  ("clip_relative", "factor", {}, 1.0, False),
  ("clip_relative", "beta", {}, 0.0, True),
  ("clip_relative", "warmup_max_norm", {}, 0.0, False),
  ("clip_per_example", "l2_clip", {}, 0.0, False),
  ("clip_per_example", "noise_multiplier", {"l2_clip": 1.0}, 0.0, False),
  ("clip_per_example", "quantile_lr", {"l2_clip": 1.0}, 0.0, False),
  ("guard", "spike_z", {"inner": optax.sgd(0.1)}, 0.0, True),
  ("guard", "alpha", {"inner": optax.sgd(0.1)}, 0.0, True),
  ("clipped", "clipnorm", {"inner": optax.sgd(0.1)}, 0.0, False),
]


def _bad_values(low, low_open):
  below = st.floats(
    max_value=low,
    exclude_max=not low_open,
    allow_nan=False,
    allow_infinity=False,
  )
  return st.one_of(
    below,
    st.just(math.nan),
    st.just(-math.inf),
    st.text(max_size=3),
    st.booleans(),
    st.complex_numbers(min_magnitude=1, max_magnitude=2),
  )


@st.composite
def bad_arguments(draw):
  case = draw(st.sampled_from(NUMERIC))
  return case, draw(_bad_values(case[3], case[4]))


@hypothesis.given(bad_arguments())
def test_bad_numbers_fail_at_construction_in_the_one_format(drawn):
  (name, argument, needed, _, _), value = drawn
  with pytest.raises((TypeError, ValueError)) as caught:
    getattr(optaxclip, name)(**needed, **{argument: value})
  pattern = rf"^{name}: {re.escape(argument)} must .+; got .+"
  assert re.match(pattern, str(caught.value), re.S), str(caught.value)


# Real-valued hyperparameters a user may write as a Python int of any size
# (besides NUMERIC's): (clipper, argument, keyword arguments it needs).
LARGE = [
  (name, argument, needed) for name, argument, needed, _, _ in NUMERIC
] + [
  ("clip_zscore", "max_norm", {}),
  ("scale_by_norm_ema", "eps", {}),
  ("spam", "eps", {"learning_rate": 1e-3}),
  ("spam", "weight_decay", {"learning_rate": 1e-3}),
  ("stable_spam", "learning_rate", {}),
  ("stable_spam", "eps", {"learning_rate": 1e-3}),
  ("clipped", "global_clipnorm", {"inner": optax.sgd(0.1)}),
]


def _run(build):
  """The first update of ``build()`` on PARAMS, or the error it raises."""
  try:
    tx = build()
    return tx.update(PARAMS, tx.init(PARAMS), PARAMS)[0], None
  except (TypeError, ValueError) as err:
    return None, str(err)


@fz.examples(6)
@hypothesis.given(
  st.sampled_from(LARGE), st.integers(min_value=2**31, max_value=2**62)
)
def test_a_python_int_beyond_int32_is_the_same_float(case, value):
  """A real hyperparameter given as a Python int of 2**31 or more updates as
  the same float does (or both fail at construction): the int does not
  become an int32 array, whose update would raise OverflowError
  (clip_global(2**31)).
  """
  name, argument, needed = case
  factory = getattr(optaxclip, name)
  as_int = _run(lambda: factory(**needed, **{argument: value}))
  as_float = _run(lambda: factory(**needed, **{argument: float(value)}))
  assert (as_int[1] is None) == (as_float[1] is None), (as_int[1], as_float[1])
  if as_int[1] is None:
    for a, b in zip(jax.tree.leaves(as_int[0]), jax.tree.leaves(as_float[0])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


STEP_COUNTS = [
  ("clip_zscore", "warmup_steps"),
  ("clip_zscore", "patience"),
  ("clip_relative", "warmup_steps"),
  ("clip_relative", "patience"),
  ("clip_percentile", "history"),
  ("guard", "warmup_steps"),
]


@hypothesis.given(
  st.sampled_from(STEP_COUNTS), st.integers(min_value=1, max_value=2**40)
)
def test_step_counts_fit_the_int32_counters(where, count):
  name, argument = where
  needed = {"inner": optax.sgd(0.1)} if name == "guard" else {}
  build = lambda: getattr(optaxclip, name)(**needed, **{argument: count})
  if count <= np.iinfo(np.int32).max:
    if argument != "history":  # a long history is memory: not allocated.
      build()
  else:
    with pytest.raises(
      ValueError,
      match=rf"^{name}: {argument} must be <= "
      r"2147483647 \(the state",
    ):
      build()


@hypothesis.given(st.integers(min_value=-(2**40), max_value=2**40))
def test_seeds_map_to_distinct_keys_or_are_rejected(seed):
  if -(2**31) <= seed < 2**32:
    tx = optaxclip.clip_per_example(1.0, seed=seed)
    key = tx.init(PARAMS).key
    np.testing.assert_array_equal(key, jax.random.PRNGKey(seed))
  else:
    with pytest.raises(ValueError, match=r"^clip_per_example: seed must be"):
      optaxclip.clip_per_example(1.0, seed=seed)


# A plain clipper compiles once per value (its limit is a constant of the
# program): a few values keep this cheap.
@fz.examples(3)
@hypothesis.given(
  st.sampled_from([0.05, 2.0, 7.5]), st.sampled_from(["clip_global"])
)
def test_injected_hyperparameter_updates_like_a_plain_one(limit, name):
  grads = fz.to_jax(
    {
      "w": np.arange(6.0, dtype=np.float32).reshape(2, 3),
      "b": np.asarray([1.0, -2, 3], np.float32),
    }
  )
  factory = getattr(optaxclip, name)
  injected = optax.inject_hyperparams(factory)(limit)
  plain = factory(limit)
  got, _ = injected.update(grads, injected.init(grads))
  want, _ = plain.update(grads, plain.init(grads))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


# Transformations and the extra keyword arguments their update needs.
UPDATES = {
  "dp_noise": (lambda: optaxclip.dp_noise(1.0), {"example_norms": np.ones(2)}),
  "dp_noise(noise)": (
    lambda: optaxclip.dp_noise(1.0, noise_multiplier=1.0),
    {"example_norms": np.ones(2)},
  ),
  "clip_global": (lambda: optaxclip.clip_global(1.0), {}),
  "clip_global(ord=inf)": (
    lambda: optaxclip.clip_global(1.0, ord=math.inf),
    {},
  ),
  "clip_value": (lambda: optaxclip.clip_value(1.0), {}),
  "clip_norm": (lambda: optaxclip.clip_norm(1.0), {}),
  "clip_unitwise": (lambda: optaxclip.clip_unitwise(0.1), {}),
  "clip_zscore": (optaxclip.clip_zscore, {}),
  "clip_percentile": (optaxclip.clip_percentile, {}),
  "clip_relative": (optaxclip.clip_relative, {}),
  "guard": (lambda: optaxclip.guard(optax.sgd(0.1)), {}),
  "clip_per_example": (lambda: optaxclip.clip_per_example(1.0), {}),
  "clip_spikes": (optaxclip.clip_spikes, {}),
  "spam": (lambda: optaxclip.spam(1e-3), {}),
  "stable_spam": (lambda: optaxclip.stable_spam(1e-3), {}),
  "clip_spikes_adaptive": (optaxclip.clip_spikes_adaptive, {}),
  "scale_by_norm_ema": (optaxclip.scale_by_norm_ema, {}),
}
SPAM_FAMILY = {
  "clip_spikes",
  "spam",
  "stable_spam",
  "clip_spikes_adaptive",
  "scale_by_norm_ema",
}


@fz.examples(6)
@hypothesis.given(
  name=st.sampled_from(sorted(UPDATES)),
  dtype=st.sampled_from(("int32", "complex64", "float8_e4m3fn", "float8_e5m2")),
)
@hypothesis.example(name="stable_spam", dtype="complex64")
def test_leaves_a_transformation_cannot_step_are_named_in_one_message(
  name, dtype
):
  """An integer leaf fails with the leaf's path, and so does a complex one
  in the SPAM family, whose element-wise moments are real (others take
  complex leaves), and a float8 one anywhere, each message opening with
  the name of the transformation built (stable_spam's, not its first
  stage's, clip_spikes_adaptive). Otherwise dp_noise would truncate
  integer leaves silently (or fail inside its noise draw), the SPAM family
  would compute complex leaves wrongly (``g * g`` for ``|g|**2``), and
  float8 leaves would fail with a TypePromotionError from inside the norms.
  """
  make, extra = UPDATES[name]
  tree = {
    "w": np.ones(3, np.float32),
    "x": np.ones(3, getattr(ml_dtypes, dtype, dtype)),
  }
  if dtype == "complex64" and name.split("(")[0] not in SPAM_FAMILY:
    tx = make()
    tx.update(
      fz.to_jax(tree), tx.init(fz.to_jax(tree)), fz.to_jax(tree), **extra
    )
    return
  kind = {
    "complex64": "a real float",
    "int32": "float",
  }.get(dtype, "float16, bfloat16, float32 or float64")
  # The message names the transformation the user built, not a stage of it.
  who = name.split("(")[0]
  with pytest.raises(
    TypeError,
    match=rf"^{who}: (updates|params) leaf \['x'\] must be {kind}",
  ):
    tx = make()
    tx.update(
      fz.to_jax(tree), tx.init(fz.to_jax(tree)), fz.to_jax(tree), **extra
    )
