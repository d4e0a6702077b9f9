#!/usr/bin/env bash
# The kernel benchmark's GPU calls (experiments/kernel_bench.py), one command each, run from the
# repository root on the GPU machine. Everything lands in $OUT (at most 8 files come back):
#
#   bash scripts/gpu_session.sh A   carry [".device", ".peers/vllm"]
#       gpu-marked tests (pytest -m gpu), then the benchmark of the CuTe kernels and vLLM's:
#       gpu-tests.log, kernel_bench_A.{log,csv,meta.json}, kernel_bench_A_{time,speedup,
#       formats}.png
#   bash scripts/gpu_session.sh B   carry [".peers/flashinfer", ".peers/vllm", ".device"]
#       FlashInfer's kernels, with the CuTe two-precision, FP32 ReplaySSM and conventional FP32
#       kernels timed again in the same run (the speedups against FlashInfer then come from one
#       machine); without .device only FlashInfer and vLLM run: kernel_bench_B.{log,csv,meta.json}
#
#   bash scripts/gpu_session.sh C   carry [".device"]
#       check and tuning after a kernel change: gpu-marked tests (-n 8), then at L = 16
#       cute_kernels.bench_write (flush stages left out one at a time) and bench_read (tuning
#       variants) at batch 256, bench_read's small-batch grid (warps x head_splits) at batch
#       1 to 128, and the two flush layouts (64 or 32 elements a thread) at batch 1 and 8:
#       gpu-tests.log, bench_write.csv, bench_read.csv, bench_read_splits.csv,
#       bench_write_small_{1,8}.csv, kernel_bench_C.log
#
#   bash scripts/gpu_session.sh T   carry [".device"]
#       a shorter C, for knob changes: gpu-marked tests (-n 8), bench_read's knob variants (L2
#       prefetch, partial-sum layout) at batch 256 and 128, and bench_write's two-precision and
#       FP32 flushes and windows at batch 256: gpu-tests.log, bench_read_knobs.csv,
#       bench_write_T.csv, kernel_bench_T.log
#
#   bash scripts/gpu_session.sh E   carry [".device"] (not needed: the emulation is Triton)
#       the emulation backend of experiments.error_growth at the real layer shape (issue 5):
#       error_growth_emulation_gpu.{csv,png,meta.json} and kernel_bench_E.log
#
#   bash scripts/gpu_session.sh D   carry [".device", ".peers/vllm"]
#       E (at most KB_E_S seconds, default 290), then A's benchmark without A's tests or plots
#       (for a session whose kernels were tested in an earlier call, C): E's files,
#       kernel_bench_A.{csv,meta.json} and kernel_bench_D.log
#
#   bash scripts/gpu_session.sh G   carry [".device"]
#       every gpu-marked test, 10 workers, in a call of its own (314 tests, 419 s in the
#       twenty-third session; A, C and T run them time-boxed, a first look): gpu-tests.log,
#       kernel_bench_G.log
#
#   bash scripts/gpu_session.sh P   carry [".device"]
#       where the time goes: ncu (clocks left alone) on the two-precision and the FP32-checkpoint
#       non-flush kernels and the two-precision flush at the headline point (batch 256, L = 16):
#       ncu_<kernel>.txt (details page) and kernel_bench_P.log; without ncu, exit 2 at once
#
#   bash scripts/gpu_session.sh K   carry [".device"]
#       the non-flush kernel's knobs A/B in the benchmark's own conditions (kernel_bench
#       --nonflush-knob): KB_AB="name:key=value,key=value name2:..." (an empty list after the
#       colon is the default), each variant run in turn KB_AB_REPS times (default 2) at batches
#       KB_AB_BATCHES (default 1,8,128,256), shapes KB_AB_SHAPES (default nemotron3-super) and
#       windows KB_AB_WINDOWS (default 16), kernels KB_AB_KERNELS (default
#       cute:nonflush:nvfp4); first, with KB_TEST_K set, the gpu-marked
#       tests that `pytest -k "$KB_TEST_K"` selects (KB_TEST_K=all: every one, -n 8):
#       ab.tar (ab_<name>_<rep>.{csv,meta.json,log}),
#       gpu-tests.log, kernel_bench_K.log (a summary table at its end)
#
# KB_SKIP_TESTS=1 leaves A's tests out (for a call after C tested the same kernels; unset,
# empty or 0 runs them).
# Start each as `LOWPREC_COMMIT=<git rev-parse --short HEAD, here> bash scripts/gpu_session.sh X`:
# the device's copy of the tree carries a .git that is not this checkout's, so the meta files
# would otherwise name a stale commit (they did on 2026-11-29).
#
# Then, here: merge the two runs' CSVs (the merged one holds every row of both; keep their logs
# and .meta.json in results/kernel_bench_runs/, not the run CSVs):
#   python -m experiments.kernel_bench --merge kernel_bench_A.csv kernel_bench_B.csv \
#       --out results/kernel_bench.csv --plot-dir results
#
# The whole command stays under KB_TOTAL_S seconds (default 540, i.e. 9 minutes: the call limit
# is 10): the tests get at most KB_TESTS_S (default 150 in A, 200 in C, T and K's -k subset,
# 330 in K with KB_TEST_K=all, the rest of the call less 10 s in G), the benchmark the rest less a margin for its plots (--budget-s
# drops the lowest-priority points when time runs out, and records them as skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
if [ $# -gt 1 ]; then  # a second part was ignored without a word: one part a call
  echo "usage: bash scripts/gpu_session.sh A|B|C|D|E|G|K|P|T (one part; got: $*)" >&2; exit 2
fi
case "$part" in
  A|B|C|D|E|G|K|P|T) ;;
  -h|--help) sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "usage: bash scripts/gpu_session.sh A|B|C|D|E|G|K|P|T (--help: what each does)" >&2; exit 2 ;;
esac
# the numeric knobs feed shell arithmetic and timeout: a typo ("9m", "540s") used to surface
# as a syntax error halfway through the call, after device time was spent
for knob in KB_TOTAL_S KB_TESTS_S KB_E_S KB_AB_REPS; do
  value=${!knob:-0}
  if ! [[ $value =~ ^(0|[1-9][0-9]*)$ ]]; then  # no leading 0: bash reads 090 as octal
    echo "gpu_session.sh: $knob: expected a whole number of seconds (or reps), got '$value'" >&2
    exit 2
  fi
done
out=${OUT:-/tmp/kernel-bench-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
start=$(date +%s)
total=${KB_TOTAL_S:-540}
remaining() { echo $(( total - ($(date +%s) - start) )); }
status=0  # the call's exit status: the first step that failed (a later one may still run)
record() { if [ "$1" -ne 0 ] && [ "$status" -eq 0 ]; then status=$1; fi; }

log="$out/kernel_bench_$part.log"
{
  echo "== kernel_bench call $part: $(date -u +%FT%TZ), ${LOWPREC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null) (device .git, may be stale)}"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw --format=csv
} > "$log" 2>&1

if [ -f .device/activate.sh ]; then
  # shellcheck disable=SC1091
  source .device/activate.sh || echo "CuTe DSL archive failed to unpack" >> "$log"
fi
for peer in vllm flashinfer; do
  if [ -f ".peers/$peer/activate.sh" ]; then
    # shellcheck disable=SC1090
    source ".peers/$peer/activate.sh" || echo "peer $peer failed to unpack" >> "$log"
  fi
done
"$py" - >> "$log" 2>&1 <<'EOF'
import importlib, importlib.metadata, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
for name in ("triton", "cutlass", "flashinfer"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as error:
        print(name, "not importable:", type(error).__name__, error)
for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
    try:
        print(dist, importlib.metadata.version(dist))
    except importlib.metadata.PackageNotFoundError:
        print(dist, "no distribution metadata")
EOF

# every gpu-marked test, $2 workers (default 8), at most KB_TESTS_S (default $1) seconds. In
# A, C and T this is a time-boxed first look: the whole suite took 419 s with 10 workers in the
# twenty-third session (314 tests), more than those parts leave it, so it stops part-way
# (exit 124). Stopped with no failure or error in its progress lines, the call's status keeps 0
# and the log says how far it got; the whole suite is part G, a call of its own.
gpu_tests() {
  timeout "${KB_TESTS_S:-$1}" "$py" -m pytest -m gpu -q -n "${2:-8}" -p no:cacheprovider \
    > "$out/gpu-tests.log" 2>&1
  local rc=$? progress done failed
  progress=$(grep -E '^[.sxXFE]+( +\[ *[0-9]+%\])?$' "$out/gpu-tests.log" | tr -cd '.sxXFE')
  done=${#progress}
  failed=$(printf '%s' "$progress" | tr -cd 'FE' | wc -c)
  if [ $rc -eq 124 ] && [ "$failed" -eq 0 ]; then
    echo "gpu tests: stopped by the time box after $done tests, none failed (the whole suite:" \
      "part G)" | tee -a "$log"
  else
    record $rc
    echo "gpu tests: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$log"
  fi
  tail -n 3 "$out/gpu-tests.log"
}

emulation_run() {  # issue 5: 128 heads x 64 x 128, 2 sequences, 131,072 steps, two arms
  timeout "$1" "$py" -m experiments.error_growth --backend emulation --device cuda \
    --dv 64 --dk 128 --heads 128 --seeds 2 --steps 131072 --log-grid 48 \
    --arms separate_fp16sr:nvfp4,every_step:fp16:rn --memory long \
    --out "$out/error_growth_emulation_gpu.csv" --plot "$out/error_growth_emulation_gpu.png" 2>&1 \
    | tr '\r' '\n' | awk 'NR % 20 == 1 || /error|Error|rel_err|arm|t=/' | tail -n 60 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  record "$rc"
  echo "error_growth emulation: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$log"
}

if [ "$part" = C ]; then
  gpu_tests 200
  timeout 120 "$py" -m cute_kernels.bench_write --batch 256 --out "$out/bench_write.csv" 2>&1 \
    | tee -a "$log" || record $?
  timeout 90 "$py" -m cute_kernels.bench_read --batch 256 --out "$out/bench_read.csv" 2>&1 \
    | tee -a "$log" || record $?
  timeout "$(( $(remaining) - 70 ))" "$py" -m cute_kernels.bench_read --splits-sweep \
    --batch 1 8 32 64 128 --out "$out/bench_read_splits.csv" 2>&1 | tee -a "$log" || record $?
  for b in 1 8; do  # the two layouts by exact name: the bare name is in every variant's
    timeout 30 "$py" -m cute_kernels.bench_write --batch $b --only "=flush fp16-SR + nvfp4" \
      "=flush fp16-SR + nvfp4, 64 elements per thread (128 threads)" \
      --out "$out/bench_write_small_$b.csv" 2>&1 | tee -a "$log" || record $?
  done
elif [ "$part" = T ]; then
  gpu_tests 200
  timeout 150 "$py" -m cute_kernels.bench_read --knob-variants --batch 256 128 \
    --out "$out/bench_read_knobs.csv" 2>&1 | tee -a "$log" || record $?
  # the shipped flushes by exact name ("flush fp16-SR" is in every variant's name)
  timeout "$(( $(remaining) - 10 ))" "$py" -m cute_kernels.bench_write --batch 256 \
    --only "=flush fp16-SR + nvfp4" "=flush fp32 single copy" "window/token" \
    --out "$out/bench_write_T.csv" 2>&1 | tee -a "$log" || record $?
elif [ "$part" = G ]; then
  gpu_tests "$(( $(remaining) - 10 ))" 10
elif [ "$part" = E ]; then
  emulation_run "$(( $(remaining) - 5 ))"
elif [ "$part" = A ] || [ "$part" = D ]; then
  if [ "$part" = A ] && [ "${KB_SKIP_TESTS:-0}" != 0 ]; then  # 0 skipped them too
    echo "gpu tests: skipped (KB_SKIP_TESTS; they ran in an earlier call)" | tee -a "$log"
  elif [ "$part" = A ]; then
    gpu_tests 150
  else
    emulation_run "${KB_E_S:-290}"
  fi
  budget=$(( $(remaining) - 40 ))
  # the hard limit: a run killed there still leaves the CSV it checkpoints every ~10 s
  timeout "$(( $(remaining) - 5 ))" "$py" -m experiments.kernel_bench --peers vllm \
    --run-label A --budget-s "$budget" --out "$out/kernel_bench_A.csv" \
    --plot-dir "$([ "$part" = D ] && echo none || echo "$out")" 2>&1 \
    | tee -a "$log" || record $?
elif [ "$part" = K ]; then
  if [ "${KB_TEST_K:-}" = all ]; then
    gpu_tests 330
  elif [ -n "${KB_TEST_K:-}" ]; then
    timeout "${KB_TESTS_S:-200}" "$py" -m pytest -m gpu -q -n 8 -p no:cacheprovider \
      -k "$KB_TEST_K" tests > "$out/gpu-tests.log" 2>&1
    rc=$?
    record $rc
    echo "gpu tests (-k $KB_TEST_K): exit $rc after $(( $(date +%s) - start )) s" | tee -a "$log"
    tail -n 3 "$out/gpu-tests.log" | tee -a "$log"
  fi
  for rep in $(seq 1 "${KB_AB_REPS:-2}"); do
    for variant in ${KB_AB:-default:}; do
      name=${variant%%:*}
      knobs=()
      IFS=, read -ra pairs <<< "${variant#*:}"
      for pair in "${pairs[@]}"; do knobs+=(--nonflush-knob "$pair"); done
      if [ "$(remaining)" -lt 50 ]; then echo "skipped $name $rep: time" | tee -a "$log"; continue; fi
      timeout "$(( $(remaining) - 10 ))" "$py" -m experiments.kernel_bench \
        --shapes "${KB_AB_SHAPES:-nemotron3-super}" --windows "${KB_AB_WINDOWS:-16}" \
        --batches "${KB_AB_BATCHES:-1,8,128,256}" --kernels "${KB_AB_KERNELS:-cute:nonflush:nvfp4}" \
        --peers none --plot-dir none "${knobs[@]}" --run-label "${name}_$rep" \
        --out "$out/ab_${name}_$rep.csv" > "$out/ab_${name}_$rep.log" 2>&1
      rc=$?
      record $rc
      echo "$name rep $rep (${variant#*:}): exit $rc after $(( $(date +%s) - start )) s" | tee -a "$log"
    done
  done
  "$py" - "$out" >> "$log" 2>&1 <<'EOF'
import csv, glob, os, sys
rows = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "ab_*.csv"))):
    for r in csv.DictReader(open(path)):
        if r["status"] == "ok":
            fmt = r.get("kernel", "cute:nonflush:nvfp4").rsplit(":", 1)[-1]  # read-copy format
            key = (f"{r['shape']}/{fmt}", r["window"], r["batch"], r["cursor"])
            rows.setdefault(key, {})[r["run"]] = float(r["time_us"])
runs = sorted({run for v in rows.values() for run in v})
print(f"{'shape/format':22s} window batch cursor " + " ".join(f"{run:>16s}" for run in runs))
for (sh, w, b, c), v in sorted(rows.items(), key=lambda kv: (kv[0][0], int(kv[0][1]),
                                                            int(kv[0][2]), int(kv[0][3]))):
    print(f"{sh:22s} {w:>6s} {b:>5s} {c:>6s} "
          + " ".join(f"{v.get(run, float('nan')):16.2f}" for run in runs))
EOF
  if compgen -G "$out/ab_*" > /dev/null; then  # nothing to pack when KB_AB_REPS=0 (tests only)
    (cd "$out" && tar -cf ab.tar ab_* && rm -f ab_*)
  fi
elif [ "$part" = P ] && ! command -v ncu > /dev/null; then  # each ncu run exited 127
  echo "gpu_session.sh P: no ncu here (run it on the GPU machine)" | tee -a "$log" >&2
  record 2
elif [ "$part" = P ]; then
  for kernel in cute:nonflush:nvfp4 cute:nonflush:fp32 cute:flush:fp16sr+nvfp4; do
    name=$(echo "$kernel" | tr ':+' '__')
    timeout "$(( $(remaining) / 2 ))" ncu --profile-from-start off --clock-control none \
      --set full --page details "$py" -m experiments.kernel_bench --profile "$kernel" \
      --shapes nemotron3-super --batches 256 --windows 16 > "$out/ncu_$name.txt" 2>&1
    rc=$?
    record $rc
    echo "ncu $kernel: exit $rc" | tee -a "$log"
    grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy" \
      "$out/ncu_$name.txt" | head -n 12 | tee -a "$log"
  done
else
  kernels="none"  # the CuTe anchors, when CuTe DSL came along; none: the peers alone
  if "$py" -c "import cutlass" 2> /dev/null; then
    kernels="cute:nonflush:nvfp4,cute:flush:fp16sr+nvfp4,cute:nonflush:fp32,cute:flush:fp32"
    kernels="$kernels,cute:update:fp32,cute:update:fp16"
  fi
  budget=$(( $(remaining) - 30 ))
  timeout "$(( $(remaining) - 5 ))" "$py" -m experiments.kernel_bench --kernels "$kernels" \
    --peers flashinfer,vllm --run-label B --budget-s "$budget" --windows 16,8 \
    --out "$out/kernel_bench_B.csv" --plot-dir none 2>&1 | tee -a "$log" || record $?
fi
ls -la "$out" >> "$log"
if [ "$status" = 0 ]; then
  echo "call $part done in $(( $(date +%s) - start )) s, exit 0 (every step passed)"
else
  echo "call $part done in $(( $(date +%s) - start )) s, exit $status (the first step that failed)"
fi
exit "$status"
