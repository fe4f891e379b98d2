#!/usr/bin/env python3
"""What tensor parallelism adds to rank 0's host path per step: pickling the step's `Execute(SchedulerOutput)`
once and writing it to a rank's pipe (worker/tp_executor.py), for a decode step of N requests.

A spawned child stands in for a rank: it reads, unpickles and acknowledges, so the round trip bounds what a
rank waits before it can launch. Rank 0's own cost is the pickle plus the write (the child's unpickle and
the ack are not on rank 0's path). No model, no torch collectives:

    PYTHONPATH=src python benchmarks/tp_control_plane.py [--requests 8 256 1024] [--repeats 300]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from conveyor.core.outputs import NO_NEW_BLOCKS, CachedRequestData, SchedulerOutput
from conveyor.worker.parallel import Execute


def rank_stand_in(connection: Connection) -> None:
    while (data := connection.recv_bytes()) != b"stop":
        ForkingPickler.loads(data)
        connection.send_bytes(b"k")


def decode_step(num_requests: int) -> SchedulerOutput:
    """N running requests, one token each, one in sixteen crossing into a new block."""
    cached = CachedRequestData()
    for i in range(num_requests):
        cached.append(f"cmpl-{i:032x}-0", NO_NEW_BLOCKS if i % 16 else (1000 + i,), 700 + i)
    return SchedulerOutput([], cached, {rid: 1 for rid in cached.req_ids}, num_requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 256, 1024])
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=rank_stand_in, args=(theirs,))
    child.start()
    for num_requests in args.requests:
        step = decode_step(num_requests)
        pickle_s, round_trip_s = [], []
        for _ in range(args.repeats):
            tick = time.perf_counter()
            payload = ForkingPickler.dumps(Execute(step))
            pickle_s.append(time.perf_counter() - tick)
            tick = time.perf_counter()
            ours.send_bytes(payload)
            ours.recv_bytes()
            round_trip_s.append(time.perf_counter() - tick)
        print(f"{num_requests} decodes: {len(payload)} bytes; pickle median {statistics.median(pickle_s) * 1e6:.0f} us; "
              f"write + rank unpickle + ack median {statistics.median(round_trip_s) * 1e6:.0f} us "
              f"(p90 {sorted(round_trip_s)[int(0.9 * len(round_trip_s))] * 1e6:.0f} us)")
    ours.send_bytes(b"stop")
    child.join()


if __name__ == "__main__":
    main()
