"""Every validation of optaxclip, with one message format.

Every error says which transformation and which argument, what is required
and what was given: ``"<clipper>: <argument> must ...; got ..."``.

Concrete hyperparameters (Python or NumPy numbers) are checked when a
transformation is built. JAX arrays -- traced values under ``jit`` or the
arrays that :func:`optax.inject_hyperparams` passes in -- are accepted
unchecked: reading their value would need a host transfer. Trees (updates,
params) are checked when the update is traced, naming the leaf's path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import math
import numbers
from typing import Any, Optional
import warnings

import jax
import jax.numpy as jnp
import numpy as np

# Integer hyperparameters that count steps are compared with int32 counters
# in the state: a larger value would overflow them.
INT32_MAX = 2**31 - 1


def _prefix(who: Optional[str], name: str) -> str:
  return f"{who}: {name}" if who else name


def is_concrete_number(value: Any) -> bool:
  """True for a Python or NumPy scalar whose value can be checked now."""
  if isinstance(value, jax.Array):
    return False
  if isinstance(value, np.ndarray):
    return value.ndim == 0
  return isinstance(value, (numbers.Number, np.generic))


def check_number(
  name: str,
  value: Any,
  *,
  who: Optional[str] = None,
  low: Optional[float] = None,
  high: Optional[float] = None,
  low_open: bool = False,
  high_open: bool = False,
  allow_inf: bool = False,
  integer: bool = False,
  allow_none: bool = False,
  why: str = "",
) -> None:
  """Raises a clear error when a concrete hyperparameter is out of range.

  Args:
    name: the argument's name, used in the message.
    value: the value to check. JAX arrays pass unchecked.
    who: the transformation, used in the message.
    low: smallest allowed value (or None for no bound).
    high: largest allowed value (or None for no bound).
    low_open: whether ``low`` itself is excluded.
    high_open: whether ``high`` itself is excluded.
    allow_inf: whether +inf is a valid value.
    integer: whether the value must be a whole number.
    allow_none: whether ``None`` is a valid value.
    why: appended to a range error, to say why the bound exists.

  Raises:
    TypeError: for a value that is not a real number (a string, a bool, a
      complex number, an array of several elements).
    ValueError: for NaN, an infinity that is not allowed, a non-integer where
      one is required, or a value outside the range.
  """
  arg = _prefix(who, name)
  if value is None and allow_none:
    return
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value.item()  # a 0-d bool, complex or str array is checked as such.
  if isinstance(value, jax.Array):
    if value.ndim != 0 or not is_real_dtype(value.dtype):
      raise TypeError(
        f"{arg} must be a real scalar; got an array of shape {value.shape}"
        f" and dtype {value.dtype}."
      )
    return  # traced or injected: accepted as is.
  kind = "a whole number" if integer else "a real number"
  if (
    value is None
    or isinstance(value, (bool, np.bool_))
    or not is_concrete_number(value)
  ):
    raise TypeError(f"{arg} must be {kind}; got {value!r}.")
  if isinstance(value, (complex, np.complexfloating)):
    raise TypeError(f"{arg} must be {kind}; got complex {value!r}.")
  v = float(value)
  if math.isnan(v):
    raise ValueError(f"{arg} must be {kind}; got NaN.")
  if math.isinf(v) and not (allow_inf and v > 0):
    raise ValueError(f"{arg} must be finite; got {v}.")
  if integer and not (
    isinstance(value, (numbers.Integral, np.integer)) or v.is_integer()
  ):
    raise ValueError(f"{arg} must be a whole number; got {value!r}.")
  reason = f" ({why})" if why else ""
  # Integers are compared exactly (float(2**63) rounds).
  exact = int(value) if integer else v
  if low is not None and (exact < low or (low_open and exact == low)):
    bound = f"> {low}" if low_open else f">= {low}"
    raise ValueError(f"{arg} must be {bound}{reason}; got {value!r}.")
  if high is not None and (exact > high or (high_open and exact == high)):
    bound = f"< {high}" if high_open else f"<= {high}"
    raise ValueError(f"{arg} must be {bound}{reason}; got {value!r}.")


def is_real_dtype(dtype: Any) -> bool:
  """Whether ``dtype`` holds real numbers (a float or an integer type)."""
  return bool(
    jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
  )


def _check_int32(who: str, name: str, value: Any, low: int, why: str) -> None:
  """A whole number in [low, 2**31 - 1]; ``why`` says what needs int32."""
  check_number(
    name, value, who=who, low=low, high=INT32_MAX, integer=True, why=why
  )


def check_steps(who: str, name: str, value: Any, *, low: int = 1) -> None:
  """A step count (warm-up length): a whole number in [low, 2**31 - 1].

  Traced values are accepted; the bound keeps the int32 counters of the
  state from overflowing.
  """
  _check_int32(who, name, value, low, "the state counts steps in int32")


def check_probability(
  name: str,
  value: Any,
  *,
  who: Optional[str] = None,
  open_low: bool = True,
  open_high: bool = True,
) -> None:
  """Checks a value in (0, 1) (bounds open by default)."""
  check_number(
    name,
    value,
    who=who,
    low=0.0,
    high=1.0,
    low_open=open_low,
    high_open=open_high,
  )


# Structural arguments (a norm's order, reduction axes, a buffer's length)
# shape the computation, so they cannot be traced. optax.inject_hyperparams
# turns every numeric argument -- defaults included -- into an array unless
# it is named in static_args; this hint says so.
_STATIC_HINT = (
  "it shapes the computation and cannot be traced; under "
  "optax.inject_hyperparams, name it in static_args"
)


def check_count(who: str, name: str, value: Any, *, low: int = 1) -> int:
  """A whole number that fixes the state's layout (not traceable)."""
  if isinstance(value, jax.Array):
    raise TypeError(
      f"{who}: {name} must be a Python int, not an array: "
      f"{_STATIC_HINT}=({name!r},); got {value!r}."
    )
  _check_int32(who, name, value, low, "the state indexes it with int32")
  return int(value)


def check_ord(name: str, ord: Any, *, who: Optional[str] = None) -> float:
  """Checks a norm order: any real p >= 1, or inf ('inf' accepted too).

  ``None`` stands for 2 (the Euclidean norm), as in ``numpy.linalg.norm``.
  """
  arg = _prefix(who, name)
  if ord is None:
    return 2.0
  if isinstance(ord, str) and ord.lower() in ("inf", "infinity"):
    return math.inf
  if isinstance(ord, jax.Array):
    raise TypeError(
      f"{arg} must be a Python number, not an array: "
      f"{_STATIC_HINT}=({name!r},); got {ord!r}."
    )
  check_number(name, ord, who=who, low=1.0, allow_inf=True)
  return float(ord)


def check_axis(
  name: str, axis: Any, *, who: Optional[str] = None
) -> Optional[tuple[int, ...]]:
  """Normalises ``axis`` (None, an int or a sequence of ints) to a tuple."""
  arg = _prefix(who, name)
  if axis is None:
    return None
  if isinstance(axis, jax.Array):
    raise TypeError(
      f"{arg} must be None, an int or a tuple of ints, not an "
      f"array: {_STATIC_HINT}=({name!r},); got {axis!r}."
    )
  if isinstance(axis, (bool, np.bool_)):
    raise TypeError(
      f"{arg} must be None, an int or a tuple of ints; got {axis!r}."
    )
  if isinstance(axis, (numbers.Integral, np.integer)):
    return (int(axis),)
  if (
    isinstance(axis, Sequence)
    and not isinstance(axis, str)
    and all(
      isinstance(a, (numbers.Integral, np.integer))
      and not isinstance(a, (bool, np.bool_))
      for a in axis
    )
  ):
    if len({int(a) for a in axis}) != len(axis):
      raise ValueError(f"{arg} must name each axis once; got {axis!r}.")
    return tuple(int(a) for a in axis)
  raise TypeError(
    f"{arg} must be None, an int or a tuple of ints; got {axis!r}."
  )


def leaf_axes(
  who: str, axis: Optional[tuple[int, ...]], x: Any, path: str
) -> Optional[tuple[int, ...]]:
  """``axis`` (from :func:`check_axis`) for one leaf: non-negative, sorted.

  Raises:
    ValueError: naming the leaf, when an axis is outside its rank or two
      name the same axis of it.
  """
  if axis is None:
    return None
  ndim = np.ndim(x)
  if not all(-ndim <= a < ndim for a in axis):
    raise ValueError(
      f"{who}: axis must fit every leaf; got {axis} for the "
      f"leaf {path} of shape {np.shape(x)}."
    )
  axes = tuple(sorted(a % ndim for a in axis))
  if len(set(axes)) != len(axes):
    raise ValueError(
      f"{who}: axis must name each axis of a leaf once; got "
      f"{axis} for the leaf {path} of shape {np.shape(x)}."
    )
  return axes


def check_choice(
  who: str,
  name: str,
  value: Any,
  choices: Sequence[str],
  aliases: Optional[Mapping[str, str]] = None,
) -> Any:
  """One of ``choices``; a deprecated alias is accepted with a warning.

  Returns:
    The choice, with an alias replaced by its current spelling.
  """
  aliases = aliases or {}
  if isinstance(value, str) and value in aliases:
    warnings.warn(
      f"{who}: {name}={value!r} is deprecated; write "
      f"{name}={aliases[value]!r}.",
      DeprecationWarning,
      stacklevel=4,
    )  # the caller of the (decorated) public factory.
    return aliases[value]
  if not isinstance(value, str) or value not in choices:
    options = ", ".join(repr(c) for c in choices)
    raise ValueError(f"{who}: {name} must be one of {options}; got {value!r}.")
  return value


def check_finite_with_noise(
  who: str, l2_clip: Any, noise_multiplier: Any
) -> None:
  """An infinite clip norm with noise would make infinite noise."""
  if (
    is_concrete_number(l2_clip)
    and math.isinf(float(l2_clip))
    and is_concrete_number(noise_multiplier)
    and noise_multiplier > 0
  ):
    raise ValueError(
      f"{who}: l2_clip must be finite when noise_multiplier > 0 (the noise "
      f"is noise_multiplier * l2_clip); got l2_clip={l2_clip!r} and "
      f"noise_multiplier={noise_multiplier!r}."
    )


def check_bool(who: str, name: str, value: Any) -> bool:
  """A Python (or NumPy) bool: a truthy string or number is an error."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{who}: {name} must be a bool; got {value!r}.")
  return bool(value)


def check_transformation(who: str, name: str, value: Any) -> None:
  """An ``optax.GradientTransformation`` (or anything with init and update)."""
  if not (
    callable(getattr(value, "init", None))
    and callable(getattr(value, "update", None))
  ):
    raise TypeError(
      f"{who}: {name} must be an optax.GradientTransformation "
      f"(with init and update); got {type(value).__name__}."
    )


# Seeds the default PRNG takes without folding two of them onto one key: with
# 64-bit types off, jax.random.PRNGKey keeps the low 32 bits of an int (2**32
# is seed 0 again), and a negative seed n gives the key of 2**32 + n.
_SEED_RANGE = (-(2**31), 2**32 - 1)


def check_seed(who: str, seed: Any) -> Callable[[], jax.Array]:
  """Checks a seed: an int, a raw key or a typed key of the default PRNG.

  Returns:
    A function that makes the raw key (``uint32``, as
    ``jax.random.PRNGKey``) kept in the state: the same layout whatever was
    given, so checkpoints do not depend on it.
  """
  if isinstance(seed, (jax.Array, np.ndarray)) and (
    jnp.issubdtype(seed.dtype, jax.dtypes.prng_key)
  ):
    default = jax.random.key_impl(jax.random.key(0))
    if seed.shape != () or jax.random.key_impl(seed) != default:
      raise TypeError(
        f"{who}: seed must be an int or a single key of the default PRNG "
        f"({default}); got a key array of shape {seed.shape} and "
        f"implementation {jax.random.key_impl(seed)}."
      )
    return lambda: jax.random.key_data(seed)
  if isinstance(seed, (jax.Array, np.ndarray)) and seed.ndim == 1:
    raw_shape = jax.eval_shape(jax.random.PRNGKey, 0).shape
    if seed.shape != raw_shape or seed.dtype != np.uint32:
      raise TypeError(
        f"{who}: seed must be an int or a key (a raw key of the default "
        f"PRNG is uint32 of shape {raw_shape}); got an array of shape "
        f"{seed.shape} and dtype {seed.dtype}."
      )
    return lambda: jnp.asarray(seed)
  if isinstance(seed, jax.Array):
    if seed.ndim != 0 or not jnp.issubdtype(seed.dtype, jnp.integer):
      raise TypeError(
        f"{who}: seed must be an int or a key; got an array of "
        f"shape {seed.shape} and dtype {seed.dtype}."
      )
    return lambda: jax.random.PRNGKey(seed)
  if isinstance(seed, np.ndarray) and seed.ndim == 0:
    seed = seed.item()
  if isinstance(seed, (bool, np.bool_)) or not isinstance(
    seed, (numbers.Integral, np.integer)
  ):
    raise TypeError(f"{who}: seed must be an int or a key; got {seed!r}.")
  low, high = _SEED_RANGE
  check_number(
    "seed",
    seed,
    who=who,
    low=low,
    high=high,
    integer=True,
    why="the default PRNG keeps 32 bits of it",
  )
  seed = int(seed)
  return lambda: jax.random.PRNGKey(seed)


def leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
  """Leaves of ``tree`` with readable paths (``None`` leaves are dropped)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path) or "<root>", leaf) for path, leaf in flat]


def check_float_leaves(
  tree: Any, what: str = "updates", real: bool = False
) -> None:
  """Raises TypeError naming the first leaf that is not a float or complex
  (with ``real``, not a real float), or is a float narrower than 16 bits.
  """
  for path, leaf in leaves_with_paths(tree):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
      dtype = np.asarray(leaf).dtype
    if not jnp.issubdtype(dtype, jnp.inexact):
      raise TypeError(
        f"{what} leaf {path} must be float"
        + ("" if real else " or complex")
        + " (integer parameters have no gradient: mask them out with "
        f"optax.masked); got dtype {dtype}."
      )
    _check_width(path, dtype, what)
    if real and jnp.issubdtype(dtype, jnp.complexfloating):
      raise TypeError(
        f"{what} leaf {path} must be a real float (the SPAM family's "
        "element-wise moments are defined for real gradients: mask complex "
        f"leaves out with optax.masked); got dtype {dtype}."
      )


def _check_width(path: str, dtype: Any, what: str) -> None:
  if jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize < 2:
    raise TypeError(
      f"{what} leaf {path} must be float16, bfloat16, float32 or float64 "
      "(JAX promotes no 8-bit or narrower float implicitly: cast such "
      f"leaves to bfloat16 first); got dtype {dtype}."
    )


def check_float_width(tree: Any, what: str) -> None:
  """Raises TypeError naming the first float leaf narrower than 16 bits
  (float8 and float4: no implicit promotion to the statistics' dtype);
  other leaves, integers included, pass.
  """
  for path, leaf in leaves_with_paths(tree):
    dtype = getattr(leaf, "dtype", None)
    _check_width(path, np.asarray(leaf).dtype if dtype is None else dtype, what)


def check_same_structure(
  updates: Any, params: Any, who: str, why: Optional[str] = None
) -> None:
  """Raises ValueError naming the leaf where params and updates differ, or
  saying that params are needed (``why``: what reads them).
  """
  if params is None and why is not None:
    raise ValueError(
      f"{who}: params must be passed to update ({why}); got params=None."
    )
  if params is None:
    raise ValueError(
      f"{who}: params must be given (call update(updates, state, params));"
      " got None."
    )
  u = dict(leaves_with_paths(updates))
  p = dict(leaves_with_paths(params))
  for path in u:
    if path not in p:
      raise ValueError(
        f"{who}: params must have the updates' leaves; got no leaf at {path}."
      )
    if np.shape(u[path]) != np.shape(p[path]):
      raise ValueError(
        f"{who}: params leaf {path} must have the update's shape "
        f"{np.shape(u[path])}; got {np.shape(p[path])}."
      )
  for path in p:
    if path not in u:
      raise ValueError(
        f"{who}: params must have only the updates' leaves; got one at {path}."
      )


def axis_names(axis_name: Any) -> tuple[str, ...]:
  """The names in ``axis_name`` (a name, a tuple of names or ``None``)."""
  if axis_name is None:
    return ()
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def check_axis_name(who: str, axis_name: Any) -> Any:
  """Checks ``axis_name``: ``None``, a non-empty string or a non-empty tuple
  of distinct non-empty strings. Returns it unchanged.
  """
  if axis_name is None:
    return None
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if not names or not all(isinstance(n, str) for n in names):
    raise TypeError(
      f"{who}: axis_name must be a string or a tuple of strings;"
      f" got {axis_name!r}."
    )
  if not all(names):
    raise ValueError(
      f"{who}: axis_name must not be or contain an empty "
      f"name; got {axis_name!r}."
    )
  if len(set(names)) != len(names):
    raise ValueError(
      f"{who}: axis_name must name each axis once; got {axis_name!r}."
    )
  return axis_name


def is_shard_spec(value: Any) -> bool:
  """Whether ``value`` is one leaf's entry of ``sharded`` rather than a node
  of a pytree prefix: a bool, ``None``, a ``PartitionSpec``, a string (an
  error, caught by :func:`shard_spec`) or a tuple/list of strings.
  """
  if isinstance(value, (bool, np.bool_, str, jax.sharding.PartitionSpec)):
    return True
  if value is None:
    return True
  return (
    isinstance(value, (tuple, list))
    and bool(value)
    and all(isinstance(v, str) for v in value)
  )


def shard_spec(
  who: str,
  spec: Any,
  axis_name: Any,
  where: str = "",
  ndim: Optional[int] = None,
):
  """One leaf's ``sharded`` entry, checked and normalised.

  Args:
    who: the clipper, for messages.
    spec: ``True`` (split over every axis of ``axis_name``), ``False`` or
      ``None`` (not split), a tuple of axis names, or a
      ``jax.sharding.PartitionSpec`` (which array dimension each name splits).
    axis_name: the clipper's ``axis_name``.
    where: the leaf's path, for messages.
    ndim: the leaf's rank, when known (a PartitionSpec must fit it).

  Returns:
    ``(axes, dims)``: the names the leaf is split over, in ``axis_name``'s
    order, and for a PartitionSpec the names splitting each dimension (one
    tuple per dimension, ``ndim`` of them when known), else ``None``.
  """
  names = axis_names(axis_name)
  at = f" for the leaf {where}" if where else ""
  if isinstance(spec, (bool, np.bool_)):
    return (names if spec else ()), None
  if spec is None:
    return (), None
  if isinstance(spec, str):
    raise TypeError(
      f"{who}: sharded must be a bool, a tuple of axis names or a "
      f"PartitionSpec{at}; got the string {spec!r} (write ({spec!r},) for "
      "one axis)."
    )
  if isinstance(spec, jax.sharding.PartitionSpec):
    dims = []
    for entry in spec:
      if entry is None:
        dims.append(())
      elif isinstance(entry, str):
        dims.append((entry,))
      elif isinstance(entry, tuple) and all(isinstance(e, str) for e in entry):
        dims.append(entry)
      else:
        raise TypeError(
          f"{who}: sharded{at} must be a PartitionSpec of axis "
          f"names; got {spec!r}."
        )
    if ndim is not None:
      if len(dims) > ndim:
        raise ValueError(
          f"{who}: sharded{at} must have at most the leaf's "
          f"rank ({ndim}) entries; got {spec!r}."
        )
      dims += [()] * (ndim - len(dims))
    used = [n for d in dims for n in d]
  elif isinstance(spec, (tuple, list)) and all(
    isinstance(s, str) for s in spec
  ):
    dims, used = None, list(spec)
  else:
    raise TypeError(
      f"{who}: sharded{at} must be a bool, a tuple of axis "
      f"names or a PartitionSpec; got {spec!r}."
    )
  if len(set(used)) != len(used):
    raise ValueError(
      f"{who}: sharded{at} must name each axis once; got {spec!r}."
    )
  unknown = [n for n in used if n not in names]
  if unknown:
    raise ValueError(
      f"{who}: sharded{at} must name axes of axis_name "
      f"{axis_name!r}; got {spec!r}."
    )
  axes = tuple(n for n in names if n in used)
  return axes, (None if dims is None else tuple(dims))


def check_sharded(who: str, sharded: Any, axis_name: Any) -> None:
  """Checks what can be checked of ``sharded`` before the updates are seen:
  every entry of a pytree prefix (a callable is checked per leaf later).
  """
  if callable(sharded) and not is_shard_spec(sharded):
    return
  entries = jax.tree_util.tree_leaves(sharded, is_leaf=is_shard_spec)
  if not entries and not is_shard_spec(sharded):
    return  # an empty prefix: fits an empty tree.
  for entry in [sharded] if is_shard_spec(sharded) else entries:
    if not is_shard_spec(entry):
      raise TypeError(
        f"{who}: sharded must be a bool, a tuple of axis names, "
        "a PartitionSpec, a pytree prefix of those or a "
        f"callable; got an entry {entry!r}."
      )
    shard_spec(who, entry, axis_name)


def check_sharding(who: str, axis_name: Any, sharded: Any) -> Any:
  """Checks ``axis_name`` and what can be checked of ``sharded`` before the
  updates are seen. Returns ``axis_name``.
  """
  check_axis_name(who, axis_name)
  check_sharded(who, sharded, axis_name)
  return axis_name
