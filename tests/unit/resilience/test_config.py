"""``CheckpointConfig`` refuses settings that cannot work, naming the field and the bound."""

from __future__ import annotations

import pytest

from zensync.resilience import CheckpointConfig


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"replicas": -1}, "replicas=-1"),
        ({"replicate_every": 4, "max_lag_steps": 2}, "max_lag_steps=2 must be >= replicate_every - 1 = 3"),
        ({"audit_rows": -1}, "audit_rows=-1"),
        ({"keep": 1}, "keep=1"),
        ({"dcp_every": 5}, "needs dcp_dir"),
    ],
)
def test_bad_settings_are_refused(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CheckpointConfig(**fields)


def test_a_lag_bound_that_rounds_can_meet_is_taken() -> None:
    assert CheckpointConfig(replicate_every=4, max_lag_steps=3).max_lag_steps == 3
