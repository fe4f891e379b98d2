"""`conveyor serve`'s server flags (vLLM's names) and their mapping onto `ServerConfig`.

Defaults live in `ServerConfig` alone: a flag not given is not passed. A bad value is a `ConfigError`
naming the flag (`--port`, not `port`). Also the check that MODEL is a local path: there is no model hub
here, and a hub id such as `HuggingFaceTB/SmolLM2-135M-Instruct` gets one line saying so.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

from conveyor.config import ConfigError
from conveyor.server.server_config import ServerConfig, UvicornOptions

_SERVER_FLAGS = {
    "host": "host", "port": "port", "api_key": "api_keys", "shutdown_grace": "shutdown_grace_s",
    "api_server_count": "api_server_count", "allowed_origins": "allowed_origins",
    "allowed_methods": "allowed_methods", "allowed_headers": "allowed_headers",
    "allow_credentials": "allow_credentials", "limit_concurrency": "limit_concurrency",
    "timeout_keep_alive": "timeout_keep_alive_s", "header_timeout": "header_timeout_s", "body_timeout": "body_timeout_s",
    "health_check_timeout": "health_check_timeout_s",
    "max_logprobs": "max_logprobs", "enable_force_include_usage": "force_include_usage",
    "enable_prompt_tokens_details": "prompt_tokens_details", "enable_log_requests": "log_requests",
    "max_log_len": "max_log_len", "max_grammar_bytes": "max_grammar_bytes",
    "max_grammar_choices": "max_grammar_choices", "grammar_compile_timeout": "grammar_compile_timeout_s",
}
"""argparse dest -> ServerConfig field."""
_UVICORN_FLAGS = {
    "uvicorn_log_level": "log_level", "root_path": "root_path", "uds": "uds", "ssl_keyfile": "ssl_keyfile",
    "ssl_certfile": "ssl_certfile", "ssl_ca_certs": "ssl_ca_certs", "ssl_cert_reqs": "ssl_cert_reqs",
    "ssl_ciphers": "ssl_ciphers", "h11_max_incomplete_event_size": "h11_max_incomplete_event_size",
    "h11_max_header_count": "h11_max_header_count",
}
"""argparse dest -> UvicornOptions field."""


def _json_list(text: str) -> tuple[str, ...]:
    """vLLM's CORS flags take a JSON list (`'["https://a.example"]'`); a bare value is a list of one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return (text,)
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings such as \'["*"]\' (got {text!r})')
    return tuple(value)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig()
    group = parser.add_argument_group("server")
    group.add_argument("--config", metavar="FILE.yaml",
                       help="read flags from a YAML file (as vLLM; the command line wins)")
    group.add_argument("--host", help=f"address to bind (default {defaults.host})")
    group.add_argument("--port", type=int, help=f"port to bind, 0 for any free one (default {defaults.port})")
    group.add_argument("--uds", help="listen on this Unix domain socket instead of host:port")
    group.add_argument("--api-key", nargs="+", metavar="KEY",
                       help="require `Authorization: Bearer <KEY>` on /v1/*, /tokenize, /detokenize, /invocations")
    group.add_argument("--shutdown-grace", "--shutdown-timeout", type=float, metavar="SECONDS",
                       help=f"on SIGTERM, time in-flight requests get to finish (default {defaults.shutdown_grace_s})")
    group.add_argument("--api-server-count", "-asc", type=int, metavar="N",
                       help="API-server processes sharing the port, talking to the one engine core "
                            f"(default {defaults.api_server_count})")
    _add_http_flags(group)
    _add_response_flags(group)


def _add_http_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--allowed-origins", type=_json_list, metavar="JSON", help="CORS origins (default none)")
    group.add_argument("--allowed-methods", type=_json_list, metavar="JSON", help='CORS methods (default ["*"])')
    group.add_argument("--allowed-headers", type=_json_list, metavar="JSON", help='CORS headers (default ["*"])')
    group.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("--limit-concurrency", type=int, metavar="N",
                       help="most open connections; beyond it 503 and the connection is closed")
    group.add_argument("--timeout-keep-alive", type=float, metavar="SECONDS",
                       help="close an idle keep-alive connection after this long (default 5)")
    group.add_argument("--header-timeout", type=float, metavar="SECONDS",
                       help="close a connection that sent no complete request head in this long (default 10)")
    group.add_argument("--health-check-timeout", type=float, metavar="SECONDS",
                       help="/health is 503 when the engine core does not answer in this long (default 5)")
    group.add_argument("--body-timeout", type=float, metavar="SECONDS",
                       help="answer 408 to a request whose body has not arrived whole in this long (default 30)")
    group.add_argument("--uvicorn-log-level", choices=["critical", "error", "warning", "info", "debug", "trace"])
    group.add_argument("--disable-uvicorn-access-log", action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("--root-path", help="ASGI root_path behind a path-based proxy")
    group.add_argument("--ssl-keyfile")
    group.add_argument("--ssl-certfile")
    group.add_argument("--ssl-ca-certs")
    group.add_argument("--ssl-cert-reqs", type=int)
    group.add_argument("--ssl-ciphers")
    group.add_argument("--h11-max-incomplete-event-size", type=int, metavar="BYTES")
    group.add_argument("--h11-max-header-count", type=int, metavar="N")
    group.add_argument("--log-level", choices=["CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"],
                       type=str.upper, help="the server's log level (default INFO)")


def _add_response_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                       help="a Jinja chat template (a file, or the template itself) replacing the model's")
    group.add_argument("--max-logprobs", type=int, help="largest logprobs a request may ask for (default 20)")
    group.add_argument("--enable-force-include-usage", action=argparse.BooleanOptionalAction, default=None,
                       help="every stream ends with a usage chunk")
    group.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction, default=None,
                       help="usage.prompt_tokens_details.cached_tokens (prefix-cache hits)")
    group.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=None,
                       help="log one line per request")
    group.add_argument("--max-log-len", type=int, help="longest prompt excerpt a request log line prints")
    group.add_argument("--max-grammar-bytes", type=int, metavar="BYTES",
                       help="largest structured-outputs constraint a request may send (default 2 MiB)")
    group.add_argument("--max-grammar-choices", type=int, metavar="N",
                       help="most strings a guided_choice may list (default 100000)")
    group.add_argument("--grammar-compile-timeout", type=float, metavar="SECONDS",
                       help="a grammar that takes longer to compile is a 400 (default 30)")
    group.add_argument("--enable-request-id-headers", action=argparse.BooleanOptionalAction, default=None,
                       help="X-Request-Id is always echoed (accepted for vLLM)")
    group.add_argument("--enable-server-load-tracking", action=argparse.BooleanOptionalAction, default=None,
                       help="GET /load always reports the requests in flight (accepted for vLLM)")


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig the flags describe; a ConfigError names the flag, not the field."""
    given = {field: getattr(args, dest) for dest, field in _SERVER_FLAGS.items()
             if getattr(args, dest, None) is not None}
    if "api_keys" in given:
        given["api_keys"] = tuple(given["api_keys"])
    names = getattr(args, "served_model_name", None)
    if names:
        given["served_model_names"] = tuple(names[1:])
    uvicorn = {field: getattr(args, dest) for dest, field in _UVICORN_FLAGS.items()
               if getattr(args, dest, None) is not None}
    if getattr(args, "disable_uvicorn_access_log", None) is False:
        uvicorn["access_log"] = True
    try:
        template = _chat_template(getattr(args, "chat_template", None))
        return ServerConfig(**given, uvicorn=UvicornOptions(**uvicorn), chat_template=template)
    except ConfigError as error:
        message = str(error)
        for dest, field in (*_SERVER_FLAGS.items(), *_UVICORN_FLAGS.items()):
            message = re.sub(rf"\b{field}\b", "--" + dest.replace("_", "-"), message)
        raise ConfigError(message) from None


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it holds template syntax (as vLLM)."""
    if value is None:
        return None
    path = pathlib.Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if any(marker in value for marker in ("{{", "{%")):
        return value
    raise ConfigError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model_is_local(args: argparse.Namespace) -> None:
    """MODEL (or --model) must be a local file or directory; a hub id gets one clear line."""
    for value in (getattr(args, "model_tag", None), getattr(args, "model", None)):
        if value is None or pathlib.Path(value).expanduser().exists():
            continue
        if _HUB_ID.fullmatch(value):
            raise ConfigError(f"{value!r} looks like a Hugging Face hub id, and conveyor has no hub access: "
                              "pass a local Hugging Face directory or a GGUF file (e.g. one downloaded with "
                              "`huggingface-cli download`), or no MODEL for the embedded SmolLM2")
        raise ConfigError(f"MODEL {value!r}: no such file or directory (pass a local Hugging Face directory "
                          "or a GGUF file)")

