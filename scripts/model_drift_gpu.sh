#!/usr/bin/env bash
# The model-drift GPU job, one command, run from the repository root on the GPU machine:
#
#   LOWPREC_COMMIT=<git rev-parse --short HEAD, here> bash scripts/model_drift_gpu.sh
#       carry ["runs/kjv"]   (the text: `python -m experiments.train_lm prepare-data --out
#                             runs/kjv` here first; the GPU machine has no network)
#
# 1. trains the default model (experiments.train_lm, at most MD_TRAIN_S seconds of training,
#    default 180), writing the checkpoint, loss curve, held-out bits per byte and decay spectrum;
# 2. runs experiments.model_drift --preset gpu on that checkpoint: the Triton emulation, 16
#    policies and the exact arm, 4 held-out segments of 131,072 tokens, CUDA graphs (each of
#    the 17 decodes stops after MD_DRIFT_S seconds, default 300, keeping the positions it
#    reached); MD_NPROC=N (default 1) splits the policies over N GPUs with torchrun;
# 3. draws the Pareto figure from the drift CSV and results/kernel_bench.csv.
#
# Everything lands in $OUT as model_drift_gpu.tar.gz (train/ and drift/, the logs inside) and
# model_drift_gpu.log (its summary). Here, unpack into results/model_drift/:
#   tar xzf model_drift_gpu.tar.gz && cp -r train/* drift/* results/model_drift/
#
#   MD_DRY_RUN=1 bash scripts/model_drift_gpu.sh
#       the same steps on the CPU with tiny sizes (toy model, 3 steps; emulation under Triton's
#       interpreter, 20 tokens, 2 policies): checks the script end to end in a few minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
for knob in MD_TRAIN_S MD_DRIFT_S MD_NPROC; do
  value=${!knob:-0}
  if ! [[ $value =~ ^(0|[1-9][0-9]*)$ ]]; then
    echo "model_drift_gpu.sh: $knob: expected a whole number of seconds, got '$value'" >&2
    exit 2
  fi
done
out=${OUT:-runs/model_drift_gpu_out}
mkdir -p "$out/train" "$out/drift"
export PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS (train_lm asks for it)
py=${PYTHON:-python3}
data=${MD_DATA:-runs/kjv}
log="$out/model_drift_gpu.log"
status=0
record() { if [ "$1" -ne 0 ] && [ "$status" -eq 0 ]; then status=$1; fi; }
{
  echo "== model_drift GPU job: $(date -u +%FT%TZ), ${LOWPREC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null) (device .git, may be stale)}"
  nvidia-smi --query-gpu=name,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$py" -c "import platform, torch; print('python', platform.python_version(), 'torch', torch.__version__)"
} > "$log" 2>&1

if [ "${MD_DRY_RUN:-0}" = 1 ]; then
  train=(--preset toy --steps 3 --device cpu)
  drift=(--backend emulation --device cpu --tokens 20 --segments 1
         --policies every_step:fp16:rn,separate_fp16sr:nvfp4)
  decodes=3  # the exact arm and 2 policies
else
  if [ ! -f "$data/kjv.txt" ]; then
    echo "model_drift_gpu.sh: $data/kjv.txt: expected the text (carry runs/kjv after prepare-data)" | tee -a "$log" >&2
    exit 2
  fi
  train=(--data "$data" --time-limit-s "${MD_TRAIN_S:-180}")
  drift=(--preset gpu --data "$data")
  decodes=17  # the exact arm and 16 policies
fi

start=$(date +%s)
"$py" -m experiments.train_lm "${train[@]}" --out "$out/train" --no-progress \
  > "$out/train/train.log" 2>&1
record $?
echo "train: exit $status, $(( $(date +%s) - start )) s: $(tail -n 2 "$out/train/train.log" | head -n 1)" >> "$log"

if [ -f "$out/train/model/config.json" ]; then
  t0=$(date +%s)
  drift_s=${MD_DRIFT_S:-300}
  nproc=${MD_NPROC:-1}
  if [ "$nproc" -gt 1 ]; then
    launch=("$py" -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m)
  else
    launch=("$py" -m)
  fi
  # each decode has its own limit; a rank decodes the exact arm and its share of the policies
  timeout $(( drift_s * decodes + 120 )) "${launch[@]}" experiments.model_drift "${drift[@]}" \
    --model "$out/train/model" --out "$out/drift/model_drift_gpu.csv" --time-limit-s "$drift_s" \
    > "$out/drift/model_drift.log" 2>&1
  rc=$?
  record $rc
  { echo "drift: exit $rc, $(( $(date +%s) - t0 )) s"; cat "$out/drift/model_drift.log"; } >> "$log"
  if [ -f "$out/drift/model_drift_gpu.csv" ]; then
    "$py" -m experiments.model_drift --pareto --drift-csv "$out/drift/model_drift_gpu.csv" \
      --plot "$out/drift/model_drift_pareto.png" >> "$log" 2>&1
    record $?
  fi
fi
echo "total: $(( $(date +%s) - start )) s, status $status" >> "$log"
tar czf "$out/model_drift_gpu.tar.gz" -C "$out" train drift
record $?
exit "$status"
