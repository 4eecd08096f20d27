"""Picks and their confidence on GPUs, on a quiet host and beside busy processes.

    python benchmarks/picks_under_load_gpu.py --nproc 4 --hogs 0,16 --out results.json

For each number of busy processes (``while True: pass``, started before the job and
killed after it) and each mode (``graph``: ``mode="reduce-overhead"``, timed in CUDA
graphs; ``eager``: the default mode, host-launched calls), one torchrun job compiles
examples/tp_allreduce's TP block (its all-reduce tuned over NCCL, symmetric-memory
one-shot and two-shot and the op's own) at each token count, from fresh state, and
records every decision's winner, timings and confidence (lead over the runner-up, spread,
host contention, settled or provisional). Host load shows mostly in eager mode, where the
host paces the samples; graph replays are enqueued behind a GPU sleep.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]


def job(args: argparse.Namespace) -> None:
    """One rank of one torchrun job."""
    sys.path.insert(0, str(REPO))
    os.environ.update(
        TORCHINDUCTOR_COLLECTIVE_AUTOTUNE_PERSIST="0",
        TORCHINDUCTOR_FX_GRAPH_CACHE="0",
        TORCHINDUCTOR_AUTOGRAD_CACHE="0",
    )
    import torch
    import torch.distributed as dist

    from examples.tp_allreduce import ops
    from examples.tp_allreduce.demo import TPBlock
    from torch._inductor.kernel.collective.api import collective_autotune_records

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl")
    ops.register(tuple(ops.IMPLEMENTATIONS))
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        torch._dynamo.reset()
        model = TPBlock(args.hidden, 4 * args.hidden, dist.group.WORLD, device)
        model = model.to(torch.bfloat16).requires_grad_(False)
        compiled = torch.compile(
            model,
            fullgraph=True,
            dynamic=False,
            mode="reduce-overhead" if args.mode == "graph" else None,
        )
        x = torch.randn(tokens, args.hidden, device=device, dtype=torch.bfloat16)
        for _ in range(3):
            compiled(x)
        torch.cuda.synchronize()
        record = collective_autotune_records()[-1]
        rows.append(
            {
                "tokens": tokens,
                "bytes": tokens * args.hidden * 2,
                "winner": record.winner,
                "mode": record.mode,
                "provisional": record.provisional,
                "confidence": dataclasses.asdict(record.confidence)
                if record.confidence
                else None,
                "timings_us": {
                    t.name: [t.low_us, t.max_us, t.high_us]
                    for t in record.timings
                    if t.status == "ok"
                },
            }
        )
    if dist.get_rank() == 0:
        pathlib.Path(args.part).write_text(json.dumps(rows))
    dist.barrier()
    # destroy_process_group hangs on 4 GPUs after NCCL was captured in CUDA graphs, with
    # or without tuning (upstream's; README): leave without it.
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hogs", default="0,16")
    parser.add_argument("--modes", default="graph,eager")
    parser.add_argument("--tokens", default="16,256,4096")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--out", required=True)
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="graph", help=argparse.SUPPRESS)
    parser.add_argument("--part", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args)
        return
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        cwd=REPO,
    ).stdout.strip()
    results: dict = {
        "commit": commit,
        "nproc": args.nproc,
        "cpus": os.cpu_count(),
        "runs": [],
    }
    for hogs in (int(h) for h in args.hogs.split(",")):
        for mode in args.modes.split(","):
            part = tempfile.mktemp(suffix=".json")
            procs = [
                subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(hogs)
            ]
            try:
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        f"--nproc_per_node={args.nproc}",
                        __file__,
                        "--job",
                        "--mode",
                        mode,
                        "--part",
                        part,
                        "--tokens",
                        args.tokens,
                        "--hidden",
                        str(args.hidden),
                        "--out",
                        args.out,
                    ],
                    check=True,
                    env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp()},
                )
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
            rows = json.loads(pathlib.Path(part).read_text())
            results["runs"].append({"hogs": hogs, "mode": mode, "decisions": rows})
            for row in rows:
                c = row["confidence"] or {}
                print(
                    f"hogs {hogs:>2} {mode:>5} {row['tokens']:>6} tokens: {row['winner']:<24} "
                    f"{'provisional' if row['provisional'] else 'settled':<11} lead {c.get('lead', 0):+.3f} "
                    f"spread {c.get('spread', 0):.3f} contention {c.get('contention', 0):.2f}",
                    flush=True,
                )
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
