"""A small in-process OpenAI-style streaming server for the benchmark's edge cases.

Behaviour is chosen per request by the prompt's first word (so one trace can mix them):
ok (default) · http400 · http500 · http503 · stall (one token, then nothing) · break (two tokens, then
the connection drops) · errobj (HTTP 200, then an SSE error object as vLLM sends under
--max-num-queued-reqs) · nodone (tokens, then the stream ends without [DONE]).
It runs on its own event loop in a thread, on a free port, and keeps vLLM-named /metrics counters. It
also counts the streams open at once (in_flight / max_in_flight: the proof that a client's concurrency
cap holds) and keeps every generation request's body with its arrival and end times (`received`), so
tests can check what a session turn carried and when.
Prefix cache: a prompt hits the longest word prefix it shares with an earlier prompt of the same
`cache_salt` (None is one namespace; `honour_salt=False` puts every salt in it, as a server that ignores
the field), counted in vLLM's prefix_cache_queries/hits counters and, with `prompt_details`, reported as
usage.prompt_tokens_details.cached_tokens. `refuse_salt` answers a salted request 400 naming cache_salt.
The bench's one-token salt probe (a salt ending in "-probe", load/cache_mode.py) is answered but kept
apart (state.probes), so the counts tests compare are the run's own.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web


@dataclass
class FakeConfig:
    token_delay_s: float = 0.002
    send_usage: bool = True
    with_metrics: bool = True
    queue_time_s: float = 0.003
    prompt_details: bool = False
    honour_salt: bool = True
    refuse_salt: bool = False
    step_log: bool = False
    """Serve GET /step_log: one fake step record per generation request since the last drain."""


@dataclass
class Received:
    body: dict
    arrived_s: float
    ended_s: float | None = None


@dataclass
class FakeState:
    generation_tokens: int = 0
    prompt_tokens: int = 0
    num_requests: int = 0
    num_disconnects: int = 0
    queue_times: list[float] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    received: list[Received] = field(default_factory=list)
    probes: list[dict] = field(default_factory=list)
    prefix_queries: int = 0
    prefix_hits: int = 0
    cached: dict = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    num_step_log_drains: int = 0


QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)


def _first_word(body: dict) -> str:
    if "messages" in body:
        text = body["messages"][-1]["content"]
    else:
        text = body.get("prompt") or ""
    words = text.split() if isinstance(text, str) else []
    return words[0] if words else ""


def _chunk(chat: bool, text: str) -> bytes:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n".encode()


class FakeServer:
    def __init__(self, cfg: FakeConfig | None = None) -> None:
        self.cfg = cfg or FakeConfig()
        self.state = FakeState()
        self.base_url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        if self.cfg.with_metrics:
            app.router.add_get("/metrics", self._metrics)
        if self.cfg.step_log:
            app.router.add_get("/step_log", self._step_log)
        return app

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = body.get("prompt") or " ".join(m["content"] for m in body.get("messages", []))
        return web.json_response({"count": len(text.split()) + 1, "max_model_len": 4096, "tokens": []})

    async def _step_log(self, request: web.Request) -> web.Response:
        steps, self.state.steps = self.state.steps, []
        self.state.num_step_log_drains += 1
        return web.Response(text="".join(json.dumps(s) + "\n" for s in steps), content_type="application/x-ndjson")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        s = self.state
        lines = [f'vllm:generation_tokens_total{{model_name="fake-model"}} {s.generation_tokens}',
                 f'vllm:prompt_tokens_total{{model_name="fake-model"}} {s.prompt_tokens}',
                 'vllm:num_preemptions_total{model_name="fake-model"} 0',
                 'vllm:num_requests_running{model_name="fake-model"} 1',
                 'vllm:num_requests_waiting{model_name="fake-model"} 0',
                 'vllm:kv_cache_usage_perc{model_name="fake-model"} 0.25',
                 'vllm:cache_config_info{block_size="16",model_name="fake-model"} 1',
                 f'vllm:prefix_cache_queries_total{{model_name="fake-model"}} {s.prefix_queries}',
                 f'vllm:prefix_cache_hits_total{{model_name="fake-model"}} {s.prefix_hits}']
        for le in QUEUE_BUCKETS:
            n = sum(q <= le for q in s.queue_times)
            lines.append(f'vllm:request_queue_time_seconds_bucket{{le="{le}",model_name="fake-model"}} {n}')
        lines.append(f'vllm:request_queue_time_seconds_bucket{{le="+Inf",model_name="fake-model"}} {len(s.queue_times)}')
        lines.append(f'vllm:request_queue_time_seconds_count{{model_name="fake-model"}} {len(s.queue_times)}')
        return web.Response(text="\n".join(lines) + "\n")

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        mode = _first_word(body)
        salt = body.get("cache_salt")
        if salt is not None and self.cfg.refuse_salt:
            return web.json_response({"error": {"message": "Parameter 'cache_salt' is not supported", "code": 400}},
                                     status=400)
        if isinstance(salt, str) and salt.endswith("-probe"):
            self.state.probes.append(body)
            return web.json_response({"choices": [{"index": 0, "text": " t0"}]})
        if mode.startswith("http"):
            status = int(mode[4:])
            return web.json_response({"error": {"message": f"fake {status}", "code": status}}, status=status)
        self.state.num_requests += 1
        self.state.queue_times.append(self.cfg.queue_time_s)
        prompt_len = len(str(body.get("prompt") or body.get("messages")).split())
        self.state.prompt_tokens += prompt_len
        body["_cached_tokens"] = self._cache_lookup(body, salt)
        self.state.steps.append({"num_prefill_tokens": prompt_len, "num_decode_tokens": 0, "num_prefill_reqs": 1,
                                 "num_decode_reqs": 0, "num_context_tokens": prompt_len, "step_time_s": 0.001})
        received = Received(body=body, arrived_s=time.perf_counter())
        self.state.received.append(received)
        self.state.in_flight += 1
        self.state.max_in_flight = max(self.state.max_in_flight, self.state.in_flight)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await resp.prepare(request)
            await self._stream(request, resp, body, (chat, mode, prompt_len))
        except (ConnectionError, aiohttp.ClientConnectionError, asyncio.CancelledError):
            self.state.num_disconnects += 1  # the client went away (cancellation or test teardown)
        finally:
            self.state.in_flight -= 1
            received.ended_s = time.perf_counter()
        return resp

    async def _stream(self, request: web.Request, resp: web.StreamResponse, body: dict, info: tuple) -> None:
        chat, mode, prompt_len = info
        if mode == "errobj":
            await resp.write(b'data: {"error": {"message": "queue is full", "type": "ServiceUnavailable", "code": 503}}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            return
        if chat:
            await resp.write(f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': ''}}]})}\n\n".encode())
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        for i in range(n):
            await asyncio.sleep(self.cfg.token_delay_s)
            await resp.write(_chunk(chat, f" t{i}"))
            self.state.generation_tokens += 1
            if mode == "stall":  # hold the stream open, silent, until the client gives up
                while request.transport is not None and not request.transport.is_closing():
                    await asyncio.sleep(0.02)
                raise ConnectionResetError("client gave up")
            if mode == "break" and i == 1:
                request.transport.close()
                return
        if self.cfg.send_usage:
            usage = {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}
            if self.cfg.prompt_details:
                usage["prompt_tokens_details"] = {"cached_tokens": body["_cached_tokens"]}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        if mode != "nodone":
            await resp.write(b"data: [DONE]\n\n")

    def _cache_lookup(self, body: dict, salt: object) -> int:
        """Words of the prompt an earlier prompt of the same namespace already holds (at most all but one)."""
        words = str(body.get("prompt") or body.get("messages")).split()
        seen = self.state.cached.setdefault(salt if self.cfg.honour_salt else None, set())
        prefixes, h = [], 0
        for w in words:  # a running hash names each prefix (linear in the prompt)
            h = hash((h, w))
            prefixes.append(h)
        hit = max((k + 1 for k, h in enumerate(prefixes[:-1]) if h in seen), default=0)
        seen.update(prefixes)
        self.state.prefix_queries += len(words)
        self.state.prefix_hits += hit
        return hit

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.app(), handle_signals=False, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> FakeServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        time.sleep(0)
