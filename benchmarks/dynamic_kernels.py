"""What a dynamic compile costs by itself, with no collective and no tuner.

The serving model's layers ``x = x + all_reduce(relu(x @ w))`` with the all-reduce
replaced by an opaque copy (a custom op Inductor cannot fuse into, as the op's own
implementation and the symmetric-memory kernels are), compiled once with a dynamic token
dimension (compiled at 100 tokens) and once per size (static). The device time of every
kernel per step (torch.profiler, 10 steps) at each size shows how much of a dynamic
model's loss against static compiles is Inductor's own: its kernels for a symbolic size.
One GPU, no process group:

    python3 benchmarks/dynamic_kernels.py --out benchmarks/results/dynamic_kernels_h200x1.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile


HIDDEN = 4096
LAYERS = 2
COMPILE_TOKENS = 100
TOKENS = (512, 4096, 16384)
STEPS = 10


@torch.library.custom_op("dynamic_kernels::opaque_copy", mutates_args=())
def opaque_copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@opaque_copy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def make_model(weights: list[torch.Tensor]):
    def model(x: torch.Tensor) -> torch.Tensor:
        for w in weights:
            x = x + opaque_copy(torch.relu(x @ w))
        return x

    return model


def kernel_us(fn, x: torch.Tensor) -> dict[str, float]:
    """Device µs per step of each kernel of ``fn(x)``."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            fn(x)
        torch.cuda.synchronize()
    return {
        e.key: round(e.device_time_total / STEPS, 1)
        for e in prof.key_averages() if e.device_time_total > 0
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5).cuda().bfloat16() for _ in range(LAYERS)]
    rows = []
    for dynamic in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(make_model(weights), dynamic=None if dynamic else False)
        if dynamic:
            first = torch.randn(COMPILE_TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
            torch._dynamo.mark_dynamic(first, 0)
            compiled(first)
        for tokens in TOKENS:
            kernels = kernel_us(compiled, torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16))
            rows.append({
                "compile": "dynamic" if dynamic else "static", "tokens": tokens,
                "step_device_us": round(sum(kernels.values()), 1), "kernels_us": kernels,
            })
    by = {(r["compile"], r["tokens"]): r["step_device_us"] for r in rows}
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "hidden": HIDDEN,
        "layers": LAYERS, "compile_tokens": COMPILE_TOKENS, "rows": rows,
        "dynamic_loss_pct": {
            t: round((by["dynamic", t] / by["static", t] - 1) * 100, 1) for t in TOKENS
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["dynamic_loss_pct"]))
    for r in rows:
        top = sorted(r["kernels_us"].items(), key=lambda kv: -kv[1])[:5]
        print(r["compile"], r["tokens"], r["step_device_us"], top)


if __name__ == "__main__":
    main()
