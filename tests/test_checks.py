"""Every bad argument of every public function gets one clear error,
``"<clipper>: <argument> must ...; got ..."``, when the transformation is
built; traced hyperparameters are accepted unchecked.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxclip


def test_per_example_layer_scope_is_a_deprecated_alias_of_leaf():
  tree = {"w": jnp.array([[3.0, 4.0], [0.3, 0.4]]), "b": jnp.ones((2, 1))}
  with pytest.warns(
    DeprecationWarning, match=r"clip_per_example: scope='layer' is deprecated"
  ):
    old = optaxclip.clip_per_example(1.0, scope="layer")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    new = optaxclip.clip_per_example(1.0, scope="leaf")
  params = {"w": jnp.zeros(2), "b": jnp.zeros(1)}
  # The same program (traced, not compiled: cheap).
  programs = [
    str(jax.make_jaxpr(tx.update)(tree, tx.init(params))) for tx in (old, new)
  ]
  assert programs[0] == programs[1]


def test_deprecation_warning_points_at_the_caller_and_is_given_once():
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tx = optaxclip.clip_per_example(1.0, scope="layer")
    # Traced (the shared update builds the transformation again): no
    # second warning.
    jax.eval_shape(
      tx.update, {"w": jnp.ones((2, 3))}, tx.init({"w": jnp.zeros(3)})
    )
  assert len(caught) == 1, [str(w.message) for w in caught]
  assert caught[0].filename == __file__


NAN, INF = float("nan"), float("inf")
SGD = optax.sgd(0.1)


def LOSS(params, x):
  return jnp.sum(params * x)


# (clipper, keyword arguments, the argument at fault, error type, what the
# message says it must be). Positional first arguments are passed by name.
BAD = [
  (
    "clip_global",
    {"max_norm": 1.0, "leaf_stats": 1},
    "leaf_stats",
    TypeError,
    "bool",
  ),
  (
    "clip_global",
    {"max_norm": 1.0, "layer_axis": 0},
    "layer_axis",
    ValueError,
    "leaf_stats=True",
  ),
  (
    "clip_norm",
    {"max_norm": 1.0, "leaf_stats": True, "layer_axis": "0"},
    "layer_axis",
    TypeError,
    "int or None",
  ),
  (
    "clip_zscore",
    {"leaf_stats": True, "layer_axis": {"w": 1.5}},
    "layer_axis",
    TypeError,
    "int or None",
  ),
  ("clip_value", {"max_delta": -1.0}, "max_delta", ValueError, ">= 0"),
  ("clip_value", {"max_delta": NAN}, "max_delta", ValueError, "real number"),
  ("clip_value", {"max_delta": "1"}, "max_delta", TypeError, "real number"),
  ("clip_value", {"max_delta": True}, "max_delta", TypeError, "real number"),
  ("clip_value", {"max_delta": 1j}, "max_delta", TypeError, "real number"),
  ("clip_value", {"max_delta": -INF}, "max_delta", ValueError, "finite"),
  (
    "clip_value",
    {"max_delta": 1.0, "stats": "approx"},
    "stats",
    ValueError,
    "one of",
  ),
  ("clip_norm", {"max_norm": -1.0}, "max_norm", ValueError, ">= 0"),
  ("clip_norm", {"max_norm": 1.0, "ord": 0.5}, "ord", ValueError, ">= 1"),
  (
    "clip_norm",
    {"max_norm": 1.0, "ord": "fro"},
    "ord",
    TypeError,
    "real number",
  ),
  (
    "clip_norm",
    {"max_norm": 1.0, "ord": jnp.float32(2.0)},
    "ord",
    TypeError,
    "static_args",
  ),
  (
    "clip_norm",
    {"max_norm": 1.0, "axis": 1.5},
    "axis",
    TypeError,
    "an int or a tuple of ints",
  ),
  (
    "clip_norm",
    {"max_norm": 1.0, "axis": (0, 0)},
    "axis",
    ValueError,
    "each axis once",
  ),
  (
    "clip_norm",
    {"max_norm": 1.0, "axis": True},
    "axis",
    TypeError,
    "an int or a tuple",
  ),
  (
    "clip_norm",
    {"max_norm": 1.0, "axis_name": ""},
    "axis_name",
    ValueError,
    "not be or contain an empty name",
  ),
  (
    "clip_norm",
    {"max_norm": 1.0, "axis_name": 3},
    "axis_name",
    TypeError,
    "a string or a tuple of strings",
  ),
  ("clip_global", {"max_norm": NAN}, "max_norm", ValueError, "real number"),
  ("clip_global", {"max_norm": 1.0, "ord": 0}, "ord", ValueError, ">= 1"),
  (
    "clip_global",
    {"max_norm": 1.0, "axis_name": ()},
    "axis_name",
    TypeError,
    "a string or a tuple of strings",
  ),
  (
    "clip_global",
    {"max_norm": 1.0, "axis_name": ("d", "")},
    "axis_name",
    ValueError,
    "empty name",
  ),
  (
    "clip_global",
    {"max_norm": 1.0, "axis_name": "d", "sharded": "no"},
    "sharded",
    TypeError,
    "a bool",
  ),
  (
    "clip_global",
    {"max_norm": 1.0, "axis_name": "d", "sharded": 1},
    "sharded",
    TypeError,
    "a bool",
  ),
  ("clip_block_rms", {"threshold": -0.1}, "threshold", ValueError, ">= 0"),
  (
    "clip_block_rms",
    {"threshold": 1.0, "axis_name": ""},
    "axis_name",
    ValueError,
    "empty name",
  ),
  ("clip_unitwise", {"clipping": -1.0}, "clipping", ValueError, ">= 0"),
  ("clip_unitwise", {"eps": -1e-3}, "eps", ValueError, ">= 0"),
  ("clip_unitwise", {"eps": INF}, "eps", ValueError, "finite"),
  ("clip_unitwise", {"axis": "0"}, "axis", TypeError, "an int or a tuple"),
  ("clip_zscore", {"alpha": 1.0}, "alpha", ValueError, "< 1"),
  ("clip_zscore", {"alpha": 0.0}, "alpha", ValueError, "> 0"),
  ("clip_zscore", {"spike_z": 0.0}, "spike_z", ValueError, "> 0"),
  ("clip_zscore", {"max_norm": -1.0}, "max_norm", ValueError, ">= 0"),
  ("clip_zscore", {"eps": -1.0}, "eps", ValueError, ">= 0"),
  ("clip_zscore", {"warmup_steps": 0}, "warmup_steps", ValueError, ">= 1"),
  (
    "clip_zscore",
    {"warmup_steps": 2.5},
    "warmup_steps",
    ValueError,
    "whole number",
  ),
  (
    "clip_zscore",
    {"warmup_steps": 2**31},
    "warmup_steps",
    ValueError,
    "<= 2147483647 .the state counts steps in int32",
  ),
  (
    "clip_zscore",
    {"mode": "median"},
    "mode",
    ValueError,
    "one of 'zscore', 'percentile'",
  ),
  (
    "clip_zscore",
    {"clip_option": "max"},
    "clip_option",
    ValueError,
    "one of 'adaptive_scaling', 'mean'",
  ),
  ("clip_zscore", {"clip_factor": 0.0}, "clip_factor", ValueError, "> 0"),
  (
    "clip_zscore",
    {"skip_update_on_spike": "no"},
    "skip_update_on_spike",
    TypeError,
    "a bool",
  ),
  (
    "clip_zscore",
    {"scope": "layer"},
    "scope",
    ValueError,
    "one of 'global', 'leaf'",
  ),
  (
    "clip_percentile",
    {"percentile": 100.5},
    "percentile",
    ValueError,
    "<= 100",
  ),
  (
    "clip_percentile",
    {"percentile": "10"},
    "percentile",
    TypeError,
    "real number",
  ),
  ("clip_percentile", {"history": 0}, "history", ValueError, ">= 1"),
  (
    "clip_percentile",
    {"history": 2**31},
    "history",
    ValueError,
    "<= 2147483647",
  ),
  (
    "clip_percentile",
    {"history": jnp.int32(4)},
    "history",
    TypeError,
    "static_args",
  ),
  (
    "clip_percentile",
    {"scope": "tensor"},
    "scope",
    ValueError,
    "one of 'global', 'leaf'",
  ),
  (
    "clip_relative",
    {"factor": 0.5},
    "factor",
    ValueError,
    ">= 1.0 .below 1 a leaf's limit is under its own",
  ),
  ("clip_relative", {"factor": 0.0}, "factor", ValueError, ">= 1"),
  ("clip_relative", {"beta": 1.5}, "beta", ValueError, "< 1"),
  ("clip_relative", {"warmup_steps": 0}, "warmup_steps", ValueError, ">= 1"),
  (
    "clip_relative",
    {"warmup_steps": 2**31},
    "warmup_steps",
    ValueError,
    "<= 2147483647",
  ),
  (
    "clip_relative",
    {"warmup_max_norm": -1.0},
    "warmup_max_norm",
    ValueError,
    ">= 0",
  ),
  ("clip_relative", {"patience": 0}, "patience", ValueError, ">= 1"),
  ("clip_relative", {"axis_name": ""}, "axis_name", ValueError, "empty name"),
  ("clip_zscore", {"patience": 2**31}, "patience", ValueError, "<= 2147483647"),
  (
    "clip_percentile",
    {"axis_name": ("a", "a")},
    "axis_name",
    ValueError,
    "each axis once",
  ),
  (
    "guard",
    {"inner": SGD, "patience": 1.5},
    "patience",
    ValueError,
    "whole number",
  ),
  (
    "clip_per_example",
    {"l2_clip": INF, "noise_multiplier": 1.0},
    "l2_clip",
    ValueError,
    "finite when noise_multiplier > 0",
  ),
  ("clip_per_example", {"l2_clip": -1.0}, "l2_clip", ValueError, ">= 0"),
  (
    "clip_per_example",
    {"l2_clip": 1.0, "scope": "tensor"},
    "scope",
    ValueError,
    "one of 'global', 'leaf'",
  ),
  (
    "clip_per_example",
    {"l2_clip": 1.0, "reduce": "max"},
    "reduce",
    ValueError,
    "one of 'mean', 'sum'",
  ),
  (
    "clip_per_example",
    {"l2_clip": 1.0, "noise_multiplier": -0.1},
    "noise_multiplier",
    ValueError,
    ">= 0",
  ),
  (
    "clip_per_example",
    {"l2_clip": 1.0, "seed": 1.5},
    "seed",
    TypeError,
    "an int or a key",
  ),
  (
    "clip_per_example",
    {"l2_clip": 1.0, "seed": True},
    "seed",
    TypeError,
    "an int or a key",
  ),
  (
    "clip_per_example",
    {"l2_clip": 1.0, "seed": 2**32},
    "seed",
    ValueError,
    "the default PRNG keeps 32 bits",
  ),
  (
    "clip_per_example",
    {"l2_clip": 1.0, "seed": jnp.zeros(3, jnp.uint32)},
    "seed",
    TypeError,
    "a raw key of the default PRNG",
  ),
  (
    "clip_per_example",
    {"l2_clip": 1.0, "seed": jnp.float32(1.0)},
    "seed",
    TypeError,
    "an int or a key",
  ),
  (
    "clip_per_example",
    {"l2_clip": 1.0, "target_quantile": 1.5},
    "target_quantile",
    ValueError,
    "<= 1",
  ),
  (
    "clip_per_example",
    {"l2_clip": 1.0, "quantile_lr": -0.2},
    "quantile_lr",
    ValueError,
    ">= 0",
  ),
  (
    "clip_per_example",
    {"l2_clip": 1.0, "axis_name": ""},
    "axis_name",
    ValueError,
    "empty name",
  ),
  ("dp_noise", {"l2_clip": -1.0}, "l2_clip", ValueError, ">= 0"),
  (
    "dp_noise",
    {"l2_clip": 1.0, "noise_multiplier": NAN},
    "noise_multiplier",
    ValueError,
    "real number",
  ),
  (
    "dp_noise",
    {"l2_clip": 1.0, "target_quantile": -0.5},
    "target_quantile",
    ValueError,
    ">= 0",
  ),
  (
    "dp_noise",
    {"l2_clip": 1.0, "quantile_lr": "0.2"},
    "quantile_lr",
    TypeError,
    "real number",
  ),
  (
    "dp_noise",
    {"l2_clip": 1.0, "reduce": "max"},
    "reduce",
    ValueError,
    "one of 'mean', 'sum'",
  ),
  (
    "dp_noise",
    {"l2_clip": 1.0, "seed": 0.5},
    "seed",
    TypeError,
    "an int or a key",
  ),
  (
    "dp_noise",
    {"l2_clip": INF, "noise_multiplier": 1.0},
    "l2_clip",
    ValueError,
    "finite when noise_multiplier > 0",
  ),
  (
    "clipped_grad",
    {"loss_fn": 3, "l2_clip": 1.0},
    "loss_fn",
    TypeError,
    "callable",
  ),
  (
    "clipped_grad",
    {"loss_fn": LOSS, "l2_clip": -1.0},
    "l2_clip",
    ValueError,
    ">= 0",
  ),
  (
    "clipped_grad",
    {"loss_fn": LOSS, "l2_clip": 1.0, "method": "fast"},
    "method",
    ValueError,
    "one of 'ghost', 'vmap'",
  ),
  (
    "clipped_grad",
    {"loss_fn": LOSS, "l2_clip": 1.0, "reduce": "max"},
    "reduce",
    ValueError,
    "one of 'sum', 'mean'",
  ),
  (
    "clipped_grad",
    {"loss_fn": LOSS, "l2_clip": 1.0, "batch_argnums": 0},
    "batch_argnums",
    ValueError,
    "ints >= 1",
  ),
  (
    "clipped_grad",
    {"loss_fn": LOSS, "l2_clip": 1.0, "microbatch_size": 0},
    "microbatch_size",
    ValueError,
    ">= 1",
  ),
  (
    "clipped_grad",
    {"loss_fn": LOSS, "l2_clip": 1.0, "gamma": 0.0},
    "gamma",
    ValueError,
    "> 0",
  ),
  (
    "clipped_grad",
    {"loss_fn": LOSS, "l2_clip": 1.0, "has_aux": "yes"},
    "has_aux",
    TypeError,
    "a bool",
  ),
  (
    "clipped_grad",
    {"loss_fn": LOSS, "l2_clip": 1.0, "normalize": 1},
    "normalize",
    TypeError,
    "a bool",
  ),
  (
    "guard",
    {"inner": "adam"},
    "inner",
    TypeError,
    "an optax.GradientTransformation",
  ),
  (
    "guard",
    {"inner": SGD, "skip_nonfinite": 1},
    "skip_nonfinite",
    TypeError,
    "a bool",
  ),
  ("guard", {"inner": SGD, "spike_z": -1.0}, "spike_z", ValueError, "> 0"),
  (
    "guard",
    {"inner": SGD, "max_norm": NAN},
    "max_norm",
    ValueError,
    "real number",
  ),
  ("guard", {"inner": SGD, "alpha": 2.0}, "alpha", ValueError, "< 1"),
  (
    "guard",
    {"inner": SGD, "warmup_steps": 2**31},
    "warmup_steps",
    ValueError,
    "<= 2147483647",
  ),
  (
    "clipped",
    {"inner": None, "clipnorm": 1.0},
    "inner",
    TypeError,
    "an optax.GradientTransformation",
  ),
  ("clipped", {"inner": SGD, "clipnorm": -1.0}, "clipnorm", ValueError, ">= 0"),
  (
    "clipped",
    {"inner": SGD, "clipvalue": "1"},
    "clipvalue",
    TypeError,
    "real number",
  ),
  (
    "clipped",
    {"inner": SGD, "global_clipnorm": NAN},
    "global_clipnorm",
    ValueError,
    "real number",
  ),
  (
    "clipped",
    {"inner": SGD, "clipnorm": 1.0, "clipvalue": 1.0},
    "at most one of clipvalue, clipnorm and global_clipnorm",
    ValueError,
    "be given",
  ),
  # The functional API checks its arguments in the same format.
  ("global_norm", {"tree": {"w": 1.0}, "ord": 0.5}, "ord", ValueError, ">="),
  ("leaf_norms", {"tree": {"w": 1.0}, "ord": "2"}, "ord", TypeError, "real"),
  (
    "clip_by_global_norm",
    {"tree": {"w": 1.0}, "max_norm": -1.0},
    "max_norm",
    ValueError,
    ">=",
  ),
  (
    "clip_by_global_norm",
    {"tree": {"w": 1.0}, "max_norm": 1.0, "norm": NAN},
    "norm",
    ValueError,
    "",
  ),
  (
    "clip_by_norm",
    {"tree": {"w": 1.0}, "max_norm": NAN},
    "max_norm",
    ValueError,
    "",
  ),
  (
    "clip_by_value",
    {"tree": {"w": 1.0}, "min_value": 1.0, "max_value": 0.0},
    "max_value",
    ValueError,
    ">= min_value",
  ),
  ("spam", {"learning_rate": -1.0}, "learning_rate", ValueError, ">= 0"),
  ("spam", {"learning_rate": 0.1, "b1": 1.0}, "b1", ValueError, "< 1"),
  ("spam", {"learning_rate": 0.1, "eps": NAN}, "eps", ValueError, "real"),
  (
    "spam",
    {"learning_rate": 0.1, "reset_interval": 0},
    "reset_interval",
    ValueError,
    ">= 1",
  ),
  (
    "spam",
    {"learning_rate": 0.1, "warmup_steps": 1.5},
    "warmup_steps",
    ValueError,
    "whole number",
  ),
  (
    "spam",
    {"learning_rate": 0.1, "grad_accu_steps": -1},
    "grad_accu_steps",
    ValueError,
    ">= 0",
  ),
  ("clip_spikes", {"threshold": -1.0}, "threshold", ValueError, ">= 0"),
  ("clip_spikes", {"b2": "0.9"}, "b2", TypeError, "real number"),
  (
    "clip_spikes",
    {"reset_interval": None},
    "reset_interval",
    TypeError,
    "whole number",
  ),
  ("clip_spikes_adaptive", {"gamma3": 1.0}, "gamma3", ValueError, "< 1"),
  (
    "clip_spikes_adaptive",
    {"reset_interval": -2},
    "reset_interval",
    ValueError,
    ">= 1",
  ),
  ("scale_by_norm_ema", {"gamma1": -0.1}, "gamma1", ValueError, ">= 0"),
  ("scale_by_norm_ema", {"gamma2": 1.5}, "gamma2", ValueError, "< 1"),
  ("scale_by_norm_ema", {"eps": -1.0}, "eps", ValueError, ">= 0"),
  (
    "stable_spam",
    {"learning_rate": 0.1, "weight_decay": -0.1},
    "weight_decay",
    ValueError,
    ">= 0",
  ),
  (
    "stable_spam",
    {"learning_rate": 0.1, "eta_min": 2.0},
    "eta_min",
    ValueError,
    "<= 1",
  ),
  (
    "stable_spam",
    {"learning_rate": 0.1, "total_steps": 0},
    "total_steps",
    ValueError,
    ">= 1",
  ),
  (
    "stable_spam",
    {"learning_rate": 0.1, "gamma3": True},
    "gamma3",
    TypeError,
    "real number",
  ),
  (
    "stable_adamw",
    {"learning_rate": 0.1, "b2": 1.0},
    "b2",
    ValueError,
    "< 1",
  ),
  ("watch", {"leaf_stats": 1}, "leaf_stats", TypeError, "bool"),
]


def _id(case):
  name, kwargs, arg, _, _ = case
  return f"{name}-{arg}-{kwargs.get(arg.split(',')[0], '')!r}"[:60]


@pytest.mark.parametrize("case", BAD, ids=[_id(c) for c in BAD])
def test_bad_argument_fails_at_construction_in_one_format(case):
  name, kwargs, arg, error, must = case
  with pytest.raises(error) as caught:
    getattr(optaxclip, name)(**kwargs)
  message = str(caught.value)
  pattern = rf"^{re.escape(name)}: {re.escape(arg)} must .*{must}.*; got "
  assert re.search(pattern, message), message


def test_every_public_transformation_has_a_bad_argument_case():
  covered = {name for name, *_ in BAD}
  factories = {
    "clip_value",
    "clip_norm",
    "clip_global",
    "clip_block_rms",
    "clip_unitwise",
    "clip_zscore",
    "clip_percentile",
    "clip_relative",
    "clip_per_example",
    "guard",
    "clipped",
    "dp_noise",
    "clipped_grad",
    "global_norm",
    "leaf_norms",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "spam",
    "stable_spam",
    "clip_spikes",
    "clip_spikes_adaptive",
    "scale_by_norm_ema",
    "stable_adamw",
    "watch",
  }
  assert factories <= covered, factories - covered
  public = {n for n in optaxclip.__all__ if n[0].islower()}
  others = {
    "stats",
    "explain",
    "leaf_norm_table",
    "default_unit_axes",
    "upgrade_state",
  }
  assert factories | others >= public - {"__version__"}, public


# Under jit (or optax.inject_hyperparams) hyperparameters are traced: they
# are accepted unchecked, and the update runs.
TRACED = [
  ("clip_value", {"max_delta": 0.5}),
  ("clip_norm", {"max_norm": 0.5}),
  ("clip_global", {"max_norm": 0.5}),
  ("clip_block_rms", {"threshold": 0.5}),
  ("clip_unitwise", {"clipping": 0.5, "eps": 1e-3}),
  (
    "clip_zscore",
    {
      "alpha": 0.9,
      "spike_z": 2.0,
      "max_norm": 1.0,
      "eps": 1e-6,
      "warmup_steps": 2,
      "clip_factor": 1.0,
    },
  ),
  ("clip_percentile", {"percentile": 50.0}),
  (
    "clip_relative",
    {"factor": 1.5, "beta": 0.9, "warmup_steps": 2, "warmup_max_norm": 1.0},
  ),
  (
    "clip_per_example",
    {
      "l2_clip": 1.0,
      "noise_multiplier": 0.0,
      "seed": 3,
      "target_quantile": 0.5,
      "quantile_lr": 0.2,
    },
  ),
  (
    "spam",
    {
      "learning_rate": 0.1,
      "b1": 0.9,
      "b2": 0.999,
      "eps": 1e-6,
      "weight_decay": 0.1,
      "threshold": 50.0,
      "reset_interval": 4,
      "warmup_steps": 2,
      "grad_accu_steps": 1,
    },
  ),
  (
    "stable_spam",
    {
      "learning_rate": 0.1,
      "b1": 0.9,
      "b2": 0.999,
      "eps": 1e-8,
      "weight_decay": 0.1,
      "gamma1": 0.7,
      "gamma2": 0.9,
      "gamma3": 0.999,
      "total_steps": 10,
      "eta_min": 0.5,
      "reset_interval": 4,
    },
  ),
  (
    "clip_spikes",
    {"threshold": 50.0, "b2": 0.9, "reset_interval": 4, "grad_accu_steps": 1},
  ),
  ("clip_spikes_adaptive", {"gamma3": 0.9, "reset_interval": 4}),
  ("scale_by_norm_ema", {"gamma1": 0.7, "gamma2": 0.9, "eps": 1e-8}),
]


@pytest.mark.parametrize(
  "name,hyperparams", TRACED, ids=[name for name, _ in TRACED]
)
def test_traced_hyperparameters_are_accepted(name, hyperparams):
  params = {"w": jnp.ones((2, 3))}
  grads = {
    "w": jnp.full((4, 2, 3) if name == "clip_per_example" else (2, 3), 2.0)
  }
  factory = getattr(optaxclip, name)

  def step(values, grads):
    tx = factory(**values)
    updates, state = tx.update(grads, tx.init(params), params)
    return updates, optaxclip.stats(state)

  # Traced (as under jit), not compiled: the checks see tracers.
  out = jax.eval_shape(
    step, {k: jnp.asarray(v) for k, v in hyperparams.items()}, grads
  )
  assert jax.tree.structure(out[0]) == jax.tree.structure(params)


def test_guard_hyperparameters_traced():
  def step(spike_z, max_norm, alpha, warmup_steps, grads):
    tx = optaxclip.guard(
      SGD,
      spike_z=spike_z,
      max_norm=max_norm,
      alpha=alpha,
      warmup_steps=warmup_steps,
    )
    return tx.update(grads, tx.init(grads))[1].counts.skipped

  skipped = jax.eval_shape(
    step,
    jnp.float32(3.0),
    jnp.float32(1.0),
    jnp.float32(0.9),
    jnp.int32(2),
    {"w": jnp.full(3, 2.0)},
  )
  assert skipped.dtype == jnp.int32


@pytest.mark.parametrize(
  "seed",
  [
    0,
    7,
    np.int64(2**32 - 1),
    -1,
    np.array(5),
    jnp.int32(5),
    jax.random.PRNGKey(5),
    jax.random.key(5),
  ],
  ids=["0", "7", "2**32-1", "-1", "np0d", "jnp", "raw", "typed"],
)
def test_seed_may_be_an_int_or_a_key(seed):
  tx = optaxclip.clip_per_example(1.0, noise_multiplier=1.0, seed=seed)
  state = tx.init({"w": jnp.zeros(3)})
  assert state.key.dtype == jnp.uint32 and state.key.shape == (2,)
  if (
    isinstance(seed, jax.Array)
    and seed.ndim == 0
    and (jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key))
  ):
    np.testing.assert_array_equal(state.key, jax.random.PRNGKey(5))
  # The key is one the update can split (traced, not compiled: cheap).
  out, new_state = jax.eval_shape(tx.update, {"w": jnp.ones((4, 3))}, state)
  assert new_state.key.shape == (2,) and out["w"].shape == (3,)


def test_typed_key_of_another_prng_is_rejected_early():
  key = jax.random.key(0, impl="rbg")
  with pytest.raises(
    TypeError,
    match=r"^clip_per_example: seed must be an "
    r"int or a single key of the default PRNG",
  ):
    optaxclip.clip_per_example(1.0, seed=key)


def test_clip_relative_factor_one_is_the_smallest_accepted():
  optaxclip.clip_relative(1.0)
  with pytest.raises(ValueError, match=r"^clip_relative: factor must be >= 1"):
    optaxclip.clip_relative(np.nextafter(1.0, 0.0))


@pytest.mark.parametrize(
  "name",
  [
    "clip_value",
    "clip_norm",
    "clip_global",
    "clip_block_rms",
    "clip_zscore",
    "clip_percentile",
    "clip_relative",
  ],
)
def test_an_integer_leaf_is_named_when_the_update_is_traced(name):
  g = {"a": jnp.ones(2), "n": jnp.ones(2, jnp.int32)}
  tx = getattr(optaxclip, name)(
    **({"max_delta": 1.0} if name == "clip_value" else {})
    | ({"max_norm": 1.0} if name in ("clip_norm", "clip_global") else {})
    | ({"threshold": 1.0} if name == "clip_block_rms" else {})
  )
  with pytest.raises(
    TypeError,
    match=rf"^{name}: updates leaf \['n'\] must "
    r"be float or complex .*; got dtype int32\.",
  ):
    tx.update(g, tx.init(g))


@pytest.mark.parametrize(
  "name, make",
  [
    ("clip_value", lambda: optaxclip.clip_value(1.0)),
    ("clip_global", lambda: optaxclip.clip_global(1.0, ord=np.inf)),
    ("clip_norm", lambda: optaxclip.clip_norm(1.0)),
    ("clip_zscore", optaxclip.clip_zscore),
    ("clip_percentile", optaxclip.clip_percentile),
    ("guard", lambda: optaxclip.guard(optax.sgd(0.1))),
    ("clip_spikes", optaxclip.clip_spikes),
    ("clip_spikes_adaptive", optaxclip.clip_spikes_adaptive),
    ("clip_per_example", lambda: optaxclip.clip_per_example(1.0)),
  ],
)
def test_a_float8_leaf_is_named(name, make):
  # Before, a TypePromotionError from inside the norms.
  g = {"a": jnp.ones(2), "f8": jnp.ones(2, jnp.float8_e4m3fn)}
  tx = make()
  with pytest.raises(
    TypeError,
    match=rf"^{name}: (updates|params) leaf \['f8'\] must be float16, "
    r"bfloat16, "
    r"float32 or float64 .*; got dtype float8_e4m3fn\.",
  ):
    tx.update(g, tx.init(g), g)


def test_params_errors_of_clip_unitwise():
  tx = optaxclip.clip_unitwise(0.1)
  g = {"a": jnp.ones((2, 2))}
  with pytest.raises(
    ValueError,
    match=r"^clip_unitwise: params must be "
    r"given .*; got None\.",
  ):
    tx.update(g, tx.init(g))
  with pytest.raises(
    ValueError,
    match=r"^clip_unitwise: params leaf \['a'\] "
    r"must have the update's shape \(2, 2\); got \(2,\)\.",
  ):
    tx.update(g, tx.init(g), {"a": jnp.ones(2)})
