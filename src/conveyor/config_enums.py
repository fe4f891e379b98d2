"""The named values of the engine's configuration (vLLM's spellings), beside the dataclasses of config.py.

Each enum's value is the string a flag or an `LLM(...)` keyword takes; config.py re-exports them, so callers
import them from `conveyor.config`. Only stdlib here, as config.py.
"""

import enum


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class Batching(enum.Enum):
    CONTINUOUS = "continuous"
    STATIC = "static"


class CUDAGraphMode(enum.Enum):
    """Which steps replay CUDA graphs (vLLM's `cudagraph_mode` names, for the modes conveyor has)."""

    FULL = "full"
    """Decode steps and mixed prefill/decode steps up to `max_cudagraph_capture_size` tokens."""
    FULL_DECODE_ONLY = "full_decode_only"
    """Only pure-decode steps; steps with a prefill chunk run eagerly."""


class Quantization(enum.Enum):
    """How a quantized checkpoint's weights are served (vLLM's `--quantization`)."""

    AUTO = "auto"
    """GGUF for a GGUF checkpoint on CPU in float32 where the CPU kernels build, else NONE."""
    GGUF = "gguf"
    """Compute on the GGUF's Q4_0 / Q4_1 / Q8_0 blocks as stored (CPU, float32 activations)."""
    NONE = "none"
    """Dequantize every weight to `dtype` at load time."""
    FP8 = "fp8"
    """vLLM's online FP8: decoder projections quantized to e4m3 at load, per-tensor scales (CUDA)."""
    PTPC_FP8 = "ptpc_fp8"
    """vLLM's per-token-per-channel online FP8 (ROCm-only there): per-channel weight, per-token input scales."""

    @property
    def is_fp8(self) -> bool:
        return self in (Quantization.FP8, Quantization.PTPC_FP8)


class GemmBackend(enum.Enum):
    """Which GEMM the decoder projections (`layers.Linear`) call: conveyor's `--gemm-backend`."""

    TORCH = "torch"
    """F.linear (cuBLAS), `torch._scaled_mm` for FP8: the default."""
    TRITON = "triton"
    """kernels/triton_gemm.py, tiled for decode batches (opt-in, to time lever 6; CUDA, per-tensor FP8 only)."""


class LoadFormat(enum.Enum):
    AUTO = "auto"
    GGUF = "gguf"
    SAFETENSORS = "safetensors"
    DUMMY = "dummy"
