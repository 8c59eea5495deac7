#!/usr/bin/env bash
# Nsight Compute over tools/profile_conv_kernels.py: one launch of every fused conv kernel (and the
# library path's for comparison), the seeds suite's ConvTranspose3d and Conv2d convs, fp32 + bf16; CSV and
# summary under $OUT (or ./gpu_out).
#   bash tools/profile_conv_kernels.sh [--seeds convt3d] [--dtypes fp32] [--only "forward fused"]
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout -k 10 "${NCU_TIMEOUT:-400}" ncu --profile-from-start off --target-processes all \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section Occupancy --section LaunchStats --section WarpStateStats \
  --metrics "$(python3 tools/profile_conv_kernels.py --stall-metrics)" \
  --csv --page details python3 tools/profile_conv_kernels.py "$@" >"$out/ncu.csv" 2>"$out/ncu.log"
echo "ncu rc=$?"; tail -3 "$out/ncu.log"
python3 tools/profile_conv_kernels.py --summarize "$out/ncu.csv" | tee "$out/ncu_summary.txt"
