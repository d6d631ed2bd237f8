"""The ``zensync`` CLI: help everywhere, the ``demo`` flag set pinned to DemoConfig, bad values rejected."""

from __future__ import annotations

import dataclasses

import pytest

from zensync import cli
from zensync.demo import DemoConfig

_DEMO_FLAGS = {
    "--workers",
    "--steps",
    "--warmup-steps",
    "--vocab-size",
    "--output-vocab-size",
    "--embed-dim",
    "--hidden-size",
    "--batch-size",
    "--seq-len",
    "--corpus-bytes",
    "--lr",
    "--strategies",
    "--net",
    "--latency-s",
    "--bandwidth-bytes-per-s",
    "--seed",
    "--out-dir",
    "--timeout",
}
"""The pinned flag set of ``zensync demo`` (besides --help); adding a flag means adding a DemoConfig field."""


def _demo_parser():
    parser = cli.build_parser()
    return parser._subparsers._group_actions[0].choices["demo"]


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"]])
def test_help_exits_zero(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0
    assert "usage: zensync" in capsys.readouterr().out


def test_no_command_is_an_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_demo_flags_are_pinned():
    parser = _demo_parser()
    flags = {s for action in parser._actions for s in action.option_strings if s.startswith("--")} - {"--help"}
    assert flags == _DEMO_FLAGS
    assert set(cli.DEMO_FLAGS) == _DEMO_FLAGS


def test_demo_flags_map_one_to_one_onto_config_fields():
    parser = _demo_parser()
    dests = {action.dest for action in parser._actions if action.dest not in ("help", "run", "subparser")}
    fields = {f.name for f in dataclasses.fields(DemoConfig)}
    assert dests == fields
    assert sorted(cli.DEMO_FLAGS.values()) == sorted(fields)


def test_demo_defaults_are_the_config_defaults():
    args = cli.build_parser().parse_args(["demo"])
    assert cli._demo_config(args) == DemoConfig()


def test_demo_flags_reach_the_config():
    argv = ["demo", "--workers", "2", "--steps", "7", "--strategies", "ddp", "zen", "--net", "100mbit"]
    argv += ["--timeout", "30", "--lr", "0.5", "--out-dir", "/tmp/x"]
    config = cli._demo_config(cli.build_parser().parse_args(argv))
    assert config.workers == 2 and config.steps == 7 and config.strategies == ("ddp", "zen")
    assert config.net == "100mbit" and config.timeout_s == 30.0 and config.lr == 0.5 and config.out_dir == "/tmp/x"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "0"], "workers=0"),
        (["--workers", "two"], "invalid int value"),
        (["--net", "10zbit"], "zbit"),
        (["--strategies", "ddp", "nope"], "unknown"),
        (["--strategies", "zen", "zen"], "twice"),
        (["--steps", "0"], "steps=0"),
        (["--warmup-steps", "-1"], "warmup_steps=-1"),
        (["--output-vocab-size", "60000"], "output_vocab_size=60000"),
        (["--timeout", "0"], "timeout_s=0"),
        (["--lr", "-1"], "lr=-1"),
        (["--latency-s", "0"], "latency_s=0"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_demo_values_exit_nonzero_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "zensync demo: error:" in err or "zensync: error:" in err
    assert message in err


def test_config_round_trips_through_json():
    config = DemoConfig(workers=3, strategies=("ddp", "auto"), net="1gbit")
    assert DemoConfig.from_json(config.to_json()) == config


def test_union_length_counts_overlaps_once():
    from zensync.demo.meter import union_length

    assert union_length([]) == 0.0
    assert union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0
    assert union_length([(0.0, 5.0), (1.0, 2.0)]) == 5.0


def test_net_without_emulation_warns_and_falls_back(monkeypatch):
    from zensync.demo import runner
    from zensync.testbed import LoopbackCluster

    monkeypatch.setattr(runner, "make_cluster", lambda n, rate: LoopbackCluster(n))
    said = []
    cluster = runner._make_cluster(DemoConfig(workers=2, net="1gbit"), said.append)
    assert isinstance(cluster, LoopbackCluster)
    assert len(said) == 1 and "WARNING" in said[0] and "NOT shaped" in said[0]


def test_report_flags_reproduce_the_config():
    from zensync.demo.report import _flags
    from zensync.demo.runner import DemoResult

    config = DemoConfig(workers=2, strategies=("ddp", "zen"), net="1gbit", timeout_s=30.0)
    result = DemoResult(config=config, runs=[], emulated=True, corpus_tokens=0, corpus_words=0, wall_s=0.0)
    args = cli.build_parser().parse_args(["demo", *_flags(result).split()])
    assert cli._demo_config(args) == config
