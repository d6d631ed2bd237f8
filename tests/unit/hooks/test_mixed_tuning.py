"""``HookConfig.tuning`` (transport="mixed"): read from a table or file, checked against the group size."""

from __future__ import annotations

from pathlib import Path

import pytest

from zensync.hooks.config import HookConfig
from zensync.hooks.runtime import load_tuning
from zensync.transport import TuningTable
from zensync.transport.mixed import TuningEntry

TABLE = TuningTable(default="gloo", entries=(TuningEntry(op="all_reduce", backend="mpi", max_bytes=64),), world_size=2)


def test_tuning_is_only_for_the_mixed_transport() -> None:
    with pytest.raises(ValueError, match="tuning is the routing of transport='mixed'; transport='torch' has none"):
        HookConfig(tuning=TABLE)
    assert HookConfig(transport="mixed", tuning=TABLE).tuning is TABLE
    with pytest.raises(ValueError, match="transport='nccl' is not one of torch, mpi, mixed"):
        HookConfig(transport="nccl")


def test_a_file_from_zensync_tune_loads_as_the_same_table(tmp_path: Path) -> None:
    path = tmp_path / "tuning.json"
    path.write_text(TABLE.to_json())
    assert load_tuning(path, 2) == TABLE
    assert load_tuning(str(path), 2) == TABLE
    assert load_tuning(TABLE, 2) is TABLE
    assert load_tuning(None, 2) is None


def test_a_table_of_another_group_size_or_no_table_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"measured on 2 ranks, this group has 4; .* -n 4 .*zensync tune"):
        load_tuning(TABLE, 4)
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 2}')
    with pytest.raises(ValueError, match="not a tuning table: version 2, expected 1"):
        load_tuning(bad, 2)
    with pytest.raises(FileNotFoundError):
        load_tuning(tmp_path / "missing.json", 2)
