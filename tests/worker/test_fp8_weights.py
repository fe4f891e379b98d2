"""--quantization fp8 in the model and the runner (CPU: `torch._scaled_mm` runs there too, though the engine
refuses the flag on CPU): which modules are quantized, the load-time rules, and a tiny model's logits
against its 16-bit self."""

from __future__ import annotations

import pathlib

import pytest
import torch
from runner_harness import (
    BLOCK_SIZE,
    ToyScheduler,
    five_prefill_logits,
    record_logits,
    sharpen,
    write_tiny_llama,
)

from conveyor.config import (
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    LoadFormat,
    ModelConfig,
    Quantization,
    SchedulerConfig,
)
from conveyor.kernels.fp8_linear import FP8_WEIGHT_DTYPE
from conveyor.model.fp8_weights import quantize_linears_fp8
from conveyor.model.layers import Linear
from conveyor.model.loader import load_model, resolve_quantization
from conveyor.model.tensor_parallel import tensor_parallel_quantization
from conveyor.sampling_params import SamplingParams
from conveyor.worker.model_runner import ModelRunner


@pytest.mark.parametrize("quantization", [Quantization.FP8, Quantization.PTPC_FP8])
def test_load_quantizes_the_projections_only(tmp_path: pathlib.Path, quantization: Quantization) -> None:
    config = ModelConfig(model=str(write_tiny_llama(tmp_path)), load_format=LoadFormat.DUMMY,
                         quantization=quantization, dtype="bfloat16")
    loaded = load_model(config, "cpu", torch.bfloat16)
    assert loaded.quantization is quantization
    linears = [m for m in loaded.module.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4  # per layer: qkv, o, gate_up, down
    assert all(m.weight.dtype == FP8_WEIGHT_DTYPE and m.weight_scale is not None for m in linears)
    per_channel = quantization is Quantization.PTPC_FP8  # a [1, N] row of scales, else one []
    assert all(m.weight_scale.shape == ((1, m.weight.shape[0]) if per_channel else ()) for m in linears)
    others = [p.dtype for name, p in loaded.module.named_parameters() if not name.endswith("proj.weight")]
    assert others and set(others) == {torch.bfloat16}  # embedding, norms, LM head


def test_fp8_is_refused_where_it_cannot_run() -> None:
    assert resolve_quantization(Quantization.FP8, LoadFormat.GGUF, "cuda", torch.bfloat16) is Quantization.FP8
    with pytest.raises(ValueError, match="quantizes 16-bit weights at load"):
        resolve_quantization(Quantization.FP8, LoadFormat.GGUF, "cuda", torch.float32)
    with pytest.raises(ValueError, match="--dtype bfloat16 or float16"):
        resolve_quantization(Quantization.FP8, LoadFormat.DUMMY, "cuda", torch.float32)
    assert resolve_quantization(Quantization.FP8, LoadFormat.SAFETENSORS, "cuda", torch.float16) is Quantization.FP8
    assert tensor_parallel_quantization(Quantization.FP8) is Quantization.FP8  # each rank quantizes its shard
    with pytest.raises(ConfigError, match="quantization fp8 needs --device cuda"):
        EngineConfig(model=ModelConfig(quantization=Quantization.FP8))
    EngineConfig(model=ModelConfig(quantization=Quantization.FP8), device=DeviceConfig(device="cuda"))
    assert tensor_parallel_quantization(Quantization.PTPC_FP8) is Quantization.PTPC_FP8
    with pytest.raises(ValueError, match="quantization ptpc_fp8 quantizes 16-bit weights"):
        resolve_quantization(Quantization.PTPC_FP8, LoadFormat.SAFETENSORS, "cuda", torch.float32)
    with pytest.raises(ConfigError, match="quantization ptpc_fp8 needs --device cuda"):
        EngineConfig(model=ModelConfig(quantization=Quantization.PTPC_FP8))


def first_step_logits(model_dir: pathlib.Path, fp8: bool, per_channel: bool = False) -> torch.Tensor:
    """Logits [5, V] of five prompts' prefills, teacher-forced: the same inputs for both models."""
    runner = ModelRunner(ModelConfig(model=str(model_dir), load_format=LoadFormat.DUMMY, dtype="bfloat16"),
                         CacheConfig(block_size=BLOCK_SIZE, num_blocks_override=512),
                         SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=256),
                         DeviceConfig())
    sharpen(runner.model)  # the 16-bit weights first, then quantized as the loader would
    if fp8:
        assert quantize_linears_fp8(runner.model, per_channel) == 8
    return five_prefill_logits(runner)


def test_logits_stay_close_to_the_16_bit_models(tmp_path: pathlib.Path) -> None:
    model_dir = write_tiny_llama(tmp_path)
    reference, quantized = first_step_logits(model_dir, fp8=False), first_step_logits(model_dir, fp8=True)
    error = float((quantized - reference).norm() / reference.norm())
    assert 0 < error <= 0.1  # measured 0.057 over 2 layers; argmax equal on 4 of 5 rows (one near-tie)
    per_channel = first_step_logits(model_dir, fp8=True, per_channel=True)  # ptpc_fp8: finer scales, as close
    assert 0 < float((per_channel - reference).norm() / reference.norm()) <= 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_runner_serves_fp8_weights_with_graphs(tmp_path: pathlib.Path) -> None:
    """Loaded as `conveyor serve --quantization fp8` loads it; CUDA graphs replay the dynamic activation
    scales; tokens come out and the logits stay near the bf16 model's."""
    model_dir = write_tiny_llama(tmp_path)
    outputs = {}
    for quantization in (Quantization.NONE, Quantization.FP8, Quantization.PTPC_FP8):
        runner = ModelRunner(ModelConfig(model=str(model_dir), load_format=LoadFormat.DUMMY, dtype="bfloat16",
                                         quantization=quantization),
                             CacheConfig(block_size=BLOCK_SIZE, num_blocks_override=512),
                             SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256),
                             DeviceConfig(device="cuda"))
        runner.initialize_kv_cache()
        assert runner.cuda_graphs is not None
        calls = record_logits(runner)
        scheduler = ToyScheduler()
        for index in range(4):
            scheduler.add(f"r{index}", [(5 * index + j) % 250 + 3 for j in range(9 + 7 * index)],
                          SamplingParams(temperature=0.0, max_tokens=1))
        scheduler.run(runner)
        outputs[quantization] = calls[0].float()  # the prefill step's logits: the same inputs for both
    reference = outputs[Quantization.NONE]
    for quantized in (outputs[Quantization.FP8], outputs[Quantization.PTPC_FP8]):
        assert not quantized.isnan().any()
        assert float((quantized - reference).norm() / reference.norm()) <= 0.1


@pytest.mark.parametrize("method", ["fp8", "ptpc_fp8"])
def test_serve_on_cpu_refuses_fp8_weights_in_one_line(capsys: pytest.CaptureFixture[str], method: str) -> None:
    from conveyor.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--quantization", method])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"quantization {method} needs --device cuda" in errors[0]


def test_each_tensor_parallel_rank_quantizes_its_own_shard(tmp_path: pathlib.Path) -> None:
    """Rank r's FP8 weights read back (x its own scale) as its rows / columns of the full bf16 model,
    within e4m3's roundoff: scales are per shard, and the row-parallel sum stays exact in them."""
    from conveyor.model.parallel_layers import TensorParallelGroup

    config = ModelConfig(model=str(write_tiny_llama(tmp_path)), load_format=LoadFormat.DUMMY, dtype="bfloat16")
    full = load_model(config, "cpu", torch.bfloat16).module
    fp8 = ModelConfig(model=config.model, load_format=LoadFormat.DUMMY, dtype="bfloat16",
                      quantization=Quantization.FP8)
    for rank in range(2):
        shard = load_model(fp8, "cpu", torch.bfloat16, tensor_parallel=TensorParallelGroup(rank, 2)).module
        down = shard.model.layers[0].mlp.down_proj  # row-parallel: this rank's 64 of 128 input columns
        back = down.weight.float() * down.weight_scale
        expected = full.model.layers[0].mlp.down_proj.weight.float()[:, 64 * rank: 64 * (rank + 1)]
        assert ((back - expected).abs() <= expected.abs() * 2.0**-4 + down.weight_scale * 2.0**-10).all()


def _scaled_mm_in_float32(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                          bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """What `_scaled_mm` computes for per-tensor scales (FP8 operands, float32 accumulation), by a float32 GEMM."""
    out = (a.float() @ b.float()) * (scale_a * scale_b)
    out = out if bias is None else out + bias.float()
    return out.to(out_dtype or a.dtype)


def test_the_embedded_gguf_quantizes_to_fp8_from_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """The only real weights CI ships: SmolLM2's GGUF dequantized to bf16, then its 120 projections in
    FP8 (what benchmarks/gpu/real_weights.py --fp8 serves on CUDA). Eight prompts' prefill logits, the
    same inputs for both models: measured 11.4% relative L2 and the same argmax on 8 of 8 rows on a Xeon, 13.7% and 6 of 8
    on an AVX-512 BF16 EPYC (every FP8 pick within 0.25 std of the reference's top logit)."""
    from conveyor.engine.tokenizer import Tokenizer
    from conveyor.model.loader import embedded_gguf_path

    # torch 2.13's CPU `_scaled_mm` takes ~0.46 s a call on a 2-vCPU Xeon (~280 s for this test): this test is
    # about the weights' quantization, so the GEMM runs as the same math in float32 (the kernel's own tests
    # and the GPU tests cover `_scaled_mm` itself).
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_in_float32)
    gguf = embedded_gguf_path()
    tokenizer = Tokenizer.from_path(gguf)
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
             "The three laws of thermodynamics are", "SELECT name, email FROM users WHERE", "In 1969, the first",
             "A recipe for pancakes:\n1.", "The difference between TCP and UDP is"]
    logits = {}
    for quantization in (Quantization.NONE, Quantization.FP8):
        runner = ModelRunner(ModelConfig(model=str(gguf), dtype="bfloat16", quantization=quantization),
                             CacheConfig(block_size=BLOCK_SIZE, num_blocks_override=64),
                             SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256),
                             DeviceConfig())
        linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
        assert len(linears) == 30 * 4 and all((m.weight.dtype == FP8_WEIGHT_DTYPE) == quantization.is_fp8
                                              for m in linears)
        runner.initialize_kv_cache()
        calls, scheduler = record_logits(runner), ToyScheduler()
        for index, text in enumerate(texts):
            scheduler.add(f"r{index}", tokenizer.encode(text), SamplingParams(temperature=0.0, max_tokens=1))
        scheduler.step(runner)
        logits[quantization] = calls[0].float()
    reference, quantized = logits[Quantization.NONE], logits[Quantization.FP8]
    assert 0 < float((quantized - reference).norm() / reference.norm()) <= 0.2
    # FP8 may flip a near-tie of the bf16 reference (whose own bits vary with the CPU's bf16 GEMM: an AVX-512
    # BF16 EPYC gave 13.7% and 6 of 8 argmaxes, where the two rows that differ sat 0.25 and 0.04 std below the
    # reference's top); wrong scales would pick tokens several std below it.
    picked = reference.gather(1, quantized.argmax(-1, keepdim=True)).squeeze(1)
    assert bool((reference.max(-1).values - picked <= 0.5 * reference.std(-1)).all())
    assert int((quantized.argmax(-1) == reference.argmax(-1)).sum()) >= 6
