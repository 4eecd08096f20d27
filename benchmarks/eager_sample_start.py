"""How does a host-paced eager sample start, after the host waited for the device?

The benchmarker's eager samples (runtime/collective_benchmarking.py) start after a
barrier and a wait for the device, on an idle GPU; a sample of few calls is mostly its
start. This times one serving-step layer (``x + neg(relu(x @ w))``, hidden 4096, bf16)
in samples of back-to-back calls with a CUDA event after each call, after the host waited
for the device by sleeping (as the benchmarker does) or by spinning, optionally after
2 ms more with the device idle, with and without untimed lead-in calls, and records the
median time of each call position and the quartiles of the samples' means:

    python benchmarks/eager_sample_start.py --out /tmp/eager_sample_start.json

Measured (two H200 hosts, torch 2.11, results/eager_sample_start_h200x1_2026-11-29.md):
at one token (host-bound, 45-57 µs a call) the first call of a sample took 11-47% longer
than the steady pace after a sleeping wait, 32-82% after 2 ms idle; 7-15% after a
spinning wait (33-65% after 2 ms idle); after ten untimed calls 5-15%. At 16384 tokens
(device-bound, 930-1060 µs) the first call took 3-17% longer whatever the wait; after
two untimed calls none. Hence the benchmarker's lead-in (``_EAGER_LEAD_IN_US``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from common import header, write_json

HIDDEN = 4096
SAMPLES = 40
IDLE_S = 0.002
# (tokens, calls per sample, lead-in calls): about 1000 µs of calls each.
SIZES = ((1, 12, 10), (16384, 6, 2))


def wait_for_device(spin: bool) -> None:
    """Wait for the device as the benchmarker does (sleeps doubling from 10 µs to
    200 µs), or spinning."""
    event = torch.cuda.Event()
    event.record()
    pause = 1e-5
    while not event.query():
        if not spin:
            time.sleep(pause)
            pause = min(2 * pause, 2e-4)


def sample(
    fn: Callable[[], torch.Tensor], calls: int, spin: bool, lead_in: int, idle_s: float
) -> list[float]:
    """µs of each of ``calls`` back-to-back calls, after the wait, ``idle_s`` more
    seconds with the device idle, and ``lead_in`` untimed calls."""
    wait_for_device(spin)
    began = time.perf_counter()
    while time.perf_counter() - began < idle_s:
        if not spin:
            time.sleep(1e-4)
    for _ in range(lead_in):
        fn()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    marks[0].record()
    for i in range(calls):
        fn()
        marks[i + 1].record()
    marks[-1].synchronize()
    return [marks[i].elapsed_time(marks[i + 1]) * 1e3 for i in range(calls)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    results = {}
    for tokens, calls, lead_in in SIZES:
        x = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
        w = torch.randn(HIDDEN, HIDDEN, device=device, dtype=torch.bfloat16)

        def layer() -> torch.Tensor:
            return x + torch.relu(x @ w).neg()

        for _ in range(20):
            layer()
        for spin in (False, True):
            for lead in (0, lead_in):
                for idle_s in (0.0, IDLE_S):
                    per = [
                        sample(layer, calls, spin, lead, idle_s) for _ in range(SAMPLES)
                    ]
                    key = (
                        f"tok{tokens}_{'spin' if spin else 'sleep'}_lead{lead}"
                        f"_idle{int(idle_s * 1e3)}ms"
                    )
                    positions = [
                        round(statistics.median(p[i] for p in per), 1)
                        for i in range(calls)
                    ]
                    means = statistics.quantiles([statistics.mean(p) for p in per], n=4)
                    results[key] = {
                        "position_median_us": positions,
                        "sample_mean_quartiles_us": [round(q, 1) for q in means],
                    }
                    print(key, positions[:4], "...", positions[-1], flush=True)
    write_json(args.out, {**header(device), "samples": SAMPLES, "results": results})


if __name__ == "__main__":
    main()
