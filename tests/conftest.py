"""Suite-wide test configuration: the Hypothesis profiles, the markers each folder implies, and the slow tier.

Hypothesis profiles (pick one with ``--hypothesis-profile=NAME``; ``zensync`` is loaded by default):

- ``zensync``: no deadline (numba compiles on first call, and the machine may be shared), health check
  ``too_slow`` off (inputs are large on purpose), and ``print_blob``: a failure prints the
  ``@reproduce_failure`` line that replays it on any clone. Examples are random, so repeated runs
  cover more inputs; a property test may fail only when the code is wrong.
- ``zensync-derandomized``: the same, with the examples a function of each test alone (every clone
  and every run draw the same ones).

Example counts are set per test through ``tests.strategies.examples`` and multiplied by the
environment variable ``ZENSYNC_HYPOTHESIS_SCALE`` (e.g. 20 for a thorough run).

Markers come from the folder (``_FOLDER_MARKERS``): every test under ``tests/distributed/`` is marked
``distributed``, under ``tests/emulated/`` ``emulated``, under ``tests/property/`` ``property`` and under
``tests/gpu/`` ``gpu``; test files do not repeat them. Inside each tier, ``tests/<tier>/<package>/`` holds the
tests of ``zensync.<package>``. Marks that say something about one test (``slow``, ``exhaustive``,
``netns``, a ``skipif``) stay on the test.

Slow tier: the tests marked ``slow`` (the large variants of tests whose small form runs in the default
tier, e.g. the world-size-4 run of a distributed class), ``emulated`` (``tests/emulated``: the CUDA
kernels compiled for CPU threads, and again under ThreadSanitizer and AddressSanitizer: 20 minutes on
2 cores when every build is cold, a sanitized build alone 5-7) or ``exhaustive`` (full matrices, e.g.
every strategy x fault in ``tests/distributed/hooks/test_faults.py``, about 4 minutes) are deselected
unless the ``-m`` expression names one of their markers, so that ``python -m pytest`` stays fast.
``.ci/run`` runs them after the README's command (``-m emulated tests/emulated``, ``-m exhaustive
tests``, ``-m slow tests``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

_TESTS_DIR = Path(__file__).resolve().parent
_FOLDER_MARKERS = {"distributed": "distributed", "emulated": "emulated", "property": "property", "gpu": "gpu"}
"""Top-level folder of tests/ -> the marker every test in it gets."""
_SLOW_TIER_MARKERS = ("slow", "emulated", "exhaustive")
"""A test with any of these markers runs only when ``-m`` names one of its markers."""

settings.register_profile("zensync", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("zensync-derandomized", settings.get_profile("zensync"), derandomize=True)
# Loaded while pytest starts, before any test module builds its settings on the default profile;
# hypothesis's own --hypothesis-profile option, when given, is applied later and wins.
settings.load_profile("zensync")


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark each test by its top-level folder as it is collected, before ``-m`` selects tests."""
    try:
        folder = Path(item.path).resolve().relative_to(_TESTS_DIR).parts[0]
    except ValueError:  # not under tests/
        return
    marker = _FOLDER_MARKERS.get(folder)
    if marker is not None:
        item.add_marker(marker)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the slow tier's tests unless ``-m`` names one of their markers (``-m slow``, ``-m emulated``,
    ``-m "exhaustive or ..."``; ``-m "not slow"`` names ``slow`` and then deselects those tests itself)."""
    named = set(re.findall(r"\w+", config.option.markexpr or "")) & set(_SLOW_TIER_MARKERS)
    slow = [
        item
        for item in items
        if (markers := {m for m in _SLOW_TIER_MARKERS if item.get_closest_marker(m) is not None})
        and not markers & named
    ]
    if slow:
        config.hook.pytest_deselected(items=slow)
        slow_ids = {id(item) for item in slow}
        items[:] = [item for item in items if id(item) not in slow_ids]
