"""Every flag of `vllm serve` (vLLM 0.32, plus a few older spellings still in vLLM's docs) and what
`conveyor serve` does with it: the table `engine.vllm_flags` registers and docs/serving.md prints.

Four statuses. IMPLEMENTED: conveyor has the flag with vLLM's meaning (registered by engine/args.py,
server/cli.py or engine/vllm_flags.py itself; the note says where conveyor differs). IGNORED: accepted,
with a one-line warning, because it cannot change what this server computes (logging, hub downloads,
multimodal inputs of a text-only engine, kernel choices conveyor makes itself, ...). DEFAULT_ONLY:
accepted silently at vLLM's default value (restating the default changes nothing); any other value is
an error naming the flag and why. UNSUPPORTED: always an error naming the flag and why. Data only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FlagStatus(enum.Enum):
    IMPLEMENTED = "implemented"
    IGNORED = "ignored"
    DEFAULT_ONLY = "default only"
    UNSUPPORTED = "unsupported"


class Arity(enum.Enum):
    """How the flag takes its value (as vLLM's argparse declares it)."""

    SWITCH = "switch"
    """`--x` alone (store_true)."""
    BOOL = "bool"
    """`--x` / `--no-x`."""
    VALUE = "value"
    """`--x V`."""
    VALUES = "values"
    """`--x V [V ...]`."""


@dataclass(frozen=True)
class VllmFlag:
    """One `vllm serve` flag and conveyor's answer to it."""

    names: tuple[str, ...]
    """Its spellings, long name first (`--tensor-parallel-size`, `-tp`); `--no-x` is implied by BOOL."""
    arity: Arity
    """How it takes a value."""
    status: FlagStatus
    """What conveyor does with it."""
    note: str
    """Why (IGNORED, DEFAULT_ONLY, UNSUPPORTED) or how conveyor's meaning differs (IMPLEMENTED)."""
    defaults: tuple[str, ...] = ()
    """DEFAULT_ONLY: the values that are no-ops (vLLM's default; `false` for a BOOL means `--no-x`)."""

    @property
    def name(self) -> str:
        return self.names[0]


S, B, V, L = Arity.SWITCH, Arity.BOOL, Arity.VALUE, Arity.VALUES
_I, _G, _D, _U = FlagStatus.IMPLEMENTED, FlagStatus.IGNORED, FlagStatus.DEFAULT_ONLY, FlagStatus.UNSUPPORTED

HUB = "no model hub here: models are local HF directories or GGUF files"
LOGS = "a logging/tracing option with no counterpart in conveyor"
MM = "multimodal inputs: conveyor serves text-only models"
MAMBA = "Mamba/SSM state: conveyor serves attention-only models"
LORA = "LoRA adapters are not supported"
PARALLEL = "conveyor runs one engine-core process: no data/pipeline/context/expert parallelism"
KERNELS = "kernel and backend choices: conveyor picks its own kernels"
MOE = "mixture-of-experts models are not supported"
TOOLS = "tool calling and reasoning parsers are not supported"
LOADING = "weight-loading tuning: conveyor's loader reads safetensors/GGUF its own way"
OFFLOAD = "weight/KV offloading is not supported"
KV_TRANSFER = "disaggregated prefill / KV and encoder transfer are not supported"
PLUGINS = "loading user code (plugins, classes, middleware) is not supported"
OTHER_APIS = "that API (Cohere, Anthropic, gRPC, ...) is not served by conveyor"
POOLING = "pooling/embedding models are not served"
SLEEP = "sleep mode is not supported"
FEATURE = "not supported by conveyor's engine"


def _f(names: str, arity: Arity, status: FlagStatus, note: str, *defaults: str) -> VllmFlag:
    return VllmFlag(tuple(names.split(",")), arity, status, note, tuple(defaults))


VLLM_FLAGS: tuple[VllmFlag, ...] = (
    # ---- top level -------------------------------------------------------------------------------
    _f("--headless", S, _U, "headless engines serve multi-node data parallelism: " + PARALLEL),
    _f("--api-server-count,-asc", V, _I, "N API-server processes sharing the port (default 1)"),
    _f("--config", V, _I, "a YAML file of flags, as vLLM (needs PyYAML)"),
    _f("--grpc", S, _U, OTHER_APIS),
    _f("--disable-log-stats", S, _G, "conveyor logs no periodic stats; /metrics has them"),
    _f("--aggregate-engine-logging", S, _G, PARALLEL),
    _f("--fail-on-environ-validation", B, _G, "conveyor reads no VLLM_* environment variables"),
    _f("--shutdown-timeout", V, _I, "seconds in-flight requests get after SIGTERM (= --shutdown-grace)"),
    _f("--gdn-prefill-backend", V, _G, KERNELS),
    _f("--kda-prefill-backend", V, _G, KERNELS),
    _f("--kda-decode-backend", V, _G, KERNELS),
    _f("--enable-log-requests", B, _I, "one INFO line per request (id, prompt tokens, sampling parameters)"),
    # ---- frontend --------------------------------------------------------------------------------
    _f("--lora-modules", L, _U, LORA),
    _f("--chat-template", V, _I, "a Jinja template file, or the template itself, replacing the model's"),
    _f("--chat-template-content-format", V, _D, "text parts are joined into one string", "auto", "string"),
    _f("--trust-request-chat-template", B, _D, "requests cannot bring their own chat template", "false"),
    _f("--trust-request-mm-kwargs", B, _G, MM),
    _f("--default-chat-template-kwargs", V, _D, "chat templates get no extra keyword arguments", "{}"),
    _f("--response-role", V, _D, "the assistant role is the only one answered", "assistant"),
    _f("--return-tokens-as-token-ids", B, _D, "logprob tokens are always text", "false"),
    _f("--enable-auto-tool-choice", B, _G, TOOLS + ": a request with `tools` gets a 400"),
    _f("--exclude-tools-when-tool-choice-none", B, _G, TOOLS),
    _f("--tool-call-parser", V, _G, TOOLS + ": a request with `tools` gets a 400"),
    _f("--tool-parser-plugin", V, _D, TOOLS, ""),
    _f("--tool-strict-level", V, _G, TOOLS),
    _f("--tool-server", V, _D, TOOLS, ""),
    _f("--max-log-len", V, _I, "longest prompt excerpt --enable-log-requests prints (characters)"),
    _f("--enable-prompt-tokens-details", B, _I, "usage.prompt_tokens_details.cached_tokens (prefix-cache hits)"),
    _f("--enable-per-request-metrics", B, _G, "per-request metrics in responses are not produced"),
    _f("--enable-server-load-tracking", B, _I, "always on: GET /load reports the requests in flight"),
    _f("--enable-force-include-usage", B, _I, "every stream ends with a usage chunk, asked for or not"),
    _f("--sse-keep-alive-interval", V, _G, "streams send no keep-alive comments (tokens flow every step)"),
    _f("--enable-tokenizer-info-endpoint", B, _D, "GET /tokenizer_info is not served", "false"),
    _f("--enable-log-outputs", B, _G, LOGS),
    _f("--enable-log-deltas", B, _G, LOGS),
    _f("--cohere-is-reasoning-model", B, _G, OTHER_APIS),
    _f("--cohere-format", V, _G, OTHER_APIS),
    _f("--anthropic-disabled-thinking-effort", V, _G, OTHER_APIS),
    _f("--log-error-stack", B, _G, "internal errors are always logged with their stack, never sent to clients"),
    _f("--tokens-only", B, _D, "the server always detokenizes", "false"),
    _f("--enable-scale-out", B, _D, PARALLEL, "false"),
    _f("--fingerprint-mode", V, _G, "responses carry no system_fingerprint"),
    _f("--fingerprint-value", V, _G, "responses carry no system_fingerprint"),
    _f("--host", V, _I, "address to bind (default 127.0.0.1; vLLM's default binds every address)"),
    _f("--port", V, _I, "port to bind (default 8000)"),
    _f("--grpc-port", V, _U, OTHER_APIS),
    _f("--data-parallel-supervisor-port", V, _G, PARALLEL),
    _f("--dp-supervisor-probe-interval-s", V, _G, PARALLEL),
    _f("--dp-supervisor-probe-timeout-s", V, _G, PARALLEL),
    _f("--dp-supervisor-probe-failure-threshold", V, _G, PARALLEL),
    _f("--uds", V, _I, "serve on a Unix domain socket instead of host:port"),
    _f("--uvicorn-log-level", V, _I, "uvicorn's log level"),
    _f("--disable-uvicorn-access-log", B, _I, "conveyor's access log is off by default anyway"),
    _f("--disable-access-log-for-endpoints", V, _G, "conveyor writes no access log"),
    _f("--allow-credentials", B, _I, "CORS: Access-Control-Allow-Credentials"),
    _f("--allowed-origins", V, _I, "CORS: JSON list of origins (default none: no CORS headers)"),
    _f("--allowed-methods", V, _I, "CORS: JSON list of methods (default [\"*\"])"),
    _f("--allowed-headers", V, _I, "CORS: JSON list of headers (default [\"*\"])"),
    _f("--api-key", L, _I, "one or more keys; every route but /health, /ping, /version, /metrics needs one"),
    _f("--ssl-keyfile", V, _I, "TLS key file (uvicorn)"),
    _f("--ssl-certfile", V, _I, "TLS certificate file (uvicorn)"),
    _f("--ssl-ca-certs", V, _I, "TLS CA certificates (uvicorn)"),
    _f("--enable-ssl-refresh", B, _D, "certificates are read once at start", "false"),
    _f("--ssl-cert-reqs", V, _I, "whether client certificates are required (ssl module's numbers, uvicorn)"),
    _f("--ssl-ciphers", V, _I, "TLS ciphers (uvicorn)"),
    _f("--root-path", V, _I, "ASGI root_path, behind a path-based proxy"),
    _f("--middleware", V, _U, PLUGINS),
    _f("--enable-request-id-headers", B, _I, "always on: X-Request-Id is echoed on every response"),
    _f("--disable-fastapi-docs", B, _G, "conveyor serves no OpenAPI docs pages"),
    _f("--h11-max-incomplete-event-size", V, _I, "largest request head (bytes) before it is refused"),
    _f("--h11-max-header-count", V, _I, "most request headers before the request is refused"),
    _f("--enable-offline-docs", B, _G, "conveyor serves no OpenAPI docs pages"),
    _f("--enable-flash-late-interaction", B, _G, POOLING),
    # ---- model -----------------------------------------------------------------------------------
    _f("--model", V, _I, "a local HF directory or GGUF file (default: the embedded SmolLM2-135M-Instruct)"),
    _f("--runner", V, _D, POOLING, "auto", "generate"),
    _f("--convert", V, _D, POOLING, "auto", "none"),
    _f("--tokenizer", V, _I, "a tokenizer.json directory or GGUF"),
    _f("--tokenizer-mode", V, _D, "the fast (tokenizers) tokenizer is the only one", "auto", "hf"),
    _f("--trust-remote-code", B, _G, "conveyor never runs code shipped with a model"),
    _f("--dtype", V, _I, "auto, half, float16, bfloat16, float, float32"),
    _f("--seed", V, _I, "seed of unseeded sampling (and of dummy weights)"),
    _f("--hf-config-path", V, _U, "the model's own config.json is read"),
    _f("--allowed-local-media-path", V, _G, MM),
    _f("--allowed-media-domains", L, _G, MM),
    _f("--revision", V, _I, HUB + "; recorded in conveyor:model_info{revision}"),
    _f("--code-revision", V, _G, HUB),
    _f("--tokenizer-revision", V, _G, HUB),
    _f("--max-model-len", V, _I, "`4k` = 4000, `4K` = 4096, `auto` / -1 = the model's max positions"),
    _f("--quantization,-q", V, _I, "auto, gguf (GGUF blocks as stored, CPU) or none; other methods are refused"),
    _f("--quantization-config", V, _D, "quantization comes from the checkpoint (GGUF)", ""),
    _f("--allow-deprecated-quantization", B, _G, "no deprecated quantization methods exist here"),
    _f("--enforce-eager", B, _I, "no CUDA graphs"),
    _f("--enable-return-routed-experts", B, _D, MOE, "false"),
    _f("--return-sampling-mask", B, _D, FEATURE, "false"),
    _f("--max-logprobs", V, _I, "largest logprobs / top_logprobs a request may ask (default 20)"),
    _f("--logprobs-mode", V, _D, "logprobs are the model's raw log-softmax", "raw_logprobs"),
    _f("--use-fp64-gumbel", B, _D, "sampling draws in float32", "false"),
    _f("--enable-trace-replay", B, _D, FEATURE, "false"),
    _f("--disable-sliding-window", B, _G, "the served architectures have no sliding window"),
    _f("--disable-cascade-attn", B, _G, KERNELS),
    _f("--skip-tokenizer-init", B, _D, "the server tokenizes and detokenizes", "false"),
    _f("--enable-prompt-embeds", B, _D, "prompts are text or token ids", "false"),
    _f("--served-model-name", L, _I, "the first name is reported; every one is accepted in `model`"),
    _f("--config-format", V, _D, "config.json (HF) or GGUF metadata is read", "auto", "hf"),
    _f("--hf-token", V, _G, HUB),
    _f("--hf-overrides", V, _D, "the model's config is used as it is", "{}"),
    _f("--model-class-overrides", V, _D, PLUGINS, "{}"),
    _f("--pooler-config", V, _D, POOLING, ""),
    _f("--generation-config", V, _D, "sampling defaults are vLLM's (generation_config.json is not read)",
       "auto", "vllm"),
    _f("--override-generation-config", V, _D, "sampling defaults are vLLM's", "{}"),
    _f("--enable-sleep-mode", B, _D, SLEEP, "false"),
    _f("--sleep-mode-offload-cudagraph", B, _G, SLEEP),
    _f("--sleep-preserve-parameter-names", L, _G, SLEEP),
    _f("--enable-cumem-allocator", B, _G, SLEEP),
    _f("--enable-nccl-comm-suspend", B, _G, SLEEP),
    _f("--model-impl", V, _D, "conveyor's own model implementations are used", "auto", "vllm"),
    _f("--logits-processors", L, _U, PLUGINS),
    _f("--io-processor-plugin", V, _U, PLUGINS),
    _f("--renderer-num-workers", V, _G, "templating and tokenization run on the API server's own threads"),
    # ---- loading ---------------------------------------------------------------------------------
    _f("--load-format", V, _I, "auto, safetensors, gguf or dummy; other formats are refused"),
    _f("--download-dir", V, _G, HUB),
    _f("--safetensors-load-strategy", V, _G, LOADING),
    _f("--safetensors-prefetch-num-threads", V, _G, LOADING),
    _f("--safetensors-prefetch-block-size", V, _G, LOADING),
    _f("--model-loader-extra-config", V, _D, LOADING, "{}"),
    _f("--ignore-patterns", L, _G, LOADING),
    _f("--use-tqdm-on-load", B, _G, LOGS),
    _f("--pt-load-map-location", V, _G, LOADING),
    _f("--attention-backend", V, _G, KERNELS),
    _f("--mamba-backend", V, _G, MAMBA),
    _f("--mamba-ssu-algorithm", V, _G, MAMBA),
    _f("--enable-mamba-cache-stochastic-rounding", B, _G, MAMBA),
    _f("--mamba-cache-philox-rounds", V, _G, MAMBA),
    _f("--reasoning-parser", V, _G, "no reasoning parser: a model's reasoning text stays in `content`"),
    _f("--reasoning-parser-plugin", V, _D, PLUGINS, ""),
    # ---- parallelism -----------------------------------------------------------------------------
    _f("--distributed-executor-backend", V, _G, PARALLEL),
    _f("--pipeline-parallel-size,-pp", V, _D, PARALLEL, "1"),
    _f("--master-addr", V, _G, PARALLEL),
    _f("--master-port", V, _G, PARALLEL),
    _f("--nnodes,-n", V, _D, PARALLEL, "1"),
    _f("--node-rank,-r", V, _D, PARALLEL, "0"),
    _f("--distributed-timeout-seconds", V, _G, PARALLEL),
    _f("--cpu-distributed-timeout-seconds", V, _G, PARALLEL),
    _f("--numa-bind", B, _G, "conveyor does not bind to NUMA nodes"),
    _f("--numa-bind-nodes", L, _G, "conveyor does not bind to NUMA nodes"),
    _f("--numa-bind-cpus", L, _G, "conveyor does not bind to NUMA nodes"),
    _f("--device-ids", V, _D, "choose GPUs with CUDA_VISIBLE_DEVICES", ""),
    _f("--tensor-parallel-size,-tp", V, _I, "one rank process per GPU (NCCL), or per CPU share (gloo)"),
    _f("--decode-context-parallel-size,-dcp", V, _D, PARALLEL, "1"),
    _f("--dcp-comm-backend", V, _G, PARALLEL),
    _f("--dcp-q-replicate", B, _G, PARALLEL),
    _f("--dcp-kv-cache-interleave-size", V, _G, PARALLEL),
    _f("--cp-kv-cache-interleave-size", V, _G, PARALLEL),
    _f("--prefill-context-parallel-size,-pcp", V, _D, PARALLEL, "1"),
    _f("--data-parallel-size,-dp", V, _D, PARALLEL, "1"),
    _f("--data-parallel-rank,-dpn", V, _D, PARALLEL, "0"),
    _f("--data-parallel-start-rank,-dpr", V, _D, PARALLEL, "0"),
    _f("--data-parallel-size-local,-dpl", V, _D, PARALLEL, "1"),
    _f("--data-parallel-address,-dpa", V, _G, PARALLEL),
    _f("--data-parallel-rpc-port,-dpp", V, _G, PARALLEL),
    _f("--data-parallel-backend,-dpb", V, _G, PARALLEL),
    _f("--data-parallel-hybrid-lb,-dph", B, _D, PARALLEL, "false"),
    _f("--data-parallel-external-lb,-dpe", B, _D, PARALLEL, "false"),
    _f("--data-parallel-multi-port-external-lb,-dpm", S, _U, PARALLEL),
    _f("--enable-hc-sp", B, _D, PARALLEL, "false"),
    _f("--enable-expert-parallel,-ep", B, _D, MOE, "false"),
    _f("--enable-batch-sharded-sampling", B, _G, PARALLEL),
    _f("--enable-ep-weight-filter", B, _G, MOE),
    _f("--all2all-backend", V, _G, MOE),
    _f("--enable-dbo", B, _D, PARALLEL, "false"),
    _f("--enable-shm-tensor-arena", B, _G, PARALLEL),
    _f("--ubatch-size", V, _D, PARALLEL, "0"),
    _f("--enable-elastic-ep", B, _D, MOE, "false"),
    _f("--elastic-ep-max-dp-size", V, _G, MOE),
    _f("--dbo-decode-token-threshold", V, _G, PARALLEL),
    _f("--dp-sync-interval", V, _G, PARALLEL),
    _f("--dbo-prefill-token-threshold", V, _G, PARALLEL),
    _f("--disable-nccl-for-dp-synchronization", B, _G, PARALLEL),
    _f("--enable-eplb", B, _D, MOE, "false"),
    _f("--eplb-config", V, _G, MOE),
    _f("--expert-placement-strategy", V, _G, MOE),
    _f("--max-parallel-loading-workers", V, _G, LOADING),
    _f("--ray-workers-use-nsight", B, _G, PARALLEL),
    _f("--disable-custom-all-reduce", B, _G, KERNELS),
    _f("--worker-cls", V, _D, PLUGINS, "auto"),
    _f("--worker-extension-cls", V, _D, PLUGINS, ""),
    _f("--enable-fault-tolerance", B, _D, FEATURE, "false"),
    _f("--fault-tolerance-config", V, _G, FEATURE),
    # ---- KV cache --------------------------------------------------------------------------------
    _f("--block-size", V, _I, "tokens per KV block (a power of two; default 16)"),
    _f("--gpu-memory-utilization,--device-memory-utilization", V, _I, "fraction of GPU memory (CUDA; default 0.9)"),
    _f("--kv-cache-memory-bytes", V, _I, "KV cache bytes (`4G` = 4 GiB as vLLM; also --kv-cache-memory)"),
    _f("--kv-cache-dtype", V, _D, "the KV cache has the model's dtype", "auto"),
    _f("--num-gpu-blocks-override", V, _I, "exact number of KV blocks"),
    _f("--enable-prefix-caching", B, _I, "on by default"),
    _f("--prefix-caching-hash-algo", V, _G, "conveyor chains its own 64-bit block hashes"),
    _f("--prefix-cache-retention-interval", V, _D, FEATURE, "0"),
    _f("--kv-cache-dtype-skip-layers", L, _G, "the KV cache has the model's dtype"),
    _f("--kv-sharing-fast-prefill", B, _D, FEATURE, "false"),
    _f("--swa-bounded-replay", B, _G, "the served architectures have no sliding window"),
    _f("--mamba-cache-dtype", V, _G, MAMBA),
    _f("--mamba-ssm-cache-dtype", V, _G, MAMBA),
    _f("--mamba-block-size", V, _G, MAMBA),
    _f("--prefix-match-unit", V, _G, MAMBA),
    _f("--mamba-cache-mode", V, _G, MAMBA),
    _f("--enable-mamba-shared-prefix-checkpoint", B, _G, MAMBA),
    _f("--replayssm-buffer-len", V, _G, MAMBA),
    _f("--use-replayssm", B, _G, MAMBA),
    _f("--kv-offloading-size", V, _D, OFFLOAD, ""),
    _f("--kv-offloading-backend", V, _G, OFFLOAD),
    _f("--offload-backend", V, _G, OFFLOAD),
    _f("--cpu-offload-gb", V, _D, OFFLOAD, "0"),
    _f("--cpu-offload-params", L, _G, OFFLOAD),
    _f("--offload-group-size", V, _D, OFFLOAD, "0"),
    _f("--offload-num-in-group", V, _G, OFFLOAD),
    _f("--offload-prefetch-step", V, _G, OFFLOAD),
    _f("--offload-params", L, _G, OFFLOAD),
    # ---- multimodal ------------------------------------------------------------------------------
    *(_f(name, arity, _G, MM) for name, arity in (
        ("--language-model-only", B), ("--limit-mm-per-prompt", V), ("--enable-mm-embeds", B),
        ("--media-io-kwargs", V), ("--mm-processor-kwargs", V), ("--mm-processor-cache-gb", V),
        ("--mm-processor-cache-type", V), ("--mm-hasher-algorithm", V), ("--mm-shm-cache-max-object-size-mb", V),
        ("--mm-encoder-only", B), ("--mm-encoder-tp-mode", V), ("--mm-encoder-attn-backend", V),
        ("--mm-encoder-attn-dtype", V), ("--mm-encoder-fp8-scale-path", V), ("--mm-encoder-fp8-scale-save-path", V),
        ("--mm-encoder-fp8-scale-save-margin", V), ("--interleave-mm-strings", B), ("--skip-mm-profiling", B),
        ("--video-pruning-rate", V), ("--video-pruning-method", V), ("--mm-tensor-ipc", V),
        ("--mm-processor-device", V), ("--mm-ipc-gpu-memory-gb", V), ("--mm-device-do-normalize", B),
        ("--disable-chunked-mm-input", B))),
    # ---- LoRA ------------------------------------------------------------------------------------
    _f("--enable-lora", B, _D, LORA, "false"),
    *(_f(name, arity, _G, LORA) for name, arity in (
        ("--max-loras", V), ("--max-lora-rank", V), ("--lora-dtype", V), ("--enable-tower-connector-lora", B),
        ("--max-cpu-loras", V), ("--fully-sharded-loras", B), ("--lora-target-modules", L), ("--default-mm-loras", V),
        ("--specialize-active-lora", B), ("--enable-mixed-moe-lora-format", B), ("--enable-moe-shared-loras", B),
        ("--max-lora-cls-labels", V))),
    # ---- logging and observability ---------------------------------------------------------------
    _f("--logging-config", V, _G, LOGS),
    _f("--log-level", V, _I, "the server's log level (CRITICAL ... DEBUG)"),
    _f("--log-config-file", V, _G, LOGS),
    _f("--show-hidden-metrics-for-version", V, _G, "conveyor hides no deprecated metric"),
    _f("--otlp-traces-endpoint", V, _G, "no OpenTelemetry traces are exported"),
    _f("--collect-detailed-traces", L, _G, "no OpenTelemetry traces are exported"),
    _f("--per-request-spec-decode-metrics", V, _G, LOGS),
    _f("--kv-cache-metrics", B, _G, "no vllm:kv_block_* residency histograms (as vLLM without it)"),
    _f("--kv-cache-metrics-sample", V, _G, "no vllm:kv_block_* residency histograms (as vLLM without it)"),
    _f("--custom-histogram-buckets", V, _G, "histograms keep vLLM's default buckets"),
    _f("--cudagraph-metrics", B, _G, LOGS),
    _f("--enable-layerwise-nvtx-tracing", B, _G, LOGS),
    _f("--enable-mfu-metrics", B, _G, "vllm:estimated_*_per_gpu_total exist and stay 0 (as vLLM without it)"),
    _f("--enable-logging-iteration-details", B, _G, LOGS),
    _f("--jit-monitor-mode", V, _G, LOGS),
    _f("--jit-monitor-verbose", B, _G, LOGS),
    # ---- scheduler -------------------------------------------------------------------------------
    _f("--max-num-batched-tokens", V, _I, "token budget of one step (`8k` as vLLM)"),
    _f("--max-num-scheduled-tokens", V, _D, "the step budget is --max-num-batched-tokens", ""),
    _f("--max-num-seqs", V, _I, "most requests running at once"),
    _f("--max-num-active-seqs", V, _D, "the running cap is --max-num-seqs", ""),
    _f("--max-num-queued-reqs", V, _I, "cap on in-flight requests (503 beyond)"),
    _f("--max-num-queued-tokens", V, _I, "cap on prompt tokens awaiting prefill (503 beyond)"),
    _f("--long-prefill-token-threshold", V, _I, "0: no cap"),
    _f("--long-prefill-token-threshold-adaptive", B, _D, FEATURE, "false"),
    _f("--scheduling-policy", V, _I, "fcfs or priority"),
    _f("--enable-chunked-prefill", B, _I, "on by default"),
    _f("--scheduler-cls", V, _D, PLUGINS, ""),
    _f("--scheduler-reserve-full-isl", B, _G, "admission already checks the whole prompt against the KV pool"),
    _f("--watermark", V, _D, FEATURE, "0", "0.0"),
    _f("--prefill-schedule-interval", V, _D, FEATURE, "1"),
    _f("--disable-hybrid-kv-cache-manager", B, _G, "the served architectures need no hybrid KV cache"),
    _f("--async-scheduling", B, _I, "default on for CUDA, off for CPU"),
    _f("--stream-interval", V, _D, "every step's tokens are streamed as they come", "1"),
    _f("--cudagraph-capture-sizes", L, _G, "conveyor captures its own batch buckets up to --max-cudagraph-capture-size"),
    _f("--max-cudagraph-capture-size", V, _I, "largest captured mixed-step graph (tokens)"),
    *(_f(name, V, _G, KERNELS) for name in ("--ir-op-priority", "--moe-backend", "--linear-backend",
                                           "--sparse-indexer-topk-backend")),
    _f("--enable-flashinfer-autotune", B, _G, KERNELS),
    # ---- vLLM config objects ---------------------------------------------------------------------
    _f("--speculative-config,-sc", V, _I, "JSON: ngram or draft_model methods"),
    _f("--spec-method", V, _I, "shorthand for --speculative-config's method"),
    _f("--spec-model", V, _I, "shorthand for --speculative-config's model"),
    _f("--spec-tokens", V, _I, "shorthand for --speculative-config's num_speculative_tokens"),
    _f("--watermark-config", V, _D, FEATURE, ""),
    _f("--diffusion-config,-dc", V, _D, FEATURE, ""),
    _f("--kv-transfer-config", V, _U, KV_TRANSFER),
    _f("--kv-events-config", V, _U, KV_TRANSFER),
    _f("--ec-transfer-config", V, _U, KV_TRANSFER),
    _f("--ec-manager-config", V, _G, MM),
    _f("--compilation-config,-cc", V, _I, "JSON: cudagraph_mode (NONE, FULL, FULL_DECODE_ONLY) and "
                                          "max_cudagraph_capture_size are read; torch.compile keys are ignored"),
    _f("--attention-config,-ac", V, _G, KERNELS),
    _f("--engram-config", V, _D, FEATURE, ""),
    _f("--reasoning-config", V, _D, TOOLS, ""),
    _f("--kernel-config", V, _G, KERNELS),
    _f("--additional-config", V, _G, "platform-specific options with no counterpart here"),
    _f("--structured-outputs-config", V, _I, "JSON: every backend name is served by llguidance"),
    _f("--aux-output-config", V, _G, MOE),
    _f("--profiler-config", V, _G, "use the benchmarks/ profilers"),
    _f("--optimization-level", V, _I, "-O0: no CUDA graphs (as --enforce-eager); -O1..-O3: conveyor's defaults"),
    _f("--performance-mode", V, _G, "conveyor's defaults are not tuned by a mode"),
    _f("--weight-transfer-config", V, _U, FEATURE),
    # ---- spellings of older vLLM releases, still in vLLM's docs and scripts ----------------------
    _f("--disable-log-requests", S, _G, "conveyor logs requests only with --enable-log-requests"),
    _f("--swap-space", V, _G, "preemption recomputes; nothing is swapped to CPU"),
    _f("--guided-decoding-backend", V, _G, "structured outputs are served by llguidance"),
    _f("--num-scheduler-steps", V, _D, "one model step per schedule", "1"),
    _f("--use-v2-block-manager", S, _G, "there is one block manager"),
    _f("--max-seq-len-to-capture", V, _G, "see --max-cudagraph-capture-size"),
    _f("--disable-frontend-multiprocessing", S, _G, "the engine core always runs in its own process"),
    _f("--tokenizer-pool-size", V, _G, "templating and tokenization run on the API server's own threads"),
    _f("--preemption-mode", V, _D, "preemption recomputes", "recompute"),
    _f("--task", V, _D, POOLING, "auto", "generate"),
    _f("--enable-reasoning", S, _U, TOOLS),
)
"""vLLM's flags in `vllm serve --help=all` order (vLLM 0.32), then older spellings."""
