"""The README's Python snippets run as written: the simulated-world one in process, the DDP program
under torchrun on 2 ranks with each of the README's ``register`` lines in turn."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import zensync
from tests.distributed._launch import free_port

README = Path(__file__).resolve().parents[2] / "README.md"
TORCHRUN_TIMEOUT_S = 240


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _block(marker: str) -> str:
    matches = [b for b in _python_blocks() if marker in b]
    assert len(matches) == 1, f"expected one README python block containing {marker!r}"
    return matches[0]


def test_every_python_block_is_tested() -> None:
    markers = (
        "SimulatedWorld(",
        'torch.save(state.state_dict(), f"zensync-rank',
        "register_fsdp(",
        'strategy="plan.json"',
        "profile_group(",
        "init_torch_distributed(",
    )
    assert len(_python_blocks()) == len(markers)
    for marker in markers:
        _block(marker)


def test_simulated_world_snippet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(_block("SimulatedWorld("), "README.md", "exec"), {"__name__": "__readme__"})
    assert "rank 0 sent" in capsys.readouterr().out


# Slow tier: the default tier runs the hook under torchrun (hooks/test_torchrun.py) and every register line's
# strategy on gloo (hooks/test_ddp_compress.py); this checks the README's program text itself.
@pytest.mark.slow
def test_ddp_program_runs_with_every_register_line(tmp_path: Path) -> None:
    program = _block('torch.save(state.state_dict(), f"zensync-rank')
    register_lines = [line for line in _block('strategy="plan.json"').splitlines() if line.startswith("state = ")]
    original = next(line for line in program.splitlines() if line.startswith("state = zensync.register"))
    cli = [sys.executable, "-c", "import sys; from zensync.cli import main; sys.exit(main())"]
    plan = ["plan", "--model", "resnet50", "--nodes", "1", "--gpus-per-node", "2", "--inter-bw", "10Gbit"]
    subprocess.run(
        [*cli, *plan, "--compressor", "topk:0.01", "-o", "plan.json"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=120,
    )
    # One torchrun launch runs the program once per register line, each on a fresh process group.
    script = ["import torch"]
    # The profile block replaces the register line too: it measures, then registers "auto" with the profile.
    for i, line in enumerate([original, *register_lines, _block("profile_group(")]):
        body = program.replace(original, line)
        if i:
            body = body.replace("torch.distributed.init_process_group(", "(lambda *a, **k: None)(")
        script.append(f"exec(compile({body!r}, 'README.md:{i}', 'exec'), {{'__name__': '__main__'}})")
        # A marker file per rank and program (the ranks' prints interleave on the shared stdout).
        script.append(f"open('ran-{i}-rank' + __import__('os').environ['RANK'], 'w').close()")
    (tmp_path / "train.py").write_text("\n".join(script) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "train.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    for i in range(2 + len(register_lines)):
        for rank in range(2):
            assert (tmp_path / f"ran-{i}-rank{rank}").exists(), done.stdout[-4000:]
    assert (tmp_path / "zensync-rank1.pt").exists()


def test_fsdp_program_runs_under_torchrun(tmp_path: Path) -> None:
    """The FSDP program as written, under torchrun on 2 ranks: the embedding took the rows path, DCP saved."""
    (tmp_path / "train_fsdp.py").write_text(_block("register_fsdp("))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "train_fsdp.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(README.parent)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("'path': 'rows'") == 2, done.stdout[-2000:]
    assert (tmp_path / "checkpoint" / ".metadata").exists()  # DCP's checkpoint of the model and zensync


def test_mpi_program_runs_under_mpiexec(tmp_path: Path) -> None:
    """The MPI program as written, under ``mpiexec -n 2 python -m mpi4py`` (the README's launch line)."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich)")
    script = tmp_path / "train_mpi.py"
    script.write_text(_block("init_torch_distributed("))
    command = [mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(README.parent)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S, env=env, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # mpiexec forwards both ranks' writes as they come: a line may arrive split around the other's.
    printed = sorted(re.findall(r"([01]) ([a-z_]+)", done.stdout))
    assert [rank for rank, _ in printed] == ["0", "1"], done.stdout
    assert printed[0][1] == printed[1][1] and printed[0][1] in zensync.SCHEMES, done.stdout
