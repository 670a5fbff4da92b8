"""Test-session set-up, shared by tests/ and the doctests in optaxclip/.

Eight host devices let the sharding tests run on a CPU; the flag must be set
before jax is first imported, which is why it lives here. The suite runs
with JAX's standard dtype promotion: optax.adam fails under "strict" (its bias
correction raises a float to an int32 power), so tests/test_strict_dtypes.py
audits the clippers alone under strict promotion.
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
  filter(
    None,
    (
      os.environ.get("XLA_FLAGS", ""),
      "--xla_force_host_platform_device_count=8",
    ),
  )
)

import hypothesis

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
hypothesis.settings.register_profile(
  "release",
  max_examples=1000,
  deadline=None,
  derandomize=False,
  suppress_health_check=[
    hypothesis.HealthCheck.too_slow,
    hypothesis.HealthCheck.data_too_large,
  ],
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(items):
  """Long tests first: those marked ``slow`` (a big compile or a
  subprocess), then the fuzz suite's properties, then the rest (many short
  tests and the doctests). pyproject's ``--dist load`` hands the tests out
  to the xdist workers in this order, so the last ones each worker runs are
  short and no worker waits long for the other at the end.
  """

  def rank(item):
    if item.get_closest_marker("slow"):
      return 0
    return 1 if item.path.name.startswith("test_fuzz") else 2

  items.sort(key=rank)  # stable: each group keeps pytest's order
