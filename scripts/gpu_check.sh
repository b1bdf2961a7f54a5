#!/usr/bin/env bash
# The GPU check: on a bare machine with one NVIDIA GPU, install, run the GPU paths, print
# one summary (about 8 minutes). Record what it prints in benchmarks/GPU.md with the date
# and the hardware.
#
#   bash scripts/gpu_check.sh            # OUT=folder keeps the logs and run folders there
#
# Runs: the default task for 10 steps with rollout.engine=hf and =vllm, on 1 worker, and on
# 2 where the machine has 2 GPUs (a worker needs a GPU of its own); the engines benchmark (HF vs vLLM tokens/s, start-up, weight
# sync per 100 MB); a worker SIGKILLed mid-step under NCCL (Ray and torchrun), which must
# be reported within 30 s. Per run: held-out accuracy before/after, tokens/s, mean
# weight-sync seconds and the peak GPU memory torch allocated in a step (metrics perf/gpu_peak_allocated_gb).
# Where the install cannot reach a package registry, it runs instead what needs only the
# machine's own torch and transformers: `distflow bench checkpointing --device cuda` on a
# Qwen2.5-0.5B-shaped model (about 2 minutes), and exits 1.
set -uo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi lists none); nothing was run" >&2
    exit 2
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
OUT=${OUT:-$(mktemp -d /tmp/distflow-gpu-check-XXXX)}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

note "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
note "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
step() {  # step NAME SECONDS COMMAND...: run it, log it, one summary line
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    note "$name: exit $rc in $(( $(date +%s) - t0 )) s$([ $rc -ne 0 ] && echo " -- $(grep -m1 'error' "$OUT/$name.log" | cut -c1-200)")"
}

start=$(date +%s)
if ! pip install -e ".[vllm,test]" > "$OUT/install.log" 2>&1; then  # vLLM's CUDA wheel brings torch 2.14.0
    note "install: FAILED ($OUT/install.log): $(grep -m1 'ERROR' "$OUT/install.log" | cut -c1-200)"
    # a machine with no package registry (the lent H200s): what runs on its own torch and
    # transformers alone, the actor's update on the GPU (docs/TOOLS.md, "Memory per billion parameters")
    note "without the install: $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' 2>&1 | tail -1)"
    step checkpointing-cuda 400 env PYTHONPATH="$PWD" python3 -m distflow.benchmarks.checkpointing --device cuda \
        --model qwen-0.5b-shape --rows 8 --prompt-len 256 --response-len 512 --head-chunk-tokens 1024 \
        --results-md "$OUT/CHECKPOINTING-cuda.md"
    cat "$OUT/CHECKPOINTING-cuda.md" 2>/dev/null | tee -a "$SUMMARY"
    exit 1
fi
note "install: $(( $(date +%s) - start )) s; $(python -c 'import torch, vllm; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "vllm", vllm.__version__)' 2>&1 | tail -1)"

TRAIN=(trainer.total_steps=10 trainer.eval_every=10 trainer.progress=false trainer.save_final=false
       runtime.device=cuda)
step hf-1w 150 distflow train "${TRAIN[@]}" runtime.num_workers=1 trainer.output_dir="$OUT/hf-1w"
step vllm-1w 180 distflow train "${TRAIN[@]}" rollout.engine=vllm rollout.gpu_memory_utilization=0.3 \
    runtime.num_workers=1 trainer.output_dir="$OUT/vllm-1w"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    step hf-2w 150 distflow train "${TRAIN[@]}" runtime.num_workers=2 trainer.output_dir="$OUT/hf-2w"
    step vllm-2w 180 distflow train "${TRAIN[@]}" rollout.engine=vllm rollout.gpu_memory_utilization=0.3 \
        runtime.num_workers=2 trainer.output_dir="$OUT/vllm-2w"
else
    note "hf-2w, vllm-2w: not run (one GPU; runtime.device=cuda gives each worker a GPU of its own)"
fi
step engines 150 distflow bench engines --quick --json "$OUT/engines.jsonl"
step worker-killed 150 python -m pytest -q -p no:cacheprovider tests/trainer/test_failures.py \
    -k "sigkilled_worker_is_named or torchrun_worker_killed"

python - "$OUT" <<'EOF' | tee -a "$SUMMARY"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
for name in ("hf-1w", "hf-2w", "vllm-1w", "vllm-2w"):
    folder = out / name
    if not (folder / "summary.json").exists():
        if (out / f"{name}.log").exists():
            print(f"{name}: no summary (see {out / name}.log)")
        continue
    s = json.loads((folder / "summary.json").read_text())
    steps = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "time/weight_sync" in m]
    sync = sum(m["time/weight_sync"] for m in steps) / max(len(steps), 1)
    peak = max((m.get("perf/gpu_peak_allocated_gb", 0.0) for m in steps), default=0.0)
    print(f"{name}: held-out {s['heldout_accuracy_initial']:.3f} -> {s['heldout_accuracy_final']:.3f}, "
          f"{s['tokens_per_second']:,.0f} tokens/s, weight sync {sync:.3f} s, peak torch GPU memory {peak:.2f} GB")
engines = out / "engines.jsonl"
for line in engines.read_text().splitlines() if engines.exists() else []:
    r = json.loads(line)
    print(f"engines ({r['model']}, batch {r['batch']}): HF {r['hf_tokens_per_s']:,.0f} vs vLLM "
          f"{r['vllm_tokens_per_s']:,.0f} tokens/s; start-up {r['vllm_startup_s']:.1f} s; "
          f"weight sync {r['vllm_sync_s_per_100mb']:.3f} s per 100 MB")
EOF
note "logs and run folders: $OUT"
