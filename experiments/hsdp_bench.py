"""HSDP on the emulated cluster: torch's native HSDP against zensync's, on the demo's LM (issue 17 item 6).

2 emulated nodes x 2 ranks: each node is a network namespace whose two ranks talk over its loopback
(unshaped: the fast intra-node link) and whose one veth to the switch is shaped to ``--rate`` (the
inter-node link; its counters give the inter-node bytes). The mesh is (replicate=nodes,
shard=ranks per node): FSDP shards inside a node, the replicas sync across nodes.

Strategies, each training the same seeded demo LM on the same batches:

    native      ``fully_shard(model, mesh=mesh2d)``: torch's HSDP (reduce-scatter in the node, then
                an all-reduce of every shard over the replicas, dense)
    auto        ``fully_shard(model, mesh=mesh["shard"])`` + ``zensync.register_fsdp(model, "auto",
                mesh=mesh2d)``: lossless; the embedding's shard syncs over the replicas by Zen (its
                non-zero rows only), the rest in one all-reduce
    floor       FSDP inside each node and no replica sync at all: the step's compute and intra-node
                floor (the replicas drift apart: its loss and parameters mean nothing)
    zen         as auto with Zen named for the replicas (auto's choice between the sparse schemes
                may differ: at 2 replicas, allgather of the rows sends less than Eq. 1's Zen)
    <spec>      the same with a compressor for the non-embedding parameters' replica sync
    plan        the same with the plan ``zensync plan`` makes for this cluster from ``zensync
                profile --model lm`` (its compressor per parameter, dense where it chose none)

Reported per strategy: step time (max over ranks per step, median over steps), inter-node bytes per
step (both nodes' veth tx), final loss (mean of the last 3 steps over ranks), largest parameter
difference from native, and for zensync the embedding's replica bytes per step (zensync's count)
against Eq. 1 for the replica group (``zensync.cost.sparse.predict_bytes``, from each step's measured
rows and union), and the veths' bytes over zensync's count of all its inter-node bytes (the dense
all-reduce's as a ring's): headers and gloo's own messages on top of the payload.

    python experiments/hsdp_bench.py                     # 1gbit: native floor auto zen powersgd:4 plan, 3 rounds
    python experiments/hsdp_bench.py --strategies native auto --steps 6

Needs root for the namespaces (else loopback, unshaped: the numbers then mean nothing for the wire).
Writes experiments/results/hsdp_<label>_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _counters import fenced_tx
from _results import versions, write

import zensync
from zensync.cost.sparse import TensorShape, measured_union, predict_bytes
from zensync.demo.config import DemoConfig
from zensync.demo.model import DemoModel, batch, lm_config
from zensync.testbed import EmulatedCluster, make_cluster, parse_rate
from zensync.workloads import lm

_PORT = 29731
EMBEDDING = "embedding.weight"


def _build(strategy: str, config: DemoConfig, mesh: Any, plan: str | None) -> tuple[nn.Module, Any]:
    """The seeded demo LM under ``strategy``: (model, zensync state or None)."""
    from torch.distributed.fsdp import fully_shard

    model = DemoModel(config, generator=torch.Generator().manual_seed(config.seed))
    sharding = mesh if strategy == "native" else mesh["shard"]
    for child in (model.embedding, model.lstm, model.decoder):
        fully_shard(child, mesh=sharding)
    fully_shard(model, mesh=sharding)
    if strategy in ("native", "floor"):  # floor: no replica sync at all (replicas drift: a time floor only)
        return model, None
    spec = plan if strategy == "plan" else strategy
    assert spec is not None
    return model, zensync.register_fsdp(model, strategy=spec, mesh=mesh)


def _train(strategy: str, args: argparse.Namespace, corpus: torch.Tensor, mesh: Any) -> dict[str, Any]:
    config = DemoConfig()
    model, state = _build(strategy, config, mesh, args.plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    rank = dist.get_rank()
    steps, tx_start = [], 0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            tx_start = fenced_tx(args.iface)
        inputs, targets = batch(corpus, config, rank, step)
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        dist.barrier()
        record: dict[str, Any] = {"loss": float(loss), "step_s": time.perf_counter() - start}
        if state is not None:
            last = state.last_step()["params"][EMBEDDING]
            keys = ("path", "replica", "replica_scheme", "replica_bytes", "replica_rows", "replica_union")
            record["embedding"] = {k: last.get(k) for k in keys}
            # What zensync sends across nodes: the replica syncs (the reduce-scatter stays in the node).
            record["inter_node_bytes"] = sum(r.get("replica_bytes") or 0 for r in state.last_step()["params"].values())
        if step >= args.warmup:
            steps.append(record)
    tx = fenced_tx(args.iface) - tx_start
    params = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    return {"steps": steps, "tx": tx, "params": params}


def worker(args: argparse.Namespace) -> None:
    """One rank: every strategy in turn on the (replicate, shard) mesh; writes rank<r>.pt."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.ranks_per_host, args.ranks_per_host),
                            mesh_dim_names=("replicate", "shard"))  # fmt: skip
    corpus = torch.load(args.corpus)
    out: dict[str, Any] = {}
    for round_ in range(args.rounds):  # the order alternates: no strategy always runs first or last
        for strategy in args.strategies if round_ % 2 == 0 else reversed(args.strategies):
            run = _train(strategy, args, corpus, mesh)
            if strategy in out:
                out[strategy]["steps"] += run["steps"]
                out[strategy]["tx"] += run["tx"]
            else:
                out[strategy] = run
    torch.save(out, pathlib.Path(args.out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _eq1_bytes(runs: list[dict[str, Any]], replicas: int, config: DemoConfig) -> list[float]:
    """Per step: Eq. 1's bytes for the embedding's replica syncs, summed over every replica group.

    Each shard's replica group (one rank per node) syncs that shard's rows: Eq. 1 (with the pull's
    smallest encoding) from the ranks' measured non-zero rows and the union the sync saw.
    """
    rows_per_shard = -(-config.vocab_size // (len(runs) // replicas))
    out = []
    for i in range(len(runs[0]["steps"])):
        total = 0.0
        for shard in range(len(runs) // replicas):
            group = [runs[node * (len(runs) // replicas) + shard]["steps"][i]["embedding"] for node in range(replicas)]
            nnz = statistics.mean(g["replica_rows"] for g in group)
            union = group[0]["replica_union"]
            shape = TensorShape(
                world_size=replicas, num_items=rows_per_shard, item_bytes=4 * config.embed_dim, index_bytes=4, nnz=nnz
            )
            total += replicas * predict_bytes("zen", shape, measured_union(shape, union / nnz if nnz else 1.0))
        out.append(total)
    return out


def _summarize(args: argparse.Namespace, ranks: list[dict[str, Any]], rate_bits: int | None) -> dict[str, Any]:
    config = DemoConfig()
    replicas = len(ranks) // args.ranks_per_host
    table: dict[str, Any] = {}
    for strategy in args.strategies:
        runs = [r[strategy] for r in ranks]
        count = len(runs[0]["steps"])
        step_s = [max(run["steps"][i]["step_s"] for run in runs) for i in range(count)]
        last = [s["loss"] for run in runs for s in run["steps"][-3:]]
        hosts_tx = sum(run["tx"] for run in runs[:: args.ranks_per_host])  # one counter per node
        row: dict[str, Any] = {
            "step_s_median": statistics.median(step_s),
            "step_s": step_s,
            "inter_node_bytes_per_step": hosts_tx / count,
            "wire_s_per_step": hosts_tx / count / replicas * 8 / rate_bits if rate_bits else None,
            "final_loss": statistics.mean(last),
        }
        if "embedding" in runs[0]["steps"][0]:
            measured = [sum(run["steps"][i]["embedding"]["replica_bytes"] or 0 for run in runs) for i in range(count)]
            eq1 = _eq1_bytes(runs, replicas, config)
            row["embedding_replica_bytes_per_step"] = statistics.mean(measured)
            row["embedding_eq1_bytes_per_step"] = statistics.mean(eq1)
            row["embedding_over_eq1"] = statistics.mean(m / e for m, e in zip(measured, eq1, strict=True))
            engine = statistics.mean(sum(run["steps"][i]["inter_node_bytes"] for run in runs) for i in range(count))
            row["engine_inter_node_bytes_per_step"] = engine
            row["veth_over_engine"] = row["inter_node_bytes_per_step"] / engine if engine else None
            row["embedding_records"] = [[s["embedding"] for s in run["steps"]] for run in runs]
            row["embedding_eq1_bytes"] = eq1
            last_record = runs[0]["steps"][-1]["embedding"]
            row["embedding_paths"] = [last_record["path"], last_record["replica"], last_record["replica_scheme"]]
        table[strategy] = row
    if "native" in table:
        native_params = ranks[0]["native"]["params"]
        for strategy, row in table.items():
            row["speedup_vs_native"] = table["native"]["step_s_median"] / row["step_s_median"]
            row["loss_vs_native"] = row["final_loss"] / table["native"]["final_loss"] - 1
            params = ranks[0][strategy]["params"]
            row["max_param_diff_vs_native"] = max(float((params[n] - native_params[n]).abs().max()) for n in params)
    return table


def _markdown(meta: dict[str, Any], table: dict[str, Any]) -> str:
    lines = [
        f"# HSDP on the emulated cluster: {meta['label']} ({meta['date']})",
        "",
        f"`{meta['command']}`: {meta['hosts']} nodes x {meta['ranks_per_host']} ranks, inter-node {meta['rate']}, "
        f"{meta['rounds']} rounds of {meta['steps']} timed steps after {meta['warmup']}; "
        f"demo LM (vocab {meta['vocab']}, dim {meta['dim']}). "
        f"Plan: {meta.get('plan_summary')}.",
        "",
        "| strategy | step s (median) | x native | inter-node MB/step | wire s/step | final loss | loss vs native "
        "| max param diff | embedding replica KB/step | Eq. 1 KB | / Eq. 1 | veth / zensync's count |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in table.items():
        emb = r.get("embedding_replica_bytes_per_step")
        lines.append(
            f"| {name} | {r['step_s_median']:.3f} | {r.get('speedup_vs_native', float('nan')):.2f} | "
            f"{r['inter_node_bytes_per_step'] / 1e6:.2f} | "
            f"{'' if r['wire_s_per_step'] is None else format(r['wire_s_per_step'], '.3f')} | {r['final_loss']:.4f} | "
            f"{100 * r.get('loss_vs_native', 0):+.2f} % | {r.get('max_param_diff_vs_native', 0):.2e} | "
            f"{'' if emb is None else format(emb / 1e3, '.1f')} | "
            f"{'' if emb is None else format(r['embedding_eq1_bytes_per_step'] / 1e3, '.1f')} | "
            f"{'' if emb is None else format(r['embedding_over_eq1'], '.3f')} | "
            f"{'' if r.get('veth_over_engine') is None else format(r['veth_over_engine'], '.3f')} |"
        )
    return "\n".join(lines) + "\n"


def demo_workload() -> tuple[nn.Module, Any, Any]:
    """The demo LM as ``zensync profile --factory hsdp_bench:demo_workload`` takes it (model, batch, loss)."""
    config = DemoConfig()
    corpus = lm.load_corpus(lm_config(config))
    model = DemoModel(config, generator=torch.Generator().manual_seed(config.seed))
    steps = iter(range(10**9))

    def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
        return batch(corpus, config, 0, next(steps))

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return model, make_batch, loss_fn


def _make_plan(args: argparse.Namespace, tmp: str) -> tuple[str, str]:
    """``zensync profile`` of the demo LM, then ``zensync plan`` for this cluster; returns (plan path, summary)."""
    cli = [sys.executable, "-m", "zensync"]
    profile, plan = os.path.join(tmp, "profile.json"), os.path.join(tmp, "plan.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pathlib.Path(__file__).parent), *sys.path])}
    subprocess.run([*cli, "profile", "--factory", "hsdp_bench:demo_workload", "--iterations", "5", "-o", profile],
                   check=True, capture_output=True, timeout=600, env=env)  # fmt: skip
    shape = ["--nodes", str(args.hosts), "--gpus-per-node", str(args.ranks_per_host), "--intra", "100Gbit"]
    planned = subprocess.run(
        [*cli, "plan", "--profile", profile, *shape, "--inter-bw", args.rate.replace("gbit", "Gbit"),
         "--compressor", args.plan_compressor, "--cpu-offload", "-o", plan],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return plan, " ".join(line for line in planned.stdout.splitlines() if line.startswith(("| comp", "| fp")))


def main(argv: list[str] | None = None) -> int:
    """Driver (or, with --worker, one rank)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="runs of every strategy, in alternating order")
    p.add_argument("--strategies", nargs="+", default=["native", "floor", "auto", "zen", "powersgd:4", "plan"])
    p.add_argument("--plan-compressor", default="fp16", help="the compressor `zensync plan` places")
    p.add_argument("--label", default="")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--results-dir", default=str(pathlib.Path(__file__).parent / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--iface", default="", help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--plan", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    forwarded = list(argv if argv is not None else sys.argv[1:])
    config = DemoConfig()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = lm.load_corpus(lm_config(config))
        torch.save(corpus.clone(), os.path.join(tmp, "corpus.pt"))
        plan, plan_summary = _make_plan(args, tmp) if "plan" in args.strategies else (None, None)
        with make_cluster(args.hosts, rate=args.rate) as cluster:
            emulated = isinstance(cluster, EmulatedCluster)
            iface = "eth0" if emulated else ""
            extra = ["--worker", "--out", tmp, "--iface", iface, "--corpus", os.path.join(tmp, "corpus.pt")]
            extra += ["--plan", plan] if plan else []
            cluster.run_workers(
                lambda r: [sys.executable, os.path.abspath(__file__), *forwarded, *extra],
                lambda r: {**cluster.env_for_torch(r, _PORT, args.ranks_per_host), "OMP_NUM_THREADS": "1"},
                timeout_s=args.timeout_s,
                ranks_per_host=args.ranks_per_host,
            )
        world = args.hosts * args.ranks_per_host
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    table = _summarize(args, ranks, parse_rate(args.rate) if emulated else None)
    date = datetime.date.today().isoformat()
    label = args.label or (f"{args.hosts}x{args.ranks_per_host}_{args.rate}" if emulated else "loopback")
    meta = {
        "date": date,
        "label": label,
        "command": " ".join(["python", "experiments/hsdp_bench.py", *forwarded]),
        "hosts": args.hosts,
        "ranks_per_host": args.ranks_per_host,
        "rate": args.rate,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "vocab": config.vocab_size,
        "dim": config.embed_dim,
        "plan_summary": plan_summary,
        **versions(),
    }
    write(args.results_dir, f"hsdp_{label}_{date}", meta, table, _markdown(meta, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
