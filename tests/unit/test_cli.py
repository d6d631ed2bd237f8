"""The ``zensync`` CLI: help everywhere, the ``demo`` flag set pinned to DemoConfig, bad values rejected."""

from __future__ import annotations

import dataclasses
import json

import pytest

from zensync import cli
from zensync.cli import demo as cli_demo
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


@pytest.mark.parametrize(
    "argv", [["--help"], ["demo", "--help"], ["plan", "--help"], ["explain", "--help"], ["profile", "--help"]]
)
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
    assert cli_demo._demo_config(args) == DemoConfig()


def test_demo_flags_reach_the_config():
    argv = ["demo", "--workers", "2", "--steps", "7", "--strategies", "ddp", "zen", "--net", "100mbit"]
    argv += ["--timeout", "30", "--lr", "0.5", "--out-dir", "/tmp/x"]
    config = cli_demo._demo_config(cli.build_parser().parse_args(argv))
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
    assert cli_demo._demo_config(args) == config


# -- plan / explain / profile -----------------------------------------------------------------------
_PLAN_ARGS = ["--nodes", "2", "--gpus-per-node", "4", "--inter-bw", "10Gbit", "--compressor", "dgc:0.01"]


def _subparser(name):
    return cli.build_parser()._subparsers._group_actions[0].choices[name]


def test_plan_and_profile_flags_are_pinned():
    from zensync.cli import plan as cli_plan
    from zensync.cli import profile as cli_profile

    for name, pinned in (("plan", set(cli_plan.PLAN_FLAGS)), ("profile", set(cli_profile.PROFILE_FLAGS))):
        parser = _subparser(name)
        flags = {s for action in parser._actions for s in action.option_strings if s.startswith("--")} - {"--help"}
        assert flags == pinned, name


def test_plan_writes_a_plan_that_explain_renders(tmp_path, capsys):
    from zensync.planner import Plan

    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", "resnet50", *_PLAN_ARGS, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = Plan.from_json(out.read_text())
    assert plan.model == "resnet50" and len(plan.tensors) == 161 and plan.profile is not None
    assert plan.predicted.plan_s <= min(plan.predicted.fp32_s, plan.predicted.fp16_s)
    assert f"plan {plan.predicted.plan_s * 1e3:.2f} ms" in printed
    assert cli.main(["explain", str(out), "--width", "60"]) == 0
    explained = capsys.readouterr().out
    assert "comm |" in explained and f"iteration {plan.predicted.plan_s * 1e3:.3f} ms" in explained


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "resnet5"], "not a built-in profile"),
        (["--model", "resnet50", "--gpu", "P100"], "P100"),
        (["--model", "resnet50", "--inter-bw", "10Gbot"], "unknown unit"),
        (["--model", "resnet50", "--compressor", "topkk:0.1"], "unknown compressor"),
        (["--model", "resnet50", "--compressor", "topk:2"], "ratio"),
        (["--model", "resnet50", "--nodes", "0"], "nodes"),
        (["--model", "resnet50", "--compressor", "powersgd:4"], "cannot be planned"),
    ],
)
def test_bad_plan_values_exit_2(argv, message, capsys):
    defaults = dict(zip(_PLAN_ARGS[::2], _PLAN_ARGS[1::2], strict=True))
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        defaults[flag] = value
    full = [x for kv in defaults.items() for x in kv]
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", *full])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not valid JSON"),
        ('{"version": 2}', "version 2"),
        ('{"version": 1, "model": "m"}', "missing field"),
        ("[]", "JSON object"),
    ],
)
def test_explain_rejects_malformed_plans(tmp_path, capsys, content, message):
    path = tmp_path / "plan.json"
    path.write_text(content)
    assert cli.main(["explain", str(path)]) == 1
    assert message in capsys.readouterr().err


def test_explain_missing_file_exits_1(tmp_path, capsys):
    assert cli.main(["explain", str(tmp_path / "nope.json")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_profile_then_plan_from_the_profile(tmp_path, capsys):
    out = tmp_path / "profile.json"
    argv = ["profile", "--model", "mlp", "--iterations", "3", "--warmup", "1", "--batch", "8"]
    argv += ["--compressors", "topk:0.01", "--sizes", "1024,8192", "--repeats", "2", "-o", str(out)]
    assert cli.main(argv) == 0
    assert "profiled mlp: 8 tensors" in capsys.readouterr().out
    bundle = json.loads(out.read_text())
    assert bundle["version"] == 1 and set(bundle["compressor_costs"]) == {"topk:0.01"}
    assert set(bundle["compressor_costs"]["topk:0.01"]) == {"cpu_compress", "cpu_decompress"}
    plan_path = tmp_path / "plan.json"
    flags = ["--nodes", "2", "--inter-bw", "1Gbit", "--compressor", "topk:0.01", "-o", str(plan_path)]
    assert cli.main(["plan", "--profile", str(out), *flags]) == 0
    from zensync.planner import Plan

    plan = Plan.from_json(plan_path.read_text())
    assert plan.model == "mlp" and set(plan.costs) == {"cpu_compress", "cpu_decompress"}
    assert [t.name for t in plan.tensors][-1] == "0.0.weight"  # the first layer's gradient is ready last


def test_profile_bad_factory_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["profile", "--factory", "no_such_module:make"])
    assert exc.value.code == 2
    assert "no_such_module" in capsys.readouterr().err


def test_demo_accepts_compressor_specs():
    config = cli_demo._demo_config(cli.build_parser().parse_args(["demo", "--strategies", "ddp", "topk:0.01"]))
    assert config.strategies == ("ddp", "topk:0.01")
    with pytest.raises(ValueError, match="compressor spec"):
        DemoConfig(strategies=("ddp", "topk:2"))
