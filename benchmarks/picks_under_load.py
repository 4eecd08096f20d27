"""Whether a pick made while the host is busy outlives the load (2 gloo ranks).

    python benchmarks/picks_under_load.py --runs 10 --out benchmarks/results/picks_under_load_gloo2.json

The op of test/inductor/test_collective_op_tuning_confidence.py: "balanced" does 10
units of CPU work on every rank, "skewed" none on rank 0 and 15 on rank 1, the op's own
25 everywhere. Three series of fresh jobs, each on a cache directory of its own:

    quiet      one job on a quiet host: which choice won, settled or provisional
    loaded     one job beside a busy process (``while True: pass``) ...
    after      ... then the next job on the same cache directories, on a quiet host

and records every job's winner, whether it was provisional, its confidence (lead over the
runner-up, spread, host contention) and its timings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "test" / "inductor"), str(REPO)]

from test_collective_op_tuning_confidence import busy_host, one_job


def _job(root: pathlib.Path) -> dict:
    record = one_job(root)
    return {
        "winner": record.winner,
        "decision": str(record.decision.value),
        "source": str(record.source.value),
        "provisional": record.provisional,
        "reason": record.reason,
        "confidence": dataclasses.asdict(record.confidence)
        if record.confidence
        else None,
        "timings_us": {
            t.name: [t.low_us, t.max_us, t.high_us, t.min_us] for t in record.timings
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument(
        "--out", default=str(REPO / "benchmarks/results/picks_under_load_gloo2.json")
    )
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        cwd=REPO,
    ).stdout.strip()
    results: dict = {
        "commit": commit,
        "cpus": os.cpu_count(),
        "quiet": [],
        "loaded": [],
        "after": [],
    }
    for i in range(args.runs):
        results["quiet"].append(
            _job(pathlib.Path(tempfile.mkdtemp(prefix="picks_quiet_")))
        )
        root = pathlib.Path(tempfile.mkdtemp(prefix="picks_loaded_"))
        with busy_host():
            results["loaded"].append(_job(root))
        results["after"].append(_job(root))
        print(
            f"run {i}: quiet {results['quiet'][-1]['winner']}"
            f"{' (provisional)' if results['quiet'][-1]['provisional'] else ''}; "
            f"loaded {results['loaded'][-1]['winner']}"
            f"{' (provisional)' if results['loaded'][-1]['provisional'] else ''}; "
            f"after {results['after'][-1]['winner']} ({results['after'][-1]['decision']}, "
            f"{'provisional' if results['after'][-1]['provisional'] else 'settled'})",
            flush=True,
        )
        _write(
            args.out, results
        )  # after every run: a run cut short keeps what it measured


def _write(path: str, results: dict) -> None:
    summary = {
        series: {
            "balanced": sum(j["winner"] == "balanced" for j in jobs),
            "provisional": sum(j["provisional"] for j in jobs),
            "wrong_and_settled": sum(
                j["winner"] != "balanced" and not j["provisional"] for j in jobs
            ),
            "runs": len(jobs),
        }
        for series, jobs in results.items()
        if isinstance(jobs, list)
    }
    results["summary"] = summary
    results["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
    pathlib.Path(path).write_text(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
