#!/usr/bin/env bash
# One GPU session in one call: install, GPU tests, demo, benchmark; logs under $OUT (or ./gpu_out).
# Usage: bash tools/gpu_session.sh [tests|demo|bench|all] [extra pytest args...]
set -uo pipefail
what=${1:-all}; shift || true
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
python3 - <<'PY' | tee "$out/env.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
print("gpu", torch.cuda.get_device_name(0))
PY
rc=0
if [[ $what == tests || $what == all ]]; then
  timeout 420 python3 -m pytest -q -x -p no:cacheprovider "$@" tests 2>&1 | tee "$out/pytest.log" | grep -v "^DEBUG" | tail -40
  rc=${PIPESTATUS[0]}
fi
if [[ $what == demo || $what == all ]]; then
  timeout 300 python3 demos/run_demo.py --seeds a,b,c 2>&1 | grep -v "Warning\|warn(" | tee "$out/demo_fp32.log"
  timeout 300 python3 demos/run_demo.py --seeds a,b,c --dtype bf16 2>&1 | grep -v "Warning\|warn(" | tee "$out/demo_bf16.log"
fi
if [[ $what == bench || $what == all ]]; then
  timeout 540 python3 -m fusion_backend bench --suite seeds --out "$out/bench" 2>&1 | tee "$out/bench.log" | tail -60
fi
exit $rc
