"""A tensor-parallel all-reduce custom op with several equivalent implementations.

``tp_demo::all_reduce(x, group_name)`` sums ``x`` over the ranks of a process group.
Its implementations cost genuinely different amounts: one all-reduce; a
reduce-scatter followed by an all-gather; the same all-reduce cut into chunks; and,
on CUDA, the symmetric-memory one-shot and two-shot kernels (as opaque ops that own
their symmetric buffers, the way production custom all-reduces integrate).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._inductor.kernel.custom_op import CustomOpConfig, register_custom_op_autotuning


fc = torch.ops._c10d_functional


@torch.library.custom_op("tp_demo::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=torch._C._distributed_c10d._resolve_process_group(group_name))
    return out


@all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def one_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return fc.wait_tensor(fc.all_reduce(x, "sum", group_name))


def reduce_scatter_all_gather(x: torch.Tensor, group_name: str) -> torch.Tensor:
    size = torch._C._distributed_c10d._resolve_process_group(group_name).size()
    shard = fc.wait_tensor(fc.reduce_scatter_tensor(x.reshape(-1), "sum", size, group_name))
    return fc.wait_tensor(fc.all_gather_into_tensor(shard, size, group_name)).view_as(x)


def chunked_all_reduce(x: torch.Tensor, group_name: str, chunks: int = 4) -> torch.Tensor:
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
    from torch.distributed import _symmetric_memory as symm_mem

    buffers = _symm_buffers.setdefault((x.dtype, x.device, group_name), [])
    if not buffers or buffers[-1].numel() < x.numel():
        capacity = max(x.numel(), 2 * buffers[-1].numel() if buffers else 0)
        buf = symm_mem.empty(capacity, dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(buf, group_name)
        buffers.append(buf)
    return buffers[-1][: x.numel()].view_as(x)


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
CPU_IMPLEMENTATIONS = ("one_all_reduce", "reduce_scatter_all_gather", "chunked_all_reduce")


def register(names: tuple[str, ...]) -> None:
    """Register the named implementations of tp_demo::all_reduce for autotuning."""
    register_custom_op_autotuning(all_reduce, configs=[IMPLEMENTATIONS[n] for n in names])
