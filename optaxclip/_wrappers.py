"""Keras-style clipping arguments for any optax optimizer."""

from __future__ import annotations

from typing import Optional

import optax

from optaxclip import _checks
from optaxclip import _schedules
from optaxclip import _static
from optaxclip._typing import ScalarOrSchedule


def clipped(
  inner: optax.GradientTransformation,
  *,
  clipvalue: Optional[ScalarOrSchedule] = None,
  clipnorm: Optional[ScalarOrSchedule] = None,
  global_clipnorm: Optional[ScalarOrSchedule] = None,
) -> optax.GradientTransformation:
  """Returns ``inner`` with Keras-style gradient clipping chained before it.

  The JAX spelling of ``keras.optimizers.Adam(clipnorm=1.0)`` and of
  ``tf.contrib.estimator.clip_gradients_by_norm(optimizer, clip_norm)``:
  ``clipvalue`` clips each element (:func:`clip_value`), ``clipnorm`` each
  tensor (:func:`clip_norm`), ``global_clipnorm`` the whole tree
  (:func:`clip_global`). As in Keras, at most one may be given; with none,
  ``inner`` is returned unchanged.

  Args:
    inner: the optimizer (any ``optax.GradientTransformation``).
    clipvalue: the element-wise limit (a number or a schedule, ``step ->
      value``), or None.
    clipnorm: the per-tensor L2 norm limit (a number or a schedule), or
      None.
    global_clipnorm: the global L2 norm limit (a number or a schedule), or
      None.

  Returns:
    ``optax.chain(clipper, inner)``, whose state's first entry holds the
    clipper's statistics (see :func:`stats`).

  Raises:
    ValueError: when more than one kind of clipping is given.
    TypeError: when ``inner`` is not a gradient transformation.

  References:
    Keras 3 ``Optimizer`` arguments ``clipvalue``, ``clipnorm`` and
    ``global_clipnorm``.

  Example:
    >>> import jax.numpy as jnp, optax, optaxclip
    >>> tx = optaxclip.clipped(optax.sgd(1.0), global_clipnorm=1.0)
    >>> params = {"w": jnp.zeros(2)}
    >>> updates, _ = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(params))
    >>> updates["w"]
    Array([-0.6, -0.8], dtype=float32)
  """
  _checks.check_transformation("clipped", "inner", inner)
  given = {
    name: value
    for name, value in (
      ("clipvalue", clipvalue),
      ("clipnorm", clipnorm),
      ("global_clipnorm", global_clipnorm),
    )
    if value is not None
  }
  if len(given) > 1:
    raise ValueError(
      "clipped: at most one of clipvalue, clipnorm and global_clipnorm must"
      f" be given, as Keras requires; got {', '.join(sorted(given))}."
    )
  if not given:
    return inner
  name, value = next(iter(given.items()))
  _schedules.check("clipped", name, value, low=0.0, allow_inf=True)
  clipper = {
    "clipvalue": _static.clip_value,
    "clipnorm": _static.clip_norm,
    "global_clipnorm": _static.clip_global,
  }[name]
  return optax.chain(clipper(value), inner)
