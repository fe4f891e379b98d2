"""The HTTP front end's configuration (`conveyor serve`'s server flags), validated at construction.

Kept beside the server rather than in `conveyor.config`: only the API-server side reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.config import ConfigError
from conveyor.engine.grammar_check import GrammarLimits


@dataclass(frozen=True)
class UvicornOptions:
    """uvicorn settings vLLM exposes as flags; passed through unchanged."""

    log_level: str = "info"
    """uvicorn's log level (vLLM's --uvicorn-log-level)."""
    access_log: bool = False
    """Log every request line (off: vLLM's --disable-uvicorn-access-log is conveyor's default)."""
    root_path: str = ""
    """ASGI root_path behind a path-based proxy (vLLM's --root-path)."""
    uds: str | None = None
    """Listen on this Unix domain socket instead of host:port (vLLM's --uds)."""
    ssl_keyfile: str | None = None
    """TLS private key file."""
    ssl_certfile: str | None = None
    """TLS certificate file."""
    ssl_ca_certs: str | None = None
    """TLS CA certificates file."""
    ssl_cert_reqs: int = 0
    """Whether a client certificate is required (the ssl module's CERT_* numbers)."""
    ssl_ciphers: str | None = None
    """TLS ciphers (None: uvicorn's default)."""
    h11_max_incomplete_event_size: int | None = None
    """Largest request head in bytes (None: uvicorn's default, 16 KiB)."""
    h11_max_header_count: int | None = None
    """Most headers a request may send (None: no cap of conveyor's own)."""


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP front end of `conveyor serve`."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 8000
    """Port to bind."""
    api_keys: tuple[str, ...] = ()
    """If any, every /v1 route, /tokenize, /detokenize, /invocations, /reset_prefix_cache and /step_log need
    `Authorization: Bearer <one of them>` (vLLM's --api-key, which may be given several keys)."""
    shutdown_grace_s: float = 30.0
    """On SIGTERM, how long in-flight requests may take to finish before they are aborted."""
    max_request_body_bytes: int = 4 * 1024 * 1024
    """Largest accepted request body."""
    api_server_count: int = 1
    """API-server (front-end) processes sharing the port, all talking to the one engine core."""
    allowed_origins: tuple[str, ...] = ()
    """CORS origins allowed (vLLM's --allowed-origins; none by default: no CORS headers)."""
    allowed_methods: tuple[str, ...] = ("*",)
    """CORS methods allowed (vLLM's --allowed-methods)."""
    allowed_headers: tuple[str, ...] = ("*",)
    """CORS request headers allowed (vLLM's --allowed-headers)."""
    allow_credentials: bool = False
    """CORS: allow credentials (vLLM's --allow-credentials)."""
    limit_concurrency: int | None = None
    """Most open connections; one more is answered 503 and closed at once (None: no limit)."""
    timeout_keep_alive_s: float = 5.0
    """An idle keep-alive connection is closed after this long without a new request."""
    header_timeout_s: float = 10.0
    """A connection that has not sent a complete request head this long after it opened (or after its
    previous response) is closed: idle and header-only sockets cannot pile up."""
    health_check_timeout_s: float = 5.0
    """/health is 503 when the engine core has not answered a check this long after it was sent."""
    body_timeout_s: float = 30.0
    """A request body that has not arrived whole this long after its handler started reading is a 408."""
    served_model_names: tuple[str, ...] = ()
    """Names accepted in `model` besides the reported one (vLLM's --served-model-name A B ...)."""
    max_logprobs: int = 20
    """Largest logprobs / top_logprobs a request may ask for (vLLM's --max-logprobs)."""
    force_include_usage: bool = False
    """Every stream ends with a usage chunk, asked for or not (vLLM's --enable-force-include-usage)."""
    prompt_tokens_details: bool = False
    """usage.prompt_tokens_details.cached_tokens in responses (vLLM's --enable-prompt-tokens-details)."""
    log_requests: bool = False
    """Log one line per request (vLLM's --enable-log-requests)."""
    max_log_len: int | None = None
    """Longest prompt excerpt a request log line prints (None: the whole prompt)."""
    chat_template: str | None = None
    """A Jinja chat template (the text) replacing the model's (vLLM's --chat-template)."""
    max_grammar_bytes: int = GrammarLimits.max_bytes
    """Largest structured-outputs constraint in UTF-8 bytes; larger is a 400 naming the field."""
    max_grammar_choices: int = GrammarLimits.max_choices
    """Most strings a choice constraint may list; more is a 400 naming the field."""
    grammar_compile_timeout_s: float = GrammarLimits.compile_timeout_s
    """A grammar that takes longer to compile is a 400 naming the field (it is compiled off the event loop)."""
    uvicorn: UvicornOptions = field(default_factory=lambda: UvicornOptions())
    """How uvicorn listens (TLS, Unix socket, root path, logging, h11 limits)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535 (got {self.port})")
        if self.api_server_count < 1:
            raise ConfigError(f"api_server_count must be >= 1 (got {self.api_server_count})")
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"shutdown_grace_s must be >= 0 (got {self.shutdown_grace_s})")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ConfigError(f"limit_concurrency must be >= 1 or unset (got {self.limit_concurrency})")
        for name in ("timeout_keep_alive_s", "header_timeout_s", "body_timeout_s", "health_check_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 (got {getattr(self, name)})")
        if not 0 <= self.max_logprobs <= 1024:
            raise ConfigError(f"max_logprobs must be in 0..1024 (got {self.max_logprobs})")
        for name in ("max_grammar_bytes", "max_grammar_choices"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if not self.grammar_compile_timeout_s > 0:
            raise ConfigError(f"grammar_compile_timeout_s must be > 0 (got {self.grammar_compile_timeout_s})")

    def grammar_limits(self) -> GrammarLimits:
        """What one request's structured-outputs constraint may cost the API server."""
        return GrammarLimits(self.max_grammar_bytes, self.max_grammar_choices, self.grammar_compile_timeout_s)
