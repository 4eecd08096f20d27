"""How fast every rank learns that the Store is gone, with the timeout knob as users set it.

    python benchmarks/store_loss.py --timeout 30 --out benchmarks/results/store_loss_gloo2.json

Two gloo ranks and a Store hosted by a process of its own, as torchrun's agent hosts
it (test/inductor/test_collective_op_tuning_store_loss.py): the Store's host is killed
(or stopped: a host that keeps its connections open and never answers), then both ranks
compile a tuned collective op. Per rank: seconds from the compile's start to the
StoreLostError, and from the error to the process's exit (after a second compile, which
must fail at once without asking the Store). The issue's bounds: the error within the
timeout + 5 s, the exit within 5 s.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "test" / "inductor"), str(REPO)]

import test_collective_op_tuning_store_loss as scenario


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument(
        "--out", default=str(REPO / "benchmarks/results/store_loss_gloo2.json")
    )
    args = parser.parse_args()
    scenario.TIMEOUT_S = args.timeout
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        cwd=REPO,
    ).stdout.strip()
    results = {"commit": commit, "timeout_s": args.timeout, "runs": []}
    for how in ("killed", "stopped"):
        lost, outcomes = scenario.lose_the_store(
            "before_the_first_compile",
            how,
            pathlib.Path(tempfile.mkdtemp(prefix="store_loss_")),
        )
        for rank in outcomes:
            compiled, later = rank.report["compile"], rank.report["later"]
            run = {
                "how": how,
                "rank": rank.rank,
                "error_after_compile_start_s": compiled["ended"] - compiled["began"],
                "later_compile_s": later["ended"] - later["began"],
                "later_requests": rank.report["later_sent"],
                "exit_after_error_s": rank.exited - later["ended"],
                "error": compiled["store_lost"],
            }
            results["runs"].append(run)
            print(
                f"{how} rank {rank.rank}: error {run['error_after_compile_start_s']:.2f} s after the "
                f"compile began; a later compile failed in {run['later_compile_s']:.2f} s with "
                f"{run['later_requests']} requests; exit {run['exit_after_error_s']:.2f} s after it"
            )
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
