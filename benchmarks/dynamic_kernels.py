"""What a dynamic compile costs by itself, with no collective and no tuner.

The serving model's layers ``x = x + all_reduce(relu(x @ w))`` with the all-reduce
replaced by an opaque copy (a custom op Inductor cannot fuse into, as the op's own
implementation and the symmetric-memory kernels are), compiled once with a dynamic token
dimension (compiled at 100 tokens), once per size (static), and twice more dynamic: with
the token dimension bounded by the model (``torch._check(x.size(0) <= 16384)``: a serving
model knows its largest batch), and compiled at the largest size. The device time of
every kernel per step (torch.profiler, 10 steps) at each size shows how much of a dynamic
model's loss against static compiles is Inductor's own: its kernels for a symbolic size.
Each compile's Triton kernels that index with 64-bit integers are listed (Inductor
indexes in 32 bits only where it can prove that every index fits). One GPU, no process
group:

    python3 benchmarks/dynamic_kernels.py --out benchmarks/results/dynamic_kernels_h200x1.json
"""

from __future__ import annotations

import argparse
import json
import re

import torch
from torch._inductor.utils import run_and_get_code
from torch.profiler import ProfilerActivity, profile

from common import header, write_json  # benchmarks/, the script's own directory


HIDDEN = 4096
LAYERS = 2
COMPILE_TOKENS = 100
TOKENS = (512, 4096, 16384)
STEPS = 10
# The compiles compared: (the model bounds its token dimension, the size the dynamic
# compile is made at; None: static, one compile per size).
COMPILES = {
    "static": (False, None),
    "dynamic": (False, COMPILE_TOKENS),
    "dynamic_bounded": (True, COMPILE_TOKENS),
    # Inductor autotunes a kernel's launch configuration at its first launch, which a
    # dynamic compile makes at the size it is compiled at: here the largest.
    "dynamic_at_largest": (False, max(TOKENS)),
}


@torch.library.custom_op("dynamic_kernels::opaque_copy", mutates_args=())
def opaque_copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@opaque_copy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def make_model(weights: list[torch.Tensor], bounded: bool):
    def model(x: torch.Tensor) -> torch.Tensor:
        if bounded:
            torch._check(x.size(0) <= max(TOKENS))
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
        for e in prof.key_averages()
        if e.device_time_total > 0
    }


def int64_kernels(codes: list[str]) -> list[str]:
    """The names of the Triton kernels in the generated ``codes`` that index in 64 bits."""
    # Each kernel's source is a string from its @triton.jit to the closing quotes.
    sources = [
        k.split("'''", 1)[0] for code in codes for k in code.split("@triton.jit")[1:]
    ]
    return sorted(
        {re.search(r"def (\w+)\(", k).group(1) for k in sources if "tl.int64" in k}
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # Each compile picks its kernels' launch configurations at their own first launch:
    # Inductor's local autotune cache would give every compile of a kernel's source the
    # configuration the first compile picked.
    torch._inductor.config.autotune_local_cache = False
    gen = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5).cuda().bfloat16()
        for _ in range(LAYERS)
    ]
    rows = []
    wide: dict[str, list[str]] = {}
    for compile_, (bounded, compile_tokens) in COMPILES.items():
        torch._dynamo.reset()
        dynamic = compile_tokens is not None
        compiled = torch.compile(
            make_model(weights, bounded), dynamic=None if dynamic else False
        )
        codes = []
        for tokens in (compile_tokens,) if dynamic else TOKENS:
            first = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
            if dynamic:
                torch._dynamo.maybe_mark_dynamic(first, 0)
            codes += run_and_get_code(compiled, first)[1]
        wide[compile_] = int64_kernels(codes)
        for tokens in TOKENS:
            kernels = kernel_us(
                compiled,
                torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16),
            )
            rows.append(
                {
                    "compile": compile_,
                    "tokens": tokens,
                    "step_device_us": round(sum(kernels.values()), 1),
                    "kernels_us": kernels,
                }
            )
    by = {(r["compile"], r["tokens"]): r["step_device_us"] for r in rows}
    result = {
        **header(torch.device("cuda", torch.cuda.current_device())),
        "hidden": HIDDEN,
        "layers": LAYERS,
        "compile_tokens": COMPILE_TOKENS,
        "rows": rows,
        "int64_kernels": wide,
        "dynamic_loss_pct": {
            compile_: {
                t: round((by[compile_, t] / by["static", t] - 1) * 100, 1)
                for t in TOKENS
            }
            for compile_ in COMPILES
            if compile_ != "static"
        },
    }
    write_json(args.out, result)
    print(json.dumps(result["dynamic_loss_pct"]))
    print("kernels indexing in 64 bits:", json.dumps(wide))
    for r in rows:
        top = sorted(r["kernels_us"].items(), key=lambda kv: -kv[1])[:5]
        print(r["compile"], r["tokens"], r["step_device_us"], top)


if __name__ == "__main__":
    main()
