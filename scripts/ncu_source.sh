#!/usr/bin/env bash
# Where each kernel's warps wait, instruction by instruction: ncu's PC sampling
# (SourceCounters) of kernel_bench kernels at the headline point (Nemotron-3-Super layer,
# batch 256, L = 16), exported per SASS instruction with the Python source line it came from
# (CuTe DSL compiles with line info under CUTE_DSL_LINEINFO=1; line info does not change the
# code ptxas makes). On the GPU machine, from the repository root (carry .device):
#
#   source .device/activate.sh && bash scripts/ncu_source.sh $OUT cute:nonflush:nvfp4 ...
#
# kernel_bench --profile launches the kernel once on each of 4 buffer sets after a warm-up;
# the first of those launches is profiled, clocks left alone, sampling every 2^(5+1) cycles
# of each SM sub-partition. Writes OUT/src_<kernel>.csv (one row per SASS instruction, every
# stall reason's samples), OUT/src_<kernel>.cuda_sass.csv (the same instructions under their
# Python source lines) and OUT/src_<kernel>.log (ncu's log and its WarpStateStats page). Then,
# on any machine:
#
#   python -m cute_kernels.stall_sites OUT/src_<kernel>.csv --lines OUT/src_<kernel>.cuda_sass.csv
#   python -m cute_kernels.stall_sites ... --trim results/kernel_bench_runs/ncu/stalls_<name>.csv.gz
#
# KB_EXTRA adds kernel_bench arguments (say "--nonflush-knob stage=bulk") and SUFFIX a tag to
# the file names, so that a knob's variant can be read beside the default.
# Exit status: the first failed ncu's (or export's), 0 when every one ran.
set -uo pipefail
# --help: the header; a missing OUT_DIR is named (it was the bare usage line)
case "${1:-}" in -h|--help) sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
[ $# -ge 2 ] || { echo "usage: bash scripts/ncu_source.sh OUT_DIR KERNEL... (see the header, --help)" >&2; exit 2; }
[ -d "$1" ] || { echo "ncu_source.sh: OUT_DIR $1 is not a folder (make it first)" >&2; exit 2; }
command -v ncu > /dev/null || { echo "ncu_source.sh: no ncu here (run it on the GPU machine)" >&2; exit 2; }
out=$1
shift
py=${PYTHON:-python}
# the exit status: the first ncu (or export) that failed, not the last grep's
failed=0
fail() { if [ "$1" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=$1; fi; }
read -ra extra <<< "${KB_EXTRA:-}"
for kernel in "$@"; do
  name=$(echo "$kernel" | tr ':+' '__')${SUFFIX:-}
  rep="$out/src_$name"
  CUTE_DSL_LINEINFO=1 timeout 300 ncu --profile-from-start off --clock-control none \
    --launch-count 1 --section SourceCounters --section WarpStateStats --import-source yes \
    --warp-sampling-interval 1 -f -o "$rep" "$py" -m experiments.kernel_bench --profile "$kernel" \
    --shapes nemotron3-super --batches 256 --windows 16 "${extra[@]}" > "$rep.log" 2>&1
  status=$?
  fail "$status"
  echo "ncu $kernel: exit $status" | tee -a "$rep.log"
  # one row per SASS instruction, with its source file and line where ncu has them
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.csv" 2>> "$rep.log"
  status=$?
  fail "$status"
  echo "export $kernel: exit $status, $(wc -l < "$rep.csv") lines" | tee -a "$rep.log"
  ncu -i "$rep.ncu-rep" --page source --csv --print-source cuda,sass > "$rep.cuda_sass.csv" \
    2>> "$rep.log"
  status=$?
  fail "$status"
  echo "export cuda,sass $kernel: exit $status, $(wc -l < "$rep.cuda_sass.csv") lines" | tee -a "$rep.log"
  ncu -i "$rep.ncu-rep" --page details --section WarpStateStats --section SourceCounters \
    >> "$rep.log" 2>&1
  rm -f "$rep.ncu-rep"
done
exit "$failed"
