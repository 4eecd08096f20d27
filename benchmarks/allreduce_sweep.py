"""bf16 all-reduce on N GPUs: NCCL vs symmetric-memory one-shot vs two-shot.

One rank per GPU, under torchrun:

    torchrun --nproc_per_node=N benchmarks/allreduce_sweep.py ours --out ours.json
    torchrun --nproc_per_node=N benchmarks/allreduce_sweep.py upstream --out upstream.json
    python benchmarks/allreduce_sweep.py merge ours.json upstream.json --out results/allreduce_h200xN.json

``ours`` (overlay applied) measures per size:
  * truth_us: each implementation in a CUDA graph of 50 calls, replayed; per call,
    slowest rank. truth_eager_us: 200 eager back-to-back calls; per call, slowest rank.
  * for mode "graph" and "eager": the CollectiveBenchmarker tuning the three
    implementations 10 times afresh (measured_us: median of its slowest-rank times;
    pick: the most frequent pick; flips: how many of the 10 picks differ from it;
    autotune_ms: median wall time of one tuning), and one torch.compile of the op
    through Inductor (compiled_pick, compiled_autotune_ms) with the same mode.
``upstream`` (overlay removed) compiles the same op through upstream Inductor's
collective benchmarking and records its pick and autotuning wall time.
``merge`` writes the JSON schema of the README and the plot.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
CHOICES = ("nccl", "one_shot", "two_shot")
REPEATS = 10  # tunings per size and mode, for the flip rate
GRAPH_CALLS, GRAPH_REPLAYS, EAGER_CALLS = 50, 20, 200

# -- the op and its three implementations (examples/tp_allreduce/ops.py) -------------

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from examples.tp_allreduce import ops  # noqa: E402

IMPLEMENTATIONS = {"nccl": "one_all_reduce", "one_shot": "symm_mem_one_shot", "two_shot": "symm_mem_two_shot"}
all_reduce = ops.all_reduce


def register() -> None:
    ops.register(tuple(IMPLEMENTATIONS.values()))


def implementation_of(choice_name: str) -> str:
    for short_name, impl in IMPLEMENTATIONS.items():
        if f"_autotuned_{impl}_" in choice_name:
            return short_name
    return "default"  # the op's own (NCCL) implementation


# -- measurement helpers ---------------------------------------------------------------


def slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def barrier() -> None:
    dist.all_reduce(torch.zeros(1, device="cuda"))
    torch.cuda.synchronize()


def graph_us(fn) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(GRAPH_REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return slowest(start.elapsed_time(end) * 1e3 / (GRAPH_REPLAYS * GRAPH_CALLS))


def eager_us(fn) -> float:
    samples = []
    for _ in range(5):
        barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(EAGER_CALLS):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / EAGER_CALLS)
    return slowest(statistics.median(samples))


# -- ours ------------------------------------------------------------------------------


def run_ours(out_path: str, sizes: list[int], repeats: int) -> None:
    from torch._inductor.kernel.collective_autotuning import collective_autotune_records
    from torch._inductor.runtime.collective_benchmarking import (
        BenchmarkSettings,
        Candidate,
        CollectiveBenchmarker,
    )
    from torch._inductor.runtime.collective_protocol import CollectiveSession
    group = dist.group.WORLD
    gname = group.group_name
    register()
    store = dist.distributed_c10d._get_default_store()
    rows = []
    for size in sizes:
        numel = size // 2
        x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
        # The implementations exactly as the compiled model calls them.
        calls = {
            "nccl": lambda: ops.one_all_reduce(x, gname),
            "one_shot": lambda: ops.symm_mem_one_shot_all_reduce(x, gname),
            "two_shot": lambda: ops.symm_mem_two_shot_all_reduce(x, gname),
        }
        truth = {name: graph_us(fn) for name, fn in calls.items()}
        truth_eager = {name: eager_us(fn) for name, fn in calls.items()}
        for mode in ("graph", "eager"):
            picks, measured, tuning_ms = [], collections.defaultdict(list), []
            with torch._inductor.config.patch(collective_benchmark_mode=mode):
                settings = BenchmarkSettings.from_config()
                for rep in range(repeats):
                    session = CollectiveSession(store, gname, f"sweep.{size}.{mode}.{rep}", dist.get_rank(), dist.get_world_size(), settings.timeout)
                    bench = CollectiveBenchmarker(group, torch.device("cuda"), settings, session)
                    start = time.perf_counter()
                    timings = bench.benchmark([Candidate(n, f) for n, f in calls.items()], lambda: None)
                    tuning_ms.append((time.perf_counter() - start) * 1e3)
                    session.close()
                    picks.append(min(timings, key=lambda t: t.max_us).name)
                    for t in timings:
                        measured[t.name].append(t.max_us)
                # Through Inductor: torch.compile of the op tunes it once.
                torch._dynamo.reset()
                start_records = len(collective_autotune_records())
                compiled = torch.compile(lambda t: all_reduce(t, gname), fullgraph=True, dynamic=False)
                y = compiled(x)
                # bf16 sums in another order (ring, one-shot, two-shot): the screen's tolerance
                ref = ops.one_all_reduce(x, gname)
                torch.testing.assert_close(y, ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())
                (record,) = collective_autotune_records()[start_records:]
            pick = collections.Counter(picks).most_common(1)[0][0]
            rows.append(
                {
                    "bytes": size,
                    "mode": mode,
                    "truth_us": truth,
                    "truth_eager_us": truth_eager,
                    "measured_us": {n: statistics.median(v) for n, v in measured.items()},
                    "pick": pick,
                    "picks": picks,
                    "flips": sum(p != pick for p in picks),
                    "autotune_ms": slowest(statistics.median(tuning_ms)),
                    "compiled_pick": implementation_of(record.winner),
                    "compiled_autotune_ms": slowest(record.tuning_s * 1e3),
                    "compiled_measured_us": {implementation_of(t.name): t.max_us for t in record.timings},
                }
            )
            if dist.get_rank() == 0:
                print(json.dumps(rows[-1]), flush=True)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"world_size": dist.get_world_size(), "rows": rows}, f, indent=1)


# -- upstream --------------------------------------------------------------------------


def run_upstream(out_path: str, sizes: list[int], repeats: int) -> None:
    from torch._inductor.kernel import custom_op

    gname = dist.group.WORLD.group_name
    register()
    selected: list = []
    inner = custom_op.autotune_select_algorithm

    def timed_select(*args, **kwargs):  # instrumentation of the benchmark, not of the product
        start = time.perf_counter()
        result = inner(*args, **kwargs)
        selected.append((result[1].name, (time.perf_counter() - start) * 1e3))
        return result

    custom_op.autotune_select_algorithm = timed_select
    rows = []
    for size in sizes:
        x = torch.randn(size // 2, dtype=torch.bfloat16, device="cuda")
        torch._dynamo.reset()
        compiled = torch.compile(lambda t: all_reduce(t, gname), fullgraph=True, dynamic=False)
        try:
            compiled(x)
            name, ms = selected[-1]
            pick = implementation_of(name)
        except Exception as e:  # noqa: BLE001 - upstream's failure is the result
            pick, ms = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}", float("nan")
        rows.append({"bytes": size, "upstream_pick": pick, "upstream_autotune_ms": slowest(ms)})
        if dist.get_rank() == 0:
            print(json.dumps(rows[-1]), flush=True)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


# -- merge and plot --------------------------------------------------------------------


def merge(ours_path: str, upstream_path: str, out_path: str, device: str, torch_version: str) -> None:
    with open(ours_path) as f:
        ours = json.load(f)
    with open(upstream_path) as f:
        upstream = {r["bytes"]: r for r in json.load(f)["rows"]}
    rows = [{**r, **{k: v for k, v in upstream[r["bytes"]].items() if k != "bytes"}} for r in ours["rows"]]
    result = {"device": device, "world_size": ours["world_size"], "torch": torch_version, "rows": rows}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, out_path.replace(".json", ".png"))


def plot(result: dict, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, mode, truth_key in zip(axes, ("graph", "eager"), ("truth_us", "truth_eager_us")):
        rows = [r for r in result["rows"] if r["mode"] == mode]
        sizes = [r["bytes"] for r in rows]
        for name, color in zip(CHOICES, ("tab:blue", "tab:orange", "tab:green")):
            ax.plot(sizes, [r[truth_key][name] for r in rows], "-o", color=color, label=f"{name} (truth)")
            ax.plot(sizes, [r["measured_us"][name] for r in rows], "x", color=color, ms=9, label=f"{name} (measured)")
        for r in rows:
            ax.plot(r["bytes"], r[truth_key][r["pick"]], "s", mfc="none", mec="black", ms=14)
            if r.get("upstream_pick") in CHOICES:
                ax.plot(r["bytes"], r[truth_key][r["upstream_pick"]], "v", color="red", ms=8)
        ax.plot([], [], "s", mfc="none", mec="black", ms=12, label="our pick")
        ax.plot([], [], "v", color="red", ms=8, label="upstream pick (if not its fallback)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_title(f"{mode} mode ({'CUDA graph' if mode == 'graph' else 'eager'} truth)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("µs per all-reduce (slowest rank)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"bf16 all-reduce, {result['world_size']}x {result['device']}, torch {result['torch']}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["ours", "upstream", "merge"])
    parser.add_argument("inputs", nargs="*")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="NVIDIA H200")
    parser.add_argument("--torch", default="")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma-separated")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    args = parser.parse_args()
    if args.what == "merge":
        merge(*args.inputs, args.out, args.device, args.torch)
        return
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    sizes = [int(b) for b in args.sizes.split(",")]
    (run_ours if args.what == "ours" else run_upstream)(args.out, sizes, args.repeats)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
