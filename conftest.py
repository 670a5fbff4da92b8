"""Test-session set-up, shared by tests/ and the doctests in optaxclip/.

Eight host devices let the sharding tests run on a CPU; the flag must be set
before jax is first imported, which is why it lives here. The suite runs
with JAX's standard dtype promotion: optax.adam fails under "strict" (its bias
correction raises a float to an int32 power), so tests/test_strict_dtypes.py
audits the clippers alone under strict promotion.

The suite compiles with tests/fast_compile.py's options (LLVM's
optimisations and XLA:CPU's fusion emitters off; the HLO passes, and so the
programs' structure, collectives and memory, as users get them), passed as
``XLA_FLAGS``: that takes about 40% off its time. What users' default
compilation gives is checked by the doctests that .ci/run runs against the
installed wheel (outside this conftest) and, before a release, by
``OPTAXCLIP_TEST_COMPILE=default python -m pytest``.
"""

import collections
import gc
import os
import pathlib
import subprocess
import sys

import hypothesis

# Fewer garbage collections in the test processes (Python's defaults are
# 700, 10, 10): tracing and compiling build millions of short-lived objects,
# and the jit caches keep a heap that every full collection walks again; at
# the defaults the collector took about 8% of the fuzz suite's CPU time
# (gc.callbacks), at these about 3%. Only when a collection runs changes:
# pytest still collects at the end of the session for its unraisable-
# exception check, and nothing in optaxclip depends on it.
gc.set_threshold(10_000, 50, 100)

_FAST_FLAGS = "_OPTAXCLIP_TEST_FAST_XLA_FLAGS"  # found once, for the workers


def _fast_compile_flags() -> str:
  """tests/fast_compile.py's options that this jaxlib knows, as
  ``XLA_FLAGS`` words (an unknown flag there would abort the process, so a
  subprocess asks; once per session: xdist's workers inherit the answer).
  """
  if os.environ.get("OPTAXCLIP_TEST_COMPILE", "fast") != "fast":
    return ""
  if _FAST_FLAGS not in os.environ:
    tests = pathlib.Path(__file__).resolve().parent / "tests"
    probe = subprocess.run(
      [
        sys.executable,
        "-c",
        "import fast_compile; print(fast_compile.xla_flags())",
      ],
      cwd=tests,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
      capture_output=True,
      text=True,
      check=False,
    )
    words = probe.stdout.split() if probe.returncode == 0 else []
    os.environ[_FAST_FLAGS] = " ".join(w for w in words if w.startswith("--"))
  return os.environ[_FAST_FLAGS]


os.environ["XLA_FLAGS"] = " ".join(
  filter(
    None,
    (
      os.environ.get("XLA_FLAGS", ""),
      "--xla_force_host_platform_device_count=8",
      _fast_compile_flags(),
    ),
  )
)

hypothesis.settings.register_profile(
  "ci",
  max_examples=40,
  deadline=None,
  derandomize=True,
  suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
# Release checks: many more examples, a fresh random seed each run, and the
# draws the ci profile narrows to fixed layouts drawn freely
# (tests/fuzz_strategies.py: examples, ci_or); hours, not a minute.
# HYPOTHESIS_PROFILE=release python -m pytest tests/test_fuzz*.py
# OPTAXCLIP_RELEASE_EXAMPLES=n sets another count (a shorter pass first).
hypothesis.settings.register_profile(
  "release",
  max_examples=int(os.environ.get("OPTAXCLIP_RELEASE_EXAMPLES", "1000")),
  deadline=None,
  derandomize=False,
  suppress_health_check=[
    hypothesis.HealthCheck.too_slow,
    hypothesis.HealthCheck.data_too_large,
  ],
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_sessionfinish(session):
  """One full collection at the end, then the survivors frozen: pytest's
  unraisable-exception check collects twice more when the session closes,
  each pass over a heap of compiled programs (a second or more a process);
  the first pass here already runs every finaliser under pytest's hook (so
  an exception in one is still reported), and the later passes only look
  at what is newer.
  """
  del session
  gc.collect()
  gc.freeze()


# The fuzz suite's longest files, longest first (seconds of one process's
# `python -m pytest -n 0 --durations=0 tests/test_fuzz*.py`, summed by
# file): handed out first, they start on different workers, and the
# short files fill in around them. An order only: a file missing here runs
# after these, those with more tests first.
LONGEST_FUZZ_FILES = (
  "test_fuzz_ghost_memory.py",
  "test_fuzz.py",
  "test_fuzz_numerics.py",
  "test_fuzz_sharding.py",
  "test_fuzz_edges.py",
  "test_fuzz_adaptive.py",
)


def pytest_collection_modifyitems(items):
  """The order of the tests, and so of the files that pyproject's ``--dist
  loadfile --no-loadscope-reorder`` hands to the xdist workers (a file is
  one unit, in the order of its first test here: the programs its tests
  share are compiled by one worker only).

  Long tests first, so that the last units each worker runs are short and
  neither waits long for the other at the end: the tests marked ``slow`` (a
  big compile, a subprocess), and so their files; then the fuzz suite's
  files, the longest (:data:`LONGEST_FUZZ_FILES`) first, then those with
  more tests first; then the other files, those with more tests first; the
  doctests last.
  """

  def module(item):
    return item.path.name

  counts = collections.Counter(module(item) for item in items)

  def rank(item):
    if item.get_closest_marker("slow"):
      return (0, 0)
    if module(item) in LONGEST_FUZZ_FILES:
      return (1, LONGEST_FUZZ_FILES.index(module(item)))
    if module(item).startswith("test_fuzz"):
      return (1, len(LONGEST_FUZZ_FILES), -counts[module(item)])
    if module(item).startswith("test_"):
      return (2, -counts[module(item)])
    return (3, 0)  # doctests

  items.sort(key=rank)  # stable: within a rank, pytest's order
