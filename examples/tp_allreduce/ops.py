"""A tensor-parallel all-reduce custom op with several equivalent implementations.

``tp_demo::all_reduce(x, group_name)`` sums ``x`` over the ranks of a process group.
Its implementations cost genuinely different amounts: one all-reduce; a
reduce-scatter followed by an all-gather; the same all-reduce cut into chunks; and,
on CUDA, the symmetric-memory one-shot and two-shot kernels (as opaque ops that own
their symmetric buffers, the way production custom all-reduces integrate).

``tp_demo::table_all_reduce(x, group_name)`` is the same sum picked as serving engines
pick it: by message size, from thresholds written in by hand (vLLM's, below).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._inductor.kernel.custom_op import (
    CustomOpConfig,
    register_custom_op_autotuning,
)


fc = torch.ops._c10d_functional


def own_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The op's own implementation: a copy, summed in place by NCCL (or gloo)."""
    out = x.clone()
    dist.all_reduce(
        out, group=torch._C._distributed_c10d._resolve_process_group(group_name)
    )
    return out


@torch.library.custom_op("tp_demo::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return own_all_reduce(x, group_name)


@all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def one_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return fc.wait_tensor(fc.all_reduce(x, "sum", group_name))


def reduce_scatter_all_gather(x: torch.Tensor, group_name: str) -> torch.Tensor:
    size = torch._C._distributed_c10d._resolve_process_group(group_name).size()
    shard = fc.wait_tensor(
        fc.reduce_scatter_tensor(x.reshape(-1), "sum", size, group_name)
    )
    return fc.wait_tensor(fc.all_gather_into_tensor(shard, size, group_name)).view_as(x)


def chunked_all_reduce(
    x: torch.Tensor, group_name: str, chunks: int = 4
) -> torch.Tensor:
    return torch.cat(
        [fc.wait_tensor(fc.all_reduce(c, "sum", group_name)) for c in x.chunk(chunks)]
    )


# The symmetric-memory kernels need their input in symmetric memory of the group.
# Like production custom all-reduces (vLLM, TensorRT-LLM), these opaque ops own such
# a buffer and copy the input in; Inductor recognises them as collectives by name.
# One buffer per dtype, device and group, grown (doubling) when a larger message
# comes: a rendezvous is collective and costs ~50 ms, too much to pay per message
# size. Every rank sees the same sizes in the same order, so all grow together.
# Outgrown buffers stay alive: CUDA graphs captured before still point into them.
_symm_buffers: dict[tuple, list[torch.Tensor]] = {}


def _symm_buffer(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """A view like ``x`` of the group's symmetric buffer for ``x``'s dtype and device."""
    buffers = _symm_buffers.setdefault((x.dtype, x.device, group_name), [])
    if not buffers or buffers[-1].numel() < x.numel():
        capacity = max(x.numel(), 2 * buffers[-1].numel() if buffers else 0)
        # A buffer is made when a compiled graph first runs a larger message, which under
        # CUDA graphs is a graph's warm-up: there CUDA-graph trees send every allocation
        # of the calling thread to the graphs' memory pool. The rendezvous allocates its
        # peer tables from the caching allocator and keeps them, so in the pool they
        # would be live blocks no graph made, and the next graph's warm-up would fail
        # ("tensor(s) in the cudagraph pool not tracked as outputs"). A thread of its own
        # allocates from the device's own pool.
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            buffers.append(
                thread.submit(
                    _new_symm_buffer, capacity, x.dtype, x.device, group_name
                ).result()
            )
    return buffers[-1][: x.numel()].view_as(x)


def _new_symm_buffer(
    numel: int, dtype: torch.dtype, device: torch.device, group_name: str
) -> torch.Tensor:
    from torch.distributed import _symmetric_memory as symm_mem

    torch.cuda.set_device(device)
    buf = symm_mem.empty(numel, dtype=dtype, device=device)
    symm_mem.rendezvous(buf, group_name)
    return buf


@torch.library.custom_op("tp_demo::symm_mem_one_shot_all_reduce", mutates_args=())
def symm_mem_one_shot_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    buf = _symm_buffer(x, group_name)
    buf.copy_(x)
    return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)


@torch.library.custom_op("tp_demo::symm_mem_two_shot_all_reduce", mutates_args=())
def symm_mem_two_shot_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    buf = _symm_buffer(x, group_name)
    buf.copy_(x)
    torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name)
    return buf.clone()  # the buffer is reused by the next call


@symm_mem_one_shot_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


@symm_mem_two_shot_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def symm_mem_one_shot(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return symm_mem_one_shot_all_reduce(x, group_name)


def symm_mem_two_shot(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return symm_mem_two_shot_all_reduce(x, group_name)


IMPLEMENTATIONS = {
    "one_all_reduce": CustomOpConfig(one_all_reduce),
    "reduce_scatter_all_gather": CustomOpConfig(reduce_scatter_all_gather),
    "chunked_all_reduce": CustomOpConfig(chunked_all_reduce, chunks=4),
    "symm_mem_one_shot": CustomOpConfig(symm_mem_one_shot),
    "symm_mem_two_shot": CustomOpConfig(symm_mem_two_shot),
}
CPU_IMPLEMENTATIONS = (
    "one_all_reduce",
    "reduce_scatter_all_gather",
    "chunked_all_reduce",
)


# -- a hand-set threshold table, as serving engines pick their all-reduce ----------------

KiB, MiB = 1 << 10, 1 << 20
# vLLM's limits in bytes, per compute capability and world size, as of vllm-project/vllm
# commit 00d618a, vllm/distributed/device_communicators/all_reduce_utils.py (SGLang copies
# them into python/sglang/srt/distributed/device_communicators/all_reduce_utils.py): its
# custom all-reduce runs below CUSTOM_ALL_REDUCE_MAX_SIZES, torch symmetric memory up to
# SYMM_MEM_ALL_REDUCE_MAX_SIZES, NCCL above.
CUSTOM_ALL_REDUCE_MAX_SIZES: dict[str, dict[int, int]] = {
    "9.0": {2: 64 * MiB, 4: 32 * MiB, 6: 512 * KiB, 8: 256 * KiB},
    "10.0": {2: 2 * MiB, 4: 2 * MiB, 6: 1 * MiB, 8: 1 * MiB},
    "10.3": {2: 4 * MiB, 4: 4 * MiB, 6: 8 * MiB, 8: 4 * MiB},
}
SYMM_MEM_ALL_REDUCE_MAX_SIZES: dict[str, dict[int, int]] = {
    "9.0": {2: 64 * MiB, 4: 32 * MiB, 6: 64 * MiB, 8: 64 * MiB},
    "10.0": {2: 8 * MiB, 4: 32 * MiB, 6: 128 * MiB, 8: 128 * MiB},
    "10.3": {2: 4 * MiB, 4: 32 * MiB, 6: 32 * MiB, 8: 64 * MiB},
}
# vLLM's custom all-reduce (custom_all_reduce.py) allocates an 8 MiB buffer, which the
# table above only lowers, and takes 2, 4, 6 or 8 ranks (NVLink-connected beyond 2).
CUSTOM_ALL_REDUCE_BUFFER = 8 * MiB
CUSTOM_ALL_REDUCE_WORLD_SIZES = (2, 4, 6, 8)
# The op's own implementation (clone + dist.all_reduce: NCCL on GPUs), named as the
# benchmarks name it.
OWN = "default"


@dataclasses.dataclass(frozen=True)
class TableLimits:
    """Where vLLM's dispatch changes implementation, for one world size and device, in
    bytes: one-shot below ``one_shot_below``, two-shot below ``two_shot_below`` (its custom
    all-reduce's second stage) and up to ``symm_mem_up_to`` (torch symmetric memory), the
    op's own NCCL above. Zeros: NCCL at every size."""

    one_shot_below: int
    two_shot_below: int
    symm_mem_up_to: int

    def pick(self, nbytes: int) -> str:
        """The implementation for an all-reduce of ``nbytes``."""
        if nbytes < self.one_shot_below:
            return "symm_mem_one_shot"
        if nbytes < self.two_shot_below or nbytes <= self.symm_mem_up_to:
            return "symm_mem_two_shot"
        return OWN


def table_limits(world_size: int, capability: str | None) -> TableLimits:
    """vLLM's limits for ``world_size`` GPUs of compute ``capability`` ("9.0"; None: no
    GPU), with symmetric memory on (VLLM_ALLREDUCE_USE_SYMM_MEM, its default).

    Where the table lists no limit vLLM falls back as here: its custom all-reduce keeps
    its buffer's size (any other capability of 2, 4, 6 or 8 ranks) and symmetric memory
    is off; NCCL alone on one rank, other rank counts and CPUs. vLLM's symmetric-memory
    path takes bf16 only (the serving model's dtype on GPUs) and needs NVLink multicast,
    which the machines here keep off; on 4, 6 or 8 ranks of 9.0 (6 or 8 of 10.x) it runs
    the multimem kernel. The limits are kept as written, two-shot running up to them.
    """
    if capability is None or world_size not in CUSTOM_ALL_REDUCE_WORLD_SIZES:
        return TableLimits(0, 0, 0)
    listed = CUSTOM_ALL_REDUCE_MAX_SIZES.get(capability, {})
    custom_below = min(
        listed.get(world_size, CUSTOM_ALL_REDUCE_BUFFER), CUSTOM_ALL_REDUCE_BUFFER
    )
    # Its kernel (csrc/custom_all_reduce.cuh) is one-shot (one stage: each rank reads every
    # peer's buffer) on 2 ranks, on up to 4 below 512 KiB and on up to 8 below 256 KiB;
    # two-shot (reduce-scatter, then all-gather) above. vLLM's custom all-reduce is thus
    # played here by torch's symmetric-memory one-shot and two-shot kernels.
    if world_size == 2:
        one_stage_below = custom_below
    else:
        one_stage_below = 512 * KiB if world_size <= 4 else 256 * KiB
    return TableLimits(
        one_shot_below=min(one_stage_below, custom_below),
        two_shot_below=custom_below,
        symm_mem_up_to=SYMM_MEM_ALL_REDUCE_MAX_SIZES.get(capability, {}).get(
            world_size, 0
        ),
    )


def device_capability(device: torch.device) -> str | None:
    """``device``'s compute capability as vLLM's table keys it ("9.0"); None off CUDA."""
    if device.type != "cuda":
        return None
    return "{}.{}".format(*torch.cuda.get_device_capability(device))


TABLE_IMPLEMENTATIONS: dict[str, Callable[[torch.Tensor, str], torch.Tensor]] = {
    "symm_mem_one_shot": symm_mem_one_shot,
    "symm_mem_two_shot": symm_mem_two_shot,
    OWN: all_reduce,
}


@torch.library.custom_op("tp_demo::table_all_reduce", mutates_args=())
def table_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``x`` summed over the group by the implementation the table picks for its size,
    at every call (under CUDA graphs: when the graph is recorded, as in vLLM)."""
    world_size = torch._C._distributed_c10d._resolve_process_group(group_name).size()
    limits = table_limits(world_size, device_capability(x.device))
    return TABLE_IMPLEMENTATIONS[limits.pick(x.numel() * x.element_size())](
        x, group_name
    )


@table_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def register(names: tuple[str, ...]) -> None:
    """Register the named implementations of tp_demo::all_reduce for autotuning."""
    register_custom_op_autotuning(
        all_reduce, configs=[IMPLEMENTATIONS[n] for n in names]
    )
