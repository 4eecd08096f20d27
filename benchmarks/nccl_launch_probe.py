"""How the way NCCL is launched costs a model step: the serving model's layers
``x = x + all_reduce(relu(x @ w))`` with the all-reduce written each way a model can write
it, timed as a step, eager and captured in a CUDA graph, and compiled.

Why: on one H200 the model with the op's own implementation (a clone, then
``dist.all_reduce``) read faster at 16384 tokens than the model with the functional
all-reduce inlined, although the functional one does less device work; the step held
0.7-0.8 ms that no kernel accounted for, growing with the message
(``results/serving_rotating_h200x1_2026-12-03.md``, section 2). The ways differ in how
NCCL is launched: ``dist.all_reduce(async_op=False)`` runs on the current stream,
``async_op=True`` and the functional ops on ProcessGroupNCCL's own stream behind events,
the functional ops stashing their tensor until ``wait_tensor``.

Per way and size: the step (median of rounds in common.sampling_order, each sample after
as many untimed calls, µs), the sum of its kernels' device time (torch.profiler, through
dynamic_kernels.kernel_us) and the caching allocator's device allocations while timed (a
block held for another stream is not reused).

    torchrun --nproc_per_node=1 benchmarks/nccl_launch_probe.py --out probe.json

Measured (one H200, results/power_cap_order_h200x1_2026-12-03.md; rounds then rotated a
fixed cycle, without the untimed calls): in place, every launch costs the step no
all-reduce costs; the kernels' sum is no measure, as it follows the power-capped clock.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import common
import torch
import torch.distributed as dist
from dynamic_kernels import kernel_us  # benchmarks/, the script's own directory
from torch.fx.experimental import _config as fx_config

fc = torch.ops._c10d_functional


def ways(group: dist.ProcessGroup) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    name = group.group_name

    def functional(y: torch.Tensor) -> torch.Tensor:
        return fc.wait_tensor(fc.all_reduce(y, "sum", name))

    def functional_in_place(y: torch.Tensor) -> torch.Tensor:
        # What Inductor generates for the inlined winner: in place on the relu's buffer.
        return fc.wait_tensor(fc.all_reduce_(y, "sum", name))

    def sync(y: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(y, group=group)
        return y

    def async_wait(y: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(y, group=group, async_op=True).wait()
        return y

    def clone_sync(y: torch.Tensor) -> torch.Tensor:  # the op's own implementation
        y = y.clone()
        dist.all_reduce(y, group=group)
        return y

    return {
        "none": lambda y: y,
        "functional": functional,
        "functional_in_place": functional_in_place,
        "sync": sync,
        "async_wait": async_wait,
        "clone_sync": clone_sync,
    }


def stack(weights: list[torch.Tensor], reduce: Callable) -> Callable:
    def step(x: torch.Tensor) -> torch.Tensor:
        for w in weights:
            x = x + reduce(torch.relu(x @ w))
        return x

    return step


def captured(step: Callable, x: torch.Tensor) -> Callable:
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(static)

    def replay(x: torch.Tensor) -> torch.Tensor:
        static.copy_(x)
        graph.replay()
        return out

    return replay


def step_us(fn: Callable, x: torch.Tensor, calls: int) -> float:
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-eager", action="store_true", help="compiled models only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    device = common.init_process_group("cuda")
    # Dynamic compiles as serving_step's: one graph for every token count.
    fx_config.backed_size_oblivious = True
    group = dist.group.WORLD
    torch.manual_seed(0)
    weights = [
        torch.randn(args.hidden, args.hidden, device=device, dtype=torch.bfloat16)
        / args.hidden**0.5
        for _ in range(args.layers)
    ]
    result = {**common.header(device), "layers": args.layers, "hidden": args.hidden}
    result["sizes"] = {}
    for tokens in map(int, args.tokens.split(",")):
        x = torch.randn(tokens, args.hidden, device=device, dtype=torch.bfloat16)
        variants: dict[str, Callable] = {}
        if not args.no_eager:
            for way, reduce in ways(group).items():
                eager = stack(weights, reduce)
                variants[f"eager/{way}"] = eager
                variants[f"captured/{way}"] = captured(eager, x)
        if not args.no_compile:
            from examples.tp_allreduce import ops  # registers no tuning

            compiled = {
                "functional": ways(group)["functional"],
                # The op's own, opaque to Inductor: clone + dist.all_reduce when it runs.
                "own_op": lambda y: ops.all_reduce(y, group.group_name),
            }
            for shape in ("static", "dynamic"):
                for way, reduce in compiled.items():
                    for mode in ("default", "reduce-overhead"):
                        model = torch.compile(
                            stack(weights, reduce),
                            mode=mode,
                            dynamic=None if shape == "dynamic" else False,
                        )
                        if shape == "dynamic":  # as serving_step: first called at 100
                            model(
                                common.token_input(
                                    100, args.hidden, x.dtype, device, True
                                )
                            )
                        for _ in range(3):
                            model(x)
                        variants[f"compiled-{mode}-{shape}/{way}"] = model
        names = list(variants)
        allocs = dict.fromkeys(names, 0)
        samples: dict[str, list[float]] = {n: [] for n in names}
        # When each sample ended (Unix seconds), to read it against the GPU's clocks and
        # power sampled beside the run (nvidia-smi).
        ended: dict[str, list[float]] = {n: [] for n in names}
        for n in names:
            variants[n](x)
        for n in common.sampling_order(names, args.rounds):
            for _ in range(args.calls):  # the GPU settles on this variant
                variants[n](x)
            before = torch.cuda.memory_stats(device).get("num_device_alloc", 0)
            samples[n].append(step_us(variants[n], x, args.calls))
            ended[n].append(round(time.time(), 3))
            allocs[n] += (
                torch.cuda.memory_stats(device).get("num_device_alloc", 0) - before
            )
        rows = {}
        for n in names:
            per_kernel = kernel_us(variants[n], x)
            kernels = sum(per_kernel.values())
            step = statistics.median(samples[n])
            rows[n] = {
                "step_us": round(step, 1),
                "kernels_us": round(kernels, 1),
                "device_allocs_while_timed": allocs[n],
                "samples_us": [round(s, 1) for s in samples[n]],
                "samples_ended_at": ended[n],
                "top_kernels_us": dict(
                    sorted(per_kernel.items(), key=lambda kv: -kv[1])[:6]
                ),
            }
            print(
                f"{tokens:6d} {n:38s} step {step:8.1f} kernels {kernels:8.1f} "
                f"allocs {allocs[n]}",
                flush=True,
            )
        result["sizes"][str(tokens)] = rows
    common.write_json(args.out, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
