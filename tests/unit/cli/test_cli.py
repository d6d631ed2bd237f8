"""The ``zensync`` CLI: help everywhere, the ``demo`` flag set pinned to DemoConfig, bad values rejected,
bad paths rejected in one line before any work, the exit-status rule, and what the demo reports and writes."""

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
    "--out",
    "--timeout",
}
"""The pinned flag set of ``zensync demo`` (besides --help); adding a flag means adding a DemoConfig field."""


def _demo_parser():
    parser = cli.build_parser()
    return parser._subparsers._group_actions[0].choices["demo"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["demo", "--help"],
        ["plan", "--help"],
        ["explain", "--help"],
        ["profile", "--help"],
        ["bench", "--help"],
        ["simulate", "--help"],
        ["launch", "--help"],
        ["agent", "--help"],
    ],
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


def test_plan_profile_tune_and_bench_flags_are_pinned():
    from zensync.cli import bench as cli_bench
    from zensync.cli import launch as cli_launch
    from zensync.cli import plan as cli_plan
    from zensync.cli import profile as cli_profile
    from zensync.cli import simulate as cli_simulate
    from zensync.cli import tune as cli_tune

    for name, pinned in (
        ("plan", set(cli_plan.PLAN_FLAGS)),
        ("profile", set(cli_profile.PROFILE_FLAGS)),
        ("tune", set(cli_tune.TUNE_FLAGS)),
        ("bench", set(cli_bench.BENCH_FLAGS)),
        ("simulate", set(cli_simulate.SIMULATE_FLAGS)),
        ("launch", set(cli_launch.LAUNCH_FLAGS)),
        ("agent", set(cli_launch.AGENT_FLAGS)),
    ):
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
    assert cli.main(["explain", str(path)]) == 2  # a file named on the command line: a usage error
    err = _one_error_line(capsys, "explain")
    assert message in err and str(path) in err


def test_explain_missing_file_exits_2(tmp_path, capsys):
    assert cli.main(["explain", str(tmp_path / "nope.json")]) == 2
    assert "cannot read plan" in _one_error_line(capsys, "explain")


def test_profile_then_plan_from_the_profile(tmp_path, capsys):
    out = tmp_path / "profile.json"
    argv = ["profile", "--model", "mlp", "--iterations", "3", "--warmup", "1", "--batch", "8"]
    argv += ["--compressors", "topk:0.01", "--sizes", "1024,8192", "--repeats", "2", "-o", str(out)]
    assert cli.main(argv) == 0
    assert "profiled mlp: 8 tensors" in capsys.readouterr().out
    bundle = json.loads(out.read_text())
    assert bundle["version"] == 1 and set(bundle["compressor_costs"]) == {"topk:0.01"}
    # A CPU model compresses on the CPU it trains on: the "gpu" (training device) options are priced
    # with the same measurement as the offloaded ones.
    measured = bundle["compressor_costs"]["topk:0.01"]
    assert set(measured) == {"gpu_compress", "gpu_decompress", "cpu_compress", "cpu_decompress"}
    assert measured["gpu_compress"] == measured["cpu_compress"]
    plan_path = tmp_path / "plan.json"
    flags = ["--nodes", "2", "--inter-bw", "1Gbit", "--compressor", "topk:0.01", "-o", str(plan_path)]
    assert cli.main(["plan", "--profile", str(out), *flags]) == 0
    from zensync.planner import Plan

    plan = Plan.from_json(plan_path.read_text())
    assert plan.model == "mlp" and set(plan.costs) == set(measured)
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


# -- exit statuses and paths ------------------------------------------------------------------------
def _one_error_line(capsys, command):
    """The single stderr line of a failed command (no usage, no traceback)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"zensync {command}: error: "), err
    return lines[0]


def test_help_documents_the_exit_statuses(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "exit status:" in out and "1  the command failed while running" in out and "2  usage error" in out


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    return path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--model", "resnet50", *_PLAN_ARGS, "-o", "/nonexistent/dir/p.json"], "does not exist"),
        (["plan", "--model", "resnet50", *_PLAN_ARGS, "-o", "{file}/p.json"], "is not a directory"),
        (["plan", "--model", "resnet50", *_PLAN_ARGS, "-o", "{dir}"], "is a directory"),
        (["plan", "--profile", "{dir}/missing.json", *_PLAN_ARGS], "cannot read profile"),
        (["plan", "--profile", "{file}", *_PLAN_ARGS], "is not valid JSON"),
        (["explain", "{dir}/missing.json"], "cannot read plan"),
        (["explain", "{plan}", "--png", "/nonexistent/dir/t.png"], "does not exist"),
        (["profile", "--model", "mlp", "-o", "/nonexistent/dir/p.json"], "does not exist"),
        (["profile", "--model", "mlp", "-o", "{file}/p.json"], "is not a directory"),
        (["demo", "--out", "/nonexistent/dir/run"], "does not exist"),
        (["demo", "--out-dir", "{file}/results"], "is not a directory"),
    ],
)
def test_bad_paths_exit_2_in_one_line_before_any_work(argv, message, tmp_path, a_file, capsys, monkeypatch):
    from zensync.cli import demo as demo_cli
    from zensync.cli import profile as profile_cli

    def no_work(*args, **kwargs):
        raise AssertionError("the command started working despite a bad path")

    monkeypatch.setattr(demo_cli, "run_demo", no_work)
    monkeypatch.setattr(profile_cli, "measure_compressor_costs", no_work)
    plan_path = tmp_path / "plan.json"
    if "{plan}" in argv:
        assert cli.main(["plan", "--model", "resnet50", *_PLAN_ARGS, "-o", str(plan_path)]) == 0
        capsys.readouterr()
    argv = [a.format(file=a_file, dir=tmp_path, plan=plan_path) for a in argv]
    assert cli.main(argv) == 2
    assert message in _one_error_line(capsys, argv[0])
    assert capsys.readouterr().out == ""


def test_demo_out_and_out_dir_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--out", "x", "--out-dir", "y"])
    assert exc.value.code == 2
    assert "give one" in capsys.readouterr().err


def test_a_write_that_fails_after_the_work_exits_1(tmp_path, capsys, monkeypatch):
    from zensync.cli import plan as plan_cli

    monkeypatch.setattr(plan_cli, "check_output_file", lambda path, flag: None)  # e.g. the disk filled up meanwhile
    assert cli.main(["plan", "--model", "resnet50", *_PLAN_ARGS, "-o", str(tmp_path / "gone" / "p.json")]) == 1
    assert "cannot write" in _one_error_line(capsys, "plan")


def test_explain_png_without_matplotlib_exits_1(tmp_path, capsys, monkeypatch):
    import importlib.util

    plan_path = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", "resnet50", *_PLAN_ARGS, "-o", str(plan_path)]) == 0
    capsys.readouterr()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a)
    )
    assert cli.main(["explain", str(plan_path), "--png", str(tmp_path / "t.png")]) == 1
    assert "needs matplotlib" in _one_error_line(capsys, "explain")


@pytest.mark.parametrize(
    ("error", "message"),
    [("worker", "a worker failed"), ("runtime", "command failed (exit 1): ip netns add")],
)
def test_demo_runtime_failures_exit_1(error, message, capsys, monkeypatch):
    from zensync.testbed import WorkerError

    def fail(*args, **kwargs):
        if error == "worker":
            raise WorkerError("workers failed; failing ranks: [1]", [])
        raise RuntimeError("command failed (exit 1): ip netns add zs1-1-sw")

    monkeypatch.setattr(cli_demo, "run_demo", fail)
    assert cli.main(["demo", "--workers", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zensync demo: error: ") and message in err and "Traceback" not in err


# -- what the demo reports and where it writes ------------------------------------------------------
def _step(counts, step_time_s=0.01):
    return {
        "step_time_s": step_time_s,
        "comm_time_s": 0.005,
        "bytes_sent": 1000.0,
        "loss": 2.0,
        "scheme_counts": counts,
    }


def _result(tmp_path, **config):
    import torch

    from zensync.demo.runner import DemoResult, StrategyRun

    def run(strategy, counts):
        steps = [_step(c) for c in counts]
        ranks = [{"rank": r, "steps": steps, "wire_tx_bytes": None} for r in range(2)]
        return StrategyRun(
            strategy=strategy, ranks=ranks, params={"w": torch.zeros(2)}, wall_s=1.0, interface_tx_bytes=None
        )

    compressed = "compress:topk:0.01|allgather|flat"
    runs = [
        run("ddp", [{"dense": 7}, {"dense": 7}]),
        run("zen", [{"zen": 1, "dense": 6}, {"zen": 1, "dense": 6}]),
        run("topk:0.01", [{"dense": 7}, {compressed: 7}]),
    ]
    cfg = DemoConfig(workers=2, steps=2, strategies=("ddp", "zen", "topk:0.01"), **config)
    return DemoResult(config=cfg, runs=runs, emulated=False, corpus_tokens=10, corpus_words=5, wall_s=3.0)


def test_the_table_shows_which_schemes_ran(tmp_path):
    from zensync.demo.report import format_table, summarize

    rows = {row["strategy"]: row for row in summarize(_result(tmp_path))}
    assert rows["ddp"]["scheme_shares"] == {"dense": 1.0}
    assert rows["zen"]["scheme_shares"] == pytest.approx({"dense": 6 / 7, "zen": 1 / 7})
    table = format_table(list(rows.values()), emulated=False)
    lines = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "schemes (share of param-steps)" in lines["strategy"]
    assert lines["ddp"].endswith("| dense 100% |") and lines["zen"].endswith("| dense 86% / zen 14% |")
    assert lines["topk:0.01"].endswith("| topk:0.01 (allgather, flat) 50% / dense 50% |")
    assert {line.count("|") for line in lines.values()} == {lines["strategy"].count("|")}  # no stray cell


@pytest.mark.parametrize("strategy", ["ddp+sparse", "auto+sparse", "zen+sparse", "agsparse+sparse"])
def test_demo_takes_sparse_embedding_strategies(strategy):
    from zensync.demo.config import DemoConfig, split_strategy

    assert DemoConfig(strategies=(strategy,)).strategies == (strategy,)
    assert split_strategy(strategy) == (strategy.removesuffix("+sparse"), True)


@pytest.mark.parametrize("strategy", ["fp16+sparse", "topk:0.01+sparse", "nope+sparse", "ddp+sparse+sparse"])
def test_demo_refuses_sparse_variants_it_cannot_run(strategy):
    from zensync.demo.config import DemoConfig

    with pytest.raises(ValueError, match=r"unknown .*\+sparse"):
        DemoConfig(strategies=(strategy,))


def test_meters_count_parameters_per_scheme():
    from types import SimpleNamespace

    from zensync.demo.meter import TorchHookMeter, ZenSyncMeter

    torch_meter = TorchHookMeter(hook=None, world_size=2, wire_bytes_per_element=2, scheme="fp16")
    torch_meter.num_params = 5
    assert torch_meter.pop_step()["scheme_counts"] == {"fp16": 5}
    assert torch_meter.pop_step()["scheme_counts"] == {"fp16": 0}
    torch_meter.num_params, torch_meter.num_sparse = 3, 1  # a sparse-gradient bucket: torch's sparse allreduce
    assert torch_meter.pop_step()["scheme_counts"] == {"fp16": 2, "torch_sparse": 1}
    params = {
        "emb": {"scheme": "zen", "bytes_sent": 10},
        "fc.weight": {"scheme": "dense"},
        "fc.bias": {"scheme": "dense"},
    }
    last = {"comm_time_s": 0.1, "bytes_sent": 50, "params": params}
    state = SimpleNamespace(step=1, last_step=lambda: last)
    record = ZenSyncMeter(state).pop_step()
    assert record["scheme_counts"] == {"zen": 1, "dense": 2} and record["schemes"]["emb"] == "zen"


def test_results_are_never_overwritten_without_out(tmp_path):
    from zensync.demo.report import format_table, summarize, write_outputs

    result = _result(tmp_path, out_dir=str(tmp_path / "results"))
    rows = summarize(result)
    written = [write_outputs(result, rows, format_table(rows, False)) for _ in range(3)]
    names = [paths["json"].name for paths in written]
    assert len(set(names)) == 3 and names[1].endswith("_2.json") and names[2].endswith("_3.json")
    assert all(json.loads(paths["json"].read_text())["summary"] for paths in written)
    (tmp_path / "results" / names[2].replace("_3.json", "_4.md")).write_text("someone else's")
    assert write_outputs(result, rows, "")["json"].name.endswith("_5.json")  # any of .json/.md/.png taken


def test_out_names_the_files_and_replaces_them(tmp_path):
    from zensync.demo.report import summarize, write_outputs

    for out in (tmp_path / "run", tmp_path / "run.json"):
        result = _result(tmp_path, out=str(out))
        paths = write_outputs(result, summarize(result), "TABLE")
        assert paths["json"] == tmp_path / "run.json" and paths["md"] == tmp_path / "run.md"
        assert "TABLE" in paths["md"].read_text()
    plotted = ["run.png"] if "png" in paths else []  # with matplotlib installed (the [bench] extra)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "run.md", *plotted]
    args = cli.build_parser().parse_args(["demo", "--out", "x/run"])
    assert cli_demo._demo_config(args).out == "x/run"


# -- progress -----------------------------------------------------------------------------------------
def test_progress_bars_are_quiet_without_a_terminal(capsys):
    from zensync.cli._progress import DemoProgress

    with DemoProgress() as progress:
        progress("ddp", 1, 4)
        progress("ddp", 4, 4)
    assert capsys.readouterr().err == ""


def test_progress_bar_per_strategy_on_a_terminal(capsys, monkeypatch):
    from zensync.cli import _progress

    monkeypatch.setattr(_progress, "interactive", lambda: True)
    with _progress.DemoProgress() as progress:
        progress.say("[1/2] ddp: starting")
        progress("ddp", 2, 4)
        progress("ddp", 4, 4)
        progress.say("[1/2] ddp: done")
        progress("zen", 1, 4)
    err = capsys.readouterr().err
    assert "ddp: 100%" in err and "4/4" in err and "zen:  25%" in err and "1/4" in err
    # the status line starts a row of its own: the bar was closed (newline) before it
    assert "\n[1/2] ddp: done" in err


def test_runner_polls_rank0_progress_file(tmp_path):
    from zensync.demo.runner import _ProgressPoll

    seen = []
    poll = _ProgressPoll(tmp_path / "progress", "zen", 3, lambda *args: seen.append(args))
    poll.start()
    poll()  # no file yet
    (tmp_path / "progress").write_text("0\n1\n")
    poll()
    poll()  # unchanged: no call
    (tmp_path / "progress").write_text("0\n1\n2\n3\n")  # never past the total
    poll()
    assert seen == [("zen", 0, 3), ("zen", 2, 3), ("zen", 3, 3)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[" * 100_000 + "]" * 100_000, "MAX_JSON_DEPTH"),
        ('{"profile": {}, "compressor_costs": []}', "compressor_costs"),
        ('{"profile": {}, "compressor_costs": {"topk:0.01": {"cpu_compress": {"seconds": "1"}}}}', "compressor_costs"),
        ('{"profile": {}, "extra": 1}', "unknown field"),
    ],
)
def test_plan_rejects_malformed_profiles_in_one_line(content, message, tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(content)
    assert cli.main(["plan", "--profile", str(path), *_PLAN_ARGS]) == 2
    assert message in _one_error_line(capsys, "plan")


def test_tune_refuses_bad_sizes_before_any_collective(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["tune", "--sizes", "8,-1"])
    assert exit_info.value.code == 2
    assert "--sizes must be positive byte counts" in capsys.readouterr().err
