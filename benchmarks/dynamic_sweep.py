"""A tensor-parallel block compiled once for a dynamic token count: which all-reduce runs at each size.

One rank per GPU, under torchrun (the overlay applied):

    torchrun --nproc_per_node=N benchmarks/dynamic_sweep.py --out benchmarks/results/dynamic_h200xN.json

CPU smoke test (gloo, fp32, hidden 256, the functional NCCL-style choice and the default only,
eager, ladder up to 512 tokens):

    torchrun --nproc_per_node=2 benchmarks/dynamic_sweep.py --device cpu --out /tmp/dyn.json

The model is examples/tp_allreduce's ``TPBlock``, ``x + all_reduce(relu(x @ w1) @ w2)``
with w1 split by columns and w2 by rows over all ranks, its all-reduce the
``tp_demo::all_reduce`` of benchmarks/allreduce_sweep.py (registered with
``one_all_reduce``, ``symm_mem_one_shot`` and ``symm_mem_two_shot`` on CUDA). Its token
dimension is dynamic and no split points are given, so Inductor tunes the all-reduce at
a ladder of sizes (kernel/collective/dispatch.py) and dispatches by size at run time.

Per mode ("graph": ``mode="reduce-overhead"``, the tuner times CUDA graphs; "eager":
the default mode), in fresh process groups so that no decision carries over:

  * one compile (the backend's compiles over the whole sweep: no recompiles), then a
    call at every size: which implementation runs ("ran", from the range records: the
    range holding the size and its winner; "observed": every all-reduce the profiler
    saw the first call at the size launch, expected [ran]), checked against the eager
    block;
  * truth_us / truth_eager_us: each implementation compiled alone at the size's static
    shape and timed as allreduce_sweep.py does (CUDA-graph replay; eager back-to-back
    calls; slowest rank), measured once before the modes; best and loss_pct of "ran";
  * the ladder: each range's winner and where it came from ("benchmark": timed,
    "ladder": taken from agreeing neighbours);
  * compile seconds, tuned and with ``collective_autotune=False`` (each in its own
    group, after an untuned compile that leaves the shared kernels in Inductor's code
    caches), and the ladder's own cost: build_s + tuning_s over its records.

Dynamo specialises sizes 0 and 1 of backed dynamic dimensions: a graph compiled at 8
tokens with ``dynamic=True`` or ``mark_dynamic(x, 0)`` recompiles at 1, and with
``mark_dynamic(x, 0, min=1)`` fails there (ConstraintViolationError).
``torch.fx.experimental._config.backed_size_oblivious`` (torch >= 2.7.1) gives backed
sizes the range [0, inf) without that specialisation: with ``mark_dynamic(x, 0)`` one
graph serves 1 .. max; ``maybe_mark_dynamic`` is used so that a specialisation shows as
a recompile in the results instead of ending the run. The block is compiled at
COMPILE_TOKENS, so size 1 comes after compiling at another size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from typing import Any
from collections.abc import Sequence

import common  # benchmarks/, the script's own directory


# Every tuning starts from fresh state.
common.fresh_state()

import torch
import torch.distributed as dist
from torch._inductor import config as inductor_config
from torch._inductor.kernel.collective.api import collective_autotune_records

import allreduce_sweep as sweep
from common import (
    assert_close_sum,
    CountedInductor,
    finite,
    first_call_s,
    group_max,
    header,
    init_process_group,
    pct,
    rank_randn,
    rounded,
    size_label,
    token_input,
    verdict,
    write_json,
)
from examples.tp_allreduce import ops
from examples.tp_allreduce.demo import TPBlock


# Goals: the implementation that runs within these of the best truth at its size; no
# recompiles; the ladder adds at most LADDER_GOAL_S of compile time per op.
LOSS_GOAL_PCT = {"graph": sweep.PICK_LOSS_GOAL_PCT, "eager": 5.0}
LADDER_GOAL_S = 0.5
# Not 1, the size Dynamo would specialise, and no size of the sweep: the first call at
# each of those then runs the compiled code (in graph mode, the CUDA-graph warm-up),
# where the profiler sees what it launches, instead of replaying a recorded graph.
COMPILE_TOKENS = 100
# The profiler's names for what each implementation launches in the compiled code.
OBSERVED_OPS = {
    "_c10d_functional::all_reduce_": "one_all_reduce",
    "_c10d_functional::all_reduce": "one_all_reduce",
    "tp_demo::symm_mem_one_shot_all_reduce": "symm_mem_one_shot",
    "tp_demo::symm_mem_two_shot_all_reduce": "symm_mem_two_shot",
    "tp_demo::all_reduce": sweep.DEFAULT,
}


@dataclasses.dataclass(frozen=True)
class Bench:
    """What one device kind runs."""

    implementations: tuple[str, ...]
    dtype: torch.dtype
    hidden: int
    ffn: int
    tokens: tuple[int, ...]
    # collective_autotune_dynamic_max: the token dimension itself is unbounded.
    dynamic_max: int
    modes: tuple[str, ...]


BENCHES = {
    "cuda": Bench(
        implementations=("one_all_reduce", "symm_mem_one_shot", "symm_mem_two_shot"),
        dtype=torch.bfloat16,
        hidden=4096,
        ffn=4 * 4096,
        tokens=(1, 8, 64, 512, 4096, 16384),
        dynamic_max=16384,
        modes=sweep.MODES,
    ),
    "cpu": Bench(  # symmetric memory and CUDA graphs need CUDA
        implementations=("one_all_reduce",),
        dtype=torch.float32,
        hidden=256,
        ffn=4 * 256,
        tokens=(1, 8, 64, 512),
        dynamic_max=512,
        modes=("eager",),
    ),
}


# -- one mode: a compile, a call at every size ------------------------------------------


def block_input(bench: Bench, tokens: int, device: torch.device) -> torch.Tensor:
    """The block's input, its token dimension dynamic (the truths' inputs stay static)."""
    return token_input(tokens, bench.hidden, bench.dtype, device, dynamic=True)


def compile_block(
    bench: Bench, group: dist.ProcessGroup, mode: str, device: torch.device
) -> tuple[Any, Any, CountedInductor]:
    """The eager block on ``group``, a fresh compile of it (nothing of earlier compiles
    kept) and the compile's counter."""
    torch._dynamo.reset()
    block = (
        TPBlock(bench.hidden, bench.ffn, group, device)
        .to(bench.dtype)
        .requires_grad_(False)
    )
    backend = CountedInductor(mode)
    return block, torch.compile(block, backend=backend, fullgraph=True), backend


def observed_call(compiled: Any, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """One call, and the all-reduce implementations the profiler saw it launch, in order
    and each time (one expected): meant for the first call at a size, since in graph mode
    later ones replay a graph that dispatches no ops."""
    from torch.profiler import profile, ProfilerActivity

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = compiled(x)
    launched = sorted(
        (e for e in prof.events() if e.name in OBSERVED_OPS),
        key=lambda e: e.time_range.start,
    )
    return out, [OBSERVED_OPS[e.name] for e in launched]


@dataclasses.dataclass(frozen=True)
class LadderRange:
    """One range of the ladder, [start, end] in tokens, as its record says."""

    start: int
    end: float  # inf: the last range, tuned at the ladder's top size
    winner: str
    source: str
    measured_us: dict[
        str, float | None
    ]  # per choice, slowest rank; empty where not timed
    # build_s and tuning_s of the record, each the slowest rank's.
    seconds: dict[str, float]

    def holds(self, tokens: int) -> bool:
        return self.start <= tokens <= self.end


_SECONDS = ("build_s", "tuning_s")


@dataclasses.dataclass(frozen=True)
class Ladder:
    """What one compile decided for the op along its dynamic dimension, and its cost."""

    ranges: list[LadderRange]
    # build_s + tuning_s over the ranges, slowest rank: what tuning the ladder cost.
    seconds: float
    # Of that, waiting for the group to join the graph's session. Every record of the
    # graph repeats this one wait as its waited_s, and the first range's tuning_s holds
    # it: adding waited_s per record would count it once per range.
    waited_s: float
    # How the tuner timed the choices ("graph", "eager"): the mode's own, expected.
    modes: list[str]


def ladder_of(records: Sequence[Any], group_name: str, device: torch.device) -> Ladder:
    """The ladder of one compile, from its records."""
    probes = sorted(
        (r for r in records if r.size is not None and r.group_name == group_name),
        key=lambda r: r.size,
    )
    # Each probe decides the sizes above the one below it; the last, every larger.
    starts = [1, *(r.size + 1 for r in probes[:-1])]
    ends = [*(float(r.size) for r in probes[:-1]), math.inf]
    own = list(zip(starts, ends, probes))
    if not own:
        raise RuntimeError(
            f"no ladder ranges among the records of group {group_name}: "
            f"{[(r.op, r.group_name) for r in records]} (was the token dimension dynamic?)"
        )
    mine = [[getattr(r, field) for field in _SECONDS] for _, _, r in own]
    # Every rank has the same ranges in this order: one MAX all-reduce for all seconds.
    *slowest, total, waited = group_max(
        [
            *(s for per_range in mine for s in per_range),
            sum(map(sum, mine)),
            max(r.waited_s for _, _, r in own),
        ],
        device,
    )
    ranges = [
        LadderRange(
            start,
            end,
            r.winner,
            r.source,
            measured_us={t.name: finite(t.max_us) for t in r.timings},
            seconds=dict(
                zip(_SECONDS, slowest[i * len(_SECONDS) : (i + 1) * len(_SECONDS)])
            ),
        )
        for i, (start, end, r) in enumerate(own)
    ]
    return Ladder(ranges, total, waited, sorted({r.mode for _, _, r in own}))


def size_row(
    bench: Bench,
    mode: str,
    tokens: int,
    block: Any,
    compiled: Any,
    ladder: Sequence[LadderRange],
    truth: dict[str, float],
    device: torch.device,
) -> dict[str, Any]:
    x = block_input(bench, tokens, device)
    out, observed = observed_call(compiled, x)
    if mode == "graph":  # the CUDA graph recorded, then replayed
        compiled(x)
        out = compiled(x)
    reference = block(x)
    assert_close_sum(out, reference)
    ran = next(r.winner for r in ladder if r.holds(tokens))
    best = min(truth, key=truth.get)
    return {
        "tokens": tokens,
        "bytes": x.numel() * x.element_size(),
        "ran": ran,
        "observed": observed,
        "truth_us" if mode == "graph" else "truth_eager_us": truth,
        "best": best,
        "loss_pct": pct(truth[ran], truth[best]),
    }


def warm_compile(bench: Bench, device: torch.device) -> None:
    """Compile the block once, untuned, before any compile is timed: the kernels every
    later compile shares (relu, the residual add) then come from Inductor's code caches
    for the untuned and the tuned compile alike, and their difference is the ladder's."""
    _, compiled, _ = compile_block(bench, dist.group.WORLD, "eager", device)
    with inductor_config.patch(collective_autotune=False):
        compiled(block_input(bench, COMPILE_TOKENS, device))


def run_mode(
    bench: Bench,
    mode: str,
    groups: dict[str, dist.ProcessGroup],
    truths: dict[int, dict[str, float]],
    device: torch.device,
    rank0: bool,
) -> dict[str, Any]:
    """Untuned and tuned compiles of the block in ``mode``, then the tuned one at every size."""
    x = block_input(bench, COMPILE_TOKENS, device)
    _, untuned, _ = compile_block(bench, groups["untuned"], mode, device)
    with inductor_config.patch(collective_autotune=False):
        untuned_s = first_call_s(untuned, x)

    block, compiled, backend = compile_block(bench, groups["tuned"], mode, device)
    group_name = groups["tuned"].group_name
    first_record = len(collective_autotune_records())
    tuned_s = first_call_s(compiled, x)
    ladder = ladder_of(collective_autotune_records()[first_record:], group_name, device)
    if rank0:
        print(
            f"[{mode}] compiled in {tuned_s:.2f} s (untuned {untuned_s:.2f} s); ladder: "
            f"{_describe_ladder(ladder.ranges)}",
            flush=True,
        )
    rows = []
    for tokens in bench.tokens:
        rows.append(
            size_row(
                bench,
                mode,
                tokens,
                block,
                compiled,
                ladder.ranges,
                truths[tokens],
                device,
            )
        )
        if rank0:
            print(f"[{mode}] {json.dumps(rounded(rows[-1]))}", flush=True)
    return rounded(
        {
            "rows": rows,
            "ladder": [
                dataclasses.asdict(r) | {"end": _end(r.end)} for r in ladder.ranges
            ],
            "tuner_modes": ladder.modes,
            "compiles": backend.compiles,
            "recompiles": backend.compiles - 1,
            "compile_s": {"tuned": tuned_s, "untuned": untuned_s},
            "extra_compile_s": tuned_s - untuned_s,
            "ladder_s": ladder.seconds,
            "ladder_waited_s": ladder.waited_s,
        }
    )


def _end(end: float) -> Any:
    return int(end) if end != float("inf") else "inf"  # JSON has no infinity


def _describe_ladder(ladder: Sequence[LadderRange]) -> str:
    return ", ".join(
        f"{r.start}..{_end(r.end)} {r.winner} ({r.source})" for r in ladder
    )


# -- the run -----------------------------------------------------------------------------


def measure_truths(
    bench: Bench, setup: sweep.Setup, rank0: bool
) -> dict[str, dict[int, dict[str, float]]]:
    """Per mode and size, every implementation's slowest-rank µs per call, compiled alone."""
    truths: dict[str, dict[int, dict[str, float]]] = {mode: {} for mode in bench.modes}
    for tokens in bench.tokens:
        x = rank_randn((tokens, bench.hidden), bench.dtype, setup.device)
        graph, eager = sweep.measure_truth(setup, x)
        for mode, truth in (("graph", graph), ("eager", eager)):
            if mode in truths:
                truths[mode][tokens] = truth
        if rank0:
            print(
                f"truth {tokens} tokens ({size_label(x.numel() * x.element_size())}): "
                f"graph {rounded(graph)}, eager {rounded(eager)}",
                flush=True,
            )
    return truths


def run(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    device = init_process_group(args.device)
    bench = BENCHES[args.device]
    ops.register(bench.implementations)
    # One graph for every size, 1 included (the module's docstring says why).
    torch.fx.experimental._config.backed_size_oblivious = True
    inductor_config.collective_autotune_dynamic_max = bench.dynamic_max
    world = dist.get_world_size()
    # Fresh groups per mode and variant: their decisions are theirs alone.
    groups = {
        mode: {
            variant: dist.new_group(list(range(world)))
            for variant in ("untuned", "tuned")
        }
        for mode in bench.modes
    }
    setup = sweep.Setup(
        device=device,
        dtype=bench.dtype,
        implementations={
            name: name for name in bench.implementations
        },  # keys as the records name them
        world_name=dist.group.WORLD.group_name,
        tuning_groups=tuple(
            g.group_name for by_variant in groups.values() for g in by_variant.values()
        ),
    )
    # Communicators set up before any compile is timed: a job sets up its group once,
    # whether it tunes or not.
    sweep.warm_up(setup, torch.ones(1024, dtype=bench.dtype, device=device))
    rank0 = dist.get_rank() == 0
    truths = measure_truths(bench, setup, rank0)
    warm_compile(bench, device)
    result = {
        **header(device),
        "dtype": str(bench.dtype).removeprefix("torch."),
        "hidden": bench.hidden,
        "ffn": bench.ffn,
        "compile_tokens": COMPILE_TOKENS,
        "collective_autotune_dynamic_max": bench.dynamic_max,
        "dynamic": "maybe_mark_dynamic(x, 0); torch.fx.experimental._config.backed_size_oblivious=True",
        "modes": {
            mode: run_mode(bench, mode, groups[mode], truths[mode], device, rank0)
            for mode in bench.modes
        },
    }
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if rank0:
        write_json(args.out, result)
        print(summary(result), flush=True)
    dist.destroy_process_group()


# -- report ------------------------------------------------------------------------------


def summary(result: dict[str, Any]) -> str:
    """The goals, checked on the result: a plain-text report."""
    lines = [
        f"goals: {result['world_size']}x {result['device']}, torch {result['torch']}, TP block hidden "
        f"{result['hidden']}, ffn {result['ffn']}, {result['dtype']}, one compile at "
        f"{result['compile_tokens']} tokens ({result['dynamic']})",
    ]
    for mode, m in result["modes"].items():
        truth_key = "truth_us" if mode == "graph" else "truth_eager_us"
        lines.append(
            f"[{mode}] ladder (range in tokens, winner, source, slowest rank's seconds):"
        )
        for entry in m["ladder"]:
            r = _ladder_range(entry)
            seconds = ", ".join(
                f"{k.removesuffix('_s')} {v:.2f}" for k, v in r.seconds.items()
            )
            lines.append(
                f"  {r.start:>6}..{_end(r.end):<6} {r.winner:<18} {r.source:<9} {seconds}"
            )
        for row in m["rows"]:
            truth = row[truth_key]
            times = ", ".join(f"{k} {v:.1f}" for k, v in truth.items())
            mismatch = (
                ""
                if row["observed"] == [row["ran"]]
                else f" (profiler saw {row['observed'] or 'none'})"
            )
            lines.append(
                f"  {row['tokens']:>6} tokens {size_label(row['bytes']):>8}: ran {row['ran']}"
                f"{mismatch}, best {row['best']}, loss {row['loss_pct']:+.1f}%  "
                f"[{truth_key}: {times}]"
            )
        worst = max(m["rows"], key=lambda r: r["loss_pct"])
        goal = LOSS_GOAL_PCT[mode]
        unexpected = [
            f"{r['tokens']} ({len(r['observed'])} launched)"
            for r in m["rows"]
            if r["observed"] != [r["ran"]]
        ]
        lines += [
            f"  loss vs best (goal <= {goal:g}%): worst {worst['loss_pct']:.1f}% at {worst['tokens']} tokens "
            f"-> {verdict(worst['loss_pct'] <= goal)}",
            f"  profiler: one all-reduce per call, the winner's (tuner timed as {', '.join(m['tuner_modes'])}): "
            f"{'as expected' if not unexpected else 'not at ' + ', '.join(unexpected) + ' tokens'} "
            f"-> {verdict(not unexpected)}",
            f"  compiles over the sweep: {m['compiles']} (goal: 1, no recompiles) "
            f"-> {verdict(m['recompiles'] == 0)}",
            f"  extra compile time (tuned {m['compile_s']['tuned']:.2f} s - untuned "
            f"{m['compile_s']['untuned']:.2f} s; goal <= {LADDER_GOAL_S:g} s per op): "
            f"{m['extra_compile_s']:.2f} s -> {verdict(m['extra_compile_s'] <= LADDER_GOAL_S)}",
            f"  ladder records, build_s + tuning_s: {m['ladder_s']:.2f} s (waiting for the group "
            f"{m['ladder_waited_s']:.2f} s of it) -> {verdict(m['ladder_s'] <= LADDER_GOAL_S)}",
        ]
    lines.append(f"wall time from the process group's start: {result['wall_s']:.0f} s")
    return "\n".join(lines)


def _ladder_range(entry: dict[str, Any]) -> LadderRange:
    return LadderRange(**entry | {"end": float(entry["end"])})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", required=True, help="the results JSON (rank 0 writes it)"
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
