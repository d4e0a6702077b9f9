#!/usr/bin/env bash
# Where the two-precision flush's stages spend their time, read by ncu: issue rate, pipe
# loads and warp stall reasons of the flush as shipped and of bench_write's forms with a
# stage left out (no Philox and SR, no NVFP4 encode, neither), at batch 256, L = 16. On the
# GPU machine, from the repository root (carry .device):
#
#   source .device/activate.sh && bash scripts/ncu_flush_stages.sh $OUT
#
# Each form runs `python -m cute_kernels.bench_write --only "=<form>"`, and ncu profiles its
# first full-batch flush launch (`-k regex:ReplayFlush`; the shipped form's check launches a
# 4-slot flush first, which is skipped), clocks left alone, raw page. Writes
# OUT/ncu_flush_<tag>.txt and, with only the lines kept in results/ (time, executed
# instructions, issue rate, pipes, occupancy, stall reasons per issue), OUT/ncu_flush_<tag>.trim.txt.
# Exit status: the first failed ncu's (or export's), 0 when every one ran.
set -uo pipefail
# --help: the header; a missing OUT_DIR is named (it was the bare usage line), and one folder
# only (a second argument was ignored)
case "${1:-}" in -h|--help) sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
[ $# -eq 1 ] || { echo "usage: bash scripts/ncu_flush_stages.sh OUT_DIR (see the header, --help)" >&2; exit 2; }
[ -d "$1" ] || { echo "ncu_flush_stages.sh: OUT_DIR $1 is not a folder (make it first)" >&2; exit 2; }
command -v ncu > /dev/null || { echo "ncu_flush_stages.sh: no ncu here (run it on the GPU machine)" >&2; exit 2; }
out=$1
py=${PYTHON:-python}
# the exit status: the first ncu (or export) that failed, not the last grep's
failed=0
fail() { if [ "$1" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=$1; fi; }
keep='==PROF==|\), Context |^  (gpu__time_duration\.sum|smsp__inst_executed\.sum|smsp__issue_active\.avg\.per_cycle_active|sm__inst_executed_pipe_(alu|fma|fmaheavy|lsu|xu|tensor_op_hmma)\.avg\.pct_of_peak_sustained_active|sm__warps_active\.avg\.pct_of_peak_sustained_active|smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active\.ratio) '
# tag, bench_write case, launches to skip (the check's)
forms=(
  "sr_nvfp4|flush fp16-SR + nvfp4|1"
  "rn_nvfp4|flush fp16-RN + nvfp4 (no Philox, no SR)|0"
  "sr_none|flush fp16-SR, no read copy (no NVFP4 encode)|0"
  "rn_none|flush fp16-RN, no read copy (fold, output, stores)|0"
)
for form in "${forms[@]}"; do
  IFS='|' read -r tag case skip <<< "$form"
  timeout 240 ncu -k regex:ReplayFlush --launch-skip "$skip" --launch-count 1 \
    --clock-control none --section ComputeWorkloadAnalysis --section InstructionStats \
    --section WarpStateStats --section SchedulerStats --section Occupancy --page raw \
    "$py" -m cute_kernels.bench_write --batch 256 --reps 2 --replays 2 --only "=$case" \
    > "$out/ncu_flush_$tag.txt" 2>&1
  status=$?
  fail "$status"
  echo "ncu $tag: exit $status, $(wc -l < "$out/ncu_flush_$tag.txt") lines"
  grep -E "$keep" "$out/ncu_flush_$tag.txt" > "$out/ncu_flush_$tag.trim.txt"
done
exit "$failed"
