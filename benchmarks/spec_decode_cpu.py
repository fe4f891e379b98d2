"""Speculative decoding on the CPU: `conveyor serve` + `conveyor bench run`, speculation off vs n-gram vs
a draft model, on copy-heavy agent traffic, on chat traffic and on plain copying, the same trace for
every configuration.

Traffic classes: `agent` (`conveyor trace make`'s agent class with every turn a copy task -- quote a
passage, edit code, fill JSON -- shrunk to fit a CPU), `chat` (its chat class) and `copy` (written
here: "repeat this exactly" over natural passages and code, COPY_TEXTS, stopping at EOS). The agent
class's documents and programs are natural text (bench/trace/agent_corpus.py), but SmolLM2-135M follows a
quote or edit instruction over a few hundred tokens of context only part of the time; `copy` is what
the model really copies, so it bounds what n-gram lookup can buy here. Configurations (`--configs`): off,
ngram and draft-q4 (the same GGUF on its Q4 blocks drafting for the float32 target). Per repeat, every
configuration in turn gets a fresh server (embedded SmolLM2, float32: `--serve-args`) that serves
every trace through the chat endpoint (`--endpoint`) at `--temperature` (default 0, greedy), closed
loop at `--concurrency` requests in flight (low concurrency is where speculation pays: the step is memory-bound and verifying 1 + K tokens costs little more than decoding
one). The order of the configurations alternates between repeats (A B C, C B A, ...) so that a drift
of a shared machine does not favour one. Printed per class and configuration: output tok/s, median
TPOT and ITL (ITL is the gap between streamed chunks, as vllm bench serve defines it: a verifying step
streams several tokens in one chunk, so per-token time is TPOT), median TTFT, draft acceptance and
mean accepted length (from the server's vllm:spec_decode_* counters) -- the median over repeats with
the min-max -- and output tok/s relative to speculation off. Results go to OUT/results.json, every run
directory under OUT.

    PYTHONPATH=src python benchmarks/spec_decode_cpu.py --out /tmp/spec-cpu
    PYTHONPATH=src python benchmarks/spec_decode_cpu.py --out /tmp/spec-cpu --repeats 3 --num-requests 16

`--configs` takes a JSON object name -> speculative config (null: off) to try other proposers, e.g.
'{"off": null, "ngram-k2": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}}'.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "src"))

from conveyor.bench.load.launch import ServerProcess, ServerSpec  # noqa: E402
from conveyor.bench.trace.traces import TraceRequest, make_trace, write_trace  # noqa: E402
from conveyor.model.loader import embedded_gguf_path  # noqa: E402

TRACE_PARAMS = {
    "agent": ["--mix", "agent=1", "--param", "agent.copy_fraction=1.0", "--param", "agent.system_prompt_len=96",
              "--param", "agent.documents_len=192", "--param", "agent.copy_len_median=64", "--param",
              "agent.output_len_max=96", "--param", "agent.cancel_fraction=0", "--param", "agent.turns_mean=1",
              "--param", "agent.think_time_s_mean=0"],
    "chat": ["--mix", "chat=1", "--param", "chat.output_len_median=64", "--param", "chat.output_len_max=96"],
}
"""`conveyor trace make` flags per traffic class (`copy` is written here: COPY_TEXTS)."""
COPY_TEXTS = [
    "The river rises in the hills above the old town and runs for forty miles to the sea. In spring the water is "
    "high and fast, and the fishermen stay at home; in late summer it is slow and clear, and the children swim "
    "under the stone bridge.",
    "def rectangle_area(width, height):\n    if width < 0 or height < 0:\n        raise ValueError('negative size')\n"
    "    return width * height\n\n\ndef square_area(side):\n    return rectangle_area(side, side)",
    "Our office opens at nine in the morning and closes at six in the evening, Monday to Friday. Parcels can be "
    "collected at the back door until five. On public holidays the office is closed, and urgent requests go to "
    "the duty manager by telephone.",
    '{"name": "Ada Lovelace", "born": 1815, "city": "London", "known_for": ["the first published algorithm", '
    '"notes on the Analytical Engine"], "languages": ["English", "French"]}',
    "To reset the router, hold the small button on the back for ten seconds until the light turns orange. Wait "
    "two minutes, then connect to the network named on the label and open the setup page in a browser.",
    "for index, line in enumerate(lines):\n    words = line.split()\n    if not words:\n        continue\n"
    "    counts[words[0]] = counts.get(words[0], 0) + len(words)\nprint(sorted(counts.items()))",
    "The meeting is moved from Tuesday to Thursday at three o'clock, in the large room on the second floor. "
    "Please bring the budget figures for the last quarter and the list of open questions from the previous meeting.",
    "Mix two cups of flour with one spoon of sugar and a pinch of salt. Add one cup of warm milk and two eggs, "
    "stir until smooth, and let the batter rest for half an hour before you cook it in a hot pan.",
]
"""Natural passages and code the instruct model copies when asked to repeat them."""
METRICS = (("output tok/s", "output_throughput", 1.0), ("TPOT ms", "median_tpot_ms", 1.0),
           ("ITL ms", "median_itl_ms", 1.0), ("TTFT ms", "median_ttft_ms", 1.0),
           ("accept %", "server.spec_decode_acceptance_rate", 100.0),
           ("accepted len", "server.spec_decode_mean_accepted_length", 1.0))
"""(column, summary.json key, scale) of the table."""


def default_configs() -> dict[str, dict[str, Any] | None]:
    # No smaller model shares SmolLM2's tokenizer here. The draft is the same GGUF computed on its Q4 blocks
    # (a draft model's --quantization is auto: gguf on the CPU) for the float32 target that DEFAULT_SERVE_ARGS
    # asks for: the cheaper kernel of the same weights, as the issue suggests. '"num_hidden_layers_override": N'
    # in a --configs entry truncates it instead.
    draft = {"method": "draft_model", "model": str(embedded_gguf_path()), "num_speculative_tokens": 3}
    return {"off": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
            "draft-q4": draft}


DEFAULT_SERVE_ARGS = "--quantization none"
"""The target: SmolLM2 dequantized to float32 (its Q4 blocks draft for it)."""


@dataclass(frozen=True)
class Plan:
    """What one benchmark invocation runs."""

    out: pathlib.Path
    """Traces, run directories, server logs and results.json."""
    configs: dict[str, dict[str, Any] | None]
    """Name -> speculative config (None: off)."""
    classes: list[str]
    """Traffic classes (keys of TRACE_PARAMS)."""
    num_requests: int
    """Requests per run."""
    concurrency: int
    """Requests in flight (closed loop)."""
    repeats: int
    """Rounds over every configuration."""
    serve_args: list[str]
    """Extra `conveyor serve` flags."""
    endpoint: str
    """completions or chat (the chat template of the instruct model)."""
    temperature: float
    """Of every request (0: greedy, where acceptance is the share of drafts the target's argmax matches)."""


def conveyor(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "conveyor", *args], check=True, cwd=HERE,
                   env={**os.environ, "PYTHONPATH": str(HERE / "src")})


def write_copy_trace(path: pathlib.Path, num_requests: int) -> None:
    """`copy`: 'repeat exactly' over COPY_TEXTS, stopping at EOS (max_tokens 2x the passage's words)."""
    requests = []
    for index in range(num_requests):
        text = COPY_TEXTS[index % len(COPY_TEXTS)]
        prompt = f"Repeat the following text exactly, word for word, and nothing else:\n\n{text}"
        requests.append(TraceRequest(request_id=f"copy-{index}", request_class="copy", prompt_len=len(prompt.split()),
                                     output_len=2 * len(text.split()), prompt=prompt, ignore_eos=False))
    write_trace(make_trace(requests, seed=None, generator={"name": "spec_decode_cpu.copy"}), path)


def make_traces(plan: Plan) -> dict[str, pathlib.Path]:
    traces = {}
    for name in plan.classes:
        path = plan.out / f"trace-{name}.jsonl"
        if path.exists():
            pass
        elif name == "copy":
            write_copy_trace(path, plan.num_requests)
        else:
            conveyor("trace", "make", *TRACE_PARAMS[name], "--num-requests", str(plan.num_requests), "--seed", "7",
                     "--out", str(path))
        traces[name] = path
    return traces


def run_config(plan: Plan, name: str, repeat: int, traces: dict[str, pathlib.Path]) -> dict[str, dict[str, Any]]:
    """One fresh server for this configuration; one bench run per traffic class; their summaries."""
    spec_config = plan.configs[name]
    args: dict[str, Any] = {"max_model_len": 2048} | ({"speculative_config": spec_config} if spec_config else {})
    command = f"{sys.executable} -m conveyor serve --host {{host}} --port {{port}} {{args}} {shlex.join(plan.serve_args)}"
    server_dir = plan.out / f"{name}-r{repeat}"
    summaries = {}
    spec = ServerSpec(name=name, command=command, args=args, env={"PYTHONPATH": str(HERE / "src")},
                      startup_timeout_s=600)
    with ServerProcess(spec, server_dir) as server:
        for traffic, trace in traces.items():
            run_dir = server_dir / traffic
            conveyor("bench", "run", "--base-url", server.base_url, "--trace", str(trace), "--rate", "inf",
                     "--max-concurrency", str(plan.concurrency), "--endpoint", plan.endpoint,
                     "--temperature", str(plan.temperature), "--out", str(run_dir),
                     "--label",
                     f"{name}/{traffic}/r{repeat}", "--no-progress", "--force")
            summaries[traffic] = json.loads((run_dir / "summary.json").read_text())
    return summaries


def value(summary: dict[str, Any], key: str) -> float | None:
    holder = summary.get("server") or {} if key.startswith("server.") else summary
    found = holder.get(key.removeprefix("server."))
    return None if found is None else float(found)


def cell(values: list[float]) -> str:
    if not values:
        return "-"
    middle = statistics.median(values)
    spread = f" [{min(values):.3g}-{max(values):.3g}]" if len(values) > 1 else ""
    return f"{middle:.3g}{spread}"


def print_table(plan: Plan, results: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    """Per class: one row per configuration, medians over repeats [min-max], and tok/s vs off."""
    columns = ["class", "config", *(c for c, _, _ in METRICS), "tok/s vs off"]
    print(" | ".join(columns))
    for traffic in plan.classes:
        base = [value(s, "output_throughput") or 0.0 for s in results.get("off", {}).get(traffic, [])]
        for name in plan.configs:
            runs = results[name][traffic]
            cells = [cell([v * scale for s in runs if (v := value(s, key)) is not None]) for _, key, scale in METRICS]
            ratio = [(value(s, "output_throughput") or 0.0) / b for s, b in zip(runs, base) if b]
            print(" | ".join([traffic, name, *cells, cell(ratio)]))


def run(plan: Plan) -> dict[str, dict[str, list[dict[str, Any]]]]:
    plan.out.mkdir(parents=True, exist_ok=True)
    traces = make_traces(plan)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {name: {c: [] for c in plan.classes} for name in plan.configs}
    names = list(plan.configs)
    for repeat in range(plan.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            for traffic, summary in run_config(plan, name, repeat, traces).items():
                results[name][traffic].append(summary)
            (plan.out / "results.json").write_text(json.dumps(results, indent=1))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/conveyor-spec-cpu"))
    parser.add_argument("--configs", type=json.loads, default=None, help="JSON: name -> speculative config or null")
    parser.add_argument("--classes", default="agent,chat,copy", help="traffic classes, of: agent, chat, copy")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--serve-args", default=DEFAULT_SERVE_ARGS, help="extra conveyor serve flags (default: "
                        f"{DEFAULT_SERVE_ARGS!r}, a float32 target; on CPU the engine leaves a core to the API server)")
    parser.add_argument("--temperature", type=float, default=0.0, help="of every request (default 0: greedy)")
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                        help="chat (default: SmolLM2 is an instruct model) or completions (raw prompts)")
    args = parser.parse_args()
    configs = args.configs or default_configs()
    if "off" not in configs:
        parser.error("--configs needs an 'off' entry (null): ratios are taken against it")
    plan = Plan(out=args.out, configs=configs, classes=args.classes.split(","), num_requests=args.num_requests,
                concurrency=args.concurrency, repeats=args.repeats, serve_args=shlex.split(args.serve_args),
                endpoint=args.endpoint, temperature=args.temperature)
    print_table(plan, run(plan))


if __name__ == "__main__":
    main()
