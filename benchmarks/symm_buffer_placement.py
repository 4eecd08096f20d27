"""Does the same symmetric-memory kernel run at one speed in every buffer?

serving_step.py gives every variant a process group of its own, so that its decisions
are its own, and the example's symmetric-memory ops allocate a buffer per group: the
variants that run the same two-shot kernel on the same sizes run it in different
buffers. On 2 H200s its kernel read 880, 949 and 1053 µs per step (8 layers, 4096
tokens) in three variants whose other kernels read alike (3215800, ``--kernels``).
This times the kernels alone in ``--buffers`` buffers, each of a fresh group and of
serving_step's size, round-robin over the buffers (so that a drift of the machine hits
all alike), slowest rank:

    torchrun --nproc_per_node=2 benchmarks/symm_buffer_placement.py --out /tmp/placement.json

Measured (3215800, results/symm_buffer_placement_h200x{2,4}.json): the two-shot kernel
at 4096 tokens takes 109 µs per call on 2 H200s in each of six buffers (spread 0.6%),
173 µs on 4 (0.7%); 512 tokens and the one-shot kernel at 64 spread by 0.9-1.8%. The
buffer does not explain the model's difference; inside the model the kernel takes
110-132 µs per call, waiting for its peer.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory as symm_mem

from common import header, init_process_group, write_json

HIDDEN = 4096
LARGEST = 16384  # tokens: serving_step's largest size, at which it allocates


def two_shot(x: torch.Tensor, group_name: str) -> None:
    torch.ops.symm_mem.two_shot_all_reduce_(x, "sum", group_name)


def one_shot(x: torch.Tensor, group_name: str) -> None:
    torch.ops.symm_mem.one_shot_all_reduce(x, "sum", group_name)


KERNELS = {  # name: (tokens, call)
    "two_shot_4096": (4096, two_shot),
    "two_shot_512": (512, two_shot),
    "one_shot_64": (64, one_shot),
}


def time_us(call, x: torch.Tensor, group_name: str, calls: int) -> float:
    x.fill_(2.0**-100)  # in-place sums double it each call: far from overflow
    dist.barrier()
    torch.cuda.synchronize()
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    call(x, group_name)  # rendezvous: the ranks' skew stays out of the timing
    start.record()
    for _ in range(calls):
        call(x, group_name)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--buffers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    device = init_process_group("cuda")
    world = list(range(dist.get_world_size()))
    buffers = []
    for _ in range(args.buffers):
        group = dist.new_group(world)
        buf = symm_mem.empty(LARGEST * HIDDEN, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buf, group.group_name)
        buffers.append((buf, group.group_name))
    samples = {k: [[] for _ in buffers] for k in KERNELS}
    for _ in range(args.rounds):
        for name, (tokens, call) in KERNELS.items():
            for i, (buf, group_name) in enumerate(buffers):
                x = buf[: tokens * HIDDEN].view(tokens, HIDDEN)
                us = time_us(call, x, group_name, args.calls)
                slowest = torch.tensor([us], device=device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                samples[name][i].append(slowest.item())
    result = {
        **header(device),
        "hidden": HIDDEN,
        "allocated_tokens": LARGEST,
        "calls": args.calls,
        "rounds": args.rounds,
        "kernels": {
            name: {
                "tokens": KERNELS[name][0],
                "median_us_per_buffer": [round(statistics.median(s), 2) for s in per],
                "samples_us": [[round(v, 2) for v in s] for s in per],
            }
            for name, per in samples.items()
        },
    }
    if dist.get_rank() == 0:
        for name, k in result["kernels"].items():
            m = k["median_us_per_buffer"]
            print(
                f"{name}: per buffer {m}, spread {100 * (max(m) / min(m) - 1):.1f}%",
                flush=True,
            )
        write_json(args.out, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
