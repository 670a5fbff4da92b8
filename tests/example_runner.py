"""Runs a script of the checkout (an example, a benchmark) in a subprocess,
as a user would: the checkout on ``PYTHONPATH``, JAX on the CPU.
"""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_script(path, *args, cwd, timeout=600):
  """Runs ``ROOT / path`` with ``args`` in ``cwd``; returns its stdout and
  fails the test (with its output) when it exits non-zero.
  """
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    filter(None, (str(ROOT), env.get("PYTHONPATH")))
  )
  env["JAX_PLATFORMS"] = "cpu"
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
