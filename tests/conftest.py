"""Shared test settings: bounded hypothesis runs so the suite fits CI's budget."""
from hypothesis import HealthCheck, settings

# The Triton interpreter is slow and timing on shared CI machines is noisy: no deadlines,
# few examples. `HYPOTHESIS_PROFILE=thorough` runs many more (e.g. natively on a GPU).
settings.register_profile("ci", max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(__import__("os").environ.get("HYPOTHESIS_PROFILE", "ci"))
