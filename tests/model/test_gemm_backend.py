"""--gemm-backend: the config accepts and refuses it, the CLI parses it, the loader marks every decoder
projection, and `layers.linear` dispatches only CUDA inputs to kernels/triton_gemm.py (CPU results unchanged).

`triton_linear` itself (the dispatch's operand checks and reshapes) runs on the CPU under Triton's interpreter
(`TRITON_INTERPRET=1 PYTHONPATH=src:/tmp/triton python -m pytest tests/model/test_gemm_backend.py`), at
fp16 as tests/kernels/test_triton_gemm.py does (the interpreter's bf16 `tl.dot` is wrong); the model's bf16
and FP8 logits against the torch backend are tests/worker/test_gemm_backend_gpu.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import pytest
import torch
import torch.nn.functional as F

from conveyor import config as cfg
from conveyor.cli import build_parser
from conveyor.config import ConfigError, EngineConfig, GemmBackend, ModelConfig
from conveyor.engine.args import build_engine_config, engine_config_to_flags
from conveyor.engine.llm import engine_config_from_kwargs
from conveyor.kernels.fp8_linear import quantize_weight_fp8
from conveyor.kernels.triton_compat import HAS_TRITON
from conveyor.model.layers import TRITON_GEMM_MAX_ROWS, Linear, linear, triton_linear
from conveyor.model.loader import load_model, use_triton_linears

INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "eos_token_id": 2,
    "bos_token_id": 1,
}


def test_the_default_is_torch_and_triton_is_refused_off_cuda() -> None:
    assert ModelConfig().gemm_backend is GemmBackend.TORCH
    assert engine_config_to_flags(EngineConfig())["gemm-backend"] == "torch"
    with pytest.raises(ConfigError, match="--gemm-backend triton needs --device cuda"):
        EngineConfig(model=ModelConfig(gemm_backend=GemmBackend.TRITON))


def test_triton_refuses_per_channel_fp8_scales() -> None:
    with pytest.raises(ConfigError, match="--gemm-backend triton .*--quantization ptpc_fp8"):
        ModelConfig(gemm_backend=GemmBackend.TRITON, quantization=cfg.Quantization.PTPC_FP8)
    ModelConfig(gemm_backend=GemmBackend.TRITON, quantization=cfg.Quantization.FP8)  # per tensor: taken


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton importable (the config checks that it is installed)")
def test_triton_is_accepted_on_cuda_with_triton() -> None:
    config = EngineConfig(model=ModelConfig(gemm_backend=GemmBackend.TRITON), device=cfg.DeviceConfig(device="cuda"))
    assert config.model.gemm_backend is GemmBackend.TRITON


def test_the_cli_parses_the_flag() -> None:
    parser = build_parser("serve")
    args = parser.parse_args(["serve", "--gemm-backend", "torch"])
    assert build_engine_config(args).model.gemm_backend is GemmBackend.TORCH
    assert parser.parse_args(["serve", "--gemm-backend", "triton"]).gemm_backend == "triton"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--gemm-backend", "cutlass"])
    with pytest.raises(ConfigError, match="--gemm-backend triton"):
        build_engine_config(parser.parse_args(["serve", "--gemm-backend", "triton", "--device", "cpu"]))



def test_vllms_linear_backend_is_accepted_and_leaves_the_default() -> None:
    """A `vllm serve` command line keeps working: vLLM's --linear-backend picks vLLM's kernels, so conveyor
    ignores it (with a warning) whatever its value, and its own --gemm-backend stays torch."""
    args = build_parser("serve").parse_args(["serve", "--linear-backend", "cutlass"])
    assert build_engine_config(args).model.gemm_backend is GemmBackend.TORCH


def test_llm_takes_the_engine_argument() -> None:
    """LLM(gemm_backend=...) as vLLM's engine arguments: the string value becomes the enum."""
    assert engine_config_from_kwargs(gemm_backend="torch").model.gemm_backend is GemmBackend.TORCH
    with pytest.raises(ConfigError, match="--gemm-backend triton needs --device cuda"):
        engine_config_from_kwargs(gemm_backend="triton", device="cpu")


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_cpu_inputs_never_take_triton(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(64, 96, bias=True)
    x = torch.randn(rows, 64, generator=gen)
    want = layer(x)
    layer.use_triton_gemm = True
    assert torch.equal(layer(x), want)
    weight = layer.weight.detach()
    assert torch.equal(linear(x, weight, None, use_triton_gemm=True), linear(x, weight))


def test_the_loader_marks_every_decoder_projection(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    config = ModelConfig(model=str(tmp_path), load_format=cfg.LoadFormat.DUMMY)
    module = load_model(config, "cpu", torch.float32).module
    linears = [m for m in module.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4 and not any(m.use_triton_gemm for m in linears)  # the default: torch
    assert use_triton_linears(module) == 8
    assert all(m.use_triton_gemm for m in linears)
    assert not Linear(16, 16).use_triton_gemm  # a class default: other models are untouched
    triton = dataclasses.replace(config, gemm_backend=GemmBackend.TRITON)
    marked = load_model(triton, "cpu", torch.float32).module
    assert all(m.use_triton_gemm for m in marked.modules() if isinstance(m, Linear))


def test_operands_the_triton_gemm_does_not_take_fall_back() -> None:
    """None (the torch path) instead of the kernel's asserts; nothing is launched, so no Triton is needed."""
    x = torch.randn(3, 64, dtype=torch.float16)
    weight = torch.randn(96, 64, dtype=torch.float16)
    assert triton_linear(x, weight[:40], None, None, None) is None  # N not a multiple of 16
    assert triton_linear(x[:, :56], weight[:, :56], None, None, None) is None  # K not a multiple of 16
    assert triton_linear(x.float(), weight, None, None, None) is None  # float32 activations
    assert triton_linear(x, weight.float(), None, None, None) is None  # dtypes differ
    assert triton_linear(x, weight.t().contiguous().t(), None, None, None) is None  # strided rows
    many = torch.randn(TRITON_GEMM_MAX_ROWS + 1, 64, dtype=torch.float16)
    assert triton_linear(many, weight, None, None, None) is None  # prefill-sized: cuBLAS
    fp8, scale = quantize_weight_fp8(weight.to(torch.bfloat16))
    x16 = x.to(torch.bfloat16)
    assert triton_linear(x16, fp8, None, scale.reshape(1, 1).expand(1, 96), None) is None  # per channel
    assert triton_linear(x16, fp8, None, scale, torch.tensor(0.5)) is None  # a static input scale


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter: TRITON_INTERPRET=1 with triton importable")
@pytest.mark.parametrize("shape", [(3,), (2, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_interpreted_triton_linear_matches_f_linear(shape: tuple[int, ...], with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, 64, generator=gen).to(torch.float16)
    weight = (torch.randn(96, 64, generator=gen) * 0.1).to(torch.float16)
    bias = torch.randn(96, generator=gen).to(torch.float16) if with_bias else None
    out = triton_linear(x, weight, bias, None, None)
    assert out is not None and out.shape == (*shape, 96) and out.dtype == torch.float16
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert ((out.float() - want).norm() / want.norm()).item() < 2e-3
