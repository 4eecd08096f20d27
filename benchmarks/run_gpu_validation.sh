#!/usr/bin/env bash
# Everything the GPU validation needs, on a machine whose python3 has torch 2.11/2.13:
#   bash benchmarks/run_gpu_validation.sh NPROC OUTDIR [all | comma-list of demo,sweep,torchrun,spawn]
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
  V=$(python3 -c "import torch; print(torch.__version__)")
  timeout 330 torchrun --nproc_per_node="$N" benchmarks/allreduce_sweep.py ours --out "$OUT/ours.json" > "$OUT/sweep_ours_n$N.log" 2>&1; echo "ours rc=$?"
  python3 tools/overlay.py --python python3 remove
  timeout 150 torchrun --nproc_per_node="$N" benchmarks/allreduce_sweep.py upstream --out "$OUT/upstream.json" > "$OUT/sweep_upstream_n$N.log" 2>&1; echo "upstream rc=$?"
  python3 tools/overlay.py --python python3 apply
  python3 benchmarks/allreduce_sweep.py merge "$OUT/ours.json" "$OUT/upstream.json" --torch "$V" \
    --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" --out "$OUT/allreduce_h200x$N.json"; echo "merge rc=$?"
fi
if has torchrun; then
  timeout 210 torchrun --nproc_per_node="$N" -m pytest test -q -k cuda > "$OUT/pytest_torchrun_n$N.log" 2>&1; echo "torchrun pytest rc=$?"
fi
if has spawn; then
  timeout 480 python3 -m pytest test -q -k cuda --durations=8 > "$OUT/pytest_spawn_n$N.log" 2>&1; echo "spawn pytest rc=$?"
fi
tail -n 3 "$OUT"/*.log
