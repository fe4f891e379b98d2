"""Load generator capacity: achieved rate, send lag and client CPU per request for 1, 2, ... workers.

A trivial streaming server (aiohttp, its own process, 2 token chunks + usage + [DONE] per request, no
model) answers as fast as it can, so what is measured is the client. Each (workers, rate) point is a
real `conveyor bench run` (trace, arrivals, client, metrics, run directory) at a Poisson rate for
--duration seconds. client_cpu_ms_per_req is the CPU time of every load-generator process (the parent,
which also scrapes and writes the run directory, plus each worker) per request sent; 1000 divided by it
is the rate one dedicated core sustains, and 5,000 req/s needs ceil(5000 / that) worker cores (plus the
server's). A point is good when every worker's p99 send lag is <= --bound-ms and nothing failed.

--ab N alternates, in this one process and N times each, at one rate with one worker: the stdlib path
(json, asyncio loop), orjson alone, uvloop alone, both (the fast path), and the fast path with the
dispatcher's former 1 ms spin-wait, so each saving is measured against the same machine noise.

On a quiet machine (nothing else running; the server takes a core of its own):
    PYTHONPATH=src python benchmarks/loadgen_capacity.py --workers 1,2 --rates 1000,2000,3000,4000,5000 --duration 5
    PYTHONPATH=src python benchmarks/loadgen_capacity.py --ab 5 --rates 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any


def serve(port: int) -> None:
    from aiohttp import web

    chunk = b'data: {"choices":[{"index":0,"text":" x"}]}\n\n'
    tail = b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2}}\n\ndata: [DONE]\n\n'

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk)
        await resp.write(chunk + tail)
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "trivial"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str) -> None:
    for _ in range(100):
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("trivial server did not start")


def measure(url: str, point: tuple[int, float], duration_s: float, tmp: str, bound_ms: float) -> dict[str, Any]:
    from conveyor.bench.measure.runner import BenchRunConfig, run_benchmark
    from conveyor.bench.measure.summary import summary_to_json
    from conveyor.bench.trace.traces import TraceRequest, make_trace, write_trace

    workers, rate = point
    n = int(rate * duration_s)
    reqs = [TraceRequest(request_id=f"r{i}", request_class="tiny", prompt="a b c d", prompt_len=4, output_len=2)
            for i in range(n)]
    trace = os.path.join(tmp, f"trace-{rate:g}.jsonl")
    write_trace(make_trace(reqs, 0, {"name": "loadgen_capacity"}), trace)
    cpu0 = time.process_time()
    s = summary_to_json(run_benchmark(BenchRunConfig(base_url=url, trace_path=trace, request_rate=rate, num_workers=workers,
                                     out_dir=os.path.join(tmp, f"run-{workers}-{rate:g}"), max_send_lag_p99_ms=bound_ms,
                                     show_progress=False, scrape_interval_s=60.0)))
    parent_cpu = time.process_time() - cpu0  # with workers > 1 the parent only scrapes, merges and writes
    client = s["client"]
    worker_cpu = sum(client["cpu_s_per_worker"]) if workers > 1 else 0.0
    cpu_ms = 1000.0 * (parent_cpu + worker_cpu) / n
    return {"workers": workers, "rate": rate, "sent": s["num_sent"], "failed": s["failed"],
            "achieved_req_s": round(s["request_throughput"], 1),
            "send_lag_p99_ms_per_worker": [round(x, 2) for x in client["send_lag_p99_ms_per_worker"]],
            "valid": s["valid"], "client_cpu_ms_per_req": round(cpu_ms, 3),
            "req_s_per_core": round(1000.0 / cpu_ms, 0), "json": client["json"], "event_loop": client["event_loop"]}


MODES = ("stdlib", "orjson", "uvloop", "fast", "fast-1ms-spin")


def _use(mode: str, spin_s: float) -> None:
    """Switch this process's client to one JSON library, event loop and dispatcher spin (for --ab)."""
    from conveyor.bench.load import client, loadgen, workers
    from conveyor.bench.measure import runner

    loadgen.SPIN_S = 0.001 if mode.endswith("1ms-spin") else spin_s
    if mode in ("orjson", "fast", "fast-1ms-spin"):
        client.json_loads, client.json_dumps, _ = client._json_codec()
    else:
        client.json_loads, client.json_dumps = json.loads, lambda obj: json.dumps(obj).encode()
    runner.run_async = workers.run_async if mode != "stdlib" and mode != "orjson" else asyncio.run  # type: ignore[assignment]


def ab(url: str, args: argparse.Namespace, tmp: str) -> None:
    from conveyor.bench.load import loadgen

    spin_s = loadgen.SPIN_S
    rate = float(args.rates.split(",")[0])
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    for k in range(args.ab):
        for mode in MODES[k % 2::] + MODES[:k % 2]:  # rotate the order so no mode always runs first
            _use(mode, spin_s)
            row = measure(url, (1, rate), args.duration, tmp, args.bound_ms)
            cpu[mode].append(row["client_cpu_ms_per_req"])
            print(json.dumps(dict(row, mode=mode)), flush=True)
    for mode, values in cpu.items():
        print(f"{mode}: client CPU {statistics.median(values):.3f} ms/request (median of {len(values)}; "
              f"min {min(values):.3f}, max {max(values):.3f})")


def sweep(url: str, args: argparse.Namespace, tmp: str) -> None:
    import numpy as np

    for workers in (int(w) for w in args.workers.split(",")):
        rows = []
        for rate in (float(r) for r in args.rates.split(",")):
            row = measure(url, (workers, rate), args.duration, tmp, args.bound_ms)
            print(json.dumps(row), flush=True)
            rows.append(row)
        good = [r["rate"] for r in rows if r["valid"] and r["failed"] == 0]
        line = f"{workers} worker(s): highest rate with every worker's p99 send lag <= {args.bound_ms:g} ms: " + (
            f"{max(good):g} req/s" if good else "none of those tried")
        if len(rows) >= 2:  # CPU ms = fixed + marginal x requests: the marginal cost is what a core can sustain
            marginal, fixed = np.polyfit([r["sent"] for r in rows],
                                         [r["client_cpu_ms_per_req"] * r["sent"] for r in rows], 1)
            per_core = 1000.0 / marginal
            line += (f"; marginal client CPU {marginal:.3f} ms/request (+{fixed:.0f} ms per run) = {per_core:.0f} "
                     f"req/s per core -> 5,000 req/s needs {math.ceil(5000 / per_core)} worker cores")
        print(line, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="250,500,1000,1500,2000,3000")
    parser.add_argument("--workers", default="1,2", help="worker counts to measure, e.g. 1,2,4")
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--bound-ms", type=float, default=5.0, help="p99 send lag a good point stays under")
    parser.add_argument("--ab", type=int, default=0, help="alternate stdlib / fast path N times at the first rate")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return 0
    port = _free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url)
        print(f"# {platform.platform()}, python {platform.python_version()}, {os.cpu_count()} cpus, "
              f"load average {os.getloadavg()[0]:.1f} at start")
        with tempfile.TemporaryDirectory() as tmp:
            (ab if args.ab else sweep)(url, args, tmp)
    finally:
        server.terminate()
        server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
