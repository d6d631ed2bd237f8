"""How much of a training step the embedding's sync can save: the demo's LM with its embedding frozen.

Launch (from the repository root, as root; without root it falls back to loopback and says so)::

    python experiments/sparse_training_floor.py                 # 4 hosts at 1gbit, ~2 min on 2 cores

Runs the demo's LM (``zensync demo``'s defaults) on the emulated cluster, one fresh process group
per variant, through the demo's own worker (``zensync.demo.worker.train``):

* ``ddp+sparse``: ``nn.Embedding(sparse=True)``, DDP's own sparse allreduce (torch's path);
* ``zen+sparse`` / ``zen``: zensync's hook on the sparse COO gradient / on the dense gradient with
  row hints;
* ``frozen``: DDP with the embedding's weight frozen (``requires_grad=False``): no embedding
  gradient is computed or synced at all, so its step time bounds from below what any way of syncing
  the embedding can reach. ``ddp+sparse`` / ``frozen`` is the largest speedup over torch's sparse path
  that a faster embedding sync could give in this setting.

Median step time of the slowest rank over the timed steps, per variant. Results:
``experiments/results/sparse_training_floor_<cluster>_<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile

import torch

from zensync.demo import worker as demo_worker
from zensync.demo.config import DemoConfig
from zensync.demo.model import DemoModel, lm_config
from zensync.testbed import EmulatedCluster, make_cluster
from zensync.transport import launch
from zensync.workloads import lm

_PORT = 29581
_VARIANTS = {"ddp+sparse": "ddp+sparse", "zen+sparse": "zen+sparse", "zen": "zen", "frozen": "ddp"}


class _FrozenEmbedding(DemoModel):
    """The demo's model with its embedding frozen: no embedding gradient, nothing of it to sync."""

    def __init__(self, config: DemoConfig, *, generator: torch.Generator, sparse_embedding: bool = False) -> None:
        super().__init__(config, generator=generator, sparse_embedding=sparse_embedding)
        self.embedding.weight.requires_grad_(False)


def worker(args: argparse.Namespace) -> None:
    config = DemoConfig(steps=args.steps, warmup_steps=args.warmup)
    rank, world_size = launch.init_from_env("gloo", timeout_s=300)
    torch.set_num_threads(1)
    try:
        if args.variant == "frozen":
            demo_worker.DemoModel = _FrozenEmbedding  # type: ignore[misc]
        corpus = torch.load(args.corpus)
        result = demo_worker.train(config, _VARIANTS[args.variant], corpus, rank, world_size)
        result.pop("model")
        times = [s["step_time_s"] for s in result["steps"]]
        pathlib.Path(args.out, f"{args.variant}_rank{rank}.json").write_text(json.dumps(times))
        launch.barrier()
    finally:
        launch.destroy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--results-dir", default=str(pathlib.Path(__file__).parent / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    forwarded = list(argv if argv is not None else sys.argv[1:])
    medians: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, make_cluster(args.hosts, rate=args.rate) as cluster:
        corpus_path = pathlib.Path(tmp, "corpus.pt")
        torch.save(lm.load_corpus(lm_config(DemoConfig())).clone(), corpus_path)
        for index, variant in enumerate(_VARIANTS):
            cmd = [sys.executable, os.path.abspath(__file__), *forwarded, "--worker", "--variant", variant]
            cmd += ["--corpus", str(corpus_path), "--out", tmp]
            port = _PORT + index

            def argv_for(rank: int, cmd: list[str] = cmd) -> list[str]:
                return cmd

            def env_for(rank: int, port: int = port) -> dict[str, str]:
                return {**cluster.env_for_torch(rank, port), "OMP_NUM_THREADS": "1"}

            cluster.run_workers(argv_for, env_for, timeout_s=600)
            ranks = [json.loads(pathlib.Path(tmp, f"{variant}_rank{r}.json").read_text()) for r in range(args.hosts)]
            medians[variant] = statistics.median(max(r[i] for r in ranks) for i in range(args.steps))
        label = f"netns{args.hosts}x{args.rate}" if isinstance(cluster, EmulatedCluster) else f"loopback{args.hosts}"
    date = datetime.date.today().isoformat()
    command = " ".join(["python", "experiments/sparse_training_floor.py", *forwarded])
    bound = medians["ddp+sparse"] / medians["frozen"]
    lines = [
        f"# The demo's LM: how much the embedding's sync can save ({label}, {date})",
        "",
        f"Command: `{command}`; {args.hosts} hosts, {args.steps} timed steps after {args.warmup}; "
        "median of the slowest rank's step time.",
        "",
        "| variant | step ms | ddp+sparse / this |",
        "|---|---|---|",
    ]
    lines += [f"| {v} | {t * 1e3:.1f} | {medians['ddp+sparse'] / t:.2f} |" for v, t in medians.items()]
    lines += [
        "",
        f"With the embedding frozen (nothing of it computed or synced) the step is {bound:.2f}x faster than "
        "torch's sparse path: no way of syncing the embedding can beat ddp+sparse by more here.",
    ]
    out_dir = pathlib.Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"sparse_training_floor_{label}_{date}"
    stem.with_suffix(".json").write_text(json.dumps({"command": command, "step_s": medians, "bound": bound}, indent=2))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
