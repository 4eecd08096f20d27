"""A tensor-parallel MLP block whose all-reduce is autotuned across ranks.

    torchrun --nproc_per_node=2 examples/tp_allreduce/demo.py              # CPU, gloo
    torchrun --nproc_per_node=4 examples/tp_allreduce/demo.py --device cuda  # GPUs, NCCL
    torchrun --nproc_per_node=8 examples/tp_allreduce/demo.py --device cuda --tp-size 2

The block's second matmul is row-parallel, so its partial sums meet in
``tp_demo::all_reduce``, which has several registered implementations. torch.compile
tunes them on every rank in lockstep, once per input shape; rank 0 prints each
decision and the winner per shape, and every rank checks the compiled output
against eager and against the unsharded block.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from examples.tp_allreduce import ops
from torch._inductor.kernel.collective.api import (
    collective_autotune_records,
    format_record,
)


class TPBlock(nn.Module):
    """x + W2 relu(W1 x), with W1 split by columns and W2 by rows over ``group``."""

    def __init__(
        self, hidden: int, ffn: int, group: dist.ProcessGroup, device: torch.device
    ) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)  # the same full weights on every rank
        self.full_w1 = torch.randn(hidden, ffn, generator=gen) / hidden**0.5
        self.full_w2 = torch.randn(ffn, hidden, generator=gen) / ffn**0.5
        shards, me = group.size(), dist.get_rank(group)
        self.w1 = nn.Parameter(self.full_w1.chunk(shards, dim=1)[me].to(device))
        self.w2 = nn.Parameter(self.full_w2.chunk(shards, dim=0)[me].to(device))
        self.group_name = group.group_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.relu(x @ self.w1) @ self.w2
        return x + ops.all_reduce(partial, self.group_name)

    def unsharded(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(x @ self.full_w1.to(x)) @ self.full_w2.to(x)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--tokens",
        default="16,256",
        help="comma-separated batch sizes, one compile each",
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument(
        "--tp-size",
        type=int,
        default=0,
        help="ranks per tensor-parallel group (default: all); groups tune concurrently",
    )
    args = parser.parse_args()

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl")
        dtype = torch.bfloat16
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        dtype = torch.float32
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = args.tp_size or world
    if world % tp:
        parser.error(f"--tp-size {tp} does not divide the world size {world}")
    if tp == world:
        group = dist.group.WORLD
    else:  # every rank creates every group: new_group is collective over WORLD
        groups = [
            dist.new_group(list(range(start, start + tp)))
            for start in range(0, world, tp)
        ]
        group = groups[rank // tp]
    ops.register(
        tuple(ops.IMPLEMENTATIONS) if args.device == "cuda" else ops.CPU_IMPLEMENTATIONS
    )
    model = (
        TPBlock(args.hidden, args.ffn, group, device).to(dtype).requires_grad_(False)
    )
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4

    winners = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(
            tokens, args.hidden, generator=torch.Generator().manual_seed(tokens)
        ).to(device, dtype)
        start = time.perf_counter()
        out = compiled(x)
        compile_s = time.perf_counter() - start
        torch.testing.assert_close(out, model(x), rtol=tol, atol=tol)
        torch.testing.assert_close(out, model.unsharded(x), rtol=tol, atol=tol * 10)
        record = collective_autotune_records()[-1]
        winners[tokens] = record.winner
        if dist.get_rank(group) == 0:
            print(
                f"\n[{tokens} tokens x {args.hidden}, {dtype}] compiled in {compile_s:.1f} s"
            )
            print(format_record(record))

    # Every rank of a group must have taken the same decisions.
    gathered = [None] * world
    dist.all_gather_object(gathered, winners)
    for start in range(0, world, tp):
        assert all(g == gathered[start] for g in gathered[start : start + tp]), (
            f"ranks disagree: {gathered}"
        )
    if rank == 0:
        print(
            "\nwinner per shape and group (identical on all ranks of a group; outputs match "
            "eager and the unsharded block):"
        )
        for start in range(0, world, tp):
            for tokens, winner in gathered[start].items():
                print(f"  ranks {start}-{start + tp - 1}, {tokens:>6} tokens: {winner}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
