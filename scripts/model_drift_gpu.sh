#!/usr/bin/env bash
# The model-drift GPU jobs, one command, run from the repository root on the GPU machine:
#
#   LOWPREC_COMMIT=<git rev-parse --short HEAD, here> bash scripts/model_drift_gpu.sh [PART]
#       carry ["runs/kjv"]   (the text: `python -m experiments.train_lm prepare-data --out
#                             runs/kjv` here first; the GPU machine has no network)
#
# PART is mamba2 (the default), gdn, or all (mamba2, then gdn). Each part:
#
# mamba2  1. trains the default Mamba-2 model (experiments.train_lm, at most MD_TRAIN_S seconds
#            of training, default 180), writing the checkpoint, loss curve, held-out bits per
#            byte and decay spectrum;
#         2. runs experiments.model_drift --preset gpu on that checkpoint: the Triton emulation,
#            16 policies and the exact arm, 4 held-out segments of 131,072 tokens, CUDA graphs
#            (each of the 17 decodes stops after MD_DRIFT_S seconds, default 300, keeping the
#            positions it reached);
#         3. draws the Pareto figure from the drift CSV and results/kernel_bench.csv.
#         Time: at most MD_TRAIN_S + 17 x MD_DRIFT_S (about 90 min at the defaults, one GPU).
# gdn     1. trains the default Gated DeltaNet model (train_lm --arch gdn, at most MD_GDN_TRAIN_S
#            seconds of training, default 150), the same outputs; MD_GDN_MODEL=DIR skips this
#            and takes that checkpoint instead;
#         2. runs experiments.model_drift --preset gdn-gpu on it: 4 policies (conventional bf16,
#            shared fp8 checkpoint, the two-precision scheme with NVFP4 and fp8 read copies) and
#            the exact arm, 4 held-out segments of 131,072 tokens, each of the 5 decodes stopped
#            after MD_GDN_DRIFT_S seconds (default 60; the log and the meta's positions_reached
#            say where a decode stopped).
#         Time: about 8.5 min on one H100 at the defaults (start-up ~15 s, training 150 s and
#         its evaluation ~20 s, 5 decodes of at most 60 s, writing and drawing ~20 s).
# MD_NPROC=N (default 1) splits each part's policies over N GPUs with torchrun.
#
# Everything lands in $OUT: model_drift_gpu.tar.gz (train/ and drift/, the logs inside) and
# model_drift_gpu.log (its summary) for mamba2, model_drift_gdn_gpu.tar.gz (gdn/train/ and
# gdn/drift/) and model_drift_gdn_gpu.log for gdn; the work folders are under MD_WORK (default
# runs/model_drift_gpu_work). Here, unpack into results/model_drift/:
#   tar xzf model_drift_gpu.tar.gz && cp -r train/* drift/* results/model_drift/
#   tar xzf model_drift_gdn_gpu.tar.gz && mkdir -p results/model_drift/gdn && \
#     cp -r gdn/train/* gdn/drift/* results/model_drift/gdn/
#
#   MD_DRY_RUN=1 bash scripts/model_drift_gpu.sh [PART]
#       the same steps on the CPU with tiny sizes (toy models, 3 steps; emulation under Triton's
#       interpreter, 20 tokens, 2 policies): checks the script end to end in a few minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}
part=${1:-mamba2}
case "$part" in
  -h|--help) usage; exit 0 ;;
  mamba2|gdn|all) ;;
  *) echo "model_drift_gpu.sh: PART: expected mamba2, gdn or all, got '$part' (--help)" >&2
     exit 2 ;;
esac
if [ $# -gt 1 ]; then
  echo "model_drift_gpu.sh: expected one PART, got $# arguments: $*" >&2
  exit 2
fi
for knob in MD_TRAIN_S MD_DRIFT_S MD_NPROC MD_GDN_TRAIN_S MD_GDN_DRIFT_S; do
  value=${!knob:-0}
  if ! [[ $value =~ ^(0|[1-9][0-9]*)$ ]]; then
    echo "model_drift_gpu.sh: $knob: expected a whole number, got '$value'" >&2
    exit 2
  fi
done
if [ -n "${MD_GDN_MODEL:-}" ] && [ ! -f "$MD_GDN_MODEL/config.json" ]; then
  echo "model_drift_gpu.sh: MD_GDN_MODEL: expected a checkpoint folder with config.json, got '$MD_GDN_MODEL'" >&2
  exit 2
fi
out=${OUT:-runs/model_drift_gpu_out}
work=${MD_WORK:-runs/model_drift_gpu_work}
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS (train_lm asks for it)
py=${PYTHON:-python3}
data=${MD_DATA:-runs/kjv}
dry=${MD_DRY_RUN:-0}
nproc=${MD_NPROC:-1}
if [ "$dry" != 1 ] && [ ! -f "$data/kjv.txt" ]; then
  echo "model_drift_gpu.sh: $data/kjv.txt: expected the text (carry runs/kjv after prepare-data)" >&2
  exit 2
fi
if [ "$nproc" -gt 1 ]; then
  launch=("$py" -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m)
else
  launch=("$py" -m)
fi

# run_part ARCH: train, drift (and for mamba2 the Pareto figure), pack; returns its status
run_part() {
  local arch=$1 dir name log train_args drift_args decodes drift_s model status=0 rc start t0
  if [ "$arch" = mamba2 ]; then
    dir=$work; name=model_drift_gpu
    train_args=(--time-limit-s "${MD_TRAIN_S:-180}")
    drift_args=(--preset gpu)
    decodes=17  # the exact arm and 16 policies
    drift_s=${MD_DRIFT_S:-300}
  else
    dir=$work/gdn; name=model_drift_gdn_gpu
    train_args=(--arch gdn --time-limit-s "${MD_GDN_TRAIN_S:-150}")
    drift_args=(--preset gdn-gpu)
    decodes=5  # the exact arm and 4 policies
    drift_s=${MD_GDN_DRIFT_S:-60}
  fi
  if [ "$dry" = 1 ]; then
    train_args=(--preset toy --steps 3 --device cpu)
    [ "$arch" = gdn ] && train_args+=(--arch gdn)
    drift_args=(--backend emulation --device cpu --tokens 20 --segments 1
                --policies every_step:fp16:rn,separate_fp16sr:nvfp4)
    decodes=3  # the exact arm and 2 policies
  else
    train_args+=(--data "$data")
    drift_args+=(--data "$data")
  fi
  log="$out/$name.log"
  rm -rf "$dir/train" "$dir/drift"
  mkdir -p "$dir/train" "$dir/drift"
  record() { if [ "$1" -ne 0 ] && [ "$status" -eq 0 ]; then status=$1; fi; }
  {
    echo "== model_drift GPU job ($arch): $(date -u +%FT%TZ), ${LOWPREC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null) (device .git, may be stale)}"
    nvidia-smi --query-gpu=name,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    "$py" -c "import platform, torch; print('python', platform.python_version(), 'torch', torch.__version__)"
  } > "$log" 2>&1

  start=$(date +%s)
  model=$dir/train/model
  if [ "$arch" = gdn ] && [ -n "${MD_GDN_MODEL:-}" ]; then
    model=$MD_GDN_MODEL
    echo "train: skipped, MD_GDN_MODEL=$model" >> "$log"
  else
    "$py" -m experiments.train_lm "${train_args[@]}" --out "$dir/train" --no-progress \
      > "$dir/train/train.log" 2>&1
    record $?
    echo "train: exit $status, $(( $(date +%s) - start )) s: $(tail -n 2 "$dir/train/train.log" | head -n 1)" >> "$log"
  fi

  if [ -f "$model/config.json" ]; then
    t0=$(date +%s)
    # each decode has its own limit; a rank decodes the exact arm and its share of the policies
    timeout $(( drift_s * decodes + 120 )) "${launch[@]}" experiments.model_drift \
      "${drift_args[@]}" --model "$model" --out "$dir/drift/model_drift_gpu.csv" \
      --time-limit-s "$drift_s" > "$dir/drift/model_drift.log" 2>&1
    rc=$?
    record $rc
    { echo "drift: exit $rc, $(( $(date +%s) - t0 )) s"; cat "$dir/drift/model_drift.log"; } >> "$log"
    if [ "$arch" = mamba2 ] && [ -f "$dir/drift/model_drift_gpu.csv" ]; then
      "$py" -m experiments.model_drift --pareto --drift-csv "$dir/drift/model_drift_gpu.csv" \
        --plot "$dir/drift/model_drift_pareto.png" >> "$log" 2>&1
      record $?
    fi
  fi
  echo "total: $(( $(date +%s) - start )) s, status $status" >> "$log"
  if [ "$arch" = mamba2 ]; then
    tar czf "$out/$name.tar.gz" -C "$dir" train drift
  else
    tar czf "$out/$name.tar.gz" -C "$work" gdn
  fi
  record $?
  return "$status"
}

status=0
parts=("$part")
[ "$part" = all ] && parts=(mamba2 gdn)
for arch in "${parts[@]}"; do
  run_part "$arch"
  rc=$?
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
done
exit "$status"
