#!/usr/bin/env bash
# bench/gpu_session.sh: everything a session with a lent GPU (one H100 80GB or H200; 15 minutes of device
# time per task, all calls, starts and idle waits together; at most 10 minutes per command) runs. The GPU
# machine's python3 (3.12) has torch 2.11 (CUDA 13.0), transformers 5.17, lightning, peft, pillow, pyyaml;
# bigtune runs from src/ through PYTHONPATH (no `pip install -e .`: nothing in bigtune reads its own package
# metadata; checked by running `python -S -m bigtune` with only PYTHONPATH=src). Models are random-init real
# architectures from the bundled configs, with bigtune's own tokenizer: no download, no hub.
#
# Optional libraries: the machine has no bitsandbytes, torchao or deepspeed. Cases that need one say so
# (`needs` in bench/plan_accuracy.py) and are written as "skipped: <library> not installed" without it:
#   bitsandbytes 0.50.2 (43 MB wheel, has libbitsandbytes_cuda130): llama3.1-8b-nf4-bnb-qlora-b4,
#     tinyllama-bf16true-adamw8bit-b4
#   torchao 0.18.0 (3.4 MB wheel; built for torch >= 2.11): llama3.2-3b-nf4-torchao-qdora-b4
#   deepspeed: no case (the CPU-offload case uses optim.name=cpu_offload_adamw, torch's CPU Adam)
# To carry them, once here (.whl/ is git-ignored; with the ~5 MB tree it stays under the 64 MiB limit):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl bitsandbytes==0.50.2 torchao==0.18.0
# and give every run carry=[".whl"]: each mode installs .whl/*.whl into /tmp/site first (no network needed).
#
# With the device tool (`run`), from the repository root, in this order:
#
#   1. run(command="bash bench/gpu_session.sh accuracy", carry=[".whl"], timeout_s=600)
#        planner vs measurement, most informative cases first, until its budget (BUDGET_S, default 500 s)
#        is spent; then copy the returned plan_accuracy-<gpu>.json into bench/results/ here (it then travels
#        with the working tree to the next call).
#   2. if device time is left (status: budget_left_s; a call to the warm machine starts at once, a fresh one
#      costs a minute or two): run(command="BUDGET_S=<seconds> bash bench/gpu_session.sh accuracy
#      bench/results/plan_accuracy-<gpu>.json", carry=[".whl"], timeout_s=<BUDGET_S + 60>) with BUDGET_S
#      about 90 s under what is left (at most 500): the cases the file has not finished, skipped ones included.
#   3. a later session (or one with time left after 2): run(command="bash bench/gpu_session.sh throughput
#      bench/results/plan_accuracy-<gpu>.json", timeout_s=600): bigtune vs HF Trainer on the two GPU presets
#      (TinyLlama full bf16, Llama-2-7B LoRA), then, with the time left in this call, more accuracy cases.
# One session measures about 6-8 cases; the matrix (34 cases) takes several, each resuming the last file.
#
# Every call writes at most 7 files to $OUT (names of letters, digits, '.', '-', '_'): env.txt, <mode>.log,
# cases.log (every case's own output), host_overhead-cuda.json (accuracy: the host's time per operator on
# this machine, the planner's HOST_SECONDS_PER_OP), plan_accuracy-<gpu>.json, throughput-tinyllama.json,
# throughput-llama7b-lora.json. JSONs are rewritten after every case, so a command killed at its time limit
# keeps what finished. Commit the JSONs under bench/results/.
#
# Modes: env | accuracy [RESUME_JSON] | throughput [RESUME_JSON] | check (CPU pre-flight: plans every GPU
# case and builds both throughput presets without training; run it here before renting anything).
# Environment: BUDGET_S (seconds for the whole command's work, default 500 for accuracy, 540 for
# throughput), PYTHON (default python3), OUT (default ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-}
RESUME=${2:-}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
START=$SECONDS
# carried wheels (see above): installed without network into /tmp/site, ahead of the machine's packages
if [ "$MODE" != check ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" \
    || echo "warning: installing .whl/*.whl failed; the cases that need them are skipped"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

env_report() {
  echo "== $(date -u +%FT%TZ) bench/gpu_session.sh $MODE; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1 | head -20; else echo "nvidia-smi: not found"; fi
  "$PY" - <<'EOF' 2>&1
import importlib, platform, sys, time
print("python", platform.python_version(), sys.executable)
for mod in ("torch", "transformers", "lightning", "peft", "accelerate", "tokenizers", "safetensors", "PIL", "yaml",
            "datasets", "torchmetrics", "bitsandbytes", "torchao", "deepspeed"):
    try:
        m = importlib.import_module(mod)
        print(f"  {mod:<13} {getattr(m, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001
        print(f"  {mod:<13} MISSING ({type(e).__name__})")
import torch
print("cuda available", torch.cuda.is_available(), "torch cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    print(f"device {p.name}: {p.total_memory / 2**30:.2f} GiB, {p.multi_processor_count} SMs; in use before "
          f"anything {(total - free) / 2**30:.2f} GiB")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    print(f"bf16 8192^3 matmul: {10 * 2 * 8192**3 / (time.perf_counter() - t0) / 1e12:.0f} TFLOP/s")
import bigtune
from bigtune.core.gpus import detect_gpu
print("bigtune", bigtune.__version__, "from", bigtune.__file__)
if torch.cuda.is_available():
    g = detect_gpu(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)
    print("catalog GPU:", g.key if g else "NOT IN CATALOG (plans fall back to a custom GPU of this memory)")
EOF
}

left() { echo $(( BUDGET - (SECONDS - START) )); }

accuracy() {  # $1: seconds for the cases
  local resume=()
  [ -n "$RESUME" ] && resume=(--resume "$RESUME")
  echo "== accuracy: budget $1 s ${RESUME:+(resume $RESUME)}"
  # the outer limit is a guard only: the bench keeps to its budget and kills its own late cases
  timeout -k 10 $(( $1 + 45 )) "$PY" bench/plan_accuracy.py --budget-s "$1" --out "$OUT" \
    --case-log "$OUT/cases.log" ${resume[@]+"${resume[@]}"}
}

throughput() {  # $1: config, $2: output name, $3: time limit (s)
  echo "== throughput $1: limit $3 s"
  timeout -k 10 "$3" "$PY" bench/throughput.py --config "$1" --json "$OUT/$2"
  echo "== throughput $1: exit $? after $(( SECONDS - START )) s in this command"
}

case "$MODE" in
  env)
    env_report | tee "$OUT/env.txt" ;;
  accuracy)
    BUDGET=${BUDGET_S:-500}
    env_report > "$OUT/env.txt"
    cat "$OUT/env.txt"
    {
      echo "== host time per operator (bench/host_overhead.py --accelerator cuda)"
      timeout -k 5 90 "$PY" bench/host_overhead.py --accelerator cuda --steps 30 --repeats 3 \
        --out "$OUT/host_overhead-cuda.json" || echo "host_overhead: exit $?"
      accuracy "$(left)"
    } 2>&1 | tee "$OUT/accuracy.log" ;;
  throughput)
    BUDGET=${BUDGET_S:-540}
    env_report > "$OUT/env.txt"
    cat "$OUT/env.txt"
    {
      throughput tinyllama-1.1b-full-bf16 throughput-tinyllama.json 200
      lim=$(left)
      if [ "$lim" -gt 120 ]; then throughput llama-7b-lora throughput-llama7b-lora.json $(( lim < 330 ? lim : 330 ))
      else echo "== throughput llama-7b-lora: skipped, $lim s left"; fi
      lim=$(left)
      if [ -n "$RESUME" ] && [ "$lim" -gt 90 ]; then accuracy $(( lim - 15 ))
      else echo "== no accuracy cases after throughput (${RESUME:-no resume file}, $lim s left)"; fi
    } 2>&1 | tee "$OUT/throughput.log" ;;
  check)
    set -e
    "$PY" bench/plan_accuracy.py --list
    "$PY" bench/plan_accuracy.py --check-plans --gpu "${GPU:-h100-80gb}"
    "$PY" bench/throughput.py --config tinyllama-1.1b-full-bf16 --dry-run
    "$PY" bench/throughput.py --config llama-7b-lora --dry-run
    echo "check ok" ;;
  *)
    awk 'NR > 1 && /^set -uo/ {exit} NR > 1' "$0"
    exit 2 ;;
esac
echo "== done in $(( SECONDS - START )) s; files in $OUT:"
ls -la "$OUT"
