"""Triton when it is installed, otherwise a stand-in so that kernel modules still import.

The CPU-only install (CI, laptops) has torch but no Triton. Kernel bodies are only traced when they
are launched, so defining them against the stand-in is harmless; launching one raises a clear error.
The `*_ref` references in every kernel module need only torch and keep working.
"""

from typing import Any

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install: references work, kernels refuse to launch
    HAS_TRITON = False

    class _UnlaunchableKernel:
        """What `@triton.jit` returns without Triton: indexing it with a grid raises."""

        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __getitem__(self, grid: Any) -> Any:
            raise RuntimeError(
                f"{self.fn.__name__} needs Triton and a CUDA GPU; use the torch attention backend "
                "(--attention-backend torch) or the *_ref reference"
            )

    class _TritonStandIn:
        @staticmethod
        def jit(fn: Any = None, **_options: Any) -> Any:
            if fn is None:
                return _UnlaunchableKernel
            return _UnlaunchableKernel(fn)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, (n - 1).bit_length())

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

    class _LanguageStandIn:
        constexpr = int  # only used as an annotation

    triton = _TritonStandIn()  # type: ignore[assignment]
    tl = _LanguageStandIn()  # type: ignore[assignment]

__all__ = ["HAS_TRITON", "triton", "tl"]
