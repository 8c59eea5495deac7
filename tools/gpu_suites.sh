#!/usr/bin/env bash
# The committed H100 reports of docs/perf/h100 in one device call, one job per GPU at the same time:
#   bash tools/gpu_suites.sh            (on nvidia-h100-x4: about 8-9 minutes; logs and reports under $OUT/suites)
# GPU 0: seeds | GPU 1: convnets 1-5, seeds-small, seeds-small again on its caches (warm/seeds-small)
# GPU 2: convnets 6-10, CUDA graphs | GPU 3: convnets 11-14, 15-18 | then the convnets parts merged.
#   bash tools/gpu_suites.sh realnets   instead: the realnets suite, ResNet-50 | the VAE decoder | the other four
#   networks | fp32 precision GPU tests, then ResNet-50 and EfficientNet-B0 bf16 under reduce-overhead | the
#   other networks under reduce-overhead | ResNet-50 fp32 under reduce-overhead (each job at most 9 minutes;
#   REALNETS_JOBS picks jobs: resnet50, vae, rest, cudagraphs, cudagraphs-rest, cudagraphs-fp32; REALNETS_RUNS=2
#   runs each report again in a second process on the first one's caches, into NAME-run2).
#   bash tools/gpu_suites.sh warm-first-calls   (at most 6 minutes) instead: on every GPU, with caches of its own,
#   seeds-small and then seeds-small again on its caches; each row's warm first call over the GPUs' reruns
#   (the median: tools/first_call_runs.py) in $OUT/suites/warm-first-calls.md.
# With fewer GPUs the jobs share them round-robin (slower; one GPU: run the stages of gpu_session.sh instead);
# the realnets jobs then wait for a free GPU (each still within its own limit; REALNETS_JOBS picks some).
# $OUT/suites is packed last into $OUT/suites/results.tgz (tools/pack_out.sh; PACK=0 leaves the files).
# Each job has cache folders of its own (cold first calls, as on a fresh machine) and Inductor compile
# threads of the host's cores / 4: four processes compiling at once on one host read their cold first
# calls slower otherwise (both backends alike). The reports land in $OUT/suites/<name>/; copy them into
# docs/perf/h100/ (convnets from convnets-merged/). NOTE: on the 4-GPU H100 host each part of 5 convnets
# workloads took 190-310 s beside the others, the seeds suite 433 s (the runs of docs/perf/h100).
set -uo pipefail
out=${OUT:-gpu_out}/suites; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
[[ $gpus -ge 1 ]] || { echo "no CUDA device"; exit 1; }
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-$(( $(nproc) / 4 > 1 ? $(nproc) / 4 : 1 ))}
backends=eager,inductor,fusion,inductor:default
convnets="--no-memory --no-cold --no-chart"
part() { ls demos/convnets/*.py | sed -n "$1p" | paste -sd,; }

bench() {  # bench GPU TIMEOUT NAME ARGS...: one report in $out/NAME, its last two lines echoed
  # (timeout -k: a bench stopped inside Inductor's compile outlived its TERM and held the call to its limit)
  local gpu=$1 limit=$2 name=$3; shift 3
  CUDA_VISIBLE_DEVICES=$(( gpu % gpus )) FUSION_CACHE_DIR=/tmp/gpu_suites/$gpu/fusion \
    TORCHINDUCTOR_CACHE_DIR=/tmp/gpu_suites/$gpu/inductor timeout -k 10 "$limit" \
    python3 -m fusion_backend bench --log --out "$out/$name" "$@" >"$out/$name.log" 2>&1
  echo "[$name rc $?] $(tail -2 "$out/$name.log" | tr '\n' ' ' | cut -c1-600)"
}
grid="--dtype fp32,bf16 --mode infer,train --backends $backends"
if [[ ${1:-} == realnets ]]; then  # the realnets suite, default mode and reduce-overhead, one job per GPU
  # diffusers (the VAE decoder's library) travels as wheels in .whl/ (git-ignored; carried to the device), made
  # here with: pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  # --platform manylinux2014_x86_64 -d .whl diffusers importlib_metadata (the GPU image has its other needs)
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site
  fi
  nets="--dtype fp32,bf16 --mode infer,train --backends eager,inductor,fusion --no-memory --no-cold --no-chart
        --steady-state-budget 1.25"
  r=demos/realnets
  # one job per GPU at a time (two jobs timing on one GPU disturb each other): with fewer GPUs than jobs the
  # rest wait for a GPU; REALNETS_JOBS picks some (on a two-GPU host, as one call's limit holds two jobs:
  # "resnet50,vae", then "rest,cudagraphs", then "cudagraphs-rest,cudagraphs-fp32")
  want=",${REALNETS_JOBS:-resnet50,vae,rest,cudagraphs,cudagraphs-rest,cudagraphs-fp32},"
  # REALNETS_RUNS=N: each report N times in a row, each a new process on the caches the one before left
  # (NAME, NAME-run2, ...): what a user's next runs keep, where a settle that measured its regions leaves
  # compiling the graph with them to the next process (README, decide_budget)
  runs() {  # runs GPU LIMIT NAME ARGS...
    local gpu=$1 limit=$2 name=$3; shift 3
    bench "$gpu" "$limit" "$name" "$@"
    for i in $(seq 2 "${REALNETS_RUNS:-1}"); do bench "$gpu" "$limit" "$name-run$i" "$@"; done
  }
  slot=0
  job() {  # job NAME COMMAND...: run on the next GPU when NAME is wanted; wait for a free GPU first
    [[ $want == *",$1,"* ]] || return 0
    shift
    if (( slot > 0 && slot % gpus == 0 )); then wait; fi
    ( "$@" ) &
    slot=$(( slot + 1 ))
  }
  gpu() { echo $(( slot % gpus )); }
  job resnet50 runs "$(gpu)" ${REALNETS_LIMIT:-540} realnets-resnet50 --suite $r/resnet50.py $nets
  job vae runs "$(gpu)" ${REALNETS_LIMIT:-540} realnets-vae --suite $r/sd_vae_decoder.py $nets
  job rest runs "$(gpu)" ${REALNETS_LIMIT:-540} realnets-rest \
    --suite $r/efficientnet_b0.py,$r/r3d_18.py,$r/wav2vec2_base.py,$r/dcgan_generator.py $nets
  cudagraphs() {
    CUDA_VISIBLE_DEVICES=$1 timeout -k 10 120 python3 -m pytest -q -n 0 -rs tests/e2e/test_fp32_precision_gpu.py \
      tests/ops/test_conv_precision.py >"$out/precision-tests.log" 2>&1
    echo "[precision tests rc $?] $(tail -1 "$out/precision-tests.log")"
    runs "$1" ${REALNETS_CG_LIMIT:-400} realnets-cudagraphs --suite $r/resnet50.py,$r/efficientnet_b0.py $nets \
      --dtype bf16 --compile-mode reduce-overhead
  }
  job cudagraphs cudagraphs "$(gpu)"
  # the rest of the reduce-overhead rows, each its own report: join them with
  # python -m fusion_backend bench --merge OUT/realnets-cudagraphs OUT/realnets-cudagraphs-rest OUT/realnets-cudagraphs-fp32
  job cudagraphs-rest runs "$(gpu)" ${REALNETS_LIMIT:-540} realnets-cudagraphs-rest \
    --suite $r/r3d_18.py,$r/wav2vec2_base.py,$r/dcgan_generator.py,$r/sd_vae_decoder.py $nets \
    --compile-mode reduce-overhead
  job cudagraphs-fp32 runs "$(gpu)" ${REALNETS_LIMIT:-540} realnets-cudagraphs-fp32 --suite $r/resnet50.py $nets \
    --dtype fp32 --compile-mode reduce-overhead
  wait
  [[ ${PACK:-1} == 1 ]] && bash tools/pack_out.sh "$out"  # at most 8 files come back
  exit 0
fi
if [[ ${1:-} == warm-first-calls ]]; then  # seeds-small cold, then again on its caches, on every GPU
  for gpu in $(seq 0 $(( gpus - 1 ))); do
    ( bench "$gpu" 240 "seeds-small-$gpu" --suite seeds-small $grid
      bench "$gpu" 130 "warm-seeds-small-$gpu" --suite seeds-small $grid ) &
  done
  wait
  python3 tools/first_call_runs.py "$out"/warm-seeds-small-*/bench.json | tee "$out/warm-first-calls.md"
  [[ ${PACK:-1} == 1 ]] && bash tools/pack_out.sh "$out"  # at most 8 files come back
  exit 0
fi
( bench 0 560 seeds --suite seeds $grid ) &
( bench 1 260 convnets-1 --suite "$(part 1,5)" $grid $convnets
  bench 1 180 seeds-small --suite seeds-small $grid
  bench 1 110 warm-seeds-small --suite seeds-small $grid ) &
( bench 2 340 convnets-2 --suite "$(part 6,10)" $grid $convnets
  bench 2 150 cudagraphs --suite demos/seeds/convt3d_leaky_mul_leaky_maxpool.py,demos/convnets/conv2d_64_k3_relu.py,demos/convnets/convt2d_128_64_k2_s2_relu.py \
    --dtype fp32 --mode infer,train --compile-mode reduce-overhead --no-memory ) &
( bench 3 270 convnets-3 --suite "$(part 11,14)" $grid $convnets
  bench 3 270 convnets-4 --suite "$(part 15,18)" $grid $convnets ) &
wait
python3 -m fusion_backend bench --merge "$out"/convnets-{1,2,3,4} --no-chart --out "$out/convnets-merged" 2>&1 | tail -2
rm -f "$out"/*/bench.png
[[ ${PACK:-1} == 1 ]] && bash tools/pack_out.sh "$out"  # at most 8 files come back
exit 0
