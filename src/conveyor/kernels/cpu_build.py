"""The C kernels of kernels/cpu/: compiled once per CPU by the system C compiler, loaded with ctypes.

The model: every `*.c` file under kernels/cpu/ goes into one shared library, built with
`-O3 -march=native -fopenmp` on first use (about two seconds) into a cache directory keyed by the
sources' hash, the compiler and the CPU (its model and instruction-set flags), and reused by every
later process on that CPU. Plain C rather than a torch C++ extension because torch's headers alone
take minutes to compile on two cores. The library links `libgomp.so.1`, which the dynamic loader resolves to the copy torch has already loaded (same
soname), so the kernels and torch share one OpenMP runtime and its threads; each call passes
`torch.get_num_threads()`. ctypes releases the GIL for the duration of a call.
Nothing happens at import: `cpu_kernels()` builds or loads on the first call and raises
`CPUKernelsUnavailable` (no compiler, a failed build) with the reason; callers that have a float32
fallback ask `cpu_kernels_available()` first.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

SOURCE_DIR = pathlib.Path(__file__).with_name("cpu")
"""Where the C sources (*.c, and the *.h they include) live (package data)."""
COMPILE_FLAGS = ("-O3", "-std=gnu11", "-fopenmp", "-shared", "-fPIC")
"""Flags every build uses; `-march=native` is added where the compiler accepts it."""
MARCH = "native"
"""What `cpu_kernels()` compiles for: `native`, or another CPU's -march (e.g. `znver3`, AVX2 without AVX-512)
that benchmarks/cpu_isa.py and its pytest plugin set before the first call to run the AVX2 code here."""

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES: dict[str, list[type]] = {
    "q4_matmul": [_P, _I64, _I64, _P, _P, _P, _I64, _P, _I32],
    "q8_0_matmul": [_P, _I64, _I64, _P, _P, _I64, _P, _I32],
    "q4_dequantize": [_P, _P, _P, _I64, _I64, _P, _I32],
    "q8_0_dequantize": [_P, _P, _I64, _I64, _P, _I32],
    "paged_decode_attention": [_P, _P, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _P, _I32],
    "paged_prefill_attention": [_P, _P, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _P, _I32],
    "rms_norm": [_P, _I64, _I64, _I64, _P, _F32, _P, _I32],
    "rotary_": [_P, _I64, _I64, _I64, _I64, _P, _P, _I32],
    "silu_and_mul": [_P, _I64, _I64, _P, _I32],
    "decoder_stack": [_P, _I64, _P, _P, _I32],
}
_RETURNS: dict[str, type | None] = {
    "paged_decode_attention": _I32, "paged_prefill_attention": _I32, "q4_matmul": _I32, "q8_0_matmul": _I32,
    "decoder_stack": _I32,
}
"""Functions that return a status (0: done); the others return nothing."""
"""Exported C functions and their argument types (pointers are tensors' data_ptr())."""


class CPUKernelsUnavailable(RuntimeError):
    """The C kernels could not be built or loaded here; the message says why."""


def cpu_kernels_available() -> bool:
    """True when `cpu_kernels()` succeeds (builds the library on first call)."""
    try:
        cpu_kernels()
    except CPUKernelsUnavailable:
        return False
    return True


@functools.cache
def cpu_kernels() -> ctypes.CDLL:
    """The loaded library with typed functions (built on first use, then cached per process)."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise CPUKernelsUnavailable("no C compiler (cc, gcc or clang) on PATH to build the CPU kernels")
    sources = sorted(SOURCE_DIR.glob("*.c"))
    digest = hashlib.sha256(compiler.encode() + platform.machine().encode() + cpu_identity().encode() + MARCH.encode())
    for source in sorted([*sources, *SOURCE_DIR.glob("*.h")]):
        digest.update(source.read_bytes())
    library = _cache_dir() / f"conveyor_cpu_{digest.hexdigest()[:16]}.so"
    if not library.is_file():
        _build(compiler, sources, library, (f"-march={MARCH}",))
    return load_library(library)


def load_library(library: pathlib.Path) -> ctypes.CDLL:
    """A built kernels library, its exported functions typed."""
    lib = ctypes.CDLL(str(library))
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, _RETURNS.get(name)
    return lib


def cpu_identity(cpuinfo: str | None = None) -> str:
    """What `-march=native` compiles for: the CPU's model name and instruction-set flags.

    A library built for one CPU may use instructions (AVX-512, say) that another lacks, and a cache
    directory can be shared by machines with different CPUs (a home directory on NFS, a container
    image); keyed by this, each CPU gets its own build, while the same CPU under another hostname (a
    fresh VM, a CI runner) reuses it. Linux reads /proc/cpuinfo (or `cpuinfo`, its text); elsewhere
    platform.processor().
    """
    if cpuinfo is None:
        try:
            cpuinfo = pathlib.Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")  # x86, then ARM's names
    first: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in wanted and key not in first:
            first[key] = " ".join(sorted(value.split())) if key in ("flags", "Features") else value.strip()
    return ";".join(f"{key}={first[key]}" for key in wanted if key in first) or platform.processor()


def _cache_dir() -> pathlib.Path:
    """~/.cache/conveyor/kernels, or the temp directory where the home directory is not writable."""
    for candidate in (pathlib.Path.home() / ".cache" / "conveyor" / "kernels",
                      pathlib.Path(tempfile.gettempdir()) / "conveyor-kernels"):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(candidate, os.W_OK):
            return candidate
    raise CPUKernelsUnavailable("no writable directory for the compiled CPU kernels")


def build_for(march: str, library: pathlib.Path) -> ctypes.CDLL:
    """Build the kernels for `-march=<march>` (another CPU's instruction set, e.g. znver3: AVX2 without
    AVX-512) into `library` and load it: how benchmarks/cpu_isa.py runs and checks the AVX2 code here."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise CPUKernelsUnavailable("no C compiler (cc, gcc or clang) on PATH to build the CPU kernels")
    _build(compiler, sorted(SOURCE_DIR.glob("*.c")), library, (f"-march={march}",))
    return load_library(library)


def _build(compiler: str, sources: list[pathlib.Path], library: pathlib.Path,
           march: tuple[str, ...] = ("-march=native",)) -> None:
    """Compile into a temporary file, then rename: concurrent first uses never see half a library."""
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    errors = ""
    for arch in (list(march), []):  # a compiler without -march=native still builds portable code
        command = [compiler, *COMPILE_FLAGS, *arch, *map(str, sources), "-o", str(partial)]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode == 0:
            os.replace(partial, library)
            return
        errors = result.stderr.strip()[-2000:]
    raise CPUKernelsUnavailable(f"building the CPU kernels failed ({' '.join(command)}):\n{errors}")
