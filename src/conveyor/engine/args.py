"""Engine command-line flags (vLLM names) and their mapping onto `EngineConfig`, shared by
`conveyor generate` and `conveyor serve` so both accept exactly the same engine flags.

Every flag defaults to `None` in argparse and is passed to its dataclass only when given, so the
defaults live in `config.py` alone. Cross-field validation happens in the dataclasses; their
`ConfigError` messages are rewritten to name flags instead of fields and reported through
`parser.error` (exit status 2, usage line), as for any other bad flag. Stdlib only: the server
imports this module and must not load torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass

from conveyor.config import (
    CUDA_DEFAULTS,
    KV_CACHE_DTYPES,
    Batching,
    CacheConfig,
    CUDAGraphMode,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    GemmBackend,
    LoadFormat,
    ModelConfig,
    ParallelConfig,
    Quantization,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
)
from conveyor.engine.generation_defaults import parse_generation_config, parse_override_generation_config
from conveyor.engine.model_files import checkpoint_quant_method, model_max_positions
from conveyor.engine.vllm_flags import (
    add_vllm_engine_flags,
    human_readable_int,
    speculative_shorthand,
    vllm_engine_overrides,
)

_PARSER_KEY = "engine_args_parser"
"""Namespace attribute holding the parser, so `engine_config_from_args` can call `parser.error`."""

_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


@dataclass(frozen=True)
class _Flag:
    """One engine flag: where its value goes."""

    flag: str
    """Command-line spelling, e.g. --max-num-seqs."""
    section: str
    """EngineConfig attribute holding the dataclass (model, scheduler, cache, device, parallel) or '' for top level."""
    field_name: str
    """Dataclass field the value maps onto."""


# Flag -> config field, in help order. The argparse dest is the flag without dashes.
FLAGS: tuple[_Flag, ...] = (
    _Flag("--model", "model", "model"),
    _Flag("--tokenizer", "model", "tokenizer"),
    _Flag("--load-format", "model", "load_format"),
    _Flag("--dtype", "model", "dtype"),
    _Flag("--quantization", "model", "quantization"),
    _Flag("--gemm-backend", "model", "gemm_backend"),
    _Flag("--seed", "model", "seed"),
    _Flag("--served-model-name", "model", "served_model_name"),
    _Flag("--num-hidden-layers-override", "model", "num_hidden_layers_override"),
    _Flag("--revision", "model", "revision"),
    _Flag("--generation-config", "model", "generation_config"),
    _Flag("--override-generation-config", "model", "override_generation_config"),
    _Flag("--max-model-len", "scheduler", "max_model_len"),
    _Flag("--max-num-seqs", "scheduler", "max_num_seqs"),
    _Flag("--max-num-batched-tokens", "scheduler", "max_num_batched_tokens"),
    _Flag("--enable-chunked-prefill", "scheduler", "enable_chunked_prefill"),
    _Flag("--long-prefill-token-threshold", "scheduler", "long_prefill_token_threshold"),
    _Flag("--scheduling-policy", "scheduler", "policy"),
    _Flag("--batching", "scheduler", "batching"),
    _Flag("--max-num-queued-reqs", "scheduler", "max_num_queued_reqs"),
    _Flag("--max-num-queued-tokens", "scheduler", "max_num_queued_tokens"),
    _Flag("--queue-timeout", "scheduler", "queue_timeout_s"),
    _Flag("--async-scheduling", "scheduler", "async_scheduling"),
    _Flag("--block-size", "cache", "block_size"),
    _Flag("--enable-prefix-caching", "cache", "enable_prefix_caching"),
    _Flag("--kv-cache-memory", "cache", "kv_cache_memory_bytes"),
    _Flag("--gpu-memory-utilization", "cache", "gpu_memory_utilization"),
    _Flag("--num-gpu-blocks-override", "cache", "num_blocks_override"),
    _Flag("--kv-cache-dtype", "cache", "cache_dtype"),
    _Flag("--device", "device", "device"),
    _Flag("--enforce-eager", "device", "enforce_eager"),
    _Flag("--cudagraph-mode", "device", "cudagraph_mode"),
    _Flag("--max-cudagraph-capture-size", "device", "max_cudagraph_capture_size"),
    _Flag("--num-threads", "device", "num_threads"),
    _Flag("--tensor-parallel-size", "parallel", "tensor_parallel_size"),
    _Flag("--check-invariants", "", "check_invariants"),
    _Flag("--step-log-size", "", "step_log_size"),
    _Flag("--speculative-config", "", "speculative_config"),
)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def parse_memory_bytes(text: str) -> int:
    """`1073741824`, `1GiB`, `512MiB`, `2G` (decimal) -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected bytes such as 1073741824, 1GiB or 512MiB (got {text!r})")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""])


_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
"""vLLM's other spellings of --dtype."""
MAX_MODEL_LEN_AUTO = "auto"
"""--max-model-len auto (or -1, as vLLM): the model's own max positions, resolved from its files."""


def _dtype(text: str) -> str:
    return _DTYPE_ALIASES.get(text, text)


def _max_model_len(text: str) -> int | str:
    """vLLM's syntax: 2048, 4k (4000), 4K (4096), auto or -1."""
    if text.strip().lower() in (MAX_MODEL_LEN_AUTO, "-1"):
        return MAX_MODEL_LEN_AUTO
    return human_readable_int(text)


def _threshold(text: str) -> int | None:
    """vLLM spells 'no cap' as 0."""
    value = int(text)
    return None if value == 0 else value


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """`--speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'` (vLLM's JSON keys)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error.msg}): {text!r}") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as "
                                         f'{{"method": "ngram", "num_speculative_tokens": 3}} (got {text!r})')
    try:
        return SpeculativeConfig.from_dict(data)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("speculative_config: ")) from None


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags (and an optional positional MODEL, as `vllm serve MODEL`) to `parser`."""
    group = parser.add_argument_group("engine")
    group.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                       help="same as --model")
    _add_model_flags(group)
    _add_scheduler_flags(group)
    _add_cache_and_device_flags(group)
    parser.set_defaults(**{_PARSER_KEY: parser})


def _add_model_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--model", help="GGUF file or Hugging Face directory (default: embedded SmolLM2)")
    group.add_argument("--tokenizer", help="tokenizer.json directory or GGUF (default: the model's)")
    group.add_argument("--load-format", choices=[f.value for f in LoadFormat])
    group.add_argument("--dtype", type=_dtype, choices=["auto", "float32", "bfloat16", "float16"],
                       help="auto, float32 (float), bfloat16, float16 (half)")
    group.add_argument("--quantization", "-q", choices=[q.value for q in Quantization],
                       help="gguf: compute on the GGUF's quantized blocks (CPU); none: dequantize at load; "
                            "fp8: decoder projections quantized to FP8 at load (CUDA, 16-bit weights: a GGUF is dequantized first); "
                            "auto (default): gguf for a GGUF on CPU in float32")
    group.add_argument("--gemm-backend", choices=[b.value for b in GemmBackend],
                       help="GEMM of the decoder projections: torch (cuBLAS / _scaled_mm; default) or triton "
                            "(kernels/triton_gemm.py, tiled for decode batches; CUDA, bf16/fp16 or --quantization fp8)")
    group.add_argument("--seed", type=int, help="seed for dummy weights and unseeded sampling")
    group.add_argument("--served-model-name", nargs="+", metavar="NAME",
                       help="model name(s) clients send; the first is reported (default: from the path)")
    group.add_argument("--num-hidden-layers-override", type=int, help="keep only this many layers")
    group.add_argument("--revision", help="the checkpoint's revision, recorded in conveyor:model_info (no hub: "
                                          "nothing is fetched)")
    group.add_argument("--generation-config", type=parse_generation_config, metavar="{auto,vllm,PATH}",
                       help="default sampling parameters: auto (the model's generation_config.json; default), "
                            "vllm (vLLM's own) or a folder holding a generation_config.json")
    group.add_argument("--override-generation-config", type=parse_override_generation_config, metavar="JSON",
                       help='merged over the generation config, e.g. \'{"temperature": 0.5}\'')


def _add_scheduler_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--max-model-len", type=_max_model_len,
                       help="longest prompt+output: 2048, 4k (4000), 4K (4096), auto (the model's max positions); "
                            "default 2048, capped by the model's max positions")
    group.add_argument("--max-num-seqs", type=human_readable_int, help="most requests running at once")
    group.add_argument("--max-num-batched-tokens", type=human_readable_int, help="token budget of one step (8k, ...)")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("--long-prefill-token-threshold", type=_threshold,
                       help="cap on one request's prefill tokens per step (0: none)")
    group.add_argument("--scheduling-policy", choices=[p.value for p in SchedulingPolicy])
    group.add_argument("--batching", choices=[b.value for b in Batching],
                       help="continuous (default) or static fixed batches, for A/B comparison")
    group.add_argument("--max-num-queued-reqs", type=int,
                       help="cap on in-flight requests, waiting + running (503 + Retry-After beyond)")
    group.add_argument("--max-num-queued-tokens", type=int,
                       help="cap on prompt tokens of requests still in prefill (503 + Retry-After beyond)")
    group.add_argument("--queue-timeout", type=float,
                       help="seconds a request may wait unscheduled before it ends with 503")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="launch step N+1 before step N's tokens are back (overlaps host work with the GPU; "
                            "default: on for CUDA, off for CPU)")


def _add_cache_and_device_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--block-size", type=int, help="tokens per KV block")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("--kv-cache-memory", type=parse_memory_bytes,
                       help="KV cache bytes, e.g. 1GiB (CPU default 1 GiB)")
    group.add_argument("--kv-cache-memory-bytes", type=human_readable_int, dest="kv_cache_memory",
                       help="vLLM's spelling of --kv-cache-memory (4G = 4 GiB, 4g = 4e9)")
    group.add_argument("--gpu-memory-utilization", "--device-memory-utilization", type=float)
    group.add_argument("--num-gpu-blocks-override", type=int, help="exact number of KV blocks")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                       help="KV cache element type: auto (the model's dtype; default), fp8 (= fp8_e4m3) or "
                            "fp8_e5m2, per-tensor scales 1.0 as vLLM's default (CUDA only)")
    group.add_argument("--device", choices=["cpu", "cuda"])
    group.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None, help="no CUDA graphs")
    group.add_argument("--cudagraph-mode", choices=[m.value for m in CUDAGraphMode],
                       help="full: decode and mixed steps replay graphs (default); full_decode_only")
    group.add_argument("--max-cudagraph-capture-size", type=int,
                       help="largest token count of a captured mixed-step graph (default 2048)")
    group.add_argument("--num-threads", type=int, help="torch CPU threads (per rank under tensor parallelism)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int,
                       help="ranks (processes; one GPU each on CUDA) the model is split over (default 1)")
    group.add_argument("--check-invariants", action="store_true", default=None,
                       help="check scheduler and block-pool invariants after every step (slow)")
    group.add_argument("--step-log-size", type=int, metavar="N",
                       help="record each step's batch and wall time, keeping the newest N steps for GET /step_log "
                            "(the input of a fitted step-time model; default 0: off)")
    group.add_argument("--speculative-config", "-sc", type=parse_speculative_config, metavar="JSON",
                       help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                            '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": PATH, '
                            '"num_speculative_tokens": 3}\'')
    add_vllm_engine_flags(group)


def _converted(flag: _Flag, value: object) -> object:
    enums = {"load_format": LoadFormat, "policy": SchedulingPolicy, "batching": Batching,
             "cudagraph_mode": CUDAGraphMode, "quantization": Quantization,
             "gemm_backend": GemmBackend}
    return enums[flag.field_name](value) if flag.field_name in enums else value


def _given_values(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    """section -> {field: value} for the flags present on the command line, then what vLLM's spellings
    (-O, --compilation-config, --spec-*) imply for the fields no conveyor flag set."""
    given: dict[str, dict[str, object]] = {"model": {}, "scheduler": {}, "cache": {}, "device": {}, "parallel": {},
                                           "": {}}
    for flag in FLAGS:
        value = getattr(args, _dest(flag.flag), None)
        if value is not None:
            given[flag.section][flag.field_name] = _converted(flag, value)
    for section, fields in vllm_engine_overrides(args).items():
        for name, value in fields.items():
            given[section].setdefault(name, _converted(_Flag("", section, name), value))
    shorthand = speculative_shorthand(args)
    if shorthand is not None and "speculative_config" not in given[""]:
        try:
            given[""]["speculative_config"] = SpeculativeConfig.from_dict(shorthand)
        except ConfigError as error:
            raise ConfigError(f"--spec-method/--spec-model/--spec-tokens: {error}") from None
    return given


def build_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe; raises ConfigError naming the flag on a bad value."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise ConfigError(f"MODEL ({tag}) and --model ({args.model}) disagree; give one of them")
    given = _given_values(args)
    if tag is not None:
        given["model"]["model"] = tag
    names = given["model"].get("served_model_name")
    if isinstance(names, list):
        given["model"]["served_model_name"] = names[0]
    if given["scheduler"].get("max_model_len") == MAX_MODEL_LEN_AUTO:
        given["scheduler"]["max_model_len"] = _model_max_positions(given["model"])
    if given["device"].get("device") == "cuda":
        _apply_cuda_defaults(given)
    try:
        config = EngineConfig(
            model=ModelConfig(**given["model"]),
            scheduler=SchedulerConfig(**given["scheduler"]),
            cache=CacheConfig(**given["cache"]),
            device=DeviceConfig(**given["device"]),
            parallel=ParallelConfig(**given["parallel"]),
            **given[""],
        )
    except ConfigError as error:
        raise ConfigError(fields_to_flags(str(error))) from None
    _check_fp8_checkpoint_device(config)
    return config


def _check_fp8_checkpoint_device(config: EngineConfig) -> None:
    """A checkpoint stored in FP8 is served in FP8 (model/fp8_checkpoint.py), a GPU path: refused on the
    CPU here, before the engine starts, as `--quantization fp8` is by EngineConfig."""
    if config.device.device != "cuda" and checkpoint_quant_method(config.model) == "fp8":
        raise ConfigError(f"MODEL {config.model.model!r} is an FP8 checkpoint (config.json quantization_config): "
                          "FP8 matmuls are a GPU path; pass --device cuda, or a 16-bit checkpoint for the CPU")


def _model_max_positions(model_fields: dict[str, object]) -> int:
    """--max-model-len auto: the model's max positions, read from its config.json or GGUF header."""
    try:
        return model_max_positions(ModelConfig(**model_fields))  # type: ignore[arg-type]
    except (OSError, ValueError) as error:
        raise ConfigError(f"--max-model-len auto: cannot read the model's max positions: {error}") from None


def _apply_cuda_defaults(given: dict[str, dict[str, object]]) -> None:
    """vLLM's GPU defaults (config.CUDA_DEFAULTS) for the scheduler flags not given; async scheduling only
    where it applies (continuous batching, no speculative decoding)."""
    scheduler = given["scheduler"]
    scheduler.setdefault("max_num_seqs", CUDA_DEFAULTS.max_num_seqs)
    scheduler.setdefault("max_num_batched_tokens", CUDA_DEFAULTS.max_num_batched_tokens)
    continuous = scheduler.get("batching", Batching.CONTINUOUS) is Batching.CONTINUOUS
    if continuous and given[""].get("speculative_config") is None:
        scheduler.setdefault("async_scheduling", CUDA_DEFAULTS.async_scheduling)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Like `build_engine_config`, but a bad value ends the program through `parser.error` (exit 2)."""
    try:
        return build_engine_config(args)
    except ConfigError as error:
        parser = getattr(args, _PARSER_KEY, None)
        if parser is None:
            raise
        parser.error(str(error))
        raise  # parser.error exits; this line only satisfies type checkers


def fields_to_flags(message: str) -> str:
    """Rewrite config field names in a ConfigError message as the flags that set them."""
    for flag in FLAGS:
        if "_" in flag.field_name:  # single words (model, dtype, ...) already read as their flag
            message = re.sub(rf"(?<![-\w]){flag.field_name}(?![-\w])", flag.flag, message)
    return message


def engine_config_to_flags(config: EngineConfig) -> dict[str, str]:
    """The resolved configuration as flag name -> value string (for logs, EngineInfo, info metrics)."""
    flat: dict[str, str] = {}
    for flag in FLAGS:
        holder = getattr(config, flag.section) if flag.section else config
        value = getattr(holder, flag.field_name)
        flat[flag.flag.lstrip("-")] = _as_text(value)
    return flat


def _as_text(value: object) -> str:
    if isinstance(value, (LoadFormat, SchedulingPolicy, Batching, CUDAGraphMode, Quantization, GemmBackend)):
        return value.value
    if isinstance(value, SpeculativeConfig):
        return json.dumps(value.to_dict())
    if isinstance(value, tuple):  # --override-generation-config's (key, value) pairs
        return json.dumps(dict(value))
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def with_overrides(config: EngineConfig, section: str, **changes: object) -> EngineConfig:
    """A copy of `config` with fields of one section replaced (validation runs again)."""
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **changes)})
