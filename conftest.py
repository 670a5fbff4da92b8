"""Test-session set-up, shared by tests/ and the doctests in optaxclip/.

Eight host devices let the sharding tests run on a CPU; the flag must be set
before jax is first imported, which is why it lives here.
"""

import os

os.environ["XLA_FLAGS"] = " ".join(filter(None, (
    os.environ.get("XLA_FLAGS", ""),
    "--xla_force_host_platform_device_count=8",
)))

import hypothesis

hypothesis.settings.register_profile(
    "ci", max_examples=40, deadline=None, derandomize=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
