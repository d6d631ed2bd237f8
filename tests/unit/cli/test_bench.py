"""``zensync bench``: flags validated before any collective (exit 2, valid names listed), the --tuning file
checked before launching, and --png without matplotlib failing (exit 1) before the measurement. No mpiexec:
``init_torch_distributed`` is replaced by a tripwire, so a test fails if the command started working."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import zensync.transport
from zensync import cli
from zensync.cli import bench
from zensync.transport.mixed import TuningEntry, TuningTable, collective_call

_SCAN = ["bench", "--scan"]


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    def tripwire(*args, **kwargs):
        raise AssertionError("zensync bench started working (joined torch.distributed) despite a bad flag")

    monkeypatch.setattr(zensync.transport, "init_torch_distributed", tripwire)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zensync bench: error: "), err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench"], "--scan is required: a scan over sizes, ops and backends is the only mode"),
        (
            [*_SCAN, "--ops", "all_reduce,all_to_all"],
            "unknown ['all_to_all']; valid: all_reduce, all_gather, reduce_scatter, broadcast",
        ),
        ([*_SCAN, "--backends", "gloo,nccl"], "unknown ['nccl']; valid: gloo, mpi, mixed"),
        ([*_SCAN, "--ops", ""], "--ops: empty; give one or more of: all_reduce"),
        ([*_SCAN, "--backends", "mpi,mpi"], "given twice"),
        ([*_SCAN, "--sizes", "8,10"], "multiple of 4"),
        ([*_SCAN, "--sizes", "0"], "multiple of 4"),
        ([*_SCAN, "--sizes", "8,8"], "distinct"),
        ([*_SCAN, "--sizes", "8,x"], "invalid literal"),
        ([*_SCAN, "--reps", "0"], "--reps 0: must be >= 1"),
        ([*_SCAN, "--timeout", "0"], "--timeout 0.0: must be > 0"),
        ([*_SCAN, "--backends", "gloo,mpi", "--tuning", "t.json"], "add mixed to --backends"),
    ],
)
def test_bad_flags_exit_2_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "zensync bench: error:" in err and message in err, err


def test_bench_help_gives_the_launch_command(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "mpiexec -n 2 python -m mpi4py -m zensync bench --scan" in out and "--tuning FILE" in out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read tuning table"),
        ("not json", "not a tuning table"),
        ('{"version": 1, "default": "nccl", "entries": []}', "names backends ['nccl']; bench has gloo and mpi"),
    ],
)
def test_bad_tuning_file_exits_2_in_one_line(content, message, tmp_path, capsys):
    path = tmp_path / "tuning.json"
    if content is not None:
        path.write_text(content)
    assert cli.main([*_SCAN, "--tuning", str(path)]) == 2
    line = _one_error_line(capsys)
    assert message in line and str(path) in line


def test_a_good_tuning_file_passes_the_checks(tmp_path):
    table = TuningTable(default="gloo", entries=(TuningEntry(op="all_reduce", backend="mpi", max_bytes=8),))
    path = tmp_path / "tuning.json"
    path.write_text(table.to_json())
    config = bench.ScanConfig(sizes=(8,), ops=("all_reduce",), backends=("mixed",), reps=1, tuning=str(path))
    assert bench._check_before_work(config) == table


def test_unwritable_output_exits_2(capsys):
    assert cli.main([*_SCAN, "-o", "/nonexistent/dir/scan"]) == 2
    assert "-o /nonexistent/dir/scan.json: directory /nonexistent/dir does not exist" in _one_error_line(capsys)


def test_png_without_matplotlib_exits_1_before_measuring(tmp_path, capsys, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a)
    )
    assert cli.main([*_SCAN, "--png", "-o", str(tmp_path / "scan")]) == 1
    assert "--png needs matplotlib (pip install 'zensync[bench]')" in _one_error_line(capsys)
    assert capsys.readouterr().out == "" and not list(tmp_path.iterdir())


def test_flags_reach_the_config():
    args = cli.build_parser().parse_args(
        [*_SCAN, "--sizes", "4096, 8", "--ops", "broadcast", "--backends", "mpi", "--reps", "2", "--png"]
    )
    config = bench._scan_config(args, args.subparser)
    expected = bench.ScanConfig(sizes=(8, 4096), ops=("broadcast",), backends=("mpi",), reps=2, png=True)
    assert config == expected
    assert config.prefix(4) == "collective_scan_p4"


def test_every_scan_op_is_one_collective_call_times():
    x = torch.ones(2)
    for op in bench.SCAN_OPS:
        assert callable(collective_call(None, op, x))  # builds the call, makes none
