"""Load generator capacity: the highest Poisson rate `conveyor bench run` can offer with p99 send lag <= 5 ms.

A trivial streaming server (aiohttp, separate process, 2 token chunks + usage + [DONE] per request, no
model) answers as fast as it can, so what is measured is the client: its event loop must start every
request within 5 ms of its scheduled time (p99) while also reading all the streams it already opened.
Each rate runs for --duration seconds through the real runner (trace, arrivals, client, metrics).
client_cpu_ms_per_req is the client process's CPU time per request (trace load, dispatch, streaming,
metrics, run directory): on a machine shared with other work, send lag measures the OS scheduler as much
as the client, and 1000 / client_cpu_ms_per_req is the rate one dedicated core could sustain.

    PYTHONPATH=src python benchmarks/loadgen_capacity.py [--rates 250,500,1000,1500,2000] [--duration 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

BOUND_MS = 5.0


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


def measure(url: str, rate: float, duration_s: float, tmp: str) -> dict:
    from conveyor.bench.runner import BenchRunConfig, run_benchmark
    from conveyor.bench.traces import TraceRequest, make_trace, write_trace

    n = int(rate * duration_s)
    reqs = [TraceRequest(request_id=f"r{i}", request_class="tiny", prompt="a b c d", prompt_len=4, output_len=2)
            for i in range(n)]
    trace = os.path.join(tmp, f"trace-{rate:g}.jsonl")
    write_trace(make_trace(reqs, 0, {"name": "loadgen_capacity"}), trace)
    cpu0 = time.process_time()
    s = run_benchmark(BenchRunConfig(base_url=url, trace_path=trace, request_rate=rate, out_dir=os.path.join(
        tmp, f"run-{rate:g}"), max_send_lag_p99_ms=BOUND_MS, show_progress=False, scrape_interval_s=60.0))
    return {"rate": rate, "sent": s["num_prompts"], "completed": s["completed"], "failed": s["failed"],
            "send_lag_p99_ms": round(s["send_lag_p99_ms"], 3), "achieved_req_s": round(s["request_throughput"], 1),
            "valid": s["valid"], "client_cpu_ms_per_req": round(1000 * (time.process_time() - cpu0) / n, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="250,500,1000,1500,2000,3000")
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return 0
    port = _free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    url = f"http://127.0.0.1:{port}"
    best = 0.0
    try:
        _wait(url)
        print(f"# {platform.platform()}, python {platform.python_version()}, {os.cpu_count()} cpus, "
              f"load average {os.getloadavg()[0]:.1f} at start")
        with tempfile.TemporaryDirectory() as tmp:
            for rate in (float(r) for r in args.rates.split(",")):
                row = measure(url, rate, args.duration, tmp)
                print(json.dumps(row), flush=True)
                if row["send_lag_p99_ms"] <= BOUND_MS and row["failed"] == 0:
                    best = max(best, rate)
    finally:
        server.terminate()
        server.wait(10)
    print(f"highest rate with p99 send lag <= {BOUND_MS} ms: {best:g} req/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
