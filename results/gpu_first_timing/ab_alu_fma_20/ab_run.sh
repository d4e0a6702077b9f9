# run on the GPU machine as: bash ab_run.sh $OUT (from the repository root, with numerics.diff applied to the tree and HEAD's cute_kernels/numerics.py copied to ab_old_numerics.py); runs new, old, new, old
# A/B of the flush's ALU-to-FMA rounding edits (new: the working tree; old: HEAD's numerics.py)
set -u
out=$1
cp cute_kernels/numerics.py ab_new_numerics.py
for v in new old new old; do
  cp ab_${v}_numerics.py cute_kernels/numerics.py
  python -m cute_kernels.bench_write --batch 256 --only "=flush fp16-SR + nvfp4" "=flush fp16-RN + nvfp4 (no Philox, no SR)" "=flush fp16-SR, no read copy (no NVFP4 encode)" "=state_update fp16 SR" --out $out/ab_${v}_$RANDOM.csv 2>&1 | grep -E "^(flush|state_update)" | sed "s/^/$v  /"
done
cp ab_new_numerics.py cute_kernels/numerics.py
