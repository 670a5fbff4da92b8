"""Type aliases of the public signatures, in one place."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Optional, Union

import jax
from jax.typing import ArrayLike

# A hyperparameter that may be traced: a Python or NumPy number, or a JAX
# array (under jit, or from optax.inject_hyperparams).
Scalar = ArrayLike

# The mapped axis name of shard_map / pmap, a tuple of several, or None (no
# mapped axis).
AxisName = Optional[Union[str, tuple[str, ...]]]

# A norm's order: a number >= 1, "inf" (or inf), or None for 2.
Ord = Optional[Union[float, Literal["inf"]]]

# A seed: an int, or a raw or typed key of the default PRNG.
Seed = ArrayLike

# Reduction axes: one, several, or None for the whole leaf.
Axis = Optional[Union[int, Sequence[int]]]

# What a clipping unit is: the whole tree (or example), or each leaf.
Scope = Literal["global", "leaf"]

# A threshold: a number (as Scalar) or a schedule, any callable from the
# step count (an int32 scalar) to the value (an optax schedule).
ScalarOrSchedule = Union[ArrayLike, Callable[[jax.Array], ArrayLike]]
