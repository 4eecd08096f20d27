"""What a further range graph's compile costs against the same model compiled untuned.

    torchrun --nproc_per_node=2 benchmarks/range_compile.py --out benchmarks/results/range_compile_gloo2.json

The goal: each range graph after the first (kernel/collective/range_graphs.py)
costs at most its untuned compile + 0.2 s. "Its untuned compile" is the model compiled
once, dynamically, with the range's winner written in: the graph a user would have
compiled had they known the winner, which is what the range graph inlines. (The op's own
untuned compile calls one opaque op instead, and is no graph the range compiles.)

The model: ``--layers`` layers ``x = x + all_reduce(relu(x @ w))``, the all-reduce the
test suite's ``cat_test::all_reduce`` (test/inductor/collective_ops.py) with three
implementations whose costs cross along the token dimension, so that on any machine the
ladder's winner changes twice: an inlined all-reduce costing 1 ms a row, an opaque op
(6 ms + 0.05 ms a row), the op's own (12 ms). Compiled dynamically with the FX-graph cache
off (every compile a compile; kernels stay cached after the first pass, as on a serving
machine that compiled the model before), per repetition:

  * tuned: a fresh process group (its decisions its own), the first call at 8 rows
    (tunes the ladder), then one call in each other range: the range graph's compile;
  * written in: the model with each range's winner written in, compiled alone at a
    size of that range (the op's own: the same call as an op registered for no tuning);
  * switched off: the tuned model compiled with ``collective_autotune=False`` at the
    first compile's size, against the model calling the op registered for no tuning:
    what a user who switches tuning off pays of the overlay's own work.

Seconds are the first call less a later one, slowest rank, median over repetitions
(11 by default: single compiles on a 2-core VM spread by ±0.4 s); the extra, the
median of each repetition's difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import common  # benchmarks/, the script's own directory

common.fresh_state()

import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch._inductor.kernel.collective.api import collective_autotune_records

from common import (
    first_call_s,
    header,
    init_process_group,
    REPO,
    rounded,
    verdict,
    write_json,
)

sys.path.insert(0, str(REPO / "test" / "inductor"))
import collective_ops as ops


RANGE_COMPILE_S = 0.2
DYNAMIC_MAX = 256
FIRST_ROWS = 8  # the first compile's size, in the opaque op's range
OTHER_ROWS = (2, 100)  # one size in each other range: the inlined op's, the op's own


@torch.library.custom_op("range_compile::own_all_reduce", mutates_args=())
def own_all_reduce(x: torch.Tensor, group_name: str, delay_ms: str) -> torch.Tensor:
    """The op's own implementation as an op registered for no tuning (the tuned op,
    even with collective_autotune=False, goes through the overlay's lowering)."""
    return ops.all_reduce(x, group_name, delay_ms)


@own_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str, delay_ms: str) -> torch.Tensor:
    return torch.empty_like(x)


WRITTEN_IN: dict[str, Callable[..., torch.Tensor]] = {
    "per_row_cost": ops.per_row_cost,
    "opaque": ops.opaque,
    "default": own_all_reduce,
}


def model_of(
    all_reduce: Callable[..., torch.Tensor], layers: int, group: str
) -> Callable[[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(4, 4, generator=gen) / 4 for _ in range(layers)]

    def model(x: torch.Tensor) -> torch.Tensor:
        for w in weights:
            x = x + all_reduce(torch.relu(x @ w), group, "12")
        return x

    return model


def compile_s(
    fn: Callable[[torch.Tensor], torch.Tensor], rows: tuple[int, ...], tuned: bool
) -> tuple[list[float], int]:
    """The compile seconds of ``fn``'s first call at each of ``rows`` (one dynamic
    torch.compile), and the graphs it compiled."""
    torch._dynamo.reset()  # every model_of's closure shares one code object
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, dynamic=True, fullgraph=True)
    with torch._inductor.config.patch(
        collective_autotune=tuned,
        collective_autotune_dynamic_max=DYNAMIC_MAX,
        fx_graph_cache=False,
    ):
        seconds = [first_call_s(compiled, torch.randn(n, 4)) for n in rows]
    return seconds, counter.frame_count


def repetition(layers: int) -> dict[str, Any]:
    group = dist.new_group(list(range(dist.get_world_size()))).group_name
    start = len(collective_autotune_records())
    traces = counters["inductor"]["collective_autotune_choice_traces"]
    sizes = (FIRST_ROWS, *OTHER_ROWS)
    tuned, graphs = compile_s(model_of(ops.all_reduce, layers, group), sizes, True)
    records = collective_autotune_records()[start:]
    winners = {
        rows: next(
            r.winner for r in records if _holds(r.op.rsplit("_range_", 1)[1], rows)
        )
        for rows in OTHER_ROWS
    }
    written_in = {}
    for rows, label in winners.items():
        written = model_of(WRITTEN_IN[label], layers, group)
        (written_in[rows],), _ = compile_s(written, (rows,), False)
    # The tuned model compiled with collective autotuning off, and the model calling
    # the op's own registered for no tuning: what a knob-off compile pays of the
    # overlay's work.
    switched_off = {}
    for label, all_reduce in (
        ("off", ops.all_reduce),
        ("unregistered", own_all_reduce),
    ):
        (switched_off[label],), _ = compile_s(
            model_of(all_reduce, layers, group), (FIRST_ROWS,), False
        )
    return {
        "graphs": graphs,
        "switched_off_s": switched_off,
        # Tracing the choices, as the decisions' records say it, and the traces that
        # collective autotuning counted (each implementation once per graph, torch 2.13 on).
        "trace_s": sum(r.trace_s for r in records),
        "choice_traces": counters["inductor"]["collective_autotune_choice_traces"]
        - traces,
        "winners": winners,
        "tuned_s": dict(zip(sizes, tuned)),
        "written_in_s": written_in,
    }


def _holds(label: str, rows: int) -> bool:
    low, high = label.split("_")
    return int(low) <= rows and (high == "inf" or rows <= int(high))


def run(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    init_process_group("cpu")
    ops.register_all_reduce(ops.flat_cost, ops.per_row_cost, ops.opaque)
    # A first pass compiles every kernel: the repetitions measure compiles, not gcc.
    repetition(args.layers)
    reps = [repetition(args.layers) for _ in range(args.repeat)]
    ranges = []
    for rows in OTHER_ROWS:
        range_s = statistics.median(r["tuned_s"][rows] for r in reps)
        written_s = statistics.median(r["written_in_s"][rows] for r in reps)
        ranges.append(
            {
                "rows": rows,
                "winners": sorted({r["winners"][rows] for r in reps}),
                "range_compile_s": range_s,
                "written_in_compile_s": written_s,
                # Median of each repetition's difference: the pair ran back to back,
                # so a slow spell of the machine hits both.
                "extra_s": statistics.median(
                    r["tuned_s"][rows] - r["written_in_s"][rows] for r in reps
                ),
                # (range graph, written in) seconds of each repetition.
                "per_repetition": [
                    [r["tuned_s"][rows], r["written_in_s"][rows]] for r in reps
                ],
            }
        )
    result = rounded(
        {
            **header(torch.device("cpu")),
            "layers": args.layers,
            "repeat": args.repeat,
            "graphs_per_repetition": [r["graphs"] for r in reps],
            "first_compile_s": statistics.median(
                r["tuned_s"][FIRST_ROWS] for r in reps
            ),
            "trace_s": statistics.median(r["trace_s"] for r in reps),
            "trace_s_per_repetition": [r["trace_s"] for r in reps],
            "choice_traces_per_repetition": [r["choice_traces"] for r in reps],
            "ranges": ranges,
            # collective_autotune=False against an op registered for no tuning, at the
            # first compile's size: medians, the extra the median of the differences.
            "switched_off": {
                "compile_s": statistics.median(
                    r["switched_off_s"]["off"] for r in reps
                ),
                "unregistered_compile_s": statistics.median(
                    r["switched_off_s"]["unregistered"] for r in reps
                ),
                "extra_s": statistics.median(
                    r["switched_off_s"]["off"] - r["switched_off_s"]["unregistered"]
                    for r in reps
                ),
            },
            "wall_s": time.perf_counter() - started,
        }
    )
    if dist.get_rank() == 0:
        write_json(args.out, result)
        print(
            f"first compile {result['first_compile_s']:.2f} s, tracing the choices "
            f"{result['trace_s']:.2f} s, choice traces per compile "
            f"{result['choice_traces_per_repetition']}"
        )
        off = result["switched_off"]
        print(
            f"collective_autotune=0: {off['compile_s']:.2f} s, the op registered for "
            f"no tuning {off['unregistered_compile_s']:.2f} s, extra {off['extra_s']:+.2f} s"
        )
        for r in result["ranges"]:
            print(
                f"range graph at {r['rows']} rows ({', '.join(r['winners'])}): "
                f"{r['range_compile_s']:.2f} s, written in {r['written_in_compile_s']:.2f} s, "
                f"extra {r['extra_s']:+.2f} s -> {verdict(r['extra_s'] <= RANGE_COMPILE_S)}"
            )
    dist.destroy_process_group()


def arguments(doc: str, repeat: int) -> argparse.Namespace:
    """The command line of a benchmark of this model: --out, --layers, --repeat."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="the results JSON (rank 0)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=repeat)
    return parser.parse_args()


def main() -> None:
    run(arguments(__doc__, repeat=11))


if __name__ == "__main__":
    main()
