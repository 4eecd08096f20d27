"""What lowering a collective op's ladder costs in each further range graph's compile.

    torchrun --nproc_per_node=2 benchmarks/range_lowering.py --layers 8 --out OUT.json

A further range's whole compile spreads by ±0.2 s on a 2-core VM (benchmarks/
range_compile.py), more than the lowering of the ladder at every call site that
collective autotuning adds to it. This reads that part alone: the seconds in upstream's
range-based lowering (``kernel/custom_op.py:_range_based_lowering_fn``, with the hooks
inside: each range's preparation, the range graph's guard, the winner's inlining), per
further range compile, with the choice traces it made, on range_compile.py's model
(``--layers`` layers ``x + all_reduce(relu(x @ w))``, three implementations whose costs
cross along the tokens). Per repetition: a fresh process group and model, the first
call at 8 rows (tunes the ladder), then one call at 100 rows (the op's own) and one at 2
(the inlined per-row all-reduce), each a range graph's compile. Medians over
repetitions; the first pass only builds kernels.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import common  # benchmarks/, the script's own directory

common.fresh_state()

import range_compile as rc
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch._inductor.kernel import custom_op

from common import first_call_s, header, init_process_group, rounded, write_json

ROWS = (100, 2)


@contextmanager
def timed_range_lowering(into: dict[str, float]) -> Iterator[None]:
    """Seconds spent in the range-based lowering while the block compiles."""
    lowering = custom_op._range_based_lowering_fn

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        try:
            return lowering(*args, **kwargs)
        finally:
            into["lowering_s"] += time.perf_counter() - started

    custom_op._range_based_lowering_fn = timed
    try:
        yield
    finally:
        custom_op._range_based_lowering_fn = lowering


def repetition(layers: int) -> dict[int, tuple[float, float, int]]:
    """Per size of ROWS: its range compile's seconds, the lowering's, the choice traces."""
    group = dist.new_group(list(range(dist.get_world_size()))).group_name
    torch._dynamo.reset()
    compiled = torch.compile(
        rc.model_of(rc.ops.all_reduce, layers, group), dynamic=True, fullgraph=True
    )
    result = {}
    with torch._inductor.config.patch(
        collective_autotune=True,
        collective_autotune_dynamic_max=rc.DYNAMIC_MAX,
        fx_graph_cache=False,
    ):
        first_call_s(compiled, torch.randn(rc.FIRST_ROWS, 4))
        for rows in ROWS:
            spent = collections.Counter()
            traces = counters["inductor"]["collective_autotune_choice_traces"]
            with timed_range_lowering(spent):
                seconds = first_call_s(compiled, torch.randn(rows, 4))
            if not spent["lowering_s"]:
                # Upstream's lowering no longer calls it by its module's name (the
                # contracts' breaks patch it alike): say so rather than read 0 s.
                raise RuntimeError(
                    f"the range graph at {rows} rows compiled without calling "
                    "custom_op._range_based_lowering_fn: nothing was timed"
                )
            result[rows] = (
                seconds,
                spent["lowering_s"],
                counters["inductor"]["collective_autotune_choice_traces"] - traces,
            )
    return result


def main() -> None:
    args = rc.arguments(__doc__, repeat=5)
    init_process_group("cpu")
    rc.ops.register_all_reduce(rc.ops.flat_cost, rc.ops.per_row_cost, rc.ops.opaque)
    repetition(args.layers)  # builds every kernel
    reps = [repetition(args.layers) for _ in range(args.repeat)]
    result = rounded(
        {
            **header(torch.device("cpu")),
            "layers": args.layers,
            "repeat": args.repeat,
            "ranges": {
                rows: {
                    "compile_s": statistics.median(r[rows][0] for r in reps),
                    "lowering_s": statistics.median(r[rows][1] for r in reps),
                    "lowering_s_per_repetition": [r[rows][1] for r in reps],
                    "choice_traces_per_repetition": [r[rows][2] for r in reps],
                }
                for rows in ROWS
            },
        }
    )
    if dist.get_rank() == 0:
        write_json(args.out, result)
        for rows, r in result["ranges"].items():
            print(
                f"range graph at {rows} rows: compile {r['compile_s']:.2f} s, the "
                f"ladder's lowering {r['lowering_s']:.3f} s, choice traces "
                f"{r['choice_traces_per_repetition']}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
