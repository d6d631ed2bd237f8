"""Build the CUDA kernels of ``cuda_ext/csrc`` as CPU code, so that CPU-only CI runs them (STYLE.md item 10).

The numba kernels have ``NUMBA_ENABLE_CUDASIM=1``; this is the same idea for the C++ extension. The
real ``.cu`` sources are copied and rewritten, not re-implemented:

1. every launch ``k<<<grid, block, smem, stream>>>(args)`` becomes
   ``::emu::launch(grid, block, smem, stream, [](auto... a) { k(a...); }, args)``;
2. every ``__shared__ T name[N];`` becomes ``auto& name = ::emu::shared<T[N], id>();``, the running
   block's own copy of that array (``rewrite_shared``);
3. the ops are registered for the CPU dispatch key, and the name ``zensync_cuda`` (op and C++
   namespace) becomes ``zensync_cuda_emu_<variant>``, so that the real extension and every variant
   can share a process; ``t.is_cuda()`` checks become ``t.is_cpu()``;
4. a variant may change the launch constants of ``common.cuh``, the number of blocks that run at once
   and the sanitizer (see ``VARIANTS``);
5. each ``.cu`` file starts with ``#include "emu_runtime.h"`` (the CUDA built-ins, barriers, shuffles,
   atomics, shared memory and ``emu::launch``) and is compiled as C++20 by
   ``torch.utils.cpp_extension.load``, with ``shim/`` on the include path in place of ``c10/cuda/*.h``
   and ``ATen/cuda/Atomic.cuh``.

What is emulated faithfully:

- threads and barriers: one OS thread per CUDA thread of a block, so ``__syncthreads`` is a real
  barrier and without one the threads really race on shared memory. A divergent barrier (a barrier
  that not every thread of the block reaches, undefined in CUDA) is a launch error: every thread
  must pass the same number of barriers, and a thread that returns early stops counting, so the
  others are not deadlocked;
- blocks at once: a variant's ``resident_blocks`` blocks of a launch run concurrently (2 or 3, like
  blocks resident on different SMs; the rest wait for a free slot), so blocks really race for hash
  slots and counters, and a block may wait for another (``selftest.cu`` checks it);
- warp shuffles: ``__shfl_up_sync`` exchanges values between the 32 threads of a warp through a real
  per-warp barrier (full warps only; every lane must shuffle equally often);
- atomics: ``atomicCAS/Add/Or/Min`` are relaxed ``std::atomic_ref`` operations, concurrent between
  threads and blocks, so a CAS can lose to another thread (Zen's fall-back to the next hash and to
  the serial region), and, as in CUDA, an atomic orders no other memory access;
  ``gpuAtomicAddNoReturn`` rounds every addition to its dtype, as on the GPU;
- shared memory: one copy per block, filled with 0xA5 bytes when the block first touches it, so a
  read before any write sees garbage, never another block's data;
- races, with the ``tsan`` variant: the same build under ThreadSanitizer, in a process that preloads
  its runtime (``sanitizer_environment``; ``tests/emulated/test_cuda_sanitizers.py``). It reports
  every pair of accesses, one a plain write, that CUDA's rules leave unordered: within a block only
  ``__syncthreads`` orders, between blocks only the end of the launch (blocks that share a resident
  slot run in turn and are ordered), and atomics order nothing else. It checks happens-before, not
  timing, so a race with a window of nanoseconds is reported as surely as a wide one (a
  write-then-re-read slot claim in place of the CAS is reported; the plain variants pass it);
- memory errors, with the ``asan`` variant: AddressSanitizer reports any access outside a tensor's
  allocation (device pointers are the tensors' host allocations; reads past the end of a tile, say)
  and UndefinedBehaviorSanitizer any undefined arithmetic, such as a signed index product that
  overflows. It is the counterpart of ``compute-sanitizer``'s memcheck, for host-allocated tensors;
- everything on the host side (argument checks, tile layout, host syncs, the overflow re-run) is the
  production code, compiled for the CPU, and the launch configuration is validated (1-D grid up to
  2^31 - 1 blocks, block a multiple of 32 up to 1024 threads).

What is NOT emulated:

- without the ``tsan`` variant, short races: only as many threads run at once as the machine has
  cores, switching at barriers or OS time slices, so a race with a narrow window rarely changes a
  result. The ``prod`` and ``small`` variants are functional tests, not race detectors;
- the rest of the CUDA memory model: fences, ``volatile`` and scoped atomics (``atomicAdd_block``)
  are not provided (a kernel using them fails to compile here), and plain loads and stores are those
  of the host CPU (x86: total store order), stronger than the GPU's. ThreadSanitizer still reports
  the unordered accesses, but a run without it cannot show the reorderings a GPU may make;
- warp-synchronous execution: lanes are not in lock-step, and shuffle masks other than the full warp
  are rejected; inactive lanes, ``__syncwarp`` and other intrinsics are not provided (a kernel using
  them fails to compile here; add them to ``shim/emu_runtime.h``);
- the shared memory size limit, and more blocks at once than a variant's ``resident_blocks`` (a kernel
  that waits for more blocks than that hangs, as on a GPU with fewer SMs);
- memory errors without the ``asan`` variant: device pointers are CPU pointers, so an out-of-bounds
  access goes unreported and may corrupt the process, and device memory is unified with the host
  (a kernel that dereferences a host pointer by mistake works here);
- timing and resources: streams are ignored (launches are synchronous), there is no scheduling
  like a GPU's, no register or occupancy limit, and no performance information.

Variants (``VARIANTS``): ``"prod"`` keeps the production constants (256-thread blocks, 2048-element
tiles), 2 blocks at once; ``"small"`` uses 64-thread blocks (2 warps), 128-element tiles and at most 3
blocks per grid-stride loop, all 3 at once, so that modest inputs cover many tiles, multi-row tiles and
every grid-stride iteration; ``"tsan"`` and ``"asan"`` are ``"small"`` under ThreadSanitizer and under
AddressSanitizer + UndefinedBehaviorSanitizer (``SANITIZERS``).

Example::

    from cuda_ext.emulation import build_ops

    ops = build_ops("small")  # about 25 s on 2 cores the first time, 0.2 s afterwards
    ops.topk(torch.tensor([1.0, 3.0, 2.0]), 2)  # tensor([1, 2]), computed by the CUDA kernels
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SANITIZERS",
    "VARIANTS",
    "Sanitizer",
    "Variant",
    "build_directory",
    "build_ops",
    "compile_program",
    "namespace",
    "rewrite_launches",
    "rewrite_shared",
    "run_selftest",
    "sanitizer_environment",
    "sanitizer_runtime",
    "unavailable_reason",
]

_HERE = Path(__file__).resolve().parent
_SHIM = _HERE / "shim"
_RUNTIME_INCLUDE = '#include "emu_runtime.h"  // added by cuda_ext/emulation/build.py\n'
_SELFTEST = _HERE / "selftest.cu"
_CSRC = _HERE.parent / "csrc"
_EXTENSION_NAMESPACE = "zensync_cuda"
_COMMON = "common.cuh"

_SMALL_CONSTANTS = {
    "constexpr int kThreads = 256;": "constexpr int kThreads = 64;",
    "constexpr int64_t kTile = kThreads * 8;": "constexpr int64_t kTile = kThreads * 2;",
    "constexpr int64_t kMaxGridStrideBlocks = 1 << 16;": "constexpr int64_t kMaxGridStrideBlocks = 3;",
}


@dataclass(frozen=True)
class Sanitizer:
    """A compiler sanitizer the emulated kernels can be built with.

    Attributes:
        flags: Compile and link flags.
        runtime: The runtime library's file name; a process that loads such a build must preload it
            (``LD_PRELOAD``: Python itself is not instrumented).
        options: Environment variable -> the options that make every report count (exit code 66).
        log_variables: The variables whose ``log_path`` option sends reports to files.
        faults: The deliberate faults of ``selftest.cu`` (``selftest fault NAME``) it must report.
    """

    flags: tuple[str, ...]
    runtime: str
    options: dict[str, str]
    log_variables: tuple[str, ...]
    faults: tuple[str, ...]


SANITIZERS: dict[str, Sanitizer] = {
    # halt_on_error=0: every race of a run is reported.
    "thread": Sanitizer(
        flags=("-fsanitize=thread", "-g"),
        runtime="libtsan.so",
        options={"TSAN_OPTIONS": "halt_on_error=0:exitcode=66"},
        log_variables=("TSAN_OPTIONS",),
        faults=("missing_barrier", "between_blocks", "atomic_as_fence", "write_then_reread"),
    ),
    # AddressSanitizer stops at the first error; UndefinedBehaviorSanitizer is made to stop too.
    # detect_leaks=0: Python and torch keep memory to the end by design.
    "address": Sanitizer(
        flags=("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"),
        runtime="libasan.so",
        options={
            "ASAN_OPTIONS": "detect_leaks=0:exitcode=66",
            "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=66",
        },
        log_variables=("ASAN_OPTIONS", "UBSAN_OPTIONS"),
        faults=("out_of_bounds", "past_the_tile", "signed_overflow"),
    ),
}
"""``thread``: ThreadSanitizer, data races under CUDA's ordering rules. ``address``: AddressSanitizer
and UndefinedBehaviorSanitizer, accesses outside a tensor's allocation (the emulated counterpart of
``compute-sanitizer``'s memcheck) and undefined integer arithmetic such as signed overflow."""


@dataclass(frozen=True)
class Variant:
    """One way to build the emulated kernels.

    Attributes:
        constants: Exact text of cuda_ext/csrc/cuda/common.cuh -> its replacement (each must match once).
        resident_blocks: Blocks of a launch that run at once (``EMU_RESIDENT_BLOCKS``).
        sanitizer: A key of ``SANITIZERS``, or "" for none. Such a build loads only into a process
            that preloads the sanitizer's runtime (``sanitizer_environment``).
    """

    constants: dict[str, str] = field(default_factory=dict)
    resident_blocks: int = 2
    sanitizer: str = ""


VARIANTS: dict[str, Variant] = {
    "prod": Variant(resident_blocks=2),
    "small": Variant(constants=_SMALL_CONSTANTS, resident_blocks=3),
    "tsan": Variant(constants=_SMALL_CONSTANTS, resident_blocks=3, sanitizer="thread"),
    "asan": Variant(constants=_SMALL_CONSTANTS, resident_blocks=3, sanitizer="address"),
}
"""``prod``: the production constants, 2 blocks at once. ``small``: 64-thread blocks, 128-element tiles
and at most 3 blocks per grid-stride loop, all 3 at once. ``tsan`` and ``asan``: ``small`` under the
thread and the address + undefined-behaviour sanitizers."""

_COMPILE_FLAGS = ["-O1"]
"""-O1: the kernels are cheap next to the thread hand-offs, and it compiles faster than -O3."""

_SHARED_DECLARATION = re.compile(r"__shared__\s+([A-Za-z_][\w:<>, ]*?)\s+([A-Za-z_]\w*)\s*\[([^\]]+)\]\s*;")
"""``__shared__ T name[N];`` (the only form the kernels use: fixed-size arrays)."""


def _sanitizer_flags(variant: Variant) -> list[str]:
    return list(SANITIZERS[variant.sanitizer].flags) if variant.sanitizer else []


def _compile_flags(variant: Variant) -> list[str]:
    return [*_COMPILE_FLAGS, f"-DEMU_RESIDENT_BLOCKS={variant.resident_blocks}", *_sanitizer_flags(variant)]


def sanitizer_runtime(sanitizer: str) -> Path | None:
    """The compiler's runtime library of a ``SANITIZERS`` key (to preload), or None when it has none."""
    return _library(SANITIZERS[sanitizer].runtime)


def _library(name: str) -> Path | None:
    """The compiler's own copy of a runtime library, resolved, or None."""
    try:
        found = subprocess.run(
            [*_compiler(), f"-print-file-name={name}"], check=False, capture_output=True, text=True, timeout=30
        )
    except OSError:
        return None
    path = Path(found.stdout.strip())
    return path.resolve() if found.returncode == 0 and path.is_absolute() and path.exists() else None


def sanitizer_environment(sanitizer: str, log_prefix: Path | None = None, *, preload: bool = True) -> dict[str, str]:
    """Environment variables for a process that runs a ``sanitizer`` build (add them to ``os.environ``).

    ``LD_PRELOAD`` of the runtime (unless ``preload`` is False, for an instrumented executable), and
    the options under which every report makes the process exit with 66; with ``log_prefix`` the
    reports go to ``<log_prefix>.<pid>`` files instead of stderr.

    Raises:
        RuntimeError: the compiler has no runtime for this sanitizer.
    """
    spec = SANITIZERS[sanitizer]
    env = dict(spec.options)
    if log_prefix is not None:
        for variable in spec.log_variables:
            env[variable] += f":log_path={log_prefix}"
    if preload:
        runtime = sanitizer_runtime(sanitizer)
        if runtime is None:
            raise RuntimeError(f"the C++ compiler has no {spec.runtime} (the {sanitizer} sanitizer's runtime)")
        # The C++ runtime too, right after it: AddressSanitizer looks up __cxa_throw when it starts, and
        # Python loads libstdc++ only with torch, so a C++ exception would abort the process otherwise.
        env["LD_PRELOAD"] = " ".join(str(path) for path in (runtime, _library("libstdc++.so")) if path is not None)
    return env


def namespace(variant: str) -> str:
    """The ``torch.ops`` namespace of a variant's ops, e.g. ``zensync_cuda_emu_small``."""
    _check_variant(variant)
    return f"{_EXTENSION_NAMESPACE}_emu_{variant}"


def unavailable_reason() -> str:
    """Why the emulation cannot be built on this machine ('' when it can): compiler, ninja or Python.h missing."""
    compiler = _compiler()
    if shutil.which(compiler[0]) is None:
        return f"no C++ compiler: {compiler[0]!r} is not on PATH (install g++ or clang++, or set CXX)"
    if shutil.which("ninja") is None:
        return "ninja is not on PATH (torch.utils.cpp_extension.load needs it: pip install ninja)"
    python_h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not python_h.is_file():
        return f"the Python headers are missing ({python_h}; install python3-dev)"
    return ""


def _compiler() -> list[str]:
    """The C++ compiler command torch.utils.cpp_extension uses: $CXX (e.g. "ccache g++"), else c++."""
    return shlex.split(os.environ.get("CXX", "c++")) or ["c++"]


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {sorted(VARIANTS)}")


def _kernel_sources() -> list[Path]:
    """ops.cpp, then the .cu files and the headers next to them (in a stable order)."""
    cuda_dir = _CSRC / "cuda"
    return [_CSRC / "ops.cpp", *sorted(cuda_dir.glob("*.cu")), *sorted(cuda_dir.glob("*.cuh"))]


def _matching_paren(text: str, open_at: int) -> int:
    """Index of the ')' that closes the '(' at ``open_at``."""
    depth = 0
    for index in range(open_at, len(text)):
        if text[index] == "(":
            depth += 1
        elif text[index] == ")":
            depth -= 1
            if depth == 0:
                return index
    raise ValueError(f"unbalanced parentheses after offset {open_at}")


def _kernel_name_start(text: str, launch_at: int) -> int:
    """Where the kernel name before ``<<<`` starts: an identifier, optionally with ``<template args>``."""
    end = launch_at
    if text[end - 1] == ">":  # skip back over the template arguments, nested ones included
        depth = 0
        while True:
            end -= 1
            if end < 0:
                raise ValueError(f"unbalanced template arguments before the launch at offset {launch_at}")
            depth += {">": 1, "<": -1}.get(text[end], 0)
            if depth == 0:
                break
    match = re.search(r"[A-Za-z_][A-Za-z_0-9:]*$", text[:end])
    if match is None:
        raise ValueError(f"no kernel name before the launch at offset {launch_at}")
    return match.start()


def rewrite_launches(text: str) -> str:
    """Every ``k<<<cfg>>>(args)`` -> ``::emu::launch(cfg, [](auto... a) { k(a...); }, args)``."""
    out, position = [], 0
    while (launch_at := text.find("<<<", position)) >= 0:
        line_start = text.rfind("\n", 0, launch_at) + 1
        if "//" in text[line_start:launch_at]:  # a launch quoted in a comment
            out.append(text[position : launch_at + 3])
            position = launch_at + 3
            continue
        name_at = _kernel_name_start(text, launch_at)
        config_end = text.index(">>>", launch_at)
        args_open = config_end + 3
        if text[args_open] != "(":
            raise ValueError(f"expected '(' after >>> at offset {config_end}: {text[config_end : config_end + 20]!r}")
        args_close = _matching_paren(text, args_open)
        kernel, config, args = (
            text[name_at:launch_at],
            text[launch_at + 3 : config_end],
            text[args_open + 1 : args_close],
        )
        out.append(text[position:name_at])
        args = f", {args}" if args.strip() else ""
        out.append(f"::emu::launch({config}, [](auto... a) {{ {kernel}(a...); }}{args})")
        position = args_close + 1
    out.append(text[position:])
    return "".join(out)


def rewrite_shared(text: str, first_id: int = 0) -> tuple[str, int]:
    """Every ``__shared__ T name[N];`` -> ``auto& name = ::emu::shared<T[N], id>();`` (ids from ``first_id``).

    Returns the text and the next free id. Each declaration gets its own id, hence its own per-block
    array in the runtime (shim/emu_runtime.h).
    """
    next_id = first_id

    def replace(match: re.Match[str]) -> str:
        nonlocal next_id
        element, name, size = match.groups()
        next_id += 1
        return f"auto& {name} = ::emu::shared<{element}[{size}], {next_id - 1}>();"

    return _SHARED_DECLARATION.sub(replace, text), next_id


def _rewrite(path: Path, variant: str, first_shared_id: int) -> tuple[str, int]:
    """The emulated form of one source file (Steps 1-4 of the module docstring), and the next shared-array id."""
    text, next_shared_id = rewrite_shared(rewrite_launches(path.read_text(encoding="utf-8")), first_shared_id)
    if path.suffix == ".cu":
        text = _RUNTIME_INCLUDE + text
    # The op namespace and the C++ namespace both: a variant shares no op name with the real extension
    # and no symbol with another variant (GCC makes one object per process of the static variables of
    # inline functions, across shared libraries).
    ns = namespace(variant)
    text = re.sub(rf"\b{_EXTENSION_NAMESPACE}\b", ns, text)
    text = text.replace(f"TORCH_LIBRARY_IMPL({ns}, CUDA,", f"TORCH_LIBRARY_IMPL({ns}, CPU,")
    text = text.replace(".is_cuda()", ".is_cpu()")
    if path.name == _COMMON:
        for old, new in VARIANTS[variant].constants.items():
            if text.count(old) != 1:
                raise ValueError(f"variant {variant!r}: {old!r} is not in {path} exactly once; update VARIANTS")
            text = text.replace(old, new)
    return text, next_shared_id


def _emulated_sources(variant: str) -> dict[str, str]:
    """File name in the build directory (.cu -> .cpp) -> rewritten text, checking that the rewrites applied."""
    sources, shared_id = {}, 0
    for path in _kernel_sources():
        name = path.with_suffix(".cpp").name if path.suffix == ".cu" else path.name
        sources[name], shared_id = _rewrite(path, variant, shared_id)
    joined = re.sub(r"//.*", "", "\n".join(sources.values()))
    if "<<<" in joined:
        raise ValueError("a kernel launch was not rewritten (see rewrite_launches)")
    if "__shared__" in joined:
        raise ValueError("a __shared__ declaration was not rewritten (see rewrite_shared: T name[N]; only)")
    if re.search(r"TORCH_LIBRARY_IMPL\(\w+, CUDA", joined) or ".is_cuda()" in joined:
        raise ValueError("a CUDA registration or device check was not rewritten (see _rewrite)")
    return sources


def _digest(variant: str, sources: dict[str, str]) -> str:
    """Hash of everything that decides the build: sources, shims, this file, flags, torch and Python."""
    digest = hashlib.sha256()
    shims = sorted(path for path in _SHIM.rglob("*") if path.is_file())
    for label, text in [*sorted(sources.items()), *((str(p.relative_to(_HERE)), p.read_text()) for p in shims)]:
        digest.update(f"{label}\0{text}\0".encode())
    digest.update(Path(__file__).read_bytes())
    digest.update(f"{variant} {_compile_flags(VARIANTS[variant])} {torch.__version__} {sys.version}".encode())
    return digest.hexdigest()[:16]


def build_directory(variant: str, root: Path | None = None) -> Path:
    """``<root>/<variant>-<hash of the sources>``; root defaults to ``<system temp dir>/zensync_cuda_emulation``.

    The hash changes with any edit to the kernels, the shims or this file, so an edit rebuilds in a
    fresh directory and an unchanged tree reuses its build (ninja then has nothing to do).
    """
    _check_variant(variant)
    base = root if root is not None else Path(tempfile.gettempdir()) / "zensync_cuda_emulation"
    return base / f"{variant}-{_digest(variant, _emulated_sources(variant))}"


def _write_if_changed(path: Path, text: str) -> None:
    """Keep the file's mtime when its text is unchanged, so ninja does not recompile it."""
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


_LOADED: dict[str, Any] = {}
"""Variant -> its ops namespace, once loaded: a process registers each op namespace only once."""
_LOAD_LOCK = threading.Lock()


def _build(variant: str, root: Path | None, verbose: bool) -> Any:
    directory = build_directory(variant, root)
    source_dir = directory / "src"
    source_dir.mkdir(parents=True, exist_ok=True)
    sources = _emulated_sources(variant)
    for name, text in sources.items():
        _write_if_changed(source_dir / name, text)
    from torch.utils.cpp_extension import load

    # The compiler and ninja must not inherit a preloaded sanitizer runtime (they crash under
    # ThreadSanitizer's); this process keeps it, as the sanitized variants need.
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        load(
            name=namespace(variant),  # also the Python module name (TORCH_EXTENSION_NAME in ops.cpp)
            sources=[str(source_dir / name) for name in sources if name.endswith(".cpp")],
            extra_include_paths=[str(_SHIM), str(source_dir)],
            extra_cflags=_compile_flags(VARIANTS[variant]),
            extra_ldflags=_sanitizer_flags(VARIANTS[variant]),
            build_directory=str(directory),
            verbose=verbose,
        )
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    return getattr(torch.ops, namespace(variant))


def build_ops(variant: str = "small", *, root: Path | None = None, verbose: bool = False) -> Any:
    """Compile (or reuse) the emulated kernels of ``variant`` and return their ops namespace.

    Args:
        variant: A key of ``VARIANTS``: "small" (many tiles, every grid-stride path), "prod", or "tsan"
            "tsan" or "asan" (only in a process that preloads the sanitizer's runtime: see
            ``sanitizer_environment`` and ``tests/emulated/test_cuda_sanitizers.py``).
        root: Parent of the build directories (default: see ``build_directory``).
        verbose: Show the compiler commands and output.

    Returns:
        ``torch.ops.zensync_cuda_emu_<variant>``: the ops of ``cuda_ext/csrc/ops.cpp``, taking CPU
        tensors. Built once per process and variant; later calls return the same namespace (whatever
        their ``root``).

    Raises:
        ValueError: unknown variant, or sources the rewrites no longer fit.
        RuntimeError: the compilation failed (torch.utils.cpp_extension shows the compiler output).
    """
    _check_variant(variant)
    with _LOAD_LOCK:
        if variant not in _LOADED:
            _LOADED[variant] = _build(variant, root, verbose)
        return _LOADED[variant]


def compile_program(
    cuda_source: str, binary: Path, *, sanitizer: str = "", resident_blocks: int = 3, shim: Path | None = None
) -> Path:
    """Compile a stand-alone CUDA-syntax program (no torch) on the emulation runtime into ``binary``.

    The source is rewritten like the kernels (launches, ``__shared__``) and compiled as C++20 next to
    ``binary`` (``<binary>.cpp``), with ``sanitizer`` (a ``SANITIZERS`` key or "") and the runtime of
    ``shim`` (default: this checkout's ``shim/``). Returns ``binary``.

    Raises:
        RuntimeError: the program does not compile (the compiler's output is in the message).
    """
    text, _ = rewrite_shared(rewrite_launches(cuda_source))
    source = binary.with_name(binary.name + ".cpp")
    source.write_text(_RUNTIME_INCLUDE + text, encoding="utf-8")
    flags = _compile_flags(Variant(resident_blocks=resident_blocks, sanitizer=sanitizer))
    include = str(shim if shim is not None else _SHIM)
    command = [*_compiler(), "-std=c++20", *flags, "-pthread", "-I", include, str(source), "-o", str(binary)]
    compiled = subprocess.run(command, check=False, capture_output=True, text=True)
    if compiled.returncode != 0:
        raise RuntimeError(f"{source.name} does not compile:\n{compiled.stderr}")
    return binary


def run_selftest(work_dir: Path, *, sanitizer: str = "", fault: str = "") -> subprocess.CompletedProcess[str]:
    """Compile ``selftest.cu`` (rewritten, no torch) in ``work_dir`` once, run it and return its result.

    Without ``fault`` it checks the runtime's own claims: shuffles, barriers over shared memory and
    atomics work, shared memory starts poisoned, two blocks run at once, and divergent barriers (early
    returns included), partial shuffle masks and bad launch shapes are reported; the caller checks
    ``returncode == 0`` (stdout names any failed check). With ``sanitizer`` (a ``SANITIZERS`` key) the
    binary is built with it, and ``fault`` (one of its ``faults``) runs that faulty kernel, which the
    sanitizer must report (exit code 66). A few seconds.
    """
    if sanitizer and sanitizer not in SANITIZERS:
        raise ValueError(f"sanitizer={sanitizer!r} is not one of {sorted(SANITIZERS)}")
    if fault and (not sanitizer or fault not in SANITIZERS[sanitizer].faults):
        raise ValueError(f"fault={fault!r} is not a fault of sanitizer {sanitizer!r}")
    binary = work_dir / f"selftest-{sanitizer or 'plain'}"
    if not binary.is_file():
        compile_program(_SELFTEST.read_text(encoding="utf-8"), binary, sanitizer=sanitizer)
    env = {**os.environ, **(sanitizer_environment(sanitizer, preload=False) if sanitizer else {})}
    command = [str(binary), *(["fault", fault] if fault else [])]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, env=env)
