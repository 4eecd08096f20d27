"""All-reduce on N GPUs, tuned through torch.compile: NCCL vs symmetric memory vs the op's own.

One rank per GPU, under torchrun (the overlay applied):

    torchrun --nproc_per_node=N benchmarks/allreduce_sweep.py run --out benchmarks/results/allreduce_h200xN.json
    python benchmarks/allreduce_sweep.py report benchmarks/results/allreduce_h200xN.json  # plot, goals again

CPU smoke test (gloo, fp32, the functional NCCL-style choice and the default only, eager):

    torchrun --nproc_per_node=2 benchmarks/allreduce_sweep.py run --device cpu \\
        --sizes 4096,65536 --repeats 3 --out /tmp/sweep.json

The op is examples/tp_allreduce's ``tp_demo::all_reduce``, registered with
``one_all_reduce`` ("nccl"), ``symm_mem_one_shot`` ("one_shot") and
``symm_mem_two_shot`` ("two_shot"); its own implementation ("default") is always a
fourth choice. ``run`` records, per message size (bytes of a 1-D bf16 tensor):

  * truth_us / truth_eager_us: each implementation compiled on its own (the default
    with collective autotuning off) and timed as a compiled model calls it: a CUDA
    graph of many calls, replayed; many eager back-to-back calls. Per call, slowest rank.
  * per mode, "graph" (the model compiled with mode="reduce-overhead", so the tuner
    times CUDA graphs) and "eager" (the default mode): ``repeats`` tunings through
    torch.compile, each from fresh state (a process group that never tuned the key,
    persistence off): measured_us (per choice, median of what the tuner reported for
    its slowest rank), pick (most frequent), picks, flips, autotune_ms (median over
    the tunings of the slowest rank's tuning wall time, without compiling the choices:
    build_ms), and fields derived from the truth of the row's mode (best, losses,
    measurement errors, runner-up gap).

The first tuning of the process pays NCCL and symmetric-memory set-up: it is reported
alone as first_op_autotune_ms. Rank 0 prints one JSON line per row as it goes, then
writes the JSON, the plot beside it (.png) and the goal report.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import statistics
import time
from typing import Any
from collections.abc import Callable, Sequence

import common  # benchmarks/, the script's own directory


# Every tuning starts from fresh state.
common.fresh_state()

import torch
import torch.distributed as dist
from torch._inductor import config as inductor_config

from common import (
    assert_close_sum,
    barrier,
    finite,
    group_max,
    header,
    init_process_group,
    KiB,
    MiB,
    pct,
    rank_randn,
    rounded,
    size_label,
    verdict,
    write_json,
)
from examples.tp_allreduce import ops


SIZES = [
    4 * KiB,
    16 * KiB,
    64 * KiB,
    256 * KiB,
    1 * MiB,
    4 * MiB,
    16 * MiB,
    64 * MiB,
    256 * MiB,
]
CPU_SIZES = [4 * KiB, 64 * KiB]
REPEATS = 10
MODES = ("graph", "eager")
# Our key for each registered implementation of tp_demo::all_reduce (ops.IMPLEMENTATIONS).
IMPLEMENTATIONS = {
    "nccl": "one_all_reduce",
    "one_shot": "symm_mem_one_shot",
    "two_shot": "symm_mem_two_shot",
}
CPU_IMPLEMENTATIONS = {"nccl": "one_all_reduce"}  # symmetric memory needs CUDA
DEFAULT = "default"  # the op's own implementation, always a choice
COLORS = {
    "nccl": "tab:blue",
    "one_shot": "tab:orange",
    "two_shot": "tab:green",
    DEFAULT: "tab:purple",
}

# Goals (README): pick within 3% of the best truth; measured within 10% of the graph
# truth for choices of at least 5 us; tuning within 50 ms per op up to 1 MiB and 150 ms
# at 64 MiB; at most 5% flips where best and runner-up differ by 3% or more.
PICK_LOSS_GOAL_PCT, MEASURED_ERR_GOAL_PCT, MEASURED_MIN_US = 3.0, 10.0, 5.0
AUTOTUNE_GOALS_MS: tuple[tuple[str, Callable[[int], bool], float], ...] = (
    ("<= 1 MiB", lambda nbytes: nbytes <= 1 * MiB, 50.0),
    ("64 MiB", lambda nbytes: nbytes == 64 * MiB, 150.0),
)
FLIP_GAP_PCT, FLIP_GOAL = 3.0, 0.05


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every measurement of one run shares."""

    device: torch.device
    dtype: torch.dtype
    implementations: dict[str, str]
    world_name: str  # the truths run on WORLD, as a single-group job would
    tuning_groups: tuple[str, ...]  # one per repetition: each tunes every key once

    @property
    def keys(self) -> list[str]:
        return [*self.implementations, DEFAULT]


@dataclasses.dataclass(frozen=True)
class TruthCounts:
    """Calls per measurement: many at small sizes, where launch gaps and skew matter;
    fewer at large ones, where each call lasts long enough alone and time is scarce."""

    graph_calls: int
    graph_replays: int
    eager_calls: int
    eager_samples: int

    @staticmethod
    def for_size(nbytes: int) -> TruthCounts:
        if nbytes >= 64 * MiB:
            return TruthCounts(
                graph_calls=10, graph_replays=10, eager_calls=20, eager_samples=3
            )
        return TruthCounts(
            graph_calls=50, graph_replays=20, eager_calls=200, eager_samples=3
        )


def short_name(choice: str) -> str:
    """Our key for a tuner choice name, readable ("symm_mem_one_shot", "default") or
    Inductor's ("tp_demo::all_reduce_autotuned_symm_mem_one_shot_group_name_0"; the
    op's own: "tp_demo_all_reduce_fallback" on torch 2.13, "..._fallback_default" on 2.11)."""
    if choice == DEFAULT or choice.endswith(("_fallback", "_fallback_default")):
        return DEFAULT
    for key, implementation in IMPLEMENTATIONS.items():
        if implementation in choice:
            return key
    raise ValueError(
        f"choice {choice!r} is none of {[*IMPLEMENTATIONS.values(), DEFAULT]}"
    )


# -- truth: each implementation compiled alone ---------------------------------------------


def compile_truth(
    key: str, setup: Setup, x: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``key``'s implementation compiled alone, as a compiled model calls it, after one call."""
    name = setup.world_name
    implementation = (
        ops.all_reduce if key == DEFAULT else getattr(ops, setup.implementations[key])
    )
    compiled = torch.compile(
        lambda t: implementation(t, name), fullgraph=True, dynamic=False
    )
    # Compiling happens at the first call: untuned, the op lowers to its own kernel.
    with inductor_config.patch(collective_autotune=False):
        compiled(x)
    return compiled


def graph_us(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, counts: TruthCounts
) -> float:
    """This rank's µs per call of ``fn`` in a replayed CUDA graph of many calls."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(counts.graph_calls):
            fn(x)
    graph.replay()
    barrier(x.device)
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    start.record()
    for _ in range(counts.graph_replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (counts.graph_replays * counts.graph_calls)


def eager_us(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, counts: TruthCounts
) -> float:
    """This rank's µs per call of ``fn`` called back to back, median of a few samples."""
    samples = []
    for _ in range(counts.eager_samples):
        barrier(x.device)
        if x.device.type == "cuda":
            start, end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            start.record()
            for _ in range(counts.eager_calls):
                fn(x)
            end.record()
            end.synchronize()
            elapsed_us = start.elapsed_time(end) * 1e3
        else:  # gloo collectives return when done
            begin = time.perf_counter()
            for _ in range(counts.eager_calls):
                fn(x)
            elapsed_us = (time.perf_counter() - begin) * 1e6
        samples.append(elapsed_us / counts.eager_calls)
    return statistics.median(samples)


def measure_truth(
    setup: Setup, x: torch.Tensor
) -> tuple[dict[str, float] | None, dict[str, float]]:
    """Slowest-rank µs per call of every implementation: CUDA graph (None on the CPU), eager."""
    counts = TruthCounts.for_size(x.numel() * x.element_size())
    torch._dynamo.reset()
    graph, eager = [], []
    for key in setup.keys:
        fn = compile_truth(key, setup, x)
        if setup.device.type == "cuda":
            graph.append(graph_us(fn, x, counts))
        eager.append(eager_us(fn, x, counts))
    eager_max = dict(zip(setup.keys, group_max(eager, setup.device)))
    if not graph:
        return None, eager_max
    return dict(zip(setup.keys, group_max(graph, setup.device))), eager_max


# -- tuning through torch.compile ---------------------------------------------------------


def tune(
    setup: Setup, x: torch.Tensor, mode: str, group_names: Sequence[str]
) -> list[Any]:
    """Tune the op once on each of ``group_names`` through one torch.compile; their records.

    The model calls the op once per group: each call site is a key its group never
    tuned, so one compile yields ``len(group_names)`` fresh tunings (cheaper than a
    compile each: about 2.0 s against 2.7 s for ten on 2 gloo ranks).
    """
    from torch._inductor.kernel.collective.api import collective_autotune_records

    torch._dynamo.reset()
    names = tuple(group_names)
    # reduce-overhead runs the model under CUDA graphs, so the tuner times CUDA graphs.
    compile_mode = "reduce-overhead" if mode == "graph" else None
    model = torch.compile(
        lambda t: tuple(ops.all_reduce(t, name) for name in names),
        mode=compile_mode,
        fullgraph=True,
        dynamic=False,
    )
    start = len(collective_autotune_records())
    outputs = model(x)
    records = collective_autotune_records()[start:]
    if sorted(r.group_name for r in records) != sorted(names):
        raise RuntimeError(
            f"expected one tuning on each of groups {list(names)}, got "
            f"{[(r.op, r.group_name) for r in records]}"
        )
    reused = [
        (r.group_name, r.source, r.reason) for r in records if r.source != "benchmark"
    ]
    if reused:
        raise RuntimeError(
            f"tunings not from fresh state ({mode}, {x.shape}): {reused}"
        )
    reference = ops.all_reduce(x, setup.world_name)
    for out in outputs:
        assert_close_sum(out, reference)
    return sorted(records, key=lambda r: names.index(r.group_name))


def tuning_row(
    setup: Setup,
    nbytes: int,
    mode: str,
    records: Sequence[Any],
    truth: dict[str, float] | None,
    truth_eager: dict[str, float],
) -> dict[str, Any]:
    """The row of one size and mode from its tunings' records (identical on all ranks
    except for the wall times, which are reduced here)."""
    picks = [short_name(r.winner) for r in records]
    pick = collections.Counter(picks).most_common(1)[0][0]
    timings = collections.defaultdict(list)
    skews = collections.defaultdict(list)
    dropped = {}
    for r in records:
        for t in r.timings:
            timings[short_name(t.name)].append(t.max_us)
            skews[short_name(t.name)].append(t.skew_us)
            if t.status != "ok":
                dropped.setdefault(short_name(t.name), t.reason or t.status)
    wall_ms = group_max(
        [s * 1e3 for r in records for s in (r.tuning_s, r.waited_s, r.build_s)],
        setup.device,
    )
    tuning_ms, waited_ms, build_ms = wall_ms[0::3], wall_ms[1::3], wall_ms[2::3]
    row = {
        "bytes": nbytes,
        "mode": mode,
        "truth_us": truth,
        "truth_eager_us": truth_eager,
        "measured_us": {k: finite(statistics.median(v)) for k, v in timings.items()},
        "pick": pick,
        "picks": picks,
        "flips": sum(p != pick for p in picks),
        # How far apart the ranks reached each choice's rendezvous (absorbed by it).
        "skew_us": {k: statistics.median(v) for k, v in skews.items()},
        "autotune_ms": statistics.median(tuning_ms),
        # Not part of autotune_ms: waiting for peers (to arrive, to vote).
        "waited_ms": statistics.median(waited_ms),
        # Not part of it: compiling the choices, which Inductor does for any tuned op.
        "build_ms": statistics.median(build_ms),
    }
    if dropped:
        row["dropped"] = dropped
    return rounded({**row, **derived(row)})


def derived(row: dict[str, Any]) -> dict[str, Any]:
    """Fields against the truth of the row's mode: what the goals are checked on."""
    truth = row["truth_us"] if row["mode"] == "graph" else row["truth_eager_us"]
    ranked = sorted(truth, key=truth.get)
    best = ranked[0]

    def loss(key: str) -> float:
        return pct(truth[key], truth[best])

    return {
        "best": best,
        "runner_up_gap_pct": pct(truth[ranked[1]], truth[best])
        if len(ranked) > 1
        else None,
        "pick_loss_pct": loss(row["pick"]),
        "worst_pick_loss_pct": max(loss(p) for p in row["picks"]),
        "measured_err_pct": {
            k: None if m is None else pct(m, truth[k])
            for k, m in row["measured_us"].items()
        },
    }


# -- the run --------------------------------------------------------------------------------


def warm_up(setup: Setup, x: torch.Tensor) -> None:
    """Run every implementation once on every tuning group at ``x``'s size.

    The repetition groups exist only to give each tuning fresh state. Their set-up
    (NCCL communicators and their first CUDA-graph capture, and a symmetric-memory
    buffer per group and size, which the example's ops allocate and rendezvous at their
    first call) is paid by a model once per process, not by each tuning: the process's
    first tuning pays it, reported as first_op_autotune_ms.
    """
    for name in setup.tuning_groups:
        for implementation in setup.implementations.values():
            call = functools.partial(getattr(ops, implementation), x, name)
            call()
            if x.is_cuda:  # a communicator's first capture sets it up for graphs
                with torch.cuda.graph(torch.cuda.CUDAGraph()):
                    call()
    barrier(setup.device)


def sample_input(setup: Setup, nbytes: int) -> torch.Tensor:
    numel = nbytes // torch.empty((), dtype=setup.dtype).element_size()
    return rank_randn((numel,), setup.dtype, setup.device)


def run(args: argparse.Namespace) -> None:
    device = init_process_group(args.device)
    world = dist.get_world_size()
    implementations = IMPLEMENTATIONS if device.type == "cuda" else CPU_IMPLEMENTATIONS
    ops.register(tuple(implementations.values()))
    setup = Setup(
        device=device,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        implementations=implementations,
        world_name=dist.group.WORLD.group_name,
        # Groups have their own names, hence their own tuning state.
        tuning_groups=tuple(
            dist.new_group(list(range(world))).group_name for _ in range(args.repeats)
        ),
    )
    rank0 = dist.get_rank() == 0

    # The process's first tuning, before anything else touched symmetric memory.
    (first,) = tune(
        setup, sample_input(setup, args.sizes[0]), args.modes[0], [setup.world_name]
    )
    (first_ms,) = rounded(group_max([first.tuning_s * 1e3], device))
    if rank0:
        print(
            json.dumps(
                {
                    "first_op_autotune_ms": first_ms,
                    "mode": args.modes[0],
                    "bytes": args.sizes[0],
                }
            ),
            flush=True,
        )

    rows = []
    for nbytes in args.sizes:
        x = sample_input(setup, nbytes)
        truth, truth_eager = measure_truth(setup, x)
        warm_up(setup, x)
        for mode in args.modes:
            records = tune(setup, x, mode, setup.tuning_groups)
            rows.append(tuning_row(setup, nbytes, mode, records, truth, truth_eager))
            if rank0:
                print(json.dumps(rows[-1]), flush=True)
    result = {
        **header(device),
        "path": "torch.compile",
        "dtype": str(setup.dtype).removeprefix("torch."),
        "repeats": args.repeats,
        "rows": rows,
        "first_op_autotune_ms": first_ms,
    }
    if rank0:
        write_json(args.out, result)
        print(summary(result), flush=True)
        plot(result, _png_path(args.out))
    dist.destroy_process_group()


# -- report ---------------------------------------------------------------------------------


def summary(result: dict[str, Any]) -> str:
    """The goals, checked on the rows: a plain-text report."""
    lines = [
        f"goals: {result['world_size']}x {result['device']}, torch {result['torch']}, "
        f"{result['repeats']} tunings per size and mode through {result['path']}",
        f"  first tuning of the process: {result['first_op_autotune_ms']:.1f} ms "
        "(pays NCCL/symmetric-memory set-up; not in the medians below)",
    ]
    for mode in MODES:
        rows = [r for r in result["rows"] if r["mode"] == mode]
        if rows:
            lines += [f"[{mode}]", *_mode_summary(mode, rows)]
    return "\n".join(lines)


def _mode_summary(mode: str, rows: list[dict[str, Any]]) -> list[str]:
    worst = max(rows, key=lambda r: r["worst_pick_loss_pct"])
    picks = ", ".join(
        f"{k} x{n}" for k, n in collections.Counter(worst["picks"]).most_common()
    )
    lines = [
        f"  pick loss vs best (goal <= {PICK_LOSS_GOAL_PCT:g}%): worst {worst['worst_pick_loss_pct']:.1f}% "
        f"at {size_label(worst['bytes'])} (picks {picks}; best {worst['best']}) "
        f"-> {verdict(worst['worst_pick_loss_pct'] <= PICK_LOSS_GOAL_PCT)}"
    ]
    errors = [
        (abs(err), err, r["bytes"], k)
        for r in rows
        for k, err in r["measured_err_pct"].items()
        if err is not None and _mode_truth(r)[k] >= MEASURED_MIN_US
    ]
    if errors:
        _, err, nbytes, key = max(errors)
        met = abs(err) <= MEASURED_ERR_GOAL_PCT
        goal = verdict(met) if mode == "graph" else "no goal in eager mode"
        lines.append(
            f"  measured vs truth, choices >= {MEASURED_MIN_US:g} us (goal within "
            f"{MEASURED_ERR_GOAL_PCT:g}%): worst {err:+.1f}% ({key} at {size_label(nbytes)}) "
            f"-> {goal}"
        )
    per_op = ", ".join(f"{size_label(r['bytes'])} {r['autotune_ms']:.1f}" for r in rows)
    lines.append("  autotune ms per op: " + per_op)
    for label, applies, goal_ms in AUTOTUNE_GOALS_MS:
        at = [r["autotune_ms"] for r in rows if applies(r["bytes"])]
        if at:
            lines.append(
                f"    goal <= {goal_ms:g} ms at {label}: worst {max(at):.1f} "
                f"-> {verdict(max(at) <= goal_ms)}"
            )
    separated = [r for r in rows if (r["runner_up_gap_pct"] or 0) >= FLIP_GAP_PCT]
    if separated:
        flips = sum(r["flips"] for r in separated)
        tunings = sum(len(r["picks"]) for r in separated)
        where = (
            ", ".join(
                f"{size_label(r['bytes'])} {r['flips']}"
                for r in separated
                if r["flips"]
            )
            or "none"
        )
        lines.append(
            f"  flips where best and runner-up differ by >= {FLIP_GAP_PCT:g}% (goal <= {FLIP_GOAL:.0%}): "
            f"{flips} of {tunings} tunings at {len(separated)} sizes (where: {where}) "
            f"-> {verdict(flips <= FLIP_GOAL * tunings)}"
        )
    return lines


def _mode_truth(row: dict[str, Any]) -> dict[str, float]:
    return row["truth_us"] if row["mode"] == "graph" else row["truth_eager_us"]


def _png_path(json_path: str) -> str:
    return os.path.splitext(json_path)[0] + ".png"


def plot(result: dict[str, Any], png_path: str) -> None:
    """One panel per mode: truth lines, measured crosses, the pick as a square."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if any(r["mode"] == m for r in result["rows"])]
    fig, axes = plt.subplots(
        1, len(modes), figsize=(6.5 * len(modes), 5), squeeze=False
    )
    for ax, mode in zip(axes[0], modes):
        rows = [r for r in result["rows"] if r["mode"] == mode]
        sizes = [r["bytes"] for r in rows]
        for key in _mode_truth(rows[0]):
            color = COLORS[key]
            ax.plot(
                sizes,
                [_mode_truth(r)[key] for r in rows],
                "-o",
                color=color,
                ms=4,
                label=f"{key} (truth)",
            )
            measured = [(r["bytes"], r["measured_us"].get(key)) for r in rows]
            ax.plot(
                *zip(*[(b, m) for b, m in measured if m is not None]),
                "x",
                color=color,
                ms=9,
                label=f"{key} (measured)",
            )
        for r in rows:
            ax.plot(
                r["bytes"],
                _mode_truth(r)[r["pick"]],
                "s",
                mfc="none",
                mec="black",
                ms=14,
            )
            if r["flips"]:
                ax.annotate(
                    f"{r['flips']}/{len(r['picks'])} flips",
                    (r["bytes"], _mode_truth(r)[r["pick"]]),
                    textcoords="offset points",
                    xytext=(0, 12),
                    ha="center",
                    fontsize=7,
                )
        ax.plot(
            [],
            [],
            "s",
            mfc="none",
            mec="black",
            ms=12,
            label="our pick (most frequent)",
        )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [size_label(b) for b in sizes], rotation=45, fontsize=8)
        ax.set_yscale("log")
        ax.set_xlabel("message size")
        ax.set_ylabel("µs per all-reduce (slowest rank)")
        truth_kind = (
            "replayed CUDA graph" if mode == "graph" else "eager back-to-back calls"
        )
        ax.set_title(f"{mode} mode (truth: {truth_kind})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"{result['dtype']} all-reduce tuned through torch.compile, {result['world_size']}x "
        f"{result['device']}, torch {result['torch']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def report(args: argparse.Namespace) -> None:
    with open(args.json) as f:
        result = json.load(f)
    print(summary(result))
    plot(result, _png_path(args.json))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser(
        "run", help="measure (under torchrun); writes JSON, plot, goal report"
    )
    run_parser.add_argument(
        "--out", required=True, help="the JSON; the plot goes beside it (.png)"
    )
    run_parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    run_parser.add_argument(
        "--sizes",
        help="bytes, comma-separated (default: 4 KiB .. 256 MiB; on cpu 4, 64 KiB)",
    )
    run_parser.add_argument(
        "--repeats", type=int, default=REPEATS, help="fresh tunings per size and mode"
    )
    run_parser.add_argument(
        "--modes",
        default=None,
        help="comma-separated of graph,eager (default: both; on cpu eager)",
    )
    report_parser = commands.add_parser(
        "report", help="the goal report and the plot of a JSON again"
    )
    report_parser.add_argument("json")
    args = parser.parse_args()
    if args.command == "report":
        report(args)
        return
    cpu = args.device == "cpu"
    args.sizes = (
        [int(b) for b in args.sizes.split(",")]
        if args.sizes
        else (CPU_SIZES if cpu else SIZES)
    )
    args.modes = (
        args.modes.split(",") if args.modes else (["eager"] if cpu else list(MODES))
    )
    if any(m not in MODES for m in args.modes) or (cpu and "graph" in args.modes):
        parser.error(f"--modes: {args.modes}; choose from {MODES} (eager only on cpu)")
    run(args)


if __name__ == "__main__":
    main()
