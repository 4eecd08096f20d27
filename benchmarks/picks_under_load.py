"""Whether a pick made while the host is busy outlives the load (2 gloo ranks).

    python benchmarks/picks_under_load.py --runs 10 --out benchmarks/results/picks_under_load_gloo2.json

"balanced" does 10 units of CPU work on every rank, "skewed" none on rank 0 and 15 on
rank 1, the op's own 25 everywhere: by the slowest rank balanced is faster, unless a busy
host slows the ranks that work at once more than the one that works alone. Timed for
real (test_collective_op_tuning_confidence.py checks what follows from such picks with
given readings). Three series of fresh jobs, each on a cache directory of its own:

    quiet      one job on a quiet host: which choice won, settled or provisional
    loaded     one job beside a busy process (``while True: pass``) ...
    after      ... then the next job on the same cache directories, on a quiet host

and records every job's winner, whether it was provisional, its confidence (lead over the
runner-up, spread, host contention) and its timings.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "test" / "inductor"), str(REPO)]

from collective_harness import assert_all_ok, compile_and_check, REAL, run_ranks
from torch._inductor.kernel.custom_op import (
    CustomOpConfig,
    register_custom_op_autotuning,
)

fc = torch.ops._c10d_functional
# CPU seconds of one unit of work: a fixed amount of computation, which takes longer in
# wall time when the host is busy (a sleep would not).
WORK_UNIT_S = 1e-3


@torch.library.custom_op("picks_under_load::work", mutates_args=())
def work(x: torch.Tensor, units: str) -> torch.Tensor:
    """``x``, after this rank's share of ``units`` (per rank: "0,15") of CPU work."""
    values = [float(v) for v in units.split(",")]
    spent = (
        time.thread_time() + values[min(dist.get_rank(), len(values) - 1)] * WORK_UNIT_S
    )
    while time.thread_time() < spent:
        pass
    return x.clone()


@work.register_fake
def _(x: torch.Tensor, units: str) -> torch.Tensor:
    return torch.empty_like(x)


def worked_all_reduce(name: str, units: str):
    def impl(x: torch.Tensor, group_name: str) -> torch.Tensor:
        return fc.wait_tensor(fc.all_reduce(work(x, units), "sum", group_name))

    impl.__name__ = name
    return impl


@torch.library.custom_op("picks_under_load::all_reduce", mutates_args=())
def loaded_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The op's own implementation: more work than either choice, on every rank."""
    out = work(x, "25")
    dist.all_reduce(
        out, group=torch._C._distributed_c10d._resolve_process_group(group_name)
    )
    return out


@loaded_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def balanced_or_skewed_body(r) -> list:
    register_custom_op_autotuning(
        loaded_all_reduce,
        configs=[
            CustomOpConfig(worked_all_reduce("balanced", "10")),
            CustomOpConfig(worked_all_reduce("skewed", "0,15")),
        ],
    )
    group = r.group.group_name
    return compile_and_check(
        lambda x: loaded_all_reduce(x, group) + 1, torch.randn(8, 8)
    )


@contextlib.contextmanager
def busy_host() -> Iterator[None]:
    """One process spinning on a CPU for the block, as a data loader or another job
    would."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def one_job(root: pathlib.Path):
    """A fresh job on ``root``'s cache directories, timed for real; rank 0's record."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(root / "{rank}")}
    (record,), _ = assert_all_ok(
        run_ranks(2, balanced_or_skewed_body, env=env, restarts=True, timing=REAL)
    )
    return record


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
