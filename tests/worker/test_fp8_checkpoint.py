"""Hugging Face checkpoints already in FP8 (model/fp8_checkpoint.py), loaded through the real loader on the CPU
(`torch._scaled_mm` runs there, though the engine refuses FP8 on the CPU): a tiny Llama quantized per shard
(q, k, v and gate, up each with its own scale) and saved as vLLM's `fp8` method stores it."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from runner_harness import BLOCK_SIZE, TINY_LLAMA, five_prefill_logits, sharpen, write_tiny_llama
from safetensors.torch import save_file

from conveyor.config import CacheConfig, DeviceConfig, LoadFormat, ModelConfig, Quantization, SchedulerConfig
from conveyor.kernels.fp8_linear import FP8_WEIGHT_DTYPE
from conveyor.kernels.fp8_quant import dynamic_scale, quantize_fp8
from conveyor.model.fp8_checkpoint import fp8_checkpoint_config, requantize_to_max_scale
from conveyor.model.fp8_weights import quantize_linears_fp8
from conveyor.model.layers import Linear
from conveyor.model.llama import LlamaForCausalLM
from conveyor.model.loader import load_model
from conveyor.model.parallel_layers import TensorParallelGroup
from conveyor.worker.model_runner import ModelRunner

_HF_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
SHARD_SPREAD = (1.0, 1.37, 2.5)
"""Factors on each shard's own max|W| / 448: the merge rounds q and k (ratios 1/2.5, 1.37/2.5), keeps v."""


def hf_fp8_tensors(model: LlamaForCausalLM, equal_scales: bool, static: bool) -> dict[str, torch.Tensor]:
    """`model`'s weights under HF names, every projection split into its HF shards and stored in FP8 with
    its own scale (the fused module's dynamic scale for all its shards when `equal_scales`)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        fused = next((f for f in _HF_SHARDS if f".{f}." in name), None)
        if not name.endswith("_proj.weight"):
            tensors[name] = param.detach().clone()
            continue
        parts = param.detach().split(model.shard_rows(name)) if fused else (param.detach(),)
        names = [name.replace(fused, shard) for shard in _HF_SHARDS[fused]] if fused else [name]
        for index, (hf_name, part) in enumerate(zip(names, parts)):
            scale = dynamic_scale(param) if equal_scales else dynamic_scale(part) * SHARD_SPREAD[index]
            prefix = hf_name.removesuffix(".weight")
            tensors[hf_name] = quantize_fp8(part, scale)
            tensors[f"{prefix}.weight_scale"] = scale.reshape(())
            if static:
                tensors[f"{prefix}.input_scale"] = torch.tensor(0.01 * (index + 1))
    return tensors


def write_fp8_checkpoint(directory: pathlib.Path, tensors: dict[str, torch.Tensor],
                         quantization_config: dict[str, object]) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**TINY_LLAMA, "quantization_config": quantization_config}))
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(directory / "model.safetensors"))
    return directory


def sharpened_model(tmp_path: pathlib.Path) -> LlamaForCausalLM:
    """The tiny Llama in bf16 with runner_harness's sharpened weights (the 16-bit source of every checkpoint)."""
    config = ModelConfig(model=str(write_tiny_llama(tmp_path / "bf16")), load_format=LoadFormat.DUMMY, dtype="bfloat16")
    model = load_model(config, "cpu", torch.bfloat16).module
    sharpen(model)
    return model


def load_checkpoint(directory: pathlib.Path, quantization: Quantization = Quantization.AUTO) -> LlamaForCausalLM:
    config = ModelConfig(model=str(directory), load_format=LoadFormat.SAFETENSORS, dtype="bfloat16",
                         quantization=quantization)
    loaded = load_model(config, "cpu", torch.bfloat16)
    assert loaded.quantization is Quantization.FP8
    return loaded.module


MODULE_SHARDS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.down_proj": ("mlp.down_proj",),
}


def test_shards_with_different_scales_merge_to_the_max_within_e4m3_rounding(tmp_path: pathlib.Path) -> None:
    tensors = hf_fp8_tensors(sharpened_model(tmp_path), equal_scales=False, static=False)
    model = load_checkpoint(write_fp8_checkpoint(tmp_path / "fp8", tensors, {"quant_method": "fp8"}))
    for layer in range(2):
        for module_name, shards in MODULE_SHARDS.items():
            module = model.get_submodule(f"model.layers.{layer}.{module_name}")
            assert isinstance(module, Linear) and module.weight.dtype == FP8_WEIGHT_DTYPE
            prefixes = [f"model.layers.{layer}.{shard}" for shard in shards]
            scales = [float(tensors[f"{p}.weight_scale"]) for p in prefixes]
            assert module.weight_scale is not None and float(module.weight_scale) == max(scales)
            expected = torch.cat([tensors[f"{p}.weight"].float() * s for p, s in zip(prefixes, scales)])
            loaded = module.weight.float() * module.weight_scale
            # half an e4m3 step: 2^-4 relative for normals, s_max * 2^-10 below them (+ float32 products' slop)
            bound = expected.abs() * (2.0**-4 + 1e-6) + module.weight_scale * 2.0**-10
            assert ((loaded - expected).abs() <= bound).all(), module_name
            owner = scales.index(max(scales))  # the shard holding the max scale keeps its bits
            start = sum(tensors[f"{p}.weight"].shape[0] for p in prefixes[:owner])
            stored = tensors[f"{prefixes[owner]}.weight"]
            assert torch.equal(module.weight[start:start + stored.shape[0]].view(torch.uint8), stored.view(torch.uint8))
    assert model.lm_head is not None and model.lm_head.weight.dtype == torch.bfloat16


def test_requantize_is_exact_for_power_of_two_ratios() -> None:
    values = torch.tensor([[1.0, -2.5, 448.0], [0.125, 3.0, -6.0]]).to(FP8_WEIGHT_DTYPE)  # two shards of one row
    weight = values.clone()
    merged = requantize_to_max_scale(weight, [torch.tensor(0.5), torch.tensor(2.0)], [1, 1])
    assert float(merged) == 2.0
    assert torch.equal(weight.float() * merged, values.float() * torch.tensor([[0.5], [2.0]]))


def make_runner(model_config: ModelConfig) -> ModelRunner:
    return ModelRunner(model_config, CacheConfig(block_size=BLOCK_SIZE, num_blocks_override=512),
                       SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=256), DeviceConfig())


def test_logits_equal_on_the_fly_fp8_when_the_shard_scales_are_equal(tmp_path: pathlib.Path) -> None:
    """With every shard at its fused module's dynamic scale the checkpoint holds the bits `--quantization fp8`
    computes at load, so the two models' logits agree (to the bit on this CPU)."""
    model_dir = write_tiny_llama(tmp_path / "bf16")
    online = make_runner(ModelConfig(model=str(model_dir), load_format=LoadFormat.DUMMY, dtype="bfloat16"))
    sharpen(online.model)
    tensors = hf_fp8_tensors(online.model, equal_scales=True, static=False)
    assert quantize_linears_fp8(online.model) == 8
    config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    checkpoint = write_fp8_checkpoint(tmp_path / "fp8", tensors, config)
    stored = make_runner(ModelConfig(model=str(checkpoint), load_format=LoadFormat.SAFETENSORS, dtype="bfloat16"))
    reference, loaded = five_prefill_logits(online), five_prefill_logits(stored)
    assert float((loaded - reference).abs().max()) <= 1e-3 * float(reference.abs().max())


def test_static_input_scales_merge_to_the_max_and_are_applied(tmp_path: pathlib.Path) -> None:
    tensors = hf_fp8_tensors(sharpened_model(tmp_path), equal_scales=False, static=True)
    config = {"quant_method": "fp8", "activation_scheme": "static"}
    qkv = load_checkpoint(write_fp8_checkpoint(tmp_path / "fp8", tensors, config)).model.layers[0].self_attn.qkv_proj
    assert qkv.input_scale is not None and float(qkv.input_scale) == pytest.approx(0.03)  # max of q, k, v's
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x_deq = quantize_fp8(x, qkv.input_scale).float() * qkv.input_scale  # static: never max|x| / 448
    expected = x_deq @ (qkv.weight.float() * qkv.weight_scale).t()
    assert torch.allclose(qkv(x).float(), expected, rtol=2e-2, atol=1e-2)


def test_ignored_layers_stay_16_bit(tmp_path: pathlib.Path) -> None:
    tensors = hf_fp8_tensors(sharpened_model(tmp_path), equal_scales=False, static=False)
    down = "model.layers.1.mlp.down_proj"
    tensors[f"{down}.weight"] = tensors[f"{down}.weight"].float().mul(tensors.pop(f"{down}.weight_scale")).bfloat16()
    model = load_checkpoint(write_fp8_checkpoint(tmp_path / "fp8", tensors,
                                                 {"quant_method": "fp8", "ignored_layers": [down, "lm_head"]}))
    module = model.get_submodule(down)
    assert module.weight.dtype == torch.bfloat16 and getattr(module, "weight_scale") is None
    assert model.model.layers[0].mlp.down_proj.weight.dtype == FP8_WEIGHT_DTYPE


def test_each_tensor_parallel_rank_holds_its_part_of_the_merged_weights(tmp_path: pathlib.Path) -> None:
    """Every rank merges with the whole checkpoint's scales: its rows of q/k/v (columns of down_proj) are the
    unsharded model's FP8 bits, under the same scale."""
    tensors = hf_fp8_tensors(sharpened_model(tmp_path), equal_scales=False, static=True)
    config_json = {"quant_method": "fp8", "activation_scheme": "static"}
    checkpoint = write_fp8_checkpoint(tmp_path / "fp8", tensors, config_json)
    full = load_checkpoint(checkpoint).model.layers[1]
    config = ModelConfig(model=str(checkpoint), load_format=LoadFormat.SAFETENSORS, dtype="bfloat16")
    for rank in range(2):
        shard = load_model(config, "cpu", torch.bfloat16, tensor_parallel=TensorParallelGroup(rank, 2)).module
        layer = shard.model.layers[1]
        qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
        assert torch.equal(qkv.weight_scale, full.self_attn.qkv_proj.weight_scale)
        assert torch.equal(qkv.input_scale, full.self_attn.qkv_proj.input_scale)
        weight = full.self_attn.qkv_proj.weight  # q 64 rows, k 32, v 32: a rank keeps half of each
        q, k, v = weight[32 * rank: 32 * rank + 32], weight[64 + 16 * rank: 80 + 16 * rank], weight[96 + 16 * rank:][:16]
        assert torch.equal(qkv.weight.view(torch.uint8), torch.cat([q, k, v]).view(torch.uint8))
        columns = full.mlp.down_proj.weight[:, 64 * rank: 64 * (rank + 1)]
        assert torch.equal(down.weight.view(torch.uint8), columns.view(torch.uint8))
        assert torch.equal(down.weight_scale, full.mlp.down_proj.weight_scale) and down.input_scale is not None


def one_line_error(directory: pathlib.Path, quantization: Quantization = Quantization.AUTO) -> str:
    config = ModelConfig(model=str(directory), load_format=LoadFormat.SAFETENSORS, dtype="bfloat16",
                         quantization=quantization)
    with pytest.raises(ValueError) as error:
        load_model(config, "cpu", torch.bfloat16)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_other_methods_and_contradictions_fail_in_one_line(tmp_path: pathlib.Path) -> None:
    tensors = hf_fp8_tensors(sharpened_model(tmp_path), equal_scales=False, static=False)
    fp8 = write_fp8_checkpoint(tmp_path / "fp8", tensors, {"quant_method": "fp8"})
    assert "--quantization none contradicts" in one_line_error(fp8, Quantization.NONE)
    assert "--quantization gguf contradicts" in one_line_error(fp8, Quantization.GGUF)
    assert load_checkpoint(fp8, Quantization.FP8) is not None  # the flag agrees with the checkpoint
    gptq = write_fp8_checkpoint(tmp_path / "gptq", tensors, {"quant_method": "gptq", "bits": 4})
    assert "quantized with 'gptq'" in one_line_error(gptq)
    ct = write_fp8_checkpoint(tmp_path / "ct", tensors, {"quant_method": "compressed-tensors"})
    assert "quantized with 'compressed-tensors'" in one_line_error(ct)
    with pytest.raises(ValueError, match="block-wise FP8"):
        fp8_checkpoint_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})


def test_serve_on_cpu_refuses_an_fp8_checkpoint_in_one_line(tmp_path: pathlib.Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from conveyor.cli import main

    write_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(tmp_path)])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "FP8 checkpoint" in errors[0] and "--device cuda" in errors[0]
