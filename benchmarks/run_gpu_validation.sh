#!/usr/bin/env bash
# Everything the GPU validation needs, on a machine whose python3 has torch 2.11/2.13:
#   bash benchmarks/run_gpu_validation.sh NPROC OUTDIR [all | comma-list of demo,sweep,overhead,compile,compile-graphs,dynamic,serving,serving-eager,kernels,torchrun,spawn]
#   (SERVING_ARGS="--no-producer" SERVING_TAG=_noproducer ... serving: the model without a producer)
# (NPROC=2 on a 4-GPU machine: run it with CUDA_VISIBLE_DEVICES=0,1)
# Logs and JSON land in OUTDIR. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are left as the machine sets them).
set -uo pipefail
N=$1; OUT=$2; WHAT=${3:-all}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 tools/overlay.py --python python3 apply
python3 tools/overlay.py --python python3 status > "$OUT/overlay_status.txt"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
env | grep -E "NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS" > "$OUT/env.txt"

has() { [[ ",$WHAT," == *",$1,"* || $WHAT == all ]]; }
if has demo; then
  timeout 120 torchrun --nproc_per_node="$N" examples/tp_allreduce/demo.py --device cuda --tokens 16,4096 > "$OUT/demo_n$N.log" 2>&1; echo "demo rc=$?"
  # tensor-parallel subgroups inside the world, tuning concurrently (N/2 groups of 2, 2 of N/2)
  if (( N >= 4 )); then
    for TP in $(printf "%s\n" 2 $((N / 2)) | sort -un); do
      timeout 100 torchrun --nproc_per_node="$N" examples/tp_allreduce/demo.py --device cuda --tokens 16,4096 --tp-size "$TP" > "$OUT/demo_n${N}_tp$TP.log" 2>&1; echo "demo tp=$TP rc=$?"
    done
  fi
fi
if has sweep; then
  # Everything through torch.compile: JSON, plot (.png beside it) and goal report.
  timeout 330 torchrun --nproc_per_node="$N" benchmarks/allreduce_sweep.py run --out "$OUT/allreduce_h200x$N.json" > "$OUT/sweep_n$N.log" 2>&1; echo "sweep rc=$?"
fi
if has overhead; then
  # Cold and warm compiles of a 32-layer TP model, the op tuned and untuned (five jobs).
  timeout 420 python3 benchmarks/compile_overhead.py all --nproc "$N" --device cuda --out "$OUT/compile_overhead_h200x$N.json" > "$OUT/overhead_n$N.log" 2>&1; echo "overhead rc=$?"
fi
# What tuning adds to the serving model's cold start (dynamic, 8 layers) in one mode: four rounds of the
# four jobs, the median of each round's tuned minus untuned job (about 440 s: a call per mode).
compile_jobs() {
  local mode=$1 tag="compile_jobs_h200x${N}_$1"
  timeout 560 python3 benchmarks/compile_overhead.py all --nproc "$N" --device cuda --layers 8 --hidden 4096 --tokens 100 --dynamic --rounds 4 --mode "$mode" --out "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1; echo "compile $mode rc=$?"
}
if has compile; then compile_jobs default; fi
if has compile-graphs; then compile_jobs reduce-overhead; fi
if has dynamic; then
  # One compile with a dynamic token dimension, run at 1 .. 16384 tokens.
  timeout 330 torchrun --nproc_per_node="$N" benchmarks/dynamic_sweep.py --out "$OUT/dynamic_h200x$N.json" > "$OUT/dynamic_n$N.log" 2>&1; echo "dynamic rc=$?"
fi
# An 8-layer model's step time at 1 .. 16384 tokens: one dynamic compile, static compiles, each implementation
# alone, one mode per item (each 250-350 s on 2 H200s with the settled sampling order: a call each), with the
# GPU's clocks beside it (a power-capped GPU clocks a sample by what ran before). SERVING_ARGS adds flags
# (--no-producer, --kernels, --pointwise-autotune off).
serving_mode() {
  local mode=$1 tag="serving_h200x${N}_$1${SERVING_TAG:-}"
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader -lms 100 > "$OUT/${tag}_smi.csv" 2>&1 &
  local smi=$!
  timeout 560 torchrun --nproc_per_node="$N" benchmarks/serving_step.py --modes "$mode" ${SERVING_ARGS:-} --out "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1; echo "serving $mode rc=$?"
  kill "$smi"
}
if has serving; then serving_mode graph; fi
if has serving-eager; then serving_mode eager; fi
if has kernels; then
  # Inductor's own kernels for a dynamic token dimension against static ones (one GPU, no collective).
  timeout 120 python3 benchmarks/dynamic_kernels.py --out "$OUT/dynamic_kernels_h200x1.json" > "$OUT/kernels.log" 2>&1; echo "kernels rc=$?"
fi
if has torchrun; then
  timeout 210 torchrun --nproc_per_node="$N" -m pytest test -q -k cuda > "$OUT/pytest_torchrun_n$N.log" 2>&1; echo "torchrun pytest rc=$?"
fi
if has spawn; then
  # about 520 s on 4 H200s (the fault tests wait out their timeouts): a call of its own
  timeout 570 python3 -m pytest test -q -k cuda --durations=8 > "$OUT/pytest_spawn_n$N.log" 2>&1; echo "spawn pytest rc=$?"
fi
tail -n 3 "$OUT"/*.log
