"""Grammars over HTTP (issue 34): a huge guided_choice compiles while /health and other requests are
answered at once, and a constraint over the server's size limits is a 400 naming the field."""

from __future__ import annotations

import asyncio
import time

from fake_engine import FakeEngine, FakeEngineConfig
from server_helpers import app_client, run

from conveyor.engine.grammar_check import GrammarLimits
from conveyor.engine.types import RequestOutput
from conveyor.request import FinishReason
from conveyor.server.generation import failed_output_error

COMP = "/v1/completions"
HUGE = [f"option-{i}" for i in range(100_000)]


def test_health_answers_while_several_huge_choices_compile() -> None:
    """Four requests of 100,000 choices each (1.3 MB) compile, two at a time, for seconds on a 2-core
    machine; /health and a small request keep answering, each well under a second."""
    async def main() -> None:
        async with app_client() as client:
            body = {"prompt": "pick", "max_tokens": 2, "guided_choice": HUGE}
            huge = [asyncio.ensure_future(client.post(COMP, json=body, timeout=300)) for _ in range(4)]
            latencies: list[float] = []
            while not all(task.done() for task in huge):
                start = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                latencies.append(time.monotonic() - start)
                small = await client.post(COMP, json={"prompt": "x", "max_tokens": 1})
                assert small.status_code == 200
                await asyncio.sleep(0.02)
            assert [(await task).status_code for task in huge] == [200] * 4
            assert len(latencies) >= 5, f"the compiles ended before /health could be asked during them: {latencies}"
            assert max(latencies) < 1.0, sorted(latencies)[-5:]
    run(main())


def test_constraints_over_the_size_limits_are_400_naming_the_field() -> None:
    engine = FakeEngine(FakeEngineConfig(grammar=GrammarLimits(max_bytes=64, max_choices=3)))

    async def main() -> None:
        async with app_client(engine) as client:
            many = await client.post(COMP, json={"prompt": "x", "guided_choice": ["a", "b", "c", "d"]})
            assert many.status_code == 400
            assert many.json()["error"]["param"] == "guided_choice"
            assert "--max-grammar-choices" in many.json()["error"]["message"]
            big = await client.post(COMP, json={"prompt": "x", "structured_outputs": {"regex": "a" * 65}})
            assert big.status_code == 400
            assert big.json()["error"]["param"] == "structured_outputs.regex"
            assert "--max-grammar-bytes" in big.json()["error"]["message"]
            fits = await client.post(COMP, json={"prompt": "x", "max_tokens": 1, "guided_choice": ["a", "b"]})
            assert fits.status_code == 200
            assert engine.admission.num_in_flight == 0
    run(main())


def test_a_grammar_failure_is_a_400_naming_the_field_and_an_engine_fault_stays_a_500() -> None:
    message = "guided_json: the output can no longer follow the grammar: no next token is possible"
    grammar = RequestOutput("r", "", [], 2, 0, FinishReason.ERROR, error_message=message, error_param="guided_json")
    error = failed_output_error(grammar)
    assert error is not None and (error.status_code, error.param, error.message) == (400, "guided_json", message)
    fault = failed_output_error(RequestOutput("r", "", [], 2, 0, FinishReason.ERROR, error_message="boom"))
    assert fault is not None and fault.status_code == 500
