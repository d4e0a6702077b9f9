#!/usr/bin/env bash
# The kit's GPU commands (an NVIDIA H100/H200, sm_90a), run from the repository root:
#
#   bash scripts/gpu.sh [--dry-run] TARGET [ARGS...]
#
#   test [PYTEST_ARGS...]        every gpu-marked test (pytest -m gpu): bit-exact stored codes
#                                of the CuTe kernels and the Triton emulation against lowprec,
#                                outputs against the reference; ARGS go to pytest
#   bench [KERNEL_BENCH_ARGS...] the kernel benchmark (python -m experiments.kernel_bench): every
#                                CuTe kernel, the three layer shapes (two Mamba-2, one Gated
#                                DeltaNet), batches 1-512, L = 8, 16, 32, and the peers built in
#                                .peers/ (scripts/peers/prepare.sh); ARGS go to kernel_bench,
#                                e.g. --shapes nemotron3-super --batches 256 --windows 16 for the
#                                headline point alone, --shapes qwen3-next-80b for GDN alone
#   profile [--shape SHAPE] [KERNEL...]
#                                where the time goes: Nsight Compute's warp samples per SASS
#                                instruction, read by python -m tools.stall_sites, and the
#                                executed instructions by pipe and the occupancy, read by
#                                python -m tools.instruction_count --ncu; at batch 256,
#                                L = 16 of SHAPE (nemotron3-super, the default, or
#                                qwen3-next-80b for the GDN kernels); kernels are
#                                kernel_bench's names (default: the two-precision non-flush
#                                step and flush)
#   error-growth [PRESET...] [-- ARGS...]
#                                the Triton emulation's error at the real layer shapes, 131,072
#                                steps: presets emulation-gpu (Mamba-2, 128 heads of 64 x 128),
#                                gdn-gpu and kda-gpu (32 heads of 128 x 128), default these
#                                three; sr-gpu (Mamba-2, the SR bits and rounds ablation);
#                                each a torchrun of one rank per arm sharing the GPU, the layers
#                                concurrently (the exact run and each arm replay CUDA graphs of
#                                256 steps; drawing the inputs on the host bounds them): GDN and
#                                KDA together about 3 minutes on an H100, sr-gpu 3 minutes;
#                                Mamba-2's layer draws 3x the inputs a step; ARGS after --
#                                go to every preset's error_growth (e.g. --sr-bits 32
#                                --philox-rounds 10, the reference SR setting)
#
#   --dry-run                    print the commands, run nothing
#
# Everything a target writes goes to $OUT (default runs/gpu-TARGET/), with a log TARGET.log and
# the machine's description in environment.txt. To regenerate a committed result, point OUT at
# results/. Environment: PYTHON (default python3), LIMIT_S (a time limit in seconds for each
# step, none by default), TEST_WORKERS (pytest-xdist workers for `test`, default 8 when
# pytest-xdist is installed). When present, .device/activate.sh and .peers/*/activate.sh are
# sourced first (the CuTe DSL and the peers unpacked on a machine without a registry).
# Exit status: that of the first step that failed, 0 when every one passed; 2 for a usage error.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: bash scripts/gpu.sh [--dry-run] test|bench|profile|error-growth [ARGS...] (--help: what each does)" >&2; exit 2; }

dry=0
if [ "${1:-}" = --dry-run ]; then dry=1; shift; fi
target=${1:-}
case "$target" in
  test|bench|profile|error-growth) shift ;;
  -h|--help) sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  "") usage ;;
  *) echo "gpu.sh: unknown target '$target'" >&2; usage ;;
esac
if [ -n "${LIMIT_S:-}" ] && ! [[ $LIMIT_S =~ ^[1-9][0-9]*$ ]]; then
  echo "gpu.sh: LIMIT_S: expected a whole number of seconds, got '$LIMIT_S'" >&2; exit 2
fi
if [ -n "${TEST_WORKERS:-}" ] && ! [[ $TEST_WORKERS =~ ^[1-9][0-9]*$ ]]; then
  echo "gpu.sh: TEST_WORKERS: expected a whole number, got '$TEST_WORKERS'" >&2; exit 2
fi
py=${PYTHON:-python3}
out=${OUT:-runs/gpu-$target}
log="$out/$target.log"
status=0
record() { if [ "$1" -ne 0 ] && [ "$status" -eq 0 ]; then status=$1; fi; }

# show CMD...: the command as a shell would read it back
show() {
  local arg
  printf '+'
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./:=+,@%-]+$ ]]; then printf ' %s' "$arg"; else printf ' %q' "$arg"; fi
  done
}

# run CMD...: prints the command; runs it (under LIMIT_S) unless --dry-run, its output into the log
run() {
  show "$@"; printf '\n'
  [ "$dry" = 1 ] && return 0
  if [ -n "${LIMIT_S:-}" ]; then set -- timeout "$LIMIT_S" "$@"; fi
  "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  record "$rc"
  return "$rc"
}

# run_to FILE CMD...: as run, its standard output into FILE (ncu and its exports)
run_to() {
  local file=$1; shift
  show "$@"; printf ' > %q\n' "$file"
  [ "$dry" = 1 ] && return 0
  if [ -n "${LIMIT_S:-}" ]; then set -- timeout "$LIMIT_S" "$@"; fi
  "$@" > "$file" 2>> "$log"
  local rc=$?
  record "$rc"
  echo "$(basename "$file"): exit $rc" | tee -a "$log"
  return "$rc"
}

if [ "$dry" = 0 ]; then
  mkdir -p "$out"
  : > "$log"
  if [ -f .device/activate.sh ]; then
    # shellcheck disable=SC1091
    source .device/activate.sh || echo "gpu.sh: .device/activate.sh failed" | tee -a "$log"
  fi
  for peer in vllm flashinfer fla; do
    if [ -f ".peers/$peer/activate.sh" ]; then
      # shellcheck disable=SC1090
      source ".peers/$peer/activate.sh" || echo "gpu.sh: .peers/$peer/activate.sh failed" | tee -a "$log"
    fi
  done
  {
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
    "$py" -c 'import platform, torch; print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
  } > "$out/environment.txt"
fi
export PYTHONUNBUFFERED=1

case "$target" in
  test)
    workers=()
    if [ -n "${TEST_WORKERS:-}" ]; then
      workers=(-n "$TEST_WORKERS")
    elif "$py" -c "import xdist" 2> /dev/null; then
      workers=(-n 8)
    fi
    run "$py" -m pytest -m gpu -q -p no:cacheprovider "${workers[@]}" "$@"
    ;;
  bench)
    peers=()
    for peer in vllm flashinfer fla; do [ -d ".peers/$peer" ] && peers+=("$peer"); done
    peer_list=$(IFS=,; echo "${peers[*]:-none}")
    run "$py" -m experiments.kernel_bench --peers "$peer_list" --out "$out/kernel_bench.csv" \
      --plot-dir "$out" "$@"
    ;;
  profile)
    if [ "$dry" = 0 ] && ! command -v ncu > /dev/null; then
      echo "gpu.sh profile: no ncu here (Nsight Compute; run it on the GPU machine)" | tee -a "$log" >&2
      exit 2
    fi
    shape=nemotron3-super
    if [ "${1:-}" = --shape ]; then
      case "${2:-}" in
        nemotron3-super|qwen3-next-80b) shape=$2; shift 2 ;;
        *) echo "gpu.sh profile: --shape takes nemotron3-super or qwen3-next-80b, got '${2:-}'" >&2
           exit 2 ;;
      esac
    fi
    [ $# -gt 0 ] || set -- cute:nonflush:nvfp4 cute:flush:fp16sr+nvfp4
    point=(--shapes "$shape" --batches 256 --windows 16)
    # the lines of ncu's raw page that tools.instruction_count --ncu reads
    keep='==PROF==|\), Context |^  (gpu__time_duration\.sum|smsp__inst_executed\.sum|sm__inst_executed\.avg\.per_cycle_active|sm__inst_executed_pipe_(alu|fma|lsu|xu)\.avg\.pct_of_peak_sustained_active|sm__warps_active\.avg\.per_cycle_active|sm__maximum_warps_avg_per_active_cycle|launch__occupancy_limit_(registers|shared_mem)|smsp__warps_(active|eligible)\.avg\.per_cycle_active) '
    for kernel in "$@"; do
      name=$shape-$(echo "$kernel" | tr ':+' '__')
      src="$out/src_$name"
      # warp samples per SASS instruction, with the Python line each came from (line info
      # does not change the code ptxas makes); clocks left alone
      run_to "$src.ncu.log" env CUTE_DSL_LINEINFO=1 ncu --profile-from-start off --clock-control none \
        --launch-count 1 --section SourceCounters --section WarpStateStats --import-source yes \
        --warp-sampling-interval 1 -f -o "$src" "$py" -m experiments.kernel_bench \
        --profile "$kernel" "${point[@]}"
      run_to "$src.csv" ncu -i "$src.ncu-rep" --page source --csv --print-source sass
      run_to "$src.cuda_sass.csv" ncu -i "$src.ncu-rep" --page source --csv --print-source cuda,sass
      run_to "$out/stall_sites_$name.txt" "$py" -m tools.stall_sites "$src.csv" \
        --lines "$src.cuda_sass.csv"
      # executed instructions by opcode and pipe
      pipes="$out/ncu_pipes_$name.txt"
      run_to "$pipes" ncu --profile-from-start off --clock-control none \
        --section ComputeWorkloadAnalysis --section InstructionStats --section Occupancy \
        --section SchedulerStats --section LaunchStats --page raw \
        --print-metric-instances values "$py" -m experiments.kernel_bench --profile "$kernel" \
        "${point[@]}"
      if [ "$dry" = 0 ]; then grep -E "$keep" "$pipes" > "${pipes%.txt}.trim.txt"; fi
      run_to "$out/pipes_$name.txt" "$py" -m tools.instruction_count --ncu "${pipes%.txt}.trim.txt" \
        --layer "$shape"
      [ "$dry" = 1 ] || rm -f "$src.ncu-rep"
    done
    ;;
  error-growth)
    # PRESET... [-- ARGS...]: ARGS go to every preset's run (e.g. --sr-bits 32 --philox-rounds 10)
    presets=() extra=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do presets+=("$1"); shift; done
    if [ $# -gt 0 ]; then shift; extra=("$@"); fi
    [ ${#presets[@]} -gt 0 ] || presets=(emulation-gpu gdn-gpu kda-gpu)
    set -- "${presets[@]}"
    for preset in "$@"; do
      case "$preset" in
        emulation-gpu|gdn-gpu|kda-gpu|sr-gpu) ;;
        *) echo "gpu.sh error-growth: unknown preset '$preset' (emulation-gpu, gdn-gpu, kda-gpu, sr-gpu)" >&2
           exit 2 ;;
      esac
    done
    # Each layer a torchrun (a rank per arm: the cells share the GPU over gloo), the layers as
    # concurrent processes; each summary goes to its .txt, then the growth tables are printed.
    pids=()
    for preset in "$@"; do
      name=error_growth_${preset//-/_}
      case "$preset" in emulation-gpu) ranks=2 ;; sr-gpu) ranks=8 ;; *) ranks=3 ;; esac
      layer=(run_to "$out/$name.txt" "$py" -m torch.distributed.run --standalone
             --nproc-per-node "$ranks" -m experiments.error_growth --preset "$preset"
             --no-progress --out "$out/$name.csv" --plot "$out/$name.png" ${extra[@]+"${extra[@]}"})
      # a dry run prints them in order (three background printers would interleave lines)
      if [ "$dry" = 1 ]; then "${layer[@]}"; else "${layer[@]}" & pids+=("$!"); fi
    done
    for pid in "${pids[@]}"; do wait "$pid"; record $?; done
    if [ "$dry" = 0 ]; then
      for preset in "$@"; do
        name=error_growth_${preset//-/_}
        [ -f "$out/$name.txt" ] && sed -n '/^growth:/,$p' "$out/$name.txt" | tee -a "$log"
      done
    fi
    ;;
esac
if [ "$dry" = 0 ]; then
  echo "gpu.sh $target: exit $status; files in $out" | tee -a "$log"
fi
exit "$status"
