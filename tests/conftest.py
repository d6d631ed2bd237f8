"""Suite-wide test configuration: the Hypothesis profiles and the slow tier.

Hypothesis profiles (pick one with ``--hypothesis-profile=NAME``; ``zensync`` is loaded by default):

- ``zensync``: no deadline (numba compiles on first call, and the machine may be shared), health check
  ``too_slow`` off (inputs are large on purpose), and ``print_blob``: a failure prints the
  ``@reproduce_failure`` line that replays it on any clone. Examples are random, so repeated runs
  cover more inputs; a property test may fail only when the code is wrong.
- ``zensync-derandomized``: the same, with the examples a function of each test alone (every clone
  and every run draw the same ones).

Example counts are set per test through ``tests.strategies.examples`` and multiplied by the
environment variable ``ZENSYNC_HYPOTHESIS_SCALE`` (e.g. 20 for a thorough run).

Slow tier: the tests marked ``emulated`` (``tests/emulated``: the CUDA kernels compiled for CPU
threads, and again under ThreadSanitizer and AddressSanitizer, about 5 minutes on 2 cores) or
``exhaustive`` (full matrices, e.g. every strategy x fault in ``tests/distributed/test_faults.py``,
about 4 minutes) are deselected unless the ``-m`` expression names their marker, so that
``python -m pytest`` stays fast. ``.ci/run`` runs them after the README's command
(``-m emulated tests/emulated``, ``-m exhaustive tests``).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

_SLOW_TIER_MARKERS = ("emulated", "exhaustive")

settings.register_profile("zensync", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("zensync-derandomized", settings.get_profile("zensync"), derandomize=True)
# Loaded while pytest starts, before any test module builds its settings on the default profile;
# hypothesis's own --hypothesis-profile option, when given, is applied later and wins.
settings.load_profile("zensync")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect each slow-tier marker's tests unless ``-m`` names it (``-m emulated``, ``-m "exhaustive or ..."``)."""
    expression = config.option.markexpr or ""
    skipped = [marker for marker in _SLOW_TIER_MARKERS if marker not in expression]
    slow = [item for item in items if any(item.get_closest_marker(marker) is not None for marker in skipped)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        slow_ids = {id(item) for item in slow}
        items[:] = [item for item in items if id(item) not in slow_ids]
