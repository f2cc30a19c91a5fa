#!/usr/bin/env bash
# The speed checks on one GPU, stage by stage, each under its own time limit:
#
#   bash benchmarks/gpu_speed.sh MULTI30K_DIR FLAX_WMT_DIR OUT STAGE...
#
# Checks (the tests that need a GPU):
#   cudnn_check       cuDNN's attention in the model against XLA's
#   attention_check   the Pallas attention kernels against flax's attention, and the model with
#                     them against XLA's
#   loss_check        the one-pass ('online') loss against the separate passes
# Speed:
#   base_train        train.py with configs/default.py on Multi30k text (rows of 128, packed),
#                     1,000 steps, as configured (the Pallas attention), then the bfloat16 matmul
#                     peak; base_train_cudnn the same with cuDNN's attention
#   vs_flax_base      the train step at the paper's base size, bfloat16, 256x64, against flax
#                     examples/wmt, like for like and as shipped, 1 and 5 steps per wait
#   vs_flax_multi30k  the same at configs/multi30k.py's size, 64x64, float32, and like for like
#                     with XLA's defaults and with the dot merger off as variants
#   multi30k          the recipe's train.py from an empty compilation cache under
#                     benchmarks.start_up, then eval.py on test2016
#   profile_base_train  benchmarks.profile_step of base_train's step at its shapes; with _flax
#                     flax's step, _xla_attention XLA's attention, _cudnn cuDNN's, _separate_loss
#                     the loss's separate passes over the logits
# Logs and results go to OUT/<stage>.log and OUT/results/, the machine's versions to
# OUT/environment.txt; the figures that docs/speed.md quotes are printed last. Workdirs and the
# cache stay in /tmp/gpu_speed for later stages.
set -uo pipefail
data=$1 flax=$2 out=$3
shift 3
mkdir -p "$out/results"
work=/tmp/gpu_speed
mkdir -p "$work"
cache=$work/jax_cache
export PYTHONUNBUFFERED=1
# The benchmarks compile the same base-size step in several stages: compile it once.
export JAX_COMPILATION_CACHE_DIR=$work/benchmark_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0

run() {  # run NAME SECONDS COMMAND...: the command's output in OUT/NAME.log, its time and status
  local name=$1 limit=$2
  shift 2
  local began=$(date +%s.%N)
  timeout "$limit" "$@" >>"$out/$name.log" 2>&1
  local status=$?
  echo "$name: rc=$status in $(awk "BEGIN {print $(date +%s.%N) - $began}") s" |
    tee -a "$out/summary.txt"
  return $status
}

# What every stage ran on: jax's report (versions, nvidia-smi), the compute capability, cuDNN's.
timeout 60 python3 -c 'import jax; jax.print_environment_info(); device = jax.devices()[0]
from jax._src.lib import cuda_versions  # cuDNN version: jax has no public query
print("compute capability:", getattr(device, "compute_capability", None), "cuDNN:",
      cuda_versions and cuda_versions.cudnn_get_version())' >"$out/environment.txt" 2>&1

for stage in "$@"; do
  case $stage in
    cudnn_check)
      run cudnn_check 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_ops.py \
        -k cudnn ;;
    attention_check)
      run attention_check 240 python3 -m pytest -q -p no:cacheprovider \
        tests/kernels/test_pallas_attention.py tests/kernels/test_ops.py -k 'kernels or attention' ;;
    loss_check)
      run loss_check 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernel_loss.py \
        -k online ;;
    base_train|base_train_cudnn)
      cudnn=()
      [[ $stage == *cudnn ]] && cudnn=(--config.implementation.attention=cudnn)
      run "$stage" 240 python3 train.py --config=configs/default.py --workdir="$work/$stage" \
        --config.dataset=multi30k --config.manual_dir="$data" --config.vocab_size=16000 \
        --config.max_length=128 --config.packing=True --config.num_train_steps=1000 \
        --config.log_every_steps=100 --config.eval_every_steps=0 --config.bleu_every_steps=0 \
        --config.checkpoint_every_secs=0 --config.compilation_cache_dir="$cache" \
        ${cudnn[@]+"${cudnn[@]}"}
      cp "$work/$stage/metrics.jsonl" "$out/results/${stage}_metrics.jsonl"
      # The bfloat16 matmul peak right after, for the step's share of it.
      run base_train_peak 60 python3 -c 'import jax.numpy as jnp; from benchmarks import measure
print("bfloat16 matmul peak", measure.matmul_peak(10, jnp.bfloat16))' ;;
    vs_flax_base)
      run vs_flax_base 240 python3 -m benchmarks.vs_flax --size=base --train_shapes=256x64 \
        --steps_per_call=1,5 --beam_shape= --repeats=10 --flax_dir="$flax" \
        --output="$out/results" --name=vs_flax_base_gpu ;;
    vs_flax_multi30k)
      run vs_flax_multi30k 150 python3 -m benchmarks.vs_flax --train_shapes=64x64 \
        --steps_per_call=1,5 --repeats=10 --variant=xla_flags= \
        --variant="xla_flags='--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=false --xla_disable_hlo_passes=dot-merger'" \
        --flax_dir="$flax" --output="$out/results" --name=vs_flax_multi30k_gpu ;;
    multi30k)
      run multi30k_start_up 200 python3 -m benchmarks.start_up --manual_dir="$data" \
        --label=cold --run_to_exit --workdir="$work/recipe" --output="$out/results" \
        --override=compilation_cache_dir="$cache"
      cp "$work/recipe/train.log" "$out/multi30k_cold_log.txt"
      run multi30k_eval_test 60 python3 eval.py --workdir="$work/recipe" --split=test \
        --output_dir="$out/results/eval_test" ;;
    profile_base_train|profile_base_train_flax|profile_base_train_xla_attention|\
    profile_base_train_cudnn|profile_base_train_separate_loss)
      side=ours variant='vocab_size=16000 max_length=128 packing=True'
      case $stage in
        *flax) side=flax ;;
        *xla_attention) variant+=' implementation.attention=xla' ;;
        *cudnn) variant+=' implementation.attention=cudnn' ;;
        *separate_loss) variant+=' implementation.loss_reduction=separate' ;;
      esac
      run "$stage" 150 python3 -m benchmarks.profile_step --size=base --shape=192x128 --packed \
        --variant="$variant" --steps=3 --side=$side --flax_dir="$flax" --top=30 \
        --output="$out/results" --name="${stage}_gpu" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done

echo; cat "$out/summary.txt"; tail -n 1 "$out/environment.txt"
tail -n 4 "$out"/*_check.log 2>/dev/null
for f in "$out"/results/*.md; do echo "== $f"; cat "$f"; done
for f in "$out"/results/eval_*/scores.json; do echo "== $f"; cat "$f"; done
for f in "$out"/results/*metrics.jsonl; do
  echo "== $f"; grep -v '"split"' "$f" | tail -n 3 | cut -c1-700
done
grep -h 'matmul peak' "$out"/base_train_peak.log 2>/dev/null
exit 0
