"""Compile time that collective autotuning adds to a tensor-parallel model, cold and warm.

    python benchmarks/compile_overhead.py all --nproc 2 --device cpu     # gloo
    python benchmarks/compile_overhead.py all --nproc 4 --device cuda    # NCCL

The model is a stack of layers ``x = x + tp_demo::all_reduce(relu(x @ w_i), WORLD)``
(examples/tp_allreduce/ops.py), one all-reduce per layer, compiled with
``torch.compile(fullgraph=True, dynamic=False)``; with ``--dynamic`` the token dimension is
dynamic instead (``maybe_mark_dynamic``, ``backed_size_oblivious``), so that the tuned
jobs tune the op at a ladder of sizes and dispatch by size (kernel/collective/dispatch.py). ``all`` runs four torchrun jobs in
sequence, each in fresh processes because registering an op for autotuning cannot be
undone in a process:

    untuned cold, untuned warm   the op is a plain custom op (its eager implementation runs)
    tuned cold, tuned warm       the op is registered with ops.register(...)

``--rounds R`` runs the four R times, the variant that goes first alternating: one cold
job's compile time moves by about half a second from the next on one machine, so a
round's tuned minus untuned difference, and its median over rounds, is the reading.

"cold" starts from an empty ``TORCHINDUCTOR_CACHE_DIR`` (the FX graph and AOTAutograd
caches, Triton's kernels and the persisted collective decisions all live there); "warm"
is a second job on the cold job's cache dir, as after a restart. Each rank measures the
wall time of the first forward call (compile and one run) and of the second; compile
time is their difference, MAX over ranks. One job by hand:

    torchrun --nproc_per_node=N benchmarks/compile_overhead.py run --variant tuned \\
        --phase cold --cache-dir DIR --out part.json

The results JSON (default benchmarks/results/compile_overhead_{gloo2|h200x2|...}.json)
holds the four runs (compile time, per-rank times, tuned call sites, benchmarked call
sites, winners, tuning time, cache counters) and the goals of a cheap, cacheable tuning.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import hashlib
import json
import os
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from common import (
    first_call_s,
    header,
    init_process_group,
    REPO,
    timed_call,
    write_json,
)  # benchmarks/
from examples.tp_allreduce import ops


RESULTS_DIR = str(REPO / "benchmarks" / "results")
RUNS = (("untuned", "cold"), ("untuned", "warm"), ("tuned", "cold"), ("tuned", "warm"))
# The sweep's three on GPUs (benchmarks/allreduce_sweep.py); the op's own is always added.
GPU_IMPLEMENTATIONS = ("one_all_reduce", "symm_mem_one_shot", "symm_mem_two_shot")
COUNTERS = {
    "inductor": (
        "fxgraph_cache_hit",
        "fxgraph_cache_miss",
        "fxgraph_cache_bypass",
        "collective_autotune_sessions",
        "collective_autotune_sites",
    ),
    "aot_autograd": (
        "autograd_cache_hit",
        "autograd_cache_miss",
        "autograd_cache_bypass",
    ),
}
# Per-device defaults: a ~2 MiB bf16 all-reduce on GPUs; small enough for 2 CPU cores.
DEFAULTS = {
    "cuda": {"hidden": 1024, "tokens": 1024, "dtype": "bfloat16"},
    "cpu": {"hidden": 256, "tokens": 64, "dtype": "float32"},
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What is compiled; every job of one ``all`` gets the same."""

    device: str
    layers: int
    hidden: int
    tokens: int
    dtype: str
    mode: str
    dynamic: bool

    @staticmethod
    def from_args(args: argparse.Namespace) -> ModelConfig:
        defaults = DEFAULTS[args.device]
        return ModelConfig(
            device=args.device,
            layers=args.layers,
            hidden=args.hidden or defaults["hidden"],
            tokens=args.tokens or defaults["tokens"],
            dtype=args.dtype or defaults["dtype"],
            mode=args.mode,
            dynamic=args.dynamic,
        )

    def flags(self) -> list[str]:
        return [
            "--device",
            self.device,
            "--layers",
            str(self.layers),
            "--hidden",
            str(self.hidden),
            "--tokens",
            str(self.tokens),
            "--dtype",
            self.dtype,
            "--mode",
            self.mode,
            *(["--dynamic"] if self.dynamic else []),
        ]


class TPStack(nn.Module):
    """``layers`` times x = x + all_reduce(relu(x @ w_i)), the tensor-parallel pattern
    (an activation before the reduction, a residual after): one all-reduce call site per
    layer, between a pointwise producer and consumer it is timed with."""

    def __init__(self, layers: int, hidden: int, group_name: str, world: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)  # the same weights on every rank
        # The all-reduce sums `world` equal partials: with this scale a layer adds about half
        # of |x| in a random direction, ~12% growth per layer (~35x over 32), fine in bf16.
        scale = 0.5 / (hidden**0.5 * world)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(hidden, hidden, generator=gen) * scale)
            for _ in range(layers)
        )
        self.group_name = group_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = x + ops.all_reduce(torch.relu(x @ w), self.group_name)
        return x


# -- one job (every rank of a torchrun) ----------------------------------------------


def run_job(args: argparse.Namespace) -> None:
    model_cfg = ModelConfig.from_args(args)
    rank = int(os.environ["RANK"])
    cache_dir = (
        args.cache_dir
        if args.shared_cache
        else os.path.join(args.cache_dir, f"rank{rank}")
    )
    # Before the first compile reads them: everything cacheable lands in this job's dir
    # (Inductor puts Triton's kernels under it unless TRITON_CACHE_DIR points elsewhere).
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache_dir)
    os.environ.pop("TRITON_CACHE_DIR", None)
    # Checked before the rendezvous, so before any rank of a shared dir writes to it.
    if args.phase == "cold" and os.path.isdir(cache_dir) and os.listdir(cache_dir):
        raise SystemExit(f"a cold job needs an empty cache dir; {cache_dir} is not")
    device = init_process_group(model_cfg.device)
    world = dist.get_world_size()
    if args.variant == "tuned":
        ops.register(implementations(model_cfg.device))

    dtype = getattr(torch, model_cfg.dtype)
    model = TPStack(
        model_cfg.layers, model_cfg.hidden, dist.group.WORLD.group_name, world
    )
    model = model.to(device, dtype).requires_grad_(False)
    x = torch.randn(
        model_cfg.tokens, model_cfg.hidden, generator=torch.Generator().manual_seed(1)
    )
    x = x.to(device, dtype)
    if model_cfg.dynamic:
        torch.fx.experimental._config.backed_size_oblivious = (
            True  # one graph for 1 .. max
        )
        torch._dynamo.maybe_mark_dynamic(x, 0)
    compiled = torch.compile(
        model,
        fullgraph=True,
        dynamic=None if model_cfg.dynamic else False,
        mode=None if model_cfg.mode == "default" else model_cfg.mode,
    )
    with torch.no_grad():
        first_s, out = timed_call(compiled, x)
        # Before the next call: under CUDA graphs it may reuse the output's memory.
        output_sha256 = hashlib.sha256(
            out.cpu().view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        second_s, _ = timed_call(compiled, x)
    mine = {
        "rank": rank,
        "first_call_s": first_s,
        "second_call_s": second_s,
        "compile_s": first_s - second_s,
        "output_sha256": output_sha256,
        "counters": cache_counters(),
        "compile_phases_s": compile_phases(),
        **record_summary(model_cfg.device),
    }
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, mine)
    if rank == 0:
        part = {
            "variant": args.variant,
            "phase": args.phase,
            **header(device),
            "model": dataclasses.asdict(model_cfg),
            "per_rank": per_rank,
        }
        write_json(args.out, part)
    dist.destroy_process_group()


def implementations(device_type: str) -> tuple[str, ...]:
    return GPU_IMPLEMENTATIONS if device_type == "cuda" else ops.CPU_IMPLEMENTATIONS


def cache_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        name: counters[section][name]
        for section, names in COUNTERS.items()
        for name in names
        if name in counters[section]
    }


def compile_phases() -> dict[str, float]:
    """Inductor's own accounting of this process's compiles (dynamo_timed), seconds per
    phase: where an untuned and a tuned compile differ beyond the tuning's phases."""
    from torch._dynamo.utils import compilation_time_metrics

    return {
        name: round(sum(times), 4)
        for name, times in sorted(compilation_time_metrics.items())
    }


def record_summary(device_type: str) -> dict[str, Any]:
    """Call sites tuned in this process, how many were timed, and their winners."""
    from torch._inductor.kernel.collective.api import collective_autotune_records

    records = collective_autotune_records()
    return {
        "call_sites": len(records),
        "benchmarks": sum(was_benchmarked(r) for r in records),
        # Where each decision came from ("benchmark", "job", "disk", ...); the decision
        # itself while records have no `source`.
        "sources": [getattr(r, "source", r.decision) for r in records],
        "winners": [
            short_winner(r.winner, implementations(device_type)) for r in records
        ],
        "winners_by_key": {
            r.key: short_winner(r.winner, implementations(device_type)) for r in records
        },
        # Keys whose call sites took different winners (none: every site of a key agrees).
        "conflicting_keys": sum(
            len({r.winner for r in records if r.key == k}) > 1
            for k in {r.key for r in records}
        ),
        "tuning_s_sum": sum(r.tuning_s for r in records),
        # Where a cold tuned compile spends its time, summed over the call sites (seconds
        # on this rank): tracing the choices (upstream), compiling them, their first calls
        # (the screen), timing them (sizing batches, rounds, the reduction), waiting for
        # the group; and the Store requests made.
        "breakdown_s": breakdown(records),
        "store_requests": sum(getattr(r, "store_requests", 0) for r in records),
    }


def breakdown(records: list[Any]) -> dict[str, float]:
    phases: dict[str, float] = {
        "trace": 0.0,
        "build": 0.0,
        "screen": 0.0,
        "timing": 0.0,
        "wait": 0.0,
    }
    for r in records:
        phases["trace"] += getattr(r, "trace_s", 0.0)
        phases["build"] += r.build_s
        phases["wait"] += r.waited_s
        for step, seconds in getattr(r, "phases", ()):
            phases["screen" if step == "screen" else "timing"] += seconds
    return {k: round(v, 4) for k, v in phases.items()}


def was_benchmarked(record: Any) -> bool:
    # Records say where a reused decision came from once `source` exists; before, every
    # "benchmark" decision timed its call site.
    source = getattr(record, "source", None)
    return (
        source == "benchmark" if source is not None else record.decision == "benchmark"
    )


def short_winner(label: str, names: tuple[str, ...]) -> str:
    """The implementation a record's winner names; "default" for the op's own."""
    return label if label in names else "default"


# -- the driver ------------------------------------------------------------------------


def run_all(args: argparse.Namespace) -> None:
    model_cfg = ModelConfig.from_args(args)
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="compile_overhead_")
    print(f"caches and per-job results under {work_dir}", flush=True)
    # A machine's first compile reads the compiler and the headers from disk: a throwaway
    # one-layer job keeps that cost out of the first measured job.
    launch(
        args.nproc,
        dataclasses.replace(model_cfg, layers=1),
        "untuned",
        "cold",
        empty_dir(os.path.join(work_dir, "cache_warm_up")),
        os.path.join(work_dir, "warm_up.json"),
        args.shared_cache,
        label="warm-up",
    )
    rounds: list[dict[str, dict[str, Any]]] = []
    for round_ in range(args.rounds):
        # One cold job reads +-0.5 s from the next on one machine: rounds give medians
        # and a difference paired within each round, and the variant that goes first
        # alternates, since a machine drifts over a run (clocks, caches, other tenants).
        variants = ("untuned", "tuned") if round_ % 2 == 0 else ("tuned", "untuned")
        parts = {}
        for variant in variants:
            for phase in ("cold", "warm"):
                cache_dir = os.path.join(work_dir, f"cache_{variant}")
                if phase == "cold":  # fresh per variant, even in a reused --work-dir
                    empty_dir(cache_dir)
                part_path = os.path.join(work_dir, f"{variant}_{phase}_{round_}.json")
                launch(
                    args.nproc,
                    model_cfg,
                    variant,
                    phase,
                    cache_dir,
                    part_path,
                    args.shared_cache,
                    label=f"round {round_}: {variant} {phase}",
                )
                with open(part_path) as f:
                    parts[f"{variant}_{phase}"] = json.load(f)
        rounds.append(parts)
    result = merge(rounds, model_cfg)
    tag = machine_tag(result) + ("_dynamic" if model_cfg.dynamic else "")
    out = args.out or os.path.join(RESULTS_DIR, f"compile_overhead_{tag}.json")
    write_json(out, result)
    print(summary(result))
    print(f"results: {out}")


def empty_dir(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def launch(
    nproc: int,
    model_cfg: ModelConfig,
    variant: str,
    phase: str,
    cache_dir: str,
    part_path: str,
    shared_cache: bool,
    label: str = "",
) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        os.path.abspath(__file__),
        "run",
        "--variant",
        variant,
        "--phase",
        phase,
        "--cache-dir",
        cache_dir,
        "--out",
        part_path,
        *model_cfg.flags(),
        *(["--shared-cache"] if shared_cache else []),
    ]
    label = label or f"{variant} {phase}"
    print(f"\n== {label}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    print(f"== {label}: job took {time.perf_counter() - start:.1f} s", flush=True)


def merge(
    rounds: list[dict[str, dict[str, Any]]], model_cfg: ModelConfig
) -> dict[str, Any]:
    """Every job's result, run by run: the compile time's median over the rounds (each
    round's in ``compile_s_rounds``), the worst round where a count is checked (every
    warm job must benchmark nothing); per-rank times, where tuning went and the compile
    phases are the first round's."""
    first = rounds[0]["untuned_cold"]
    runs = {}
    for name in (f"{variant}_{phase}" for variant, phase in RUNS):
        each = [run_result(parts[name]) for parts in rounds]
        run = dict(each[0])
        run["compile_s_rounds"] = [r["compile_s"] for r in each]
        run["compile_s"] = statistics.median(run["compile_s_rounds"])
        run["benchmarks"] = max(r["benchmarks"] for r in each)
        run["conflicting_keys"] = max(r["conflicting_keys"] for r in each)
        run["ranks_agree"] = all(r["ranks_agree"] for r in each)
        run["winners"] = sorted({w for r in each for w in r["winners"]})
        run["winners_by_key_rounds"] = [r["winners_by_key"] for r in each]
        runs[name] = run
    for variant in ("untuned", "tuned"):
        runs[f"{variant}_warm"]["outputs_match_cold"] = all(
            w["output_sha256"] == c["output_sha256"]
            for parts in rounds
            for w, c in zip(
                parts[f"{variant}_warm"]["per_rank"],
                parts[f"{variant}_cold"]["per_rank"],
            )
        )
    paired = {
        f"tuned_minus_untuned_{phase}_s": [
            t - u
            for t, u in zip(
                runs[f"tuned_{phase}"]["compile_s_rounds"],
                runs[f"untuned_{phase}"]["compile_s_rounds"],
            )
        ]
        for phase in ("cold", "warm")
    }
    return {
        # Each job's header; the jobs run one checkout on one machine.
        **{key: first[key] for key in ("device", "world_size", "torch", "commit")},
        "layers": model_cfg.layers,
        "hidden": model_cfg.hidden,
        "tokens": model_cfg.tokens,
        "dtype": model_cfg.dtype,
        "mode": model_cfg.mode,
        "dynamic": model_cfg.dynamic,
        "rounds": len(rounds),
        "runs": runs,
        "paired_s": paired,
        "goals": goals(runs, paired, model_cfg),
    }


def run_result(part: dict[str, Any]) -> dict[str, Any]:
    """One job's numbers: the slowest rank's where ranks differ, and every rank's."""
    ranks = part["per_rank"]
    counters = sorted({name for r in ranks for name in r["counters"]})
    winners_per_site = ranks[0]["winners"]
    return {
        "compile_s": max(r["compile_s"] for r in ranks),
        "compile_s_per_rank": [r["compile_s"] for r in ranks],
        "first_call_s_per_rank": [r["first_call_s"] for r in ranks],
        "second_call_s_per_rank": [r["second_call_s"] for r in ranks],
        "call_sites": max(r["call_sites"] for r in ranks),
        "benchmarks": max(r["benchmarks"] for r in ranks),
        "sources": sorted({s for r in ranks for s in r["sources"]}),
        "winners": sorted(set(winners_per_site)),
        "winners_per_site": winners_per_site,
        "winners_by_key": ranks[0]["winners_by_key"],
        "conflicting_keys": max(r["conflicting_keys"] for r in ranks),
        "ranks_agree": all(
            r["winners_by_key"] == ranks[0]["winners_by_key"] for r in ranks
        ),
        "tuning_s_sum": max(r["tuning_s_sum"] for r in ranks),
        # Rank 0's (where ranks differ, they wait for each other: wait says so).
        "breakdown_s": ranks[0].get("breakdown_s", {}),
        "compile_phases_s": ranks[0].get("compile_phases_s", {}),
        "store_requests_per_rank": [r.get("store_requests", 0) for r in ranks],
        "counters": {
            name: [r["counters"].get(name, 0) for r in ranks] for name in counters
        },
    }


def goals(
    runs: dict[str, dict[str, Any]],
    paired: dict[str, list[float]],
    model_cfg: ModelConfig,
) -> dict[str, dict[str, Any]]:
    gpu = model_cfg.device == "cuda"
    untuned_cold, untuned_warm = runs["untuned_cold"], runs["untuned_warm"]
    tuned_cold, tuned_warm = runs["tuned_cold"], runs["tuned_warm"]
    overhead = 100 * (tuned_cold["compile_s"] / untuned_cold["compile_s"] - 1)
    overhead_goal = 10 if gpu else 25
    ladder_extra = statistics.median(paired["tuned_minus_untuned_cold_s"])
    if gpu:
        warm_goal, warm_limit = (
            "within 10% of untuned_warm",
            1.1 * untuned_warm["compile_s"],
        )
    else:
        warm_goal, warm_limit = "<= 0.5 x tuned_cold", 0.5 * tuned_cold["compile_s"]
    return {
        "tuned_cold_overhead_pct": {
            "value": overhead,
            "goal": f"<= {overhead_goal}%",
            "met": overhead <= overhead_goal,
        },
        "one_winner_per_key_cold": {
            "value": tuned_cold["winners"],
            "call_sites": tuned_cold["call_sites"],
            "goal": "one winner for all call sites of a key (of each range's key, dynamic)",
            "met": tuned_cold["call_sites"] > 0 and tuned_cold["conflicting_keys"] == 0,
        },
        "tuned_warm_no_benchmarking": {
            "value": tuned_warm["benchmarks"],
            "goal": "0 call sites timed",
            "met": tuned_warm["benchmarks"] == 0,
        },
        "tuned_warm_compile_s": {
            "value": tuned_warm["compile_s"],
            "goal": warm_goal,
            "met": tuned_warm["compile_s"] <= warm_limit,
        },
        "tuned_warm_same_winners": same_winners(tuned_cold, tuned_warm),
        **(
            {
                "ladder_extra_compile_s": {
                    # The budget for the ladder of one op: the median of each
                    # round's tuned minus untuned cold job.
                    "value": ladder_extra,
                    "goal": "<= 0.5 s cold",
                    "met": ladder_extra <= 0.5,
                }
            }
            if model_cfg.dynamic
            else {}
        ),
    }


def same_winners(cold: dict[str, Any], warm: dict[str, Any]) -> dict[str, Any]:
    """Whether each round's warm job inlines its cold job's winners, key by key.

    A warm job compiles nothing where every graph loads from the caches: its records
    are then those of the loaded graphs' decisions, one per key. The output must be
    the cold one too.
    """
    differ = sorted(
        {
            k
            for c, w in zip(
                cold["winners_by_key_rounds"], warm["winners_by_key_rounds"]
            )
            for k in set(c) | set(w)
            if c.get(k) != w.get(k)
        }
    )
    keys = {k for c in cold["winners_by_key_rounds"] for k in c}
    return {
        "value": f"{len(differ)} of {len(keys)} keys differ"
        + (f": {differ}" if differ else ""),
        "goal": "the cold job's winner for every key, same output (each round)",
        "met": not differ and warm["outputs_match_cold"],
    }


def machine_tag(result: dict[str, Any]) -> str:
    """gloo2, h200x2, h200x4, ...: the GPU model from its name ("NVIDIA H200")."""
    if (
        result["device"].lower().startswith("cpu")
    ):  # "cpu (gloo)" before the shared header
        return f"gloo{result['world_size']}"
    model = re.search(r"\b([A-Z]+\d+)\b", result["device"])
    return f"{model.group(1).lower() if model else 'gpu'}x{result['world_size']}"


def summary(result: dict[str, Any]) -> str:
    lines = [
        f"\ncompile overhead of collective autotuning: {result['layers']} layers, hidden "
        f"{result['hidden']}, {result['tokens']} tokens{' (dynamic)' if result['dynamic'] else ''}, "
        f"{result['dtype']}, mode {result['mode']}, "
        f"{result['world_size']}x {result['device']}, torch {result['torch']}",
        f"{'run':<13} {'compile s':>9} {'1st call s':>10} {'2nd call s':>10} {'sites':>5} "
        f"{'timed':>5} {'tuning s':>8} {'fx hit/miss':>11} {'aot hit/miss':>12} {'sessions':>8}  winners",
    ]
    if result["rounds"] > 1:
        lines[0] += f"; {result['rounds']} rounds, compile s: medians"
    for name, run in result["runs"].items():
        c = run["counters"]
        lines.append(
            f"{name:<13} {run['compile_s']:>9.2f} {max(run['first_call_s_per_rank']):>10.2f} "
            f"{max(run['second_call_s_per_rank']):>10.3f} {run['call_sites']:>5} {run['benchmarks']:>5} "
            f"{run['tuning_s_sum']:>8.2f} {pair(c, 'fxgraph_cache'):>11} {pair(c, 'autograd_cache'):>12} "
            f"{max(c.get('collective_autotune_sessions', ['-'])):>8}  {describe_winners(run)}"
        )
        if run.get("breakdown_s") and run["call_sites"]:
            lines.append(
                "              where tuning went (s): "
                + ", ".join(
                    f"{phase} {seconds:.2f}"
                    for phase, seconds in run["breakdown_s"].items()
                )
            )
    if result["rounds"] > 1:
        for name, run in result["runs"].items():
            lines.append(
                f"{name:<13} compile s by round: "
                + ", ".join(f"{v:.2f}" for v in run["compile_s_rounds"])
            )
        for name, values in result["paired_s"].items():
            lines.append(
                f"{name}: median {statistics.median(values):+.2f} s ("
                + ", ".join(f"{v:+.2f}" for v in values)
                + ")"
            )
    lines.append("goals:")
    for name, goal in result["goals"].items():
        value = goal["value"]
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(
            f"  {'met' if goal['met'] else 'NOT MET':<7}  {name}: {shown} (goal: {goal['goal']})"
        )
    return "\n".join(lines)


def pair(counters: dict[str, list[int]], prefix: str) -> str:
    """Hits/misses of one cache, worst over ranks (fewest hits, most misses)."""
    return f"{min(counters.get(prefix + '_hit', [0]))}/{max(counters.get(prefix + '_miss', [0]))}"


def describe_winners(run: dict[str, Any]) -> str:
    return ",".join(run["winners"]) or "-"


# -- in one process ----------------------------------------------------------------


@torch.library.custom_op("compile_overhead::plain_all_reduce", mutates_args=())
def plain_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The tuned op's own implementation, never registered for autotuning."""
    return ops.own_all_reduce(x, group_name)


@plain_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


class PlainStack(TPStack):
    """TPStack calling the plain op: what the model costs to compile untuned."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = x + plain_all_reduce(torch.relu(x @ w), self.group_name)
        return x


class WrittenStack(TPStack):
    """TPStack with one implementation written in, as a user would write it by hand:
    what the model costs to compile with the tuned model's winner, untuned."""

    implementation: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = x + self.implementation(torch.relu(x @ w), self.group_name)
        return x


def written(winner: str) -> type:
    """The model with ``winner`` (an implementation's name; "default": the op's own)
    written in."""
    implementation = (
        plain_all_reduce
        if winner == ops.OWN
        else ops.IMPLEMENTATIONS[winner].decomposition
    )
    return type(
        f"Written_{winner}",
        (WrittenStack,),
        {"implementation": staticmethod(implementation)},
    )


def run_in_process(args: argparse.Namespace) -> None:
    """Every mode and shape in one process, without a job's start-up: for each, a
    warm-up compile of another model (what a process pays once: compile workers, device
    set-up), then ``--repeat`` times the plain model and the tuned one, each cold
    (Inductor's caches emptied: each compiles its own kernels, the tuned one also its
    choices', and times them), then the tuned one again (kernels cached, decisions known
    to the job), then, cold, the model with the tuned one's winner written in by hand:
    what the model costs to compile with that implementation, untuned (the op's own
    runs as an opaque call; an inlined winner is lowered, scheduled and generated as
    the model's own code, which costs more or less than the opaque call whoever picked
    it). Each repetition runs on a new process group (of every rank, used once
    before it is measured): the job's decisions belong to a group, so the tuned model
    tunes again. The medians are the result; one compile varies by tenths of a second.
    With ``--profile DIR``, the profile of one more tuned compile of each config, and of
    its written-in winner's (cProfile, this rank's main thread), is written there, as
    text (the functions by their cumulative time) and as pstats data. A profiled compile's times are the
    profiler's: profile only to see where time goes."""
    from torch._inductor.kernel.collective.api import collective_autotune_records
    from torch._inductor.utils import fresh_cache

    device = init_process_group(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    ops.register(implementations(args.device))
    results = []
    for config in args.configs.split(","):
        mode, shape = config.split(":")
        cfg = dataclasses.replace(
            ModelConfig.from_args(args), mode=mode, dynamic=shape == "dynamic"
        )
        with fresh_cache():
            warm_up_s, _ = compile_seconds(
                PlainStack,
                dataclasses.replace(cfg, layers=1, hidden=cfg.hidden // 2),
                device,
                dist.group.WORLD,
            )
        reps = []
        profiled = None
        for rep in range(
            args.repeat + bool(args.profile)
        ):  # a profiled one last, apart
            group = used_group(device)
            times, phases = {}, {}
            with fresh_cache():
                times["plain"], phases["plain"] = compile_seconds(
                    PlainStack, cfg, device, group
                )
            with fresh_cache():
                start = len(collective_autotune_records())
                profile_to = (
                    os.path.join(args.profile, f"{mode}_{shape}_rank{rank}")
                    if rep == args.repeat
                    else None
                )
                times["tuned"], phases["tuned"] = compile_seconds(
                    TPStack, cfg, device, group, profile_to and profile_to + ".txt"
                )
                tuned_records = collective_autotune_records()[start:]
                times["tuned_again"], _ = compile_seconds(TPStack, cfg, device, group)
            # Where ranges differ, the winner of most call sites.
            winner = statistics.mode(
                short_winner(r.winner, implementations(args.device))
                for r in tuned_records
            )
            with fresh_cache():
                times["written"], phases["written"] = compile_seconds(
                    written(winner),
                    cfg,
                    device,
                    group,
                    profile_to and profile_to + "_written.txt",
                )
            this = {
                "compile_s": {k: round(v, 3) for k, v in times.items()},
                "extra_s": round(times["tuned"] - times["plain"], 3),
                "written_winner": winner,
                "extra_over_written_s": round(times["tuned"] - times["written"], 3),
                # Inductor's phases that tuning makes longer (tuned less plain, this rank).
                "phases_extra_s": phases_longer(phases["tuned"], phases["plain"]),
                # ... and tuned less the winner written in: what tuning itself adds.
                "phases_over_written_s": phases_longer(
                    phases["tuned"], phases["written"]
                ),
                "sites": len(tuned_records),
                "winners": sorted({r.winner for r in tuned_records}),
                "breakdown_s": breakdown(tuned_records),
                "store_requests": sum(
                    getattr(r, "store_requests", 0) for r in tuned_records
                ),
            }
            if profile_to is None:
                reps.append(this)
            else:
                profiled = this
            if rank == 0:
                r = this
                print(
                    f"{mode:>15} {shape:>7} {'profiled' if profile_to else f'#{rep}'}: plain {times['plain']:.2f} s, tuned {times['tuned']:.2f} s "
                    f"(+{r['extra_s']:.2f} s), {winner} written in {times['written']:.2f} s, again {times['tuned_again']:.2f} s; {r['sites']} sites, "
                    f"winners {r['winners']}; where tuning went: {r['breakdown_s']}; "
                    f"Inductor's phases, tuned less plain: {r['phases_extra_s']}, "
                    f"tuned less written: {r['phases_over_written_s']}",
                    flush=True,
                )
        median = {
            "compile_s": {
                k: round(statistics.median(r["compile_s"][k] for r in reps), 3)
                for k in reps[0]["compile_s"]
            },
            "extra_s": round(statistics.median(r["extra_s"] for r in reps), 3),
            "extra_over_written_s": round(
                statistics.median(r["extra_over_written_s"] for r in reps), 3
            ),
            "breakdown_s": {
                k: round(statistics.median(r["breakdown_s"][k] for r in reps), 4)
                for k in reps[0]["breakdown_s"]
            },
        }
        results.append(
            {
                "mode": mode,
                "shape": shape,
                "warm_up_s": round(warm_up_s, 3),
                **median,
                "sites": reps[0]["sites"],
                "winners": sorted({w for r in reps for w in r["winners"]}),
                "repetitions": reps,
                **({"profiled": profiled} if profiled else {}),
            }
        )
        if rank == 0:
            print(
                f"{mode:>15} {shape:>7} median of {len(reps)}: plain {median['compile_s']['plain']:.2f} s, "
                f"tuned {median['compile_s']['tuned']:.2f} s, extra {median['extra_s']:+.2f} s, "
                f"over the winner written in {median['extra_over_written_s']:+.2f} s; "
                f"where tuning went: {median['breakdown_s']}",
                flush=True,
            )
    if rank == 0:
        result = {
            **header(device),
            "layers": args.layers,
            "hidden": cfg.hidden,
            "tokens": cfg.tokens,
            "dtype": cfg.dtype,
            "world_size": world,
            "repeat": args.repeat,
            "runs": results,
            "goal": "tuning adds at most 0.5 s per tuned op to a cold compile",
        }
        write_json(args.out, result)
    dist.destroy_process_group()


def phases_longer(
    after: dict[str, float], before: dict[str, float]
) -> dict[str, float]:
    """Inductor's phases (seconds) that ``after`` spent longer or shorter in than
    ``before``, by 10 ms or more."""
    differences = {
        k: after.get(k, 0.0) - before.get(k, 0.0)
        for k in sorted(set(after) | set(before))
    }
    return {k: round(d, 3) for k, d in differences.items() if abs(d) >= 0.01}


def used_group(device: torch.device) -> dist.ProcessGroup:
    """A new group of every rank, its communicator set up by one all-reduce: what a
    measured compile pays is its own, not the group's first collective."""
    group = dist.new_group(list(range(dist.get_world_size())))
    dist.all_reduce(torch.ones(1, device=device), group=group)
    return group


def compile_seconds(
    stack: type,
    cfg: ModelConfig,
    device: torch.device,
    group: dist.ProcessGroup,
    profile_to: str | None = None,
) -> tuple[float, dict[str, float]]:
    """The compile time of one model on ``group``, Dynamo reset first: its first call
    less a later one, slowest rank; and the seconds of each of Inductor's phases
    (dynamo_timed) in its calls, this rank. With ``profile_to``, the first call's
    profile is written there (text, and ``.prof`` beside it)."""
    torch._dynamo.reset()
    dtype = getattr(torch, cfg.dtype)
    model = stack(cfg.layers, cfg.hidden, group.group_name, group.size()).to(
        device, dtype
    )
    model.requires_grad_(False)
    x = torch.randn(
        cfg.tokens, cfg.hidden, generator=torch.Generator().manual_seed(1)
    ).to(device, dtype)
    if cfg.dynamic:
        torch.fx.experimental._config.backed_size_oblivious = True
        torch._dynamo.maybe_mark_dynamic(x, 0)
    compiled = torch.compile(
        model,
        fullgraph=True,
        dynamic=None if cfg.dynamic else False,
        mode=None if cfg.mode == "default" else cfg.mode,
    )
    profiler = cProfile.Profile() if profile_to else contextlib.nullcontext()
    before = compile_phases()
    with torch.no_grad():
        with profiler:
            seconds = first_call_s(compiled, x)
    after = compile_phases()
    phases = {
        k: round(v - before.get(k, 0.0), 4)
        for k, v in after.items()
        if v - before.get(k, 0.0) >= 0.005
    }
    if profile_to:
        os.makedirs(os.path.dirname(profile_to), exist_ok=True)
        profiler.dump_stats(profile_to + ".prof")
        with open(profile_to, "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(120)
    return seconds, phases


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    common.add_argument("--layers", type=int, default=32)
    common.add_argument("--hidden", type=int, help="default: 1024 on cuda, 256 on cpu")
    common.add_argument("--tokens", type=int, help="default: 1024 on cuda, 64 on cpu")
    common.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        help="default: bfloat16 on cuda, float32 on cpu",
    )
    common.add_argument(
        "--mode",
        choices=["default", "reduce-overhead"],
        default="default",
        help="torch.compile mode (reduce-overhead: CUDA graphs, cuda only)",
    )
    common.add_argument(
        "--dynamic",
        action="store_true",
        help="a dynamic token dimension: the op is tuned at a ladder of sizes",
    )
    common.add_argument(
        "--shared-cache",
        action="store_true",
        help="all ranks share the cache dir (default: DIR/rank{r} per rank)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", parents=[common], help="one job, under torchrun")
    run.add_argument("--variant", choices=["untuned", "tuned"], required=True)
    run.add_argument("--phase", choices=["cold", "warm"], required=True)
    run.add_argument("--cache-dir", required=True)
    run.add_argument(
        "--out", required=True, help="the job's part JSON, written by rank 0"
    )
    every = commands.add_parser(
        "all", parents=[common], help="the four jobs, then the results"
    )
    every.add_argument("--nproc", type=int, default=2)
    every.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="the four jobs this many times, the variant that goes first alternating "
        "(compile times: medians, and tuned minus untuned paired within each round)",
    )
    every.add_argument(
        "--work-dir", help="caches and part JSONs (default: a new temporary dir)"
    )
    every.add_argument(
        "--out",
        help="results JSON (default: benchmarks/results/compile_overhead_<machine>.json)",
    )
    inproc = commands.add_parser(
        "inprocess", parents=[common], help="every config in one process"
    )
    inproc.add_argument(
        "--configs",
        default="default:static,default:dynamic",
        help="comma-separated mode:shape (shape static or dynamic)",
    )
    inproc.add_argument("--out", required=True, help="results JSON, written by rank 0")
    inproc.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="plain and tuned compiles per config (medians)",
    )
    inproc.add_argument(
        "--profile",
        help="a dir for one more tuned compile per config, profiled (text and pstats)",
    )
    args = parser.parse_args()
    if args.mode == "reduce-overhead" and args.device != "cuda":
        parser.error("--mode reduce-overhead needs --device cuda")
    {"run": run_job, "all": run_all, "inprocess": run_in_process}[args.command](args)


if __name__ == "__main__":
    main()
