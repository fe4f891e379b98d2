"""GET /step_log: the engine's step records as JSON lines, drained; a 404 naming the flag while it is off."""

from __future__ import annotations

import json

from fake_engine import FakeEngine
from server_helpers import app_client, run

from conveyor.core.step_log import StepRecord


def record(start_s: float) -> StepRecord:
    return StepRecord(num_prefill_tokens=10, num_decode_tokens=3, num_prefill_reqs=1, num_decode_reqs=3,
                      num_context_tokens=200, num_draft_tokens=0, num_preemptions=0, step_time_s=0.02,
                      start_s=start_s)


def test_step_log_is_served_as_json_lines_and_drained() -> None:
    async def main() -> None:
        engine = FakeEngine()
        engine.step_log = [record(1.0), record(2.0)]
        async with app_client(engine) as client:
            response = await client.get("/step_log")
            assert response.status_code == 200 and response.headers["content-type"] == "application/x-ndjson"
            lines = response.text.splitlines()
            assert [StepRecord.from_json(json.loads(line)) for line in lines] == [record(1.0), record(2.0)]
            again = await client.get("/step_log")
            assert again.status_code == 200 and again.text == ""
    run(main())


def test_step_log_off_is_a_404_naming_the_flag() -> None:
    async def main() -> None:
        async with app_client(FakeEngine()) as client:
            response = await client.get("/step_log")
            assert response.status_code == 404 and "--step-log-size" in response.json()["error"]["message"]
    run(main())


def test_step_log_needs_the_api_key_when_one_is_set() -> None:
    async def main() -> None:
        engine = FakeEngine()
        engine.step_log = []
        async with app_client(engine, api_keys=("k",)) as client:
            assert (await client.get("/step_log")).status_code == 401
            assert (await client.get("/step_log", headers={"Authorization": "Bearer k"})).status_code == 200
    run(main())


def test_a_full_ring_is_served_whole() -> None:
    async def main() -> None:
        engine = FakeEngine()
        engine.step_log = [record(float(i)) for i in range(5000)]  # serialized on a worker thread
        async with app_client(engine) as client:
            lines = (await client.get("/step_log")).text.splitlines()
            assert len(lines) == 5000 and json.loads(lines[-1])["start_s"] == 4999.0
    run(main())
