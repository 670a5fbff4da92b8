"""Runs a script of the checkout (an example, a benchmark) in a subprocess,
as a user would: the checkout on ``PYTHONPATH``, JAX on the CPU; or loads it
as a module, its folder on ``sys.path`` as when it runs.

The scripts' tests check what they print, not how fast they run: the
subprocess compiles cheaply, with tests/fast_compile.py's options as
``XLA_FLAGS`` (an example's CPU time halves).
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import fast_compile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_script(path, *args, cwd, timeout=600):
  """Runs ``ROOT / path`` with ``args`` in ``cwd``; returns its stdout and
  fails the test (with its output) when it exits non-zero.
  """
  env = dict(os.environ)
  paths = (str(ROOT), env.get("PYTHONPATH"))
  env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
  env["JAX_PLATFORMS"] = "cpu"
  flags = env.get("XLA_FLAGS", "").split()
  flags += [w for w in fast_compile.xla_flags().split() if w not in flags]
  env["XLA_FLAGS"] = " ".join(flags)
  result = subprocess.run(
    [sys.executable, str(ROOT / path), *args],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout


def load_script(path):
  """``ROOT / path`` as a module, its folder on ``sys.path`` while it loads
  (as when it runs: the examples import ``_flags``, the benchmarks their
  harness).
  """
  path = ROOT / path
  spec = importlib.util.spec_from_file_location(path.stem, path)
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  saved = list(sys.path)
  sys.path.insert(0, str(path.parent))
  try:
    spec.loader.exec_module(module)
  finally:
    sys.path[:] = saved
  return module
