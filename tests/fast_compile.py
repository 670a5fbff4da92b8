"""Cheap compilation for test programs that run once or twice.

Skipping LLVM's optimisations and XLA CPU's fusion emitters halves the
compile time of the large test programs here, and one LLVM module a
program (not one split for compile threads) takes about a fifth off what is
left; the HLO passes (sharding propagation, SPMD partitioning, collective
combining) run as usual, so the collectives a test counts are those users
get. An option this jaxlib does not know is dropped (falling back to the
default compilation).
:func:`xla_flags` passes the same options to a script run in a subprocess.
"""

import functools

import jax

OPTIONS = {
  "xla_backend_optimization_level": 0,
  "xla_llvm_disable_expensive_passes": True,
  "xla_cpu_use_fusion_emitters": False,
  # One LLVM module a program, not split into parts compiled on threads:
  # the same optimised HLO for about a fifth less compile CPU, and the test
  # processes (one per core under xdist) have no idle core to lend those
  # threads.
  "xla_cpu_parallel_codegen_split_count": 1,
}


@functools.cache
def known_options():
  """The :data:`OPTIONS` this jaxlib knows (a trivial program compiled with
  them; those it rejects are dropped).
  """
  options = dict(OPTIONS)
  while True:
    try:
      jax.jit(lambda: 0).lower().compile(options)
      return options
    except jax.errors.JaxRuntimeError as err:
      unknown = [k for k in options if f"'{k}'" in str(err)]
      if "No such compile option" not in str(err) or not unknown:
        raise
      for k in unknown:
        del options[k]


def compile_fast(lowered):
  """``lowered.compile()`` with :data:`OPTIONS` (those this jaxlib knows)."""
  return lowered.compile(dict(known_options()))


def xla_flags():
  """:func:`known_options` as ``XLA_FLAGS`` words, for a subprocess."""
  return " ".join(f"--{k}={str(v).lower()}" for k, v in known_options().items())


def run_fast(fn, *args):
  """``jax.jit(fn)(*args)``, compiled with :func:`compile_fast`."""
  return compile_fast(jax.jit(fn).lower(*args))(*args)
