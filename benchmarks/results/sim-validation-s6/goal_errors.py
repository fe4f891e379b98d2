"""issue 36: the held-out validation errors of two eval_splits.sh outputs side by side, and how many runs meet
the goals (request throughput and E2E p50 within 5%, TTFT p95 within 10%).

usage: python goal_errors.py BEFORE/split-H AFTER/split-H  (prints a markdown table, then the tallies)"""

import csv
import pathlib
import sys

METRICS = [("request_throughput", "req/s"), ("p95_ttft_ms", "TTFT p95"), ("p50_e2el_ms", "E2E p50"),
           ("mean_itl_ms", "ITL mean"), ("p50_itl_ms", "ITL p50"), ("p50_ttft_ms", "TTFT p50")]


def errors(folder: pathlib.Path) -> dict[str, dict[str, float]]:
    """label -> metric -> signed relative error, from a validation.csv."""
    out: dict[str, dict[str, float]] = {}
    with open(folder / "validation" / "validation.csv") as f:
        for row in csv.DictReader(f):
            out.setdefault(row["label"], {})[row["metric"]] = float(row["relative_error"])
    return out


def met(e: dict[str, float]) -> bool:
    return abs(e["request_throughput"]) <= 0.05 and abs(e["p50_e2el_ms"]) <= 0.05 and abs(e["p95_ttft_ms"]) <= 0.10


def main(before: pathlib.Path, after: pathlib.Path) -> None:
    print("| trial-setup | held-out run | " + " | ".join(n for _, n in METRICS) + " | goals |")
    print("|---" * (len(METRICS) + 3) + "|")
    tally = {"before": [0, 0, 0, 0], "after": [0, 0, 0, 0]}  # single met, single, means met, means
    sums = {tag: {m: [0.0, 0.0] for m, _ in METRICS} for tag in tally}
    for folder in sorted(p for p in before.iterdir() if p.is_dir()):
        b, a = errors(folder), errors(after / folder.name)
        for label in b:
            cells = [f"{100 * b[label][m]:+.1f} → {100 * a[label][m]:+.1f}" for m, _ in METRICS]
            verdict = " → ".join("met" if met(e[label]) else "**miss**" for e in (b, a))
            print(f"| {folder.name} | {label} | " + " | ".join(cells) + f" | {verdict} |")
            for tag, e in (("before", b), ("after", a)):
                k = 2 if label.startswith("mean") else 0
                tally[tag][k] += met(e[label])
                tally[tag][k + 1] += 1
                for m, _ in METRICS:
                    sums[tag][m][k // 2] += abs(e[label][m])
    for tag, (s, n, ms, mn) in tally.items():
        mean = ", ".join(f"{name} {100 * sums[tag][m][0] / n:.1f} / {100 * sums[tag][m][1] / max(mn, 1):.1f}%"
                         for m, name in METRICS)
        print(f"\n{tag}: goals met by {s} of {n} single runs, {ms} of {mn} means of 3; "
              f"mean |error| single / means: {mean}")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
