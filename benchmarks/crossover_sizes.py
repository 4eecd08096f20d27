"""Every size its winner: a tuned op whose choices cross between the ladder's sizes.

A 4-layer model ``x = x + op(relu(x @ w))`` (hidden 1024, bf16) whose tuned all-reduce
has two implementations: ``per_row`` (the all-reduce, then 2 µs a row of device
time) and ``fixed`` (the all-reduce, then 400 µs), crossing at 200 rows, between the
ladder's 64 and 256; the op's own implementation (1200 µs) never wins. Each job is a
fresh process on empty caches:

* ``tuned``: compiled with the op tuned, by plain ``torch.compile`` (first call at 8
  rows; range graphs) or the engine flow (guards filtered out, first call at the
  largest size); in the default mode or ``reduce-overhead``. Step time at sizes on the
  ladder and between its sizes, the split points, the first call's compile seconds and
  where the tuner's time went;
* ``untuned``: the same compile with collective autotuning off (the op's own): what a
  compile costs without the tuner;
* ``written``: one implementation written into the model instead of the op: the truth
  each size is compared with.

    python3 benchmarks/crossover_sizes.py --nproc 1 --out benchmarks/results/crossover_h100x1

runs every job (``--repeat`` more cold tuned jobs for the split points' stability) and
writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common import header, init_process_group, rounded, write_json

LAYERS = 4
HIDDEN = 1024
# Device time well above a call's host time (a Python custom op's, tens of µs), so that
# the default mode, whose launches are host-paced, is device-bound near the crossover.
US_PER_ROW = 2.0
FIXED_US = 400.0
OWN_US = 1200.0
LARGEST = 4096
# On the ladder (1, 4, 16, 64, 256, 1024, 4096) and between its sizes, most near the
# crossover at 200 rows.
SIZES = (1, 8, 16, 64, 96, 128, 160, 192, 200, 208, 224, 256, 512, 1024, 2048, 4096)
STEPS = 20
MODES = ("default", "reduce-overhead")
FLOWS = ("plain", "engine")

fc = torch.ops._c10d_functional
_CYCLES_PER_US: list[float] = []


@torch.library.custom_op("crossover::stall", mutates_args=())
def stall(x: torch.Tensor, us_per_row: float, fixed_us: float) -> torch.Tensor:
    """``x`` after ``fixed_us + us_per_row * rows`` µs of device time."""
    us = fixed_us + us_per_row * x.shape[0]
    torch.cuda._sleep(int(us * _cycles_per_us()))
    return x.clone()


@stall.register_fake
def _(x: torch.Tensor, us_per_row: float, fixed_us: float) -> torch.Tensor:
    return torch.empty_like(x)


def _cycles_per_us() -> float:
    if not _CYCLES_PER_US:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
        torch.cuda._sleep(1_000_000)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_US.append(10_000_000 / (start.elapsed_time(end) * 1e3))
    return _CYCLES_PER_US[0]


@torch.library.custom_op("crossover::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    out = fc.wait_tensor(fc.all_reduce(x, "sum", group_name))
    return stall(out, 0.0, OWN_US)


@all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def per_row(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return stall(fc.wait_tensor(fc.all_reduce(x, "sum", group_name)), US_PER_ROW, 0.0)


def fixed(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return stall(fc.wait_tensor(fc.all_reduce(x, "sum", group_name)), 0.0, FIXED_US)


IMPLEMENTATIONS = {"per_row": per_row, "fixed": fixed}


def model_of(op: Any, device: torch.device) -> Any:
    gen = torch.Generator(device).manual_seed(0)
    weights = [
        torch.randn(HIDDEN, HIDDEN, generator=gen, device=device, dtype=torch.bfloat16)
        / HIDDEN**0.5
        for _ in range(LAYERS)
    ]
    group = dist.group.WORLD.group_name

    def model(x: torch.Tensor) -> torch.Tensor:
        for w in weights:
            x = x + op(torch.relu(x @ w), group)
        return x

    return model


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def step_us(fn: Any, x: torch.Tensor) -> float:
    """µs a step of back-to-back steps takes (as a server runs them), the median of
    five batches of STEPS steps, after warm-up calls."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
        start.record()
        for _ in range(STEPS):
            fn(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / STEPS)
    return sorted(times)[2]


def tokens(n: int, device: torch.device) -> torch.Tensor:
    x = torch.randn(n, HIDDEN, device=device, dtype=torch.bfloat16)
    torch._dynamo.mark_dynamic(x, 0)
    return x


def run_job(job: str, mode: str, flow: str, choice: str, sizes: bool) -> dict:
    """One job in this process: what it compiled, ran and measured."""
    from torch._dynamo.utils import counters
    from torch._inductor import config
    from torch._inductor.kernel.collective import api

    device = torch.device("cuda", torch.cuda.current_device())
    torch._dynamo.reset()  # a model of its own for each configuration of the process
    op = IMPLEMENTATIONS[choice] if job == "written" else all_reduce
    model = model_of(op, device)
    # torch.compile takes a mode or options: the mode's options, and an engine's filter.
    options: dict[str, Any] = dict(torch._inductor.list_mode_options(mode))
    if flow == "engine":
        options["guard_filter_fn"] = torch.compiler.skip_all_guards_unsafe
    config.collective_autotune = job != "untuned"
    compiled = torch.compile(model, options=options)
    messages = _Messages()
    logging.getLogger("torch").addHandler(messages)
    first = tokens(LARGEST if flow == "engine" else 8, device)
    torch.cuda.synchronize()
    began = time.perf_counter()
    compiled(first)
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - began
    steady_s = min(_wall(compiled, first) for _ in range(2))
    records = api.collective_autotune_records()
    result: dict[str, Any] = {
        "job": job,
        "mode": mode,
        "flow": flow,
        "choice": choice if job == "written" else None,
        "compile_s": first_call_s - steady_s,
        "points": api.winner_change_points(all_reduce),
        "tuner_s": {
            "tuning": sum(r.tuning_s for r in records),
            "tracing": sum(r.trace_s for r in records),
            "compiling choices": sum(r.build_s for r in records),
            "waiting for the group": sum(r.waited_s for r in records),
        },
        # The benchmarks' own steps, summed over the probes.
        "benchmark_phases_s": {
            phase: sum(dict(r.phases).get(phase, 0.0) for r in records)
            for phase in ("screen", "batches", "rounds", "reduce")
        },
        "probes": sorted({r.size for r in records if r.size is not None}),
        # Inductor's and Dynamo's timed phases (dynamo_timed) over the first call and
        # the steady calls: where the compile's seconds went, tuned against untuned.
        "compile_phases_s": _compile_phases(),
        "paths": [p.path.value for p in api.collective_autotune_size_paths()],
    }
    if sizes:
        frames = counters["stats"]["unique_graphs"]
        for n in api.warm_up_sizes(LARGEST) if flow == "plain" else (LARGEST,):
            compiled(tokens(n, device))  # every range graph compiled before timing
        warm = counters["stats"]["unique_graphs"]
        result["step_us"] = {n: step_us(compiled, tokens(n, device)) for n in SIZES}
        result["graphs_compiled_by_warm_up"] = warm - frames
        result["graphs_compiled_after_warm_up"] = (
            counters["stats"]["unique_graphs"] - warm
        )
    result["skipping_cudagraphs"] = [
        m for m in messages.messages if "skipping cudagraphs" in m
    ]
    return result


def _compile_phases() -> dict[str, float]:
    """Seconds per dynamo_timed phase so far in this process, the longest first."""
    from torch._dynamo.utils import compilation_time_metrics

    totals = {name: sum(times) for name, times in compilation_time_metrics.items()}
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])[:25])


def _wall(fn: Any, x: torch.Tensor) -> float:
    began = time.perf_counter()
    fn(x)
    torch.cuda.synchronize()
    return time.perf_counter() - began


# -- the driver: every job in a fresh process -------------------------------------------


def jobs(repeat: int, sizes: bool = True) -> list[dict[str, str]]:
    """Every job of a card; without ``sizes`` only the compiles (no step times)."""
    # One process times every implementation written in, in each mode: no compile
    # time is read there.
    listed = (
        [{"job": "written", "mode": "", "flow": "plain", "choice": "", "sizes": "1"}]
        if sizes
        else []
    )
    listed += [
        {
            "job": "tuned",
            "mode": m,
            "flow": f,
            "choice": "",
            "sizes": "1" if sizes else "",
        }
        for m in MODES
        for f in FLOWS
    ]
    # What a compile costs untuned; the engine flow's first call, at the largest size,
    # compiles the same graph.
    listed += [
        {"job": "untuned", "mode": m, "flow": "plain", "choice": "", "sizes": ""}
        for m in MODES
    ]
    # More cold jobs of one configuration: the split points' stability.
    listed += [
        {"job": "tuned", "mode": MODES[1], "flow": "plain", "choice": "", "sizes": ""}
    ] * repeat
    return listed


def drive(nproc: int, repeat: int, out: str, sizes: bool = True) -> None:
    results = []
    for spec in jobs(repeat, sizes):
        with tempfile.TemporaryDirectory() as cache:
            result_file = Path(cache) / "result.json"
            env = {
                **os.environ,
                "TORCHINDUCTOR_CACHE_DIR": str(Path(cache) / "inductor"),
                "TORCHINDUCTOR_COLLECTIVE_AUTOTUNE_PERSIST": "0",
                # The ladder up to the engine's largest batch.
                "TORCHINDUCTOR_COLLECTIVE_AUTOTUNE_DYNAMIC_MAX": str(LARGEST),
            }
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={nproc}",
                __file__,
                *(f"--{k}={v}" for k, v in spec.items()),
                f"--result={result_file}",
            ]
            began = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout[-3000:], done.stderr[-6000:], file=sys.stderr)
                results.append({**spec, "failed": done.stderr[-2000:]})
                continue
            for result in json.loads(result_file.read_text()):
                result["job_s"] = time.perf_counter() - began
                results.append(result)
                print(
                    json.dumps(
                        rounded({k: v for k, v in result.items() if k != "step_us"})
                    )
                )
        # After every job: a run cut short still leaves what it measured.
        write_json(f"{out}.json", rounded({"results": results}))
    card = {"results": results, **report(results)}
    write_json(f"{out}.json", rounded(card))
    Path(f"{out}.md").write_text(markdown(card))


def report(results: list[dict]) -> dict:
    written = {
        (r["mode"], r["choice"]): r["step_us"] for r in results if r["job"] == "written"
    }
    tables = {}
    for r in results:
        if r["job"] != "tuned" or "step_us" not in r:
            continue
        rows = []
        for n, us in r["step_us"].items():
            truths = {c: written[(r["mode"], c)][n] for c in IMPLEMENTATIONS}
            best = min(truths, key=truths.__getitem__)
            rows.append(
                {
                    "tokens": int(n),
                    "tuned_us": us,
                    "best": best,
                    "best_us": truths[best],
                    "ratio": us / truths[best],
                }
            )
        tables[f"{r['mode']}/{r['flow']}"] = rows
    untuned = {r["mode"]: r["compile_s"] for r in results if r["job"] == "untuned"}
    costs: dict[str, float] = {}
    phases: dict[str, dict[str, float]] = {}
    for r in results:
        name = f"{r['mode']}/{r['flow']}"
        if r["job"] != "tuned" or r["mode"] not in untuned or name in costs:
            continue
        costs[name] = r["compile_s"] - untuned[r["mode"]]
        # Where the tuned compile's extra seconds went, by dynamo_timed phase.
        base = next(
            u["compile_phases_s"]
            for u in results
            if u["job"] == "untuned" and u["mode"] == r["mode"]
        )
        phases[name] = {
            k: v - base.get(k, 0.0)
            for k, v in r["compile_phases_s"].items()
            if abs(v - base.get(k, 0.0)) >= 0.05
        }
    points = [
        r["points"]
        for r in results
        if r["job"] == "tuned" and (r["mode"], r["flow"]) == (MODES[1], "plain")
    ]
    return {
        "tables": tables,
        "worst_ratio": max(
            (row["ratio"] for t in tables.values() for row in t), default=None
        ),
        "tuning_cost_s": costs,
        "tuning_cost_by_phase_s": phases,
        "points_per_cold_job": points,
        "points_stable": all(p == points[0] for p in points),
        **header(torch.device("cuda")),
    }


def markdown(card: dict) -> str:
    lines = [
        f"# Every size its winner on {card['device']} (torch {card['torch']}, "
        f"commit {card['commit']})",
        "",
        f"Worst step-time ratio against the best single implementation written in: "
        f"{card['worst_ratio']:.3f}"
        if card["worst_ratio"]
        else "no sizes timed",
        f"Split points in {len(card['points_per_cold_job'])} cold jobs "
        f"({MODES[1]}, plain torch.compile): "
        f"{card['points_per_cold_job']} (stable: {card['points_stable']})",
        "",
    ]
    for name, rows in card["tables"].items():
        lines += [
            f"## {name}",
            "",
            "| tokens | best single (µs/step) | tuned | ratio |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r['tokens']} | {r['best_us']:.1f} ({r['best']}) | {r['tuned_us']:.1f} "
            f"| {r['ratio']:.3f} |"
            for r in rows
        ]
        lines.append("")
    lines += ["## Compile cost of tuning (first call, cold, tuned minus untuned)", ""]
    lines += [f"- {k}: {v:+.2f} s" for k, v in card["tuning_cost_s"].items()]
    for name, by_phase in card["tuning_cost_by_phase_s"].items():
        lines.append(
            f"- {name} by compile phase (tuned minus untuned): "
            + ", ".join(f"{k} {v:+.2f} s" for k, v in by_phase.items())
        )
    for r in card["results"]:
        if r.get("job") == "tuned" and "tuner_s" in r:
            lines.append(
                f"- {r['mode']}/{r['flow']}: first call {r['compile_s']:.2f} s; tuner "
                + ", ".join(f"{k} {v:.2f} s" for k, v in r["tuner_s"].items())
                + " (benchmarks: "
                + ", ".join(
                    f"{k} {v:.2f} s" for k, v in r["benchmark_phases_s"].items()
                )
                + ")"
                + f"; probes at {r['probes']}; skipping cudagraphs: "
                f"{len(r['skipping_cudagraphs'])}; graphs after warm-up: "
                f"{r.get('graphs_compiled_after_warm_up', '-')}"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--job")
    parser.add_argument("--mode", default="default")
    parser.add_argument("--flow", default="plain")
    parser.add_argument("--choice", default="")
    parser.add_argument("--sizes", default="")
    parser.add_argument("--result")
    parser.add_argument(
        "--compile-only", action="store_true", help="the compiles, no step times"
    )
    args = parser.parse_args()
    if args.job is None:
        drive(args.nproc, args.repeat, args.out, sizes=not args.compile_only)
        return
    from torch._inductor.kernel.custom_op import (
        CustomOpConfig,
        register_custom_op_autotuning,
    )

    init_process_group("cuda")
    register_custom_op_autotuning(
        all_reduce, configs=[CustomOpConfig(f) for f in IMPLEMENTATIONS.values()]
    )
    configs = (
        [(m, c) for m in MODES for c in IMPLEMENTATIONS]
        if args.job == "written"
        else [(args.mode, args.choice)]
    )
    results = [
        run_job(args.job, mode, args.flow, choice, bool(args.sizes))
        for mode, choice in configs
    ]
    if dist.get_rank() == 0:
        write_json(args.result, results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
