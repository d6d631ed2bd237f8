"""Run the demo: tokenize the corpus once, start one process group per strategy, collect and compare.

Default: ``workers`` local processes on 127.0.0.1 (``zensync.testbed.LoopbackCluster``). With ``net``:
one emulated host per worker (``zensync.testbed.make_cluster``), links shaped to that rate; without
root (or iproute2/tc) it warns and falls back to loopback. Every launch runs under ``timeout_s``; a
failed or hung worker raises ``zensync.testbed.WorkerError`` with each failing rank's stderr tail.
The temp dir (corpus, config, worker outputs) belongs to the cluster's run, so a SIGKILLed demo's
leftovers are removed with the rest of the run (``python -m zensync.testbed cleanup``).

Progress: rank 0 appends one line per finished step (warm-up included) to ``<out>/progress``; the
parent calls ``on_progress(strategy, 0, steps_total)`` as it starts the workers, then, while they run,
counts the lines and calls ``on_progress(strategy, steps_done, steps_total)`` on each change.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from zensync.demo.config import DemoConfig
from zensync.demo.model import lm_config
from zensync.testbed import LoopbackCluster, free_port, make_cluster
from zensync.workloads import lm

__all__ = ["DemoResult", "ProgressFn", "StrategyRun", "default_out_dir", "run_demo"]

logger = logging.getLogger(__name__)

_BASE_PORT = 29611
"""First master port inside emulated hosts (each namespace has its own port space)."""
ProgressFn = Callable[[str, int, int], None]
"""``on_progress(strategy, steps_done, steps_total)``: steps include the warm-up steps."""
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
"""Several workers share the machine's cores: one thread each avoids oversubscription."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StrategyRun:
    """What one strategy's launch produced."""

    strategy: str
    ranks: list[dict[str, Any]]
    """Per rank: its measurements (``zensync.demo.worker.train`` without the model)."""
    params: dict[str, torch.Tensor]
    """Rank 0's final parameters."""
    wall_s: float
    """Launch wall time, process start to exit (includes startup and warm-up)."""
    interface_tx_bytes: list[int] | None
    """Per host tx byte delta of the whole launch from ``cluster.counters()`` (emulated hosts only)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DemoResult:
    """Every strategy's run, plus the setting it ran in."""

    config: DemoConfig
    runs: list[StrategyRun]
    emulated: bool
    """True when workers ran as emulated hosts on shaped links."""
    corpus_tokens: int
    corpus_words: int
    wall_s: float


def _make_cluster(config: DemoConfig, say: Callable[[str], None]) -> Any:
    if config.net is None:
        return LoopbackCluster(config.workers)
    cluster = make_cluster(config.workers, rate=config.net)
    if isinstance(cluster, LoopbackCluster):
        say(
            f"WARNING: --net {config.net} cannot be emulated here (needs root, iproute2 and tc; see the log "
            f"line above); falling back to loopback: links are NOT shaped and wire bytes are unavailable"
        )
    return cluster


class _ProgressPoll:
    """Counts the lines of a strategy's progress file and reports each new count to ``on_progress``."""

    def __init__(self, path: pathlib.Path, strategy: str, total: int, on_progress: ProgressFn | None) -> None:
        self.path, self.strategy, self.total, self.on_progress = path, strategy, total, on_progress
        self.done = 0

    def start(self) -> None:
        """Report 0 steps done (the workers are starting: bars then count startup in elapsed time)."""
        if self.on_progress is not None:
            self.on_progress(self.strategy, 0, self.total)

    def __call__(self) -> None:
        if self.on_progress is None:
            return
        try:
            done = min(self.path.read_bytes().count(b"\n"), self.total)
        except FileNotFoundError:  # rank 0 has not finished its first step yet
            return
        if done != self.done:
            self.done = done
            self.on_progress(self.strategy, done, self.total)


def _launch_one(
    cluster: Any,
    config: DemoConfig,
    strategy: str,
    paths: dict[str, pathlib.Path],
    index: int,
    on_progress: ProgressFn | None,
) -> StrategyRun:
    """Step 2 for one strategy: a fresh process group of ``workers`` processes, then read their outputs."""
    out = paths["tmp"] / strategy
    out.mkdir()
    argv = [sys.executable, "-m", "zensync.demo.worker", "--config", str(paths["config"])]
    argv += ["--strategy", strategy, "--corpus", str(paths["corpus"]), "--out", str(out)]
    argv += ["--progress", str(out / "progress")]
    port = free_port() if isinstance(cluster, LoopbackCluster) else _BASE_PORT + index
    poll = _ProgressPoll(out / "progress", strategy, config.warmup_steps + config.steps, on_progress)
    before = cluster.counters()
    started = time.monotonic()
    poll.start()
    cluster.run_workers(
        lambda r: argv,
        lambda r: {**_WORKER_ENV, **cluster.env_for_torch(r, port)},
        timeout_s=config.timeout_s,
        on_poll=poll,
    )
    wall_s = time.monotonic() - started
    poll()  # the last steps may have finished after the last look
    after = cluster.counters()
    tx = None if before is None or after is None else [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(config.workers)]
    params = torch.load(out / "params.pt")
    return StrategyRun(strategy=strategy, ranks=ranks, params=params, wall_s=wall_s, interface_tx_bytes=tx)


def run_demo(
    config: DemoConfig, say: Callable[[str], None] | None = None, on_progress: ProgressFn | None = None
) -> DemoResult:
    """Run every strategy of ``config`` in turn and return the measurements (``report`` prints and saves them).

    Step 1: tokenize the stdlib corpus once and hand the ids to the workers as a file.
    Step 2: per strategy, launch ``workers`` processes (a fresh process group) under ``timeout_s``.

    Args:
        config: The run.
        say: Prints one status line (default: to stderr).
        on_progress: Called with (strategy, steps done, steps in all) while a strategy runs.

    Raises:
        zensync.testbed.WorkerError: When a worker fails or the launch times out (each rank's stderr tail).
    """
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    started = time.monotonic()
    logger.info("zensync demo: %s", config)
    lm_cfg = lm_config(config)
    corpus = lm.load_corpus(lm_cfg)
    words = len(lm.vocabulary(lm_cfg))
    say(f"corpus: {corpus.numel():,} tokens, {words:,} distinct words (embedding rows: {config.vocab_size:,})")
    runs = []
    with _make_cluster(config, say) as cluster, cluster.temp_dir("zensync-demo-") as tmp:
        paths = {"tmp": tmp, "config": tmp / "config.json"}
        paths["corpus"] = paths["tmp"] / "corpus.pt"
        paths["config"].write_text(config.to_json())
        torch.save(corpus.clone(), paths["corpus"])
        emulated = not isinstance(cluster, LoopbackCluster)
        where = f"{config.workers} emulated hosts at {config.net}" if emulated else f"{config.workers} local processes"
        for index, strategy in enumerate(config.strategies):
            say(f"[{index + 1}/{len(config.strategies)}] {strategy}: starting on {where} ...")
            run = _launch_one(cluster, config, strategy, paths, index, on_progress)
            say(f"[{index + 1}/{len(config.strategies)}] {strategy}: done in {run.wall_s:.1f} s")
            runs.append(run)
    return DemoResult(
        config=config,
        runs=runs,
        emulated=emulated,
        corpus_tokens=int(corpus.numel()),
        corpus_words=words,
        wall_s=time.monotonic() - started,
    )


def default_out_dir() -> pathlib.Path:
    """experiments/results under the cwd if it exists, else the cwd."""
    candidate = pathlib.Path(os.getcwd()) / "experiments" / "results"
    return candidate if candidate.is_dir() else pathlib.Path(os.getcwd())
