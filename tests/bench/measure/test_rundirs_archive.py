"""Archived results keep requests.jsonl gzipped (benchmarks/results/): a run reads the same requests."""

from __future__ import annotations

import gzip
import json
import pathlib
import shutil

from conveyor.bench.measure.rundirs import load_run

RESULTS = pathlib.Path(__file__).parents[3] / "benchmarks" / "results" / "gpu-study-s1"


def test_a_gzipped_requests_file_reads_as_the_plain_one(tmp_path: pathlib.Path) -> None:
    archived = RESULTS / "h200-call1" / "conveyor-defaults" / "rate-2-rep0"
    plain = tmp_path / "run"
    shutil.copytree(archived, plain)
    with gzip.open(plain / "requests.jsonl.gz", "rt", encoding="utf-8") as f:
        (plain / "requests.jsonl").write_text(f.read())
    (plain / "requests.jsonl.gz").unlink()
    from_archive, from_plain = load_run(archived).requests(), load_run(plain).requests()
    assert len(from_archive) == 60 and from_archive == from_plain
    assert json.loads((archived / "summary.json").read_text())["completed"] == 60
