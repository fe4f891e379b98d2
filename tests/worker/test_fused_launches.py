"""The fused launches across layer boundaries (residual add + norm, Qwen3's q/k norm + rope, the rope kernels'
K/V store, which alone gives the same logits bit for bit: test_cuda_rope_stores_kv_as_write_kv_would): a tiny Llama gives
identical logits with them and with the separate kernels on CUDA (bf16, CUDA graphs and eager); a tiny Qwen3's
stay within bf16 rounding of them (the fused q/k norm's row sum is compiled with another reduction tree: the
H100 said so on 2026-12-07), compared on the same inputs; on the CPU the residual-stream stack equals the
plain loop bit for bit. The split-K o/down projections summed in the next norm are not cuBLAS's bits: they are
off in the bit-for-bit comparisons and compared with cuBLAS's projections within bf16 rounding on their own."""

from __future__ import annotations

import json
import pathlib
import weakref
from collections.abc import Callable

import pytest
import torch
from runner_harness import TINY_MODELS, run_mixed_steps, sharpen

from conveyor.config import (
    CacheConfig,
    DeviceConfig,
    LoadFormat,
    ModelConfig,
    SchedulerConfig,
)
from conveyor.model.layers import Linear
from conveyor.model.llama import ResidualStream
from conveyor.worker.model_runner import ModelRunner

CUDA = torch.cuda.is_available()


def _runner(directory: pathlib.Path, hf_config: dict, device: str, fused: bool, eager: bool,
            kv_in_rope: bool = True, splitk: bool = True,
            before_capture: Callable[[ModelRunner], object] | None = None) -> ModelRunner:
    """A runner on the tiny model with the fused launches on or off before any CUDA graph is captured
    (`kv_in_rope=False`: all on but the rope kernels' K/V store; `splitk=False`: all on but the split-K
    projections summed in the next norm, i.e. cuBLAS's o/down projections; `before_capture` sees the model
    before the KV cache and CUDA graphs exist)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config))
    runner = ModelRunner(
        ModelConfig(model=str(directory), load_format=LoadFormat.DUMMY, seed=0),
        CacheConfig(block_size=4, num_blocks_override=256, gpu_memory_utilization=0.3),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256),
        DeviceConfig(device=device, enforce_eager=eager),
    )
    sharpen(runner.model)
    runner.model.set_fused_launches(fused)
    if not kv_in_rope:
        for layer in runner.model.model.layers:
            layer.self_attn.stores_kv_in_rope = lambda *args: False
    if not splitk:
        for module in runner.model.modules():
            if isinstance(module, Linear):
                module.fused_launches = False
    if before_capture is not None:
        before_capture(runner)
    runner.initialize_kv_cache()
    return runner


def _logits(runner: ModelRunner) -> list[torch.Tensor]:
    return run_mixed_steps(runner)[0]


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) > 0
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {step}: {(a != b).sum().item()} logits differ"


@pytest.mark.parametrize("name", TINY_MODELS)
def test_cpu_residual_stream_equals_the_plain_loop(tmp_path: pathlib.Path, name: str) -> None:
    plain = _runner(tmp_path / name, TINY_MODELS[name], "cpu", fused=True, eager=True)
    assert not plain.model.uses_residual_stream(torch.zeros(1, 64))  # the CPU keeps the plain loop
    stream = _runner(tmp_path / name, TINY_MODELS[name], "cpu", fused=True, eager=True)
    stream.model.uses_residual_stream = lambda x: True  # type: ignore[method-assign]
    _assert_same(_logits(stream), _logits(plain))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_cuda_fused_logits_equal_the_separate_kernels(tmp_path: pathlib.Path, name: str, eager: bool) -> None:
    """All fusions but split-K, whose float32 sums are not cuBLAS's bits (test_cuda_splitk_within_rounding_of_cublas)."""
    fused = _runner(tmp_path / name, TINY_MODELS[name], "cuda", fused=True, eager=eager, splitk=False)
    assert fused.model.dtype == torch.bfloat16
    assert fused.model.uses_residual_stream(torch.zeros(1, 64, dtype=torch.bfloat16, device="cuda"))
    separate = _runner(tmp_path / name, TINY_MODELS[name], "cuda", fused=False, eager=eager)
    want, tokens = run_mixed_steps(separate)
    if name == "llama":
        _assert_same(_logits(fused), want)
        return
    got, _ = run_mixed_steps(fused, forced=tokens)
    assert len(got) == len(want) > 0
    errors = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, want, strict=True)]
    print(f"{name} {eager=}: logits relative error max {max(errors):.2e}")
    assert max(errors) <= 2e-2


def _count_write_kv(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-element list counting the calls of the attention backend's `write_kv` from now on."""
    backend = runner.model.model.layers[0].self_attn.attn.backend
    calls, write_kv = [0], backend.write_kv

    def counted(*args: object) -> None:
        calls[0] += 1
        write_kv(*args)

    monkeypatch.setattr(backend, "write_kv", counted)
    return calls


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_cuda_rope_stores_kv_as_write_kv_would(tmp_path: pathlib.Path, name: str, eager: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The rope kernel's K/V store (one launch fewer a layer) against rope then `write_kv`, everything else fused
    alike: the same cache bytes, so the same logits bit for bit, with and without CUDA graphs; and no
    `write_kv` call is left on the fused path (eager prefill steps included)."""
    fused = _runner(tmp_path / name, TINY_MODELS[name], "cuda", fused=True, eager=eager)
    separate = _runner(tmp_path / name, TINY_MODELS[name], "cuda", fused=True, eager=eager, kv_in_rope=False)
    fused_calls, separate_calls = _count_write_kv(fused, monkeypatch), _count_write_kv(separate, monkeypatch)
    want, tokens = run_mixed_steps(separate)
    got, _ = run_mixed_steps(fused, forced=tokens)
    assert fused_calls[0] == 0 < separate_calls[0]
    _assert_same(got, want)


def _record_lifetimes(runner: ModelRunner) -> list[int]:
    """Hooks on every decoder layer that count, when its MLP starts, how many of the layer's [T, hidden]
    transients are still alive: the stream it was handed (the previous layer's delta and residual, or the
    embeddings) and its attention output. Weak references only, so the count sees the model's own holds."""
    alive_at_mlp: list[int] = []
    for layer in runner.model.model.layers:
        watched: list[weakref.ref[torch.Tensor]] = []

        def take_stream(stream: ResidualStream, *args: object, _original=layer.forward_residual,
                        _watched=watched) -> None:
            _watched[:] = [weakref.ref(t) for t in (stream.delta, stream.residual) if t is not None]
            _original(stream, *args)

        def watch_attention(module: torch.nn.Module, inputs: object, output: torch.Tensor,
                            _watched=watched) -> None:
            _watched.append(weakref.ref(output))

        def count_at_mlp(module: torch.nn.Module, inputs: object, _watched=watched) -> None:
            assert len(_watched) >= 2  # the stream's tensors and the attention output were seen
            alive_at_mlp.append(sum(ref() is not None for ref in _watched))

        layer.forward_residual = take_stream
        layer.self_attn.register_forward_hook(watch_attention)
        layer.mlp.register_forward_pre_hook(count_at_mlp)
    return alive_at_mlp


@pytest.mark.parametrize("name", TINY_MODELS)
def test_residual_stream_frees_each_layers_transients_before_its_mlp(tmp_path: pathlib.Path, name: str) -> None:
    """Lifetimes only (the logits are the plain loop's bit for bit: test_cpu_residual_stream_equals_the_plain_loop):
    at each layer's MLP, where gate_up and its activation set the forward's peak, the previous layer's delta and
    residual and this layer's attention output are gone, 3 x T x hidden fewer elements (24 KiB a token for
    Llama-3.1-8B in bf16), and the first layer's embeddings too. Torch's CPU allocator keeps no peak to read,
    so the test counts the live tensors instead of bytes."""
    stream = _runner(tmp_path / name, TINY_MODELS[name], "cpu", fused=True, eager=True)
    stream.model.uses_residual_stream = lambda x: True  # type: ignore[method-assign]
    alive_at_mlp = _record_lifetimes(stream)
    _logits(stream)
    assert len(alive_at_mlp) > 2 * len(stream.model.model.layers)  # several steps ran through every layer
    assert set(alive_at_mlp) == {0}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_forward_frees_transients_before_the_peak(tmp_path: pathlib.Path) -> None:
    """The same lifetimes on the fused CUDA path (eager, as the profiling pass runs), and the MLP's gate_up gone
    before down_proj allocates its output: the peak is gate_up + activation, not those plus the output."""
    runner = _runner(tmp_path / "llama", TINY_MODELS["llama"], "cuda", fused=True, eager=True, splitk=False)
    alive_at_mlp = _record_lifetimes(runner)
    gate_up_alive_at_down: list[bool] = []
    for layer in runner.model.model.layers:
        gate_up: list[weakref.ref[torch.Tensor]] = []
        layer.mlp.gate_up_proj.register_forward_hook(
            lambda module, inputs, output, _seen=gate_up: _seen.__setitem__(slice(None), [weakref.ref(output)]))
        layer.mlp.down_proj.register_forward_pre_hook(
            lambda module, inputs, _seen=gate_up: gate_up_alive_at_down.append(_seen[0]() is not None))
    _logits(runner)
    assert alive_at_mlp and set(alive_at_mlp) == {0}
    assert gate_up_alive_at_down and not any(gate_up_alive_at_down)


SPLITK_QWEN3 = {**TINY_MODELS["qwen3"], "head_dim": 32}
"""The tiny Qwen3 with o_proj's K = 4 x 32 = 128 >= 2 x hidden: both projections split K (the tiny models' o_proj,
K 64, keeps cuBLAS; their down_proj, K 128, splits)."""


def _count_partial_sums(runner: ModelRunner, taken: dict[str, int]) -> None:
    """Counts in taken["o_proj"] and taken["down_proj"] the calls of each projection's `partial_sums` that
    returned partials (CUDA graphs' captures included)."""
    for name, module in runner.model.named_modules():
        kind = name.rpartition(".")[2]
        if kind in taken and isinstance(module, Linear):
            def counted(x: torch.Tensor, silu: bool = False, _original=module.partial_sums, _kind=kind) -> object:
                sums = _original(x, silu)
                taken[_kind] += sums is not None
                return sums

            module.partial_sums = counted  # type: ignore[method-assign]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", [*TINY_MODELS, "qwen3-splitk-o"])
def test_cuda_splitk_within_rounding_of_cublas(tmp_path: pathlib.Path, name: str, eager: bool) -> None:
    """The split-K o/down projections summed in add_rms_norm (the SwiGLU taken in down_proj's loads) against
    cuBLAS's projections, everything else fused alike, on the same inputs (teacher forcing): the partials are
    added in float32 and rounded once, as cuBLAS's output is, so the logits stay within bf16 rounding."""
    config = SPLITK_QWEN3 if name == "qwen3-splitk-o" else TINY_MODELS[name]
    taken, untaken = {"o_proj": 0, "down_proj": 0}, {"o_proj": 0, "down_proj": 0}
    fused = _runner(tmp_path / name, config, "cuda", fused=True, eager=eager,
                    before_capture=lambda runner: _count_partial_sums(runner, taken))
    cublas = _runner(tmp_path / name, config, "cuda", fused=True, eager=eager, splitk=False,
                     before_capture=lambda runner: _count_partial_sums(runner, untaken))
    want, tokens = run_mixed_steps(cublas)
    got, _ = run_mixed_steps(fused, forced=tokens)
    assert taken["down_proj"] > 0 and (taken["o_proj"] > 0) == (name == "qwen3-splitk-o"), taken
    assert untaken == {"o_proj": 0, "down_proj": 0}
    assert len(got) == len(want) > 0
    errors = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, want, strict=True)]
    print(f"{name} {eager=}: split-K logits relative error max {max(errors):.2e}, partials taken {taken}")
    assert max(errors) <= 2e-2
