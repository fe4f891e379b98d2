"""The CPU kernels compile for an AVX2-only x86 CPU, not only for the AVX-512 machine that builds them.

`cpu_build` compiles with -march=native and falls back to a portable build when that fails, so a source that
only an AVX-512 CPU can compile still "works" on an AVX2 one: slower, after a failed ~2 min build, and with a
portable build that took over 10 min on a 2-vCPU AMD EPYC (an asm constraint no ymm register can meet did
exactly this). Each source is compiled here for x86-64-v3 (AVX2 + FMA, no AVX-512) at -O1, which still
expands the inline asm and so meets the same constraint checks, in a few seconds.
"""

import platform
import shutil
import subprocess

import pytest

from conveyor.kernels.cpu_build import SOURCE_DIR

COMPILER = shutil.which("cc") or shutil.which("gcc")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or COMPILER is None,
                    reason="an x86-64 C compiler is needed")
@pytest.mark.parametrize("source", sorted(p.name for p in SOURCE_DIR.glob("*.c")))
def test_each_source_compiles_for_an_avx2_only_cpu(source: str, tmp_path) -> None:
    command = [COMPILER, "-O1", "-std=gnu11", "-fopenmp", "-fPIC", "-march=x86-64-v3", "-Wno-psabi",
               "-c", str(SOURCE_DIR / source), "-o", str(tmp_path / "out.o")]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0 and "unrecognized" in result.stderr and "x86-64-v3" in result.stderr:
        pytest.skip("this compiler does not know -march=x86-64-v3")
    assert result.returncode == 0, result.stderr[-1500:]
