#!/usr/bin/env bash
# Dynamic instruction counts by pipe and by opcode of kernel_bench kernels at the headline
# point (Nemotron-3-Super layer, batch 256, L = 16), for `python -m
# cute_kernels.instruction_count --ncu FILE` to compare with the static pipe model. On the GPU
# machine, from the repository root (carry .device):
#
#   source .device/activate.sh && bash scripts/ncu_pipes.sh $OUT cute:flush:fp16sr+nvfp4 ...
#
# ncu's InstructionStats (executed instructions per opcode) and ComputeWorkloadAnalysis (per
# pipe) sections, raw page, clocks left alone; kernel_bench --profile launches the kernel once
# on each of 4 buffer sets after a warm-up. Writes OUT/ncu_pipes_<kernel>.txt and, with only
# the lines that --ncu reads, OUT/ncu_pipes_<kernel>.trim.txt.
# Exit status: the first failed ncu's (or export's), 0 when every one ran.
set -uo pipefail
# --help: the header; a missing OUT_DIR is named (it was the bare usage line)
case "${1:-}" in -h|--help) sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
[ $# -ge 2 ] || { echo "usage: bash scripts/ncu_pipes.sh OUT_DIR KERNEL... (see the header, --help)" >&2; exit 2; }
[ -d "$1" ] || { echo "ncu_pipes.sh: OUT_DIR $1 is not a folder (make it first)" >&2; exit 2; }
command -v ncu > /dev/null || { echo "ncu_pipes.sh: no ncu here (run it on the GPU machine)" >&2; exit 2; }
out=$1
shift
py=${PYTHON:-python}
# the exit status: the first ncu (or export) that failed, not the last grep's
failed=0
fail() { if [ "$1" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=$1; fi; }
keep='==PROF==|\), Context |^  (gpu__time_duration\.sum|smsp__inst_executed\.sum|sm__inst_executed\.avg\.per_cycle_active|sm__inst_executed_pipe_(alu|fma|lsu|xu)\.avg\.pct_of_peak_sustained_active) '
for kernel in "$@"; do
  name=$(echo "$kernel" | tr ':+' '__')
  args=(--profile-from-start off --clock-control none --section ComputeWorkloadAnalysis
        --section InstructionStats --page raw)
  timeout 240 ncu "${args[@]}" --print-metric-instances values "$py" -m experiments.kernel_bench \
    --profile "$kernel" --shapes nemotron3-super --batches 256 --windows 16 \
    > "$out/ncu_pipes_$name.txt" 2>&1
  status=$?
  if [ $status -ne 0 ]; then  # an ncu without --print-metric-instances: totals only
    timeout 240 ncu "${args[@]}" "$py" -m experiments.kernel_bench --profile "$kernel" \
      --shapes nemotron3-super --batches 256 --windows 16 > "$out/ncu_pipes_$name.txt" 2>&1
    status=$?
  fi
  fail "$status"
  echo "ncu $kernel: exit $status, $(wc -l < "$out/ncu_pipes_$name.txt") lines"
  # what `instruction_count --ncu` reads (NCU_METRICS there), small enough to keep in results/
  grep -E "$keep" "$out/ncu_pipes_$name.txt" > "$out/ncu_pipes_$name.trim.txt"
done
exit "$failed"
