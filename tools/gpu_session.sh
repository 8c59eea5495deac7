#!/usr/bin/env bash
# One GPU session in one call: install, then the named stages in order; logs under $OUT (or ./gpu_out), packed
# last into results.tgz there (tools/pack_out.sh; PACK=0 leaves the files).
#   bash tools/gpu_session.sh tests,kernels,explain,parity,bench      (default: all of them)
# Stages:
#   tests    the whole test suite on CUDA (pytest -n 4 --dist loadgroup: the full-size gpu tests on one worker, as
#            four of them at once run an 80 GB H100 out of memory), then the dynamic-shape test with recompile logs
#   kernels  the kernel-level timing scripts (tools/bench_*.py)
#   explain  python -m fusion_backend explain --train on the seeds suite's three full-size models
#   parity   tools/parity_check.py: the ConvT3d and Conv2d models, fp32 (TF32 off) and bf16, no package import
#   demo     demos/run_demo.py in fp32 and bf16
#   bench    the benchmark's seeds suite, fp32 + bf16, infer + train, with a first, sacrificial Inductor copy
#            and the verdict's baseline compiled after fusion (BACKENDS; BENCH_ARGS adds options); --log: the
#            first lines say whether fusion's kernels compiled in Inductor's worker processes; WARM_RERUN=1 runs
#            it a second time on the caches the first left (bench_warm: its first-call line judges warm rows at 1.2x)
#   convnets one part of the convnets suite (CONVNETS_PART=1..3: six workloads each, as one call allows),
#            fp32 + bf16, infer + train, no memory or cold-L2 readings; join the parts with
#            python -m fusion_backend bench --merge OUT1/convnets OUT2/convnets OUT3/convnets --out DIR
#   families the families suite, fp32 + bf16, infer + train (BACKENDS), after the norm and channel-reduction
#            families' GPU tests (FAMILIES_TESTS=0 skips them)
#   hostbwd  tools/conv_backward_host.py: the conv backward's host time inside fused training steps vs eager's
#   convk    the conv family: its kernel tests (CONVK_TESTS=0 skips them), tools/bench_conv.py on a quarter of ResNet-50's convs and its
#            56x56 3x3 (the weight gradient's worst row) into $out/convk (CONVK_BENCH=0 skips it),
#            then the weight gradient's tile sweep with boxes and several taps per program (CONVK_SWEEP=0 skips it), and with
#            CONVK_HOOKED_SWEEP=1 the tile sweep of the three passes with their hooks; CONVK_STATS=1 also times the
#            forward with the statistics alone against cuDNN + the statistics pass (conv_batch_norm's family candidate);
#            CONVK_TMA=1: the Gluon TMA forward's GPU tests and the forward's tile sweep with each 1x1 tile also
#            as the TMA forward's, plain and hooked, on ResNet-50's largest 1x1 convs; CONVK_WGRAD=1: the weight gradient's
#            GPU tests (the TMA kernel, the split sum) and ResNet-50's stride-1 weight gradients with every tile timed
#            and every row's kernels profiled (--profile)
#   hostrow  the host-bound row (ResNet-50 bf16 inference): tools/bench_step_accounting.py on fresh caches, then
#            twice on the caches the first left (the run where Inductor's graph comes from its cache): once with
#            one repetition per backend in turn, once with --consecutive 10 (HOSTROW_SUITE names another file)
#   bnconv   batch_norm_conv (opt-in): its op and end-to-end GPU tests (BNCONV_TESTS=0 skips them), then ResNet-50's
#            bf16 training step under CUDA graphs with every batch_norm_conv region fused, into $out/bnconv; the log's
#            impl-choice lines time each pass's family and library implementations (BNCONV_SUITE names other
#            model files, comma-separated)
#   vae      the SD VAE decoder's paths: the GPU tests of the upsample fold, the GroupNorm family, the input-norm
#            prologue, autocast's casts around regions and the residual's library pass (VAE_TESTS=0 skips them), then the decoder in bf16 inference with every region measured, under
#            CUDA graphs and in the default mode, into $out/vae-ro and $out/vae-default, each region's verdict printed
#            (diffusers from the wheels under .whl/, carried to the device: device/README.md)
#   halo     the halo forward (kernels/conv/halo.py): its GPU tests (box and flat tiles, statistics, window steps),
#            the SD VAE decoder's four largest GroupNorm + SiLU 3x3 forwards (tools/bench_conv.py --fprop-hooks
#            gn-silu --profile) into $out/gn-silu, then ResNet-50's hooked 3x3 forwards (prologue and statistics)
#            with the halo's tiles flat and as box tiles (tools/sweep_conv_tiles.py --hooked --halo --box --grid) into
#            $out/halo-sweep.json: box tiles against the flat halo where a forward writes statistics
#   strided  the TMA 1x1 kernel at a stride past 1 (kernels/conv/tma_fprop.py: the forward's strided boxes, the
#            input gradient's zeros): the kernel's GPU tests (every stride), then ResNet-50's stride-2 1x1 forwards and input gradients
#            (tools/bench_conv.py --filter '*k1x1 s2*' --profile) into $out/strided-fprop and $out/strided-dgrad
#   firstcall tools/first_call.py, cold and warm, on Conv2d 64->64 (infer, train), Conv3d (infer), ConvT3d (train)
#            (FIRSTCALL_ARGS adds options, e.g. "--warm-runs 1 --profile 25": where each first call's time goes)
set -uo pipefail
stages=${1:-tests,kernels,explain,parity,bench}
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
has() { [[ ",$stages," == *",$1,"* ]]; }
# the wheels carried under .whl/ (diffusers for the SD VAE decoder: device/README.md), on PYTHONPATH
install_wheels() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      >>"$out/install.log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
}
# The first model a case compiles times a few percent slower on host-bound rows (docs/perf/RESULTS.md,
# noise section): a first Inductor copy takes that place, and the verdict judges fusion against the
# copy compiled after it.
BACKENDS=${BACKENDS:-eager,inductor,fusion,inductor:default}
rc=0
if has tests; then
  timeout -k 10 "${TESTS_TIMEOUT:-560}" python3 -m pytest -v -rf -n "${TEST_WORKERS:-4}" --dist loadgroup -p no:cacheprovider tests >"$out/pytest.log" 2>&1 || rc=1
  grep -E " (FAILED|ERROR)|^(FAILED|ERROR)|passed|failed" "$out/pytest.log" | tail -40  # -v: names even if timed out
  TORCH_LOGS=recompiles timeout -k 10 60 python3 -m pytest -q -p no:cacheprovider tests/e2e/test_e2e_conv_epilogue.py \
    -k dynamic_true 2>&1 | grep -i -E -A4 "recompil|passed|failed" | grep -v DEBUG | head -20
fi
if has kernels; then
  for t in tools/bench_conv_fused.py tools/bench_conv_fused_bwd.py tools/bench_conv_global_mean.py; do
    [[ -f $t ]] && { echo "== $t"; timeout -k 10 "${KERNEL_TIMEOUT:-120}" python3 "$t" 2>&1 | grep -v -i warn | tee -a "$out/kernels.log" | tail -30; }
  done
fi
if has explain; then
  for s in convt3d_leaky_mul_leaky_maxpool conv2d_mul_leaky_gelu convt2d_global_mean_bias_logsumexp; do
    timeout -k 10 60 python3 -m fusion_backend explain "demos/seeds/$s.py" --train 2>&1 | grep -v -i warn \
      | tee -a "$out/explain.log" | tail -14
  done
fi
if has parity; then
  timeout -k 10 150 python3 tools/parity_check.py 2>&1 | grep -E "PASS|FAIL|skipped|imported" | tee "$out/parity.log"
fi
if has demo; then
  for d in fp32 bf16; do
    timeout -k 10 150 python3 demos/run_demo.py --seeds convt3d,conv2d,convt2d --dtype "$d" 2>&1 | grep -v -i warn | tee -a "$out/demo.log" | tail -40
  done
fi
if has bench; then
  seeds_bench() {  # seeds_bench NAME: the seeds run into $out/NAME, its log $out/NAME.log
    timeout -k 10 "${BENCH_TIMEOUT:-300}" python3 -m fusion_backend bench --log --suite seeds --dtype fp32,bf16 --mode infer,train \
      --backends "$BACKENDS" --out "$out/$1" ${BENCH_ARGS:-} >"$out/$1.log" 2>&1
  }
  seeds_bench bench
  grep -E "in worker processes|in this process from now on" "$out/bench.log" | cut -c1-400 | head -6
  tail -33 "$out/bench.log"
  if [[ ${WARM_RERUN:-0} == 1 ]]; then  # the same run again on the caches the first left: the warm first calls
    seeds_bench bench_warm
    tail -3 "$out/bench_warm.log"
  fi
fi
if has convnets; then
  part=${CONVNETS_PART:-1}
  files=$(ls demos/convnets/*.py | sed -n "$(( (part - 1) * 6 + 1 )),$(( part * 6 ))p" | paste -sd,)
  timeout -k 10 "${BENCH_TIMEOUT:-520}" python3 -m fusion_backend bench --log --suite "$files" --dtype fp32,bf16 \
    --mode infer,train --no-memory --no-cold --no-chart --backends "$BACKENDS" --out "$out/convnets" ${BENCH_ARGS:-} \
    >"$out/convnets.log" 2>&1
  tail -40 "$out/convnets.log"
fi
if has families; then
  if [[ ${FAMILIES_TESTS:-1} == 1 ]]; then
    timeout -k 10 200 python3 -m pytest -q -p no:cacheprovider -n 4 tests/ops/test_conv_group_norm_op.py \
      tests/ops/test_conv_batch_norm_op.py tests/kernels/test_group_norm_kernel.py tests/e2e/test_e2e_conv_group_norm.py \
      tests/e2e/test_e2e_conv_batch_norm.py tests/e2e/test_e2e_conv_channel_reduce.py tests/ops/test_conv_layer_norm_op.py \
      tests/kernels/test_layer_norm_kernel.py tests/e2e/test_e2e_conv_layer_norm.py tests/kernels/test_norm_pool_kernel.py \
      >"$out/families_tests.log" 2>&1 || rc=1
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/families_tests.log" | tail -20
  fi
  timeout -k 10 "${BENCH_TIMEOUT:-330}" python3 -m fusion_backend bench --log --suite families --dtype fp32,bf16 --mode infer,train \
    --no-memory --no-chart --backends "$BACKENDS" --out "$out/families" ${BENCH_ARGS:-} >"$out/families.log" 2>&1
  tail -32 "$out/families.log"
fi
if has hostbwd; then
  timeout -k 10 120 python3 tools/conv_backward_host.py demos/convnets/conv2d_64_k3_relu_batch1.py \
    demos/convnets/conv2d_depthwise_144_k3_relu6.py 2>&1 | grep -v -i warn | tee "$out/hostbwd.log" | tail -12
fi
if has convk; then
  if [[ ${CONVK_TESTS:-1} == 1 ]]; then
    timeout -k 10 240 python3 -m pytest -q -n 4 -p no:cacheprovider tests/kernels >"$out/convk_tests.log" 2>&1 || rc=1
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/convk_tests.log" | tail -12
  fi
  if [[ ${CONVK_BENCH:-1} == 1 ]]; then
    timeout -k 10 200 python3 tools/bench_conv.py demos/realnets/resnet50.py --shard 1/4 --rounds 3 --out "$out/convk" \
      >"$out/convk.log" 2>&1
    timeout -k 10 90 python3 tools/bench_conv.py demos/realnets/resnet50.py --filter "*64x64x56x56 -> 64 k3x3*" --rounds 3 \
      --out "$out/convk" --append >>"$out/convk.log" 2>&1
    sed -n '/## Summary/,/## Rows/p' "$out/convk/bench.md" | head -12
  fi
  if [[ ${CONVK_SWEEP:-1} == 1 ]]; then
    timeout -k 10 150 python3 tools/sweep_conv_tiles.py demos/realnets/resnet50.py --passes wgrad --box --taps --max-shapes 4 \
      --out "$out/convk_sweep.json" 2>&1 | grep -v -i warn | tail -16
  fi
  if [[ ${CONVK_STATS:-0} == 1 ]]; then  # the forward with the statistics alone: conv_batch_norm's family candidate
    timeout -k 10 150 python3 tools/bench_conv.py demos/realnets/resnet50.py --passes fprop --fprop-hooks stats \
      --shard 1/2 --rounds 3 --out "$out/convk_stats" >"$out/convk_stats.log" 2>&1
    sed -n '/## Summary/,/## Rows/p' "$out/convk_stats/bench.md" | head -8
  fi
  if [[ ${CONVK_TMA:-0} == 1 ]]; then  # the TMA forward: its tests, then its tiles against the gather's
    timeout -k 10 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_conv_family_fprop.py \
      tests/kernels/test_conv_stats_reduction.py -k "tma or stat" >"$out/convk_tma_tests.log" 2>&1 || rc=1
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/convk_tma_tests.log" | tail -12
    for hooked in "" "--hooked"; do
      timeout -k 10 150 python3 tools/sweep_conv_tiles.py demos/realnets/resnet50.py --filter "*k1x1*" \
        --passes fprop --tma $hooked --max-shapes 6 --out "$out/convk_tma_sweep${hooked:+_hooked}.json" 2>&1 \
        | grep -v -i warn | tail -24
    done
  fi
  if [[ ${CONVK_WGRAD:-0} == 1 ]]; then  # the weight gradient: the TMA kernel's and the split sum's tests, then
    # ResNet-50's stride-1 weight gradients with every candidate tile timed (docs/perf/h200/conv-kernels-wgrad)
    timeout -k 10 150 python3 -m pytest -q -n 4 -p no:cacheprovider tests/kernels/test_conv_family_tma_wgrad.py \
      tests/kernels/test_conv_family_backward.py tests/kernels/test_split_sum.py >"$out/convk_wgrad_tests.log" 2>&1 || rc=1
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/convk_wgrad_tests.log" | tail -12
    timeout -k 10 240 python3 tools/bench_conv.py demos/realnets/resnet50.py --passes wgrad --profile \
      --filter '*k3x3 p1 g1*,*k1x1 p0 g1*' --rounds 3 --out "$out/convk_wgrad" >"$out/convk_wgrad.log" 2>&1
    sed -n '/## Summary/,/## Rows/p' "$out/convk_wgrad/bench.md" | head -8
  fi
  if [[ ${CONVK_HOOKED_SWEEP:-0} == 1 ]]; then  # the tile grid on the hooked passes (the candidates are the plain ones')
    timeout -k 10 240 python3 tools/sweep_conv_tiles.py demos/realnets/resnet50.py --hooked --box --taps --passes fprop,dgrad,wgrad \
      --max-shapes 4 --out "$out/convk_hooked_sweep.json" 2>&1 | grep -v -i warn | tail -24
  fi
fi
if has hostrow; then
  caches=$(mktemp -d)
  for run in "fresh" "warm" "warm-blocks --consecutive 10"; do
    read -r name extra <<<"$run"
    echo "== hostrow $name"
    TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton FUSION_CACHE_DIR=$caches/fusion \
      timeout -k 10 170 python3 tools/bench_step_accounting.py --in-a-row 30 -- \
      --suite "${HOSTROW_SUITE:-demos/realnets/resnet50.py}" --dtype bf16 --mode infer --backends "$BACKENDS" \
      --no-memory --no-cold --no-chart --out "$out/hostrow_$name" ${extra:-} >"$out/hostrow_$name.log" 2>&1
    grep -E "^resnet|fusion >=|calls  wall|static|triton'|Bypassing|x " "$out/hostrow_$name.log" | cut -c1-220 | tail -24
  done
fi
if has bnconv; then
  if [[ ${BNCONV_TESTS:-1} == 1 ]]; then
    timeout -k 10 300 python3 -m pytest -q -n 4 --dist loadgroup -p no:cacheprovider tests/ops/test_batch_norm_conv_op.py \
      tests/e2e/test_e2e_batch_norm_conv.py tests/ops/test_conv_batch_norm_op.py tests/e2e/test_e2e_conv_batch_norm.py \
      tests/kernels/test_norm_pool_kernel.py >"$out/bnconv_tests.log" 2>&1 || rc=1
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/bnconv_tests.log" | tail -12
  fi
  FUSION_CACHE_DIR=$(mktemp -d) FUSION_DECIDE=fuse FUSION_PATTERNS=batch_norm_conv timeout -k 10 280 python3 -m fusion_backend \
    bench --log --suite "${BNCONV_SUITE:-demos/realnets/resnet50.py}" --dtype bf16 --mode train --backends eager,inductor,fusion \
    --no-memory --no-cold --no-chart --compile-mode reduce-overhead --out "$out/bnconv" >"$out/bnconv.log" 2>&1
  grep -E "impl choice batch_norm_conv" "$out/bnconv.log" \
    | sed -E 's/.*[|](forward|input_grad|weight_grad)[|].*x (\([0-9, ]+\)).*w (\([0-9, ]+\)).*: (library|family) (.*)/\1 x\2 w\3 -> \4 \5/' | sort -u
  tail -4 "$out/bnconv.log"
fi
if has vae; then
  install_wheels
  if [[ ${VAE_TESTS:-1} == 1 ]]; then
    timeout -k 10 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_upsample_fold_kernel.py \
      tests/ops/test_upsample_fold.py tests/e2e/test_e2e_upsample_conv.py tests/ops/test_conv_group_norm_op.py \
      tests/ops/test_conv_epilogue_input_norm.py tests/kernels/test_group_norm_kernel.py tests/e2e/test_e2e_conv_group_norm.py \
      tests/e2e/test_e2e_autocast_casts.py tests/ops/test_conv_epilogue_residual.py tests/ops/test_cudnn_fused_forward.py \
      >"$out/vae_tests.log" 2>&1 || rc=1
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/vae_tests.log" | tail -12
  fi
  for mode in ro default; do
    extra=(); [[ $mode == ro ]] && extra=(--compile-mode reduce-overhead)
    timeout -k 10 240 python3 -m fusion_backend bench --log --suite demos/realnets/sd_vae_decoder.py --dtype bf16 \
      --mode infer --backends inductor,fusion-decide-all --no-memory --no-cold --no-chart "${extra[@]}" \
      --out "$out/vae-$mode" >"$out/vae-$mode.log" 2>&1
    echo "== vae $mode"; grep -E "^[|] sd_vae" "$out/vae-$mode/bench.md" | head -1
    grep -h "fusion-decide-all" "$out/vae-$mode/bench.md" | grep -v cached | sed 's/.*fusion-decide-all[^:]*: //' | cut -c1-200
  done
fi
if has halo; then
  install_wheels
  timeout -k 10 150 python3 -m pytest -q -n 4 -p no:cacheprovider tests/kernels/test_conv_family_fprop.py \
    -k "halo or box" >"$out/halo_tests.log" 2>&1 || rc=1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/halo_tests.log" | tail -12
  timeout -k 10 150 python3 tools/bench_conv.py demos/realnets/sd_vae_decoder.py --passes fprop --fprop-hooks gn-silu \
    --filter '*1x512x128x128 -> 512 k3x3*,*1x512x256x256 -> 256 k3x3*,*1x256x512x512 -> 256 k3x3*,*1x128x512x512 -> 128 k3x3*' \
    --rounds 3 --profile --out "$out/gn-silu" 2>&1 | tail -12
  timeout -k 10 240 python3 tools/sweep_conv_tiles.py demos/realnets/resnet50.py --passes fprop --hooked --halo --box \
    --grid '128x256x64 w8 s3,128x128x64 w8 s3,128x64x64 w8 s3,64x128x64 w4 s3,64x64x64 w4 s3' \
    --filter '*k3x3 p1 g1*' --budget-s 200 --out "$out/halo-sweep.json" 2>&1 | tail -24
fi
if has strided; then
  timeout -k 10 300 python3 -m pytest -q -n 12 -p no:cacheprovider tests/kernels/test_conv_family_fprop.py \
    tests/kernels/test_conv_family_backward.py -k "tma" >"$out/strided_tests.log" 2>&1 || rc=1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/strided_tests.log" | tail -12
  for pass in fprop dgrad; do
    timeout -k 10 150 python3 tools/bench_conv.py demos/realnets/resnet50.py --passes "$pass" --filter '*k1x1 s2*' \
      --rounds 3 --profile --out "$out/strided-$pass" 2>&1 | tail -8
  done
fi
if has firstcall; then
  for spec in "demos/convnets/conv2d_64_k3_relu.py infer" "demos/convnets/conv2d_64_k3_relu.py train" \
              "demos/convnets/conv3d_32_64_k3_leaky_maxpool.py infer" "demos/seeds/convt3d_leaky_mul_leaky_maxpool.py train"; do
    read -r model mode <<<"$spec"
    timeout -k 10 150 python3 tools/first_call.py "$model" --mode "$mode" --dtype fp32 --log ${FIRSTCALL_ARGS:-} 2>&1 \
      | tee -a "$out/first_call.log" | grep -E "cold|budget|launch:|profile"
  done
fi
[[ ${PACK:-1} == 1 ]] && bash tools/pack_out.sh "$out"  # at most 8 files come back
exit $rc
