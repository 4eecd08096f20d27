"""What the guard-free path costs the host per call: a serving engine's compile (every
Dynamo guard filtered out, first called at its largest size), whose graph dispatches by
size inside, against the same model under plain torch.compile (one range graph per
size range, picked by Dynamo's guard check) and against the model whose one winner is
inlined at every size (no dispatch, no range guard: the truth).

    torchrun --nproc_per_node=1 benchmarks/dispatch_host_cost.py --out /tmp/dispatch.json

CPU, gloo. The model is ``--layers`` layers ``x = x + all_reduce(relu(x @ w))``; the
all-reduce's two implementations are the same inlined functional all-reduce under two
names, and the group's benchmark reads given costs (the tests' timing source) that make
one win up to 64 tokens and the other above, or one win everywhere: the three variants
run the same kernels, and differ only in how a size reaches them. Per size, rounds of
``--calls`` back-to-back calls of each variant in turn; the median µs per call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import common  # benchmarks/, the script's own directory

common.fresh_state()

import torch
import torch.distributed as dist
from torch._inductor.kernel.collective.api import collective_autotune_size_paths
from torch._inductor.kernel.custom_op import (
    CustomOpConfig,
    register_custom_op_autotuning,
)

from common import header, init_process_group, write_json

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "inductor"))
from collective_harness import given_timings


fc = torch.ops._c10d_functional
HIDDEN = 16
SIZES = (8, 200)


@torch.library.custom_op("dispatch_bench::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(
        out, group=torch._C._distributed_c10d._resolve_process_group(group_name)
    )
    return out


@all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def functional(name: str):
    def impl(x: torch.Tensor, group_name: str) -> torch.Tensor:
        return fc.wait_tensor(fc.all_reduce(x, "sum", group_name))

    impl.__name__ = name
    return impl


register_custom_op_autotuning(
    all_reduce,
    configs=[CustomOpConfig(functional("small")), CustomOpConfig(functional("large"))],
)


def crossing(choice: str, rows: int) -> float:
    return {"small": 10 if rows <= 64 else 100, "large": 100 if rows <= 64 else 10}.get(
        choice, 1000
    )


def one_winner(choice: str, rows: int) -> float:
    return {"small": 10, "large": 100}.get(choice, 1000)


def model(layers: int, group: str):
    gen = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN for _ in range(layers)
    ]

    def forward(x: torch.Tensor) -> torch.Tensor:
        for w in weights:
            x = x + all_reduce(torch.relu(x @ w), group)
        return x

    return forward


def tokens(n: int) -> torch.Tensor:
    x = torch.randn(n, HIDDEN)
    torch._dynamo.mark_dynamic(x, 0)
    return x


def compiled_variant(name: str, layers: int) -> tuple:
    """The model compiled as ``name`` says, warmed up at every size; its size paths."""
    torch._dynamo.reset()
    group = dist.new_group(list(range(dist.get_world_size()))).group_name
    options = (
        {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
        if name == "engine"
        else {}
    )
    compiled = torch.compile(model(layers, group), fullgraph=True, options=options)
    paths = len(collective_autotune_size_paths())
    with given_timings(one_winner if name == "one_winner" else crossing):
        for n in (max(SIZES), *SIZES):  # the engine's first call: its largest size
            compiled(tokens(n))
    return compiled, [p.path.value for p in collective_autotune_size_paths()[paths:]]


def per_call_us(fn, x: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = init_process_group("cpu")
    torch.set_num_threads(1)
    variants = {}
    paths = {}
    with torch._inductor.config.patch(collective_autotune_dynamic_max=1024):
        for name in ("one_winner", "plain", "engine"):
            variants[name], paths[name] = compiled_variant(name, args.layers)
    samples: dict[str, dict[int, list[float]]] = {
        v: {n: [] for n in SIZES} for v in variants
    }
    for _ in range(args.rounds):
        for n in SIZES:
            x = tokens(n)
            for name, fn in variants.items():
                samples[name][n].append(per_call_us(fn, x, args.calls))
    us = {
        v: {n: statistics.median(s) for n, s in by.items()} for v, by in samples.items()
    }
    result = {
        **header(device),
        "layers": args.layers,
        "hidden": HIDDEN,
        "calls": args.calls,
        "rounds": args.rounds,
        "size_paths": paths,
        "per_call_us": us,
        "samples_us": samples,
        # The guard-free path's extra host cost per call, against the inlined winner
        # and against plain torch.compile; and per layer.
        "engine_minus_one_winner_us": {
            n: us["engine"][n] - us["one_winner"][n] for n in SIZES
        },
        "engine_minus_plain_us": {n: us["engine"][n] - us["plain"][n] for n in SIZES},
    }
    if dist.get_rank() == 0:
        for n in SIZES:
            print(
                f"{n} tokens: one winner {us['one_winner'][n]:.1f} us/call, plain "
                f"{us['plain'][n]:.1f}, engine {us['engine'][n]:.1f} (engine - one winner "
                f"{result['engine_minus_one_winner_us'][n]:+.1f} us, "
                f"{result['engine_minus_one_winner_us'][n] / args.layers:+.2f} per layer; "
                f"engine - plain {result['engine_minus_plain_us'][n]:+.1f} us)"
            )
        print("size paths:", paths)
        if args.out:
            write_json(args.out, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
