"""`vllm serve` command lines, read by `conveyor serve`: vLLM's spellings and every flag of its table.

Three parts. `preprocess_argv` rewrites what vLLM's FlexibleArgumentParser accepts beyond plain
argparse (`--config FILE.yaml`, `--max_model_len` with underscores, `-O3` / `-O 3` / `-O=3`, dotted
JSON keys `--compilation-config.cudagraph_mode FULL`). `add_vllm_engine_flags` adds the engine flags
conveyor implements only for vLLM's sake (`-O`, `--compilation-config`, `--spec-*`), and
`vllm_engine_overrides` turns them into config fields; an explicit conveyor flag always wins.
`register_vllm_flags` adds every other flag of `engine.vllm_flag_table` (hidden from --help) with
vLLM's arity, recording what was given, and `check_vllm_flags` then warns (IGNORED) or raises a
`ConfigError` naming the flag (DEFAULT_ONLY at another value, UNSUPPORTED). Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from conveyor.config import ConfigError
from conveyor.engine.vllm_flag_table import VLLM_FLAGS
from conveyor.engine.vllm_flag_types import Arity, FlagStatus, VllmFlag

logger = logging.getLogger("conveyor.serve")

GIVEN_KEY = "vllm_flags_given"
"""Namespace attribute: the (flag, value) pairs of table flags seen on the command line."""
_UNDERSCORE_KEY = re.compile(r"(?<=--)[^.=]*")


def human_readable_int(text: str) -> int:
    """vLLM's integers: `4k` = 4000, `4K` = 4096 (lower case decimal, upper case binary), `25.6k`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kKmMgGtT]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected an integer such as 2048, 4k or 4K (got {text!r})")
    number, suffix = match.groups()
    if not suffix:
        if "." in number:
            raise argparse.ArgumentTypeError(f"expected an integer (got {text!r})")
        return int(number)
    if suffix.islower():
        return int(float(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
    if "." in number:
        raise argparse.ArgumentTypeError(f"decimals need a lower-case (decimal) suffix: {text!r}")
    return int(number) * 2 ** (10 * "KMGT".index(suffix) + 10)


def preprocess_argv(argv: Sequence[str]) -> list[str]:
    """vLLM's command-line spellings as plain argparse arguments (see the module docstring)."""
    args = _expand_config_file(list(argv))
    plain: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if arg.startswith("--"):
            plain.append(_dashed(arg))
        elif arg.startswith("-O") and arg != "-O":
            plain += ["--optimization-level", arg[3:] if arg[2:3] == "=" else arg[2:]]
        elif arg == "-O" and index < len(args) and args[index] in ("0", "1", "2", "3"):
            plain.append("--optimization-level")
        else:
            plain.append(arg)
    return _merge_dotted(plain)


def _dashed(arg: str) -> str:
    """`--max_model_len=4k` -> `--max-model-len=4k` (only the name, up to a dot or `=`)."""
    return _UNDERSCORE_KEY.sub(lambda m: m.group(0).replace("_", "-"), arg, count=1)


def _merge_dotted(args: list[str]) -> list[str]:
    """`--compilation-config.mode 3 -cc.cudagraph_mode=FULL` -> `--compilation-config {"mode": 3, ...}`."""
    merged: dict[str, dict[str, Any]] = {}
    rest: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        name = arg.split("=", 1)[0]
        if not (arg.startswith("-") and "." in name and not _is_number(arg)):
            rest.append(arg)
            continue
        if "=" in arg:
            value_text = arg.split("=", 1)[1]
        elif index < len(args):
            value_text, index = args[index], index + 1
        else:
            raise ConfigError(f"{name}: expects a value")
        key, *path = name.split(".")
        _set_nested(merged.setdefault(key, {}), path, _json_or_text(value_text))
    for key, value in merged.items():
        rest += [key, json.dumps(value)]
    return rest


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def _set_nested(target: dict[str, Any], path: list[str], value: object) -> None:
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = value


def _json_or_text(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _expand_config_file(args: list[str]) -> list[str]:
    """`--config FILE` (YAML, as vLLM): its keys become flags placed first, so the command line wins."""
    for index, arg in enumerate(args):
        if arg == "--config" or arg.startswith("--config="):
            path = arg.split("=", 1)[1] if "=" in arg else (args[index + 1] if index + 1 < len(args) else None)
            if path is None:
                raise ConfigError("--config: expects a YAML file")
            end = index + (1 if "=" in arg else 2)
            return _config_file_args(path) + args[:index] + args[end:]
    return args


def _config_file_args(path: str) -> list[str]:
    try:
        import yaml
    except ImportError:
        raise ConfigError("--config: reading a YAML config file needs PyYAML (pip install pyyaml)") from None
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"--config: cannot read {path!r}: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path!r} must hold a mapping of flag names to values")
    args: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + flag[2:])
        elif isinstance(value, list):
            args += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args


# ---- flags conveyor implements for vLLM's sake ----------------------------------------------------


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object value; anything else is an argparse error (one line, naming the flag)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object (got {text!r})")
    return value


def add_vllm_engine_flags(group: argparse._ArgumentGroup) -> None:
    """Engine flags that exist for vLLM command lines: mapped onto conveyor's own fields."""
    group.add_argument("--optimization-level", "-O", choices=["0", "1", "2", "3"], metavar="N",
                       help="vLLM's -O levels: -O0 runs without CUDA graphs (as --enforce-eager); 1-3 change nothing")
    group.add_argument("--compilation-config", "-cc", type=json_object, metavar="JSON",
                       help="vLLM's JSON; cudagraph_mode (NONE, FULL, FULL_DECODE_ONLY) and "
                            "max_cudagraph_capture_size are read")
    group.add_argument("--structured-outputs-config", type=json_object, metavar="JSON",
                       help="vLLM's JSON; every backend is served by llguidance")
    group.add_argument("--spec-method", help="shorthand for --speculative-config's method")
    group.add_argument("--spec-model", help="shorthand for --speculative-config's model")
    group.add_argument("--spec-tokens", type=int, help="shorthand for --speculative-config's num_speculative_tokens")


_CUDAGRAPH_MODES = {"FULL": "full", "FULL_DECODE_ONLY": "full_decode_only", "FULL_AND_PIECEWISE": "full"}
_COMPILATION_KEYS = {"cudagraph_mode", "max_cudagraph_capture_size"}


def vllm_engine_overrides(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    """section -> {field: value} from -O, --compilation-config (fields the conveyor flags did not set)."""
    device: dict[str, object] = {}
    if getattr(args, "optimization_level", None) == "0":
        device["enforce_eager"] = True
    compilation = getattr(args, "compilation_config", None) or {}
    for key in sorted(set(compilation) - _COMPILATION_KEYS):
        logger.warning("--compilation-config: key %r has no effect in conveyor (no torch.compile)", key)
    mode = compilation.get("cudagraph_mode")
    if mode is not None:
        text = str(mode).upper()
        if text == "NONE":
            device["enforce_eager"] = True
        elif text in _CUDAGRAPH_MODES:
            device["cudagraph_mode"] = _CUDAGRAPH_MODES[text]
        else:
            raise ConfigError(f"--compilation-config: cudagraph_mode {mode!r} is not supported "
                              f"(NONE, FULL, FULL_DECODE_ONLY)")
    structured = getattr(args, "structured_outputs_config", None) or {}
    for key, value in sorted(structured.items()):
        if not (key == "backend" and value in ("auto", "guidance")):
            logger.warning("--structured-outputs-config: %s=%r has no effect: structured outputs are served by "
                           "llguidance", key, value)
    if compilation.get("max_cudagraph_capture_size") is not None:
        device["max_cudagraph_capture_size"] = compilation["max_cudagraph_capture_size"]
    return {"device": device}


def speculative_shorthand(args: argparse.Namespace) -> dict[str, object] | None:
    """--spec-method/--spec-model/--spec-tokens as a --speculative-config JSON object (None: not given)."""
    keys = {"method": getattr(args, "spec_method", None), "model": getattr(args, "spec_model", None),
            "num_speculative_tokens": getattr(args, "spec_tokens", None)}
    given = {key: value for key, value in keys.items() if value is not None}
    return given or None


# ---- every other flag of the table ---------------------------------------------------------------


class _Record(argparse.Action):
    """Records (flag, value) for check_vllm_flags; `--no-x` records False."""

    def __init__(self, option_strings: list[str], dest: str, flag: VllmFlag, **kwargs: Any) -> None:
        self.flag = flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if self.flag.arity is Arity.SWITCH:
            values = True
        elif self.flag.arity is Arity.BOOL:
            values = not (option_string or "").startswith("--no-")
        given = getattr(namespace, GIVEN_KEY, None) or []
        given.append((self.flag, values))
        setattr(namespace, GIVEN_KEY, given)


_NARGS = {Arity.SWITCH: 0, Arity.BOOL: 0, Arity.VALUE: None, Arity.VALUES: "+"}


def register_vllm_flags(parser: argparse.ArgumentParser) -> list[VllmFlag]:
    """Add every table flag the parser does not have yet (hidden from --help); returns those added."""
    known = set(parser._option_string_actions)
    added: list[VllmFlag] = []
    group = parser.add_argument_group("vLLM compatibility (see docs/serving.md: every vllm serve flag)")
    for flag in VLLM_FLAGS:
        names = [name for name in flag.names if name not in known]
        if len(names) < len(flag.names):
            continue  # conveyor registered it (or an alias) itself
        if flag.arity is Arity.BOOL:
            names += ["--no-" + name[2:] for name in names if name.startswith("--")]
        group.add_argument(*names, action=_Record, flag=flag, nargs=_NARGS[flag.arity], default=None,
                           dest=GIVEN_KEY + "_" + flag.name.lstrip("-").replace("-", "_"), help=argparse.SUPPRESS)
        added.append(flag)
    parser.set_defaults(**{GIVEN_KEY: None})
    return added


def check_vllm_flags(args: argparse.Namespace) -> None:
    """Warn once per IGNORED flag; raise ConfigError naming the first refused one."""
    for flag, value in getattr(args, GIVEN_KEY, None) or []:
        given = f"{flag.name} {_shown(value)}".strip()
        if flag.status is FlagStatus.UNSUPPORTED:
            raise ConfigError(f"{flag.name}: not supported by conveyor: {flag.note}")
        if flag.status is FlagStatus.DEFAULT_ONLY and not _is_default(flag, value):
            defaults = " or ".join(repr(d) for d in flag.defaults if d) or "unset"
            raise ConfigError(f"{given}: not supported by conveyor ({flag.note}); "
                              f"only vLLM's default ({defaults}) is accepted")
        if flag.status is FlagStatus.IGNORED:
            logger.warning("%s: ignored: %s", given, flag.note)
        elif flag.status is FlagStatus.IMPLEMENTED:  # an IMPLEMENTED flag this command does not have
            logger.warning("%s: ignored by this command", given)


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "" if value else "(off)"
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


def _is_default(flag: VllmFlag, value: object) -> bool:
    if isinstance(value, bool):
        return ("true" if value else "false") in flag.defaults
    text = _shown(value).strip().lower()
    for default in flag.defaults:
        if text == default.lower() or (default == "" and text in ("none", "null", "")):
            return True
        if _is_number(text) and _is_number(default) and float(text) == float(default):
            return True
    return False


def flag_status(flag: VllmFlag, registered: set[str]) -> FlagStatus:
    """IMPLEMENTED when conveyor's parser has the flag, whatever the table says (another branch may have
    added it since), else the table's status."""
    return FlagStatus.IMPLEMENTED if flag.name in registered else flag.status
