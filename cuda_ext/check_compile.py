"""Compile-only check of the CUDA extension: every csrc/cuda/*.cu through nvcc, csrc/ops.cpp through the C++ compiler.

Launch: ``python cuda_ext/check_compile.py [--arch 90] [--jobs 2]``. It needs nvcc but no GPU and no CUDA
build of torch: the CPU torch wheel ships the ATen/c10 CUDA headers, and nothing is linked. Flags are those
torch.utils.cpp_extension passes for this torch (include dirs, -std=c++20, the extension defines, the ABI
flag, its nvcc flags), with one -gencode. Objects go to a temporary directory that is removed afterwards.

Exit status 0 when every file compiles, 1 with the compiler output otherwise. Without nvcc it prints
"skipped: nvcc not found" and exits 0, unless ZENSYNC_REQUIRE_NVCC is set (CI sets it), then 1.
Expected: about 1.5 min on 2 cores (each .cu parses the ATen headers once).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

_CSRC = Path(__file__).resolve().parent / "csrc"
_EXTENSION_NAME = "zensync_cuda_ext"
_CXX_STD = "-std=c++20"
"""What torch.utils.cpp_extension passes for torch 2.13 (its headers use C++20 features)."""
_NVCC_TORCH_FLAGS = [
    # torch.utils.cpp_extension.COMMON_NVCC_FLAGS
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]


def _find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").is_file():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _common_flags() -> list[str]:
    """Include dirs and defines shared by nvcc and the C++ compiler (imports torch: a few seconds)."""
    import torch
    from torch.utils.cpp_extension import include_paths

    torch_includes = include_paths()
    flags = [f"-I{path}" for path in torch_includes]
    flags.append(f"-I{sysconfig.get_paths()['include']}")
    flags += [
        f"-DTORCH_EXTENSION_NAME={_EXTENSION_NAME}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        _CXX_STD,
        "-O3",
    ]
    # A CPU torch wheel lacks the CMake-generated c10/cuda/impl/cuda_cmake_macros.h (a CUDA wheel
    # has it); c10 documents this define for builds without that file.
    if not any((Path(path) / "c10/cuda/impl/cuda_cmake_macros.h").is_file() for path in torch_includes):
        flags.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    return flags


def _commands(nvcc: str, arch: str, out_dir: Path) -> dict[str, list[str]]:
    common = _common_flags()
    commands = {}
    for source in sorted((_CSRC / "cuda").glob("*.cu")):
        obj = out_dir / f"{source.stem}.cuda.o"
        gencode = f"-gencode=arch=compute_{arch},code=sm_{arch}"
        commands[source.name] = [nvcc, "-c", str(source), "-o", str(obj), *common, *_NVCC_TORCH_FLAGS,
                                 "-Xcompiler", "-fPIC", gencode]  # fmt: skip
    cxx = os.environ.get("CXX", "c++")
    for source in sorted(_CSRC.glob("*.cpp")):
        obj = out_dir / f"{source.stem}.o"
        commands[source.name] = [cxx, "-c", str(source), "-o", str(obj), *common, "-fPIC"]
    return commands


def _run(name: str, command: list[str]) -> tuple[str, int, float, str]:
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    return name, result.returncode, time.perf_counter() - start, result.stdout + result.stderr


def _own_warnings(output: str) -> list[str]:
    """Compiler warnings located in this extension's sources (the torch headers' own are not ours)."""
    return [line for line in output.splitlines() if str(_CSRC) in line and "warning" in line.lower()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="90", help="compute capability to compile for (default 90: H100/H200)")
    parser.add_argument("--jobs", type=int, default=max(1, os.cpu_count() or 1), help="files compiled at once")
    args = parser.parse_args()
    nvcc = _find_nvcc()
    if nvcc is None:
        if os.environ.get("ZENSYNC_REQUIRE_NVCC"):
            print("error: nvcc not found (ZENSYNC_REQUIRE_NVCC is set): put the CUDA toolkit on PATH", file=sys.stderr)
            return 1
        print("skipped: nvcc not found (set ZENSYNC_REQUIRE_NVCC=1 to make this an error)")
        return 0
    start = time.perf_counter()
    failed = []
    with tempfile.TemporaryDirectory(prefix="zensync_cuda_check_") as tmp:
        commands = _commands(nvcc, args.arch, Path(tmp))
        print(f"compiling {len(commands)} files with {nvcc} (sm_{args.arch}), {args.jobs} at a time")
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(_run, name, command) for name, command in commands.items()]
            for future in concurrent.futures.as_completed(futures):
                name, returncode, seconds, output = future.result()
                warnings = _own_warnings(output)
                status = "ok" if returncode == 0 and not warnings else "FAILED"
                print(f"  {name:<16} {status:<7} {seconds:6.1f} s", flush=True)
                if status != "ok":
                    failed.append(name)
                    print(" ".join(commands[name]), file=sys.stderr)
                    print(output if returncode != 0 else "\n".join(warnings), file=sys.stderr)
    names = f": {', '.join(failed)}" if failed else ""
    print(f"total {time.perf_counter() - start:.1f} s; {len(failed)} failed{names}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
