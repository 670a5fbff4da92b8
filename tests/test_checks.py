"""Every bad argument of every public function gets one clear error,
``"<clipper>: <argument> must ...; got ..."``, when the transformation is
built; traced hyperparameters are accepted unchecked.
"""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import optaxclip


def test_per_example_layer_scope_is_a_deprecated_alias_of_leaf():
  tree = {"w": jnp.array([[3.0, 4.0], [0.3, 0.4]]), "b": jnp.ones((2, 1))}
  with pytest.warns(DeprecationWarning,
                    match=r"clip_per_example: scope='layer' is deprecated"):
    old = optaxclip.clip_per_example(1.0, scope="layer")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    new = optaxclip.clip_per_example(1.0, scope="leaf")
  params = {"w": jnp.zeros(2), "b": jnp.zeros(1)}
  out_old, _ = old.update(tree, old.init(params))
  out_new, _ = new.update(tree, new.init(params))
  for a, b in zip(np.asarray(out_old["w"]), np.asarray(out_new["w"])):
    assert a == b


def test_deprecation_warning_points_at_the_caller_and_is_given_once():
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tx = optaxclip.clip_per_example(1.0, scope="layer")
    tx.update({"w": jnp.ones((2, 3))}, tx.init({"w": jnp.zeros(3)}))
  assert len(caught) == 1, [str(w.message) for w in caught]
  assert caught[0].filename == __file__
