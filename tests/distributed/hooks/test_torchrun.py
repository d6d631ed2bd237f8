"""zensync's hook under torchrun (env:// rendezvous), the way most users launch DDP."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.distributed._launch import free_port

SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch import nn
    import zensync

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def train(strategy):
        torch.manual_seed(0)
        model = nn.Sequential(nn.EmbeddingBag(20000, 16, mode="sum"), nn.Linear(16, 3))
        ddp = nn.parallel.DistributedDataParallel(model)
        options = dict(adapt=False, latency_s=50e-6, bandwidth_bytes_per_s=1.25e8)  # a 1 Gbit/s network
        state = zensync.register(ddp, strategy=strategy, **options) if strategy else None
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            gen = torch.Generator().manual_seed(step * 10 + rank)
            opt.zero_grad()
            ddp(torch.randint(0, 20000, (4, 5), generator=gen)).square().sum().backward()
            opt.step()
        if state is not None:
            schemes = {name: record.scheme for name, record in state.records.items()}
            state.close()
            return [p.detach().clone() for p in model.parameters()], schemes
        return [p.detach().clone() for p in model.parameters()], None

    reference, _ = train(None)
    hooked, schemes = train("zen")
    diff = max(float((a - b).abs().max()) for a, b in zip(reference, hooked))
    assert diff < 1e-6, diff
    assert schemes["0.weight"] == "zen", schemes
    print(f"rank {rank} ok diff={diff}")
    dist.destroy_process_group()
    """
)


@pytest.mark.slow  # 13-15 s of process start-up: in the slow tier that .ci/run runs after the README's command
def test_torchrun_two_processes(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        f"--master_port={free_port()}", "--master_addr=127.0.0.1", str(script),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 0 ok" in done.stdout and "rank 1 ok" in done.stdout
