#!/usr/bin/env bash
# The speed checks on one GPU, stage by stage, each under its own time limit:
#
#   bash benchmarks/gpu_speed.sh MULTI30K_DIR FLAX_WMT_DIR OUT STAGE...
#
# STAGE: cudnn_check (the tests that need a GPU: cuDNN attention against XLA's), fused_norm_check
# (transformer/fused_norm.py's tests, its Triton kernels compiled for the GPU), loss_check (the
# online loss and the fused loss kernel, transformer/fused_loss.py, against the separate passes,
# on the GPU), attention_check (transformer/fused_attention.py's kernels against flax's attention,
# and the model with them and with cuDNN's against XLA's, on the GPU), attention_speed (the
# attention alone, forward and backward, cuDNN's, XLA's and the Pallas kernels at 4, 8, 16 warps,
# their backward over all queries at once or 32 at a time, at base_train's shapes:
# benchmarks.attention_speed), vs_flax_base (train step
# at the paper's base size, bfloat16, against flax examples/wmt, as configured: Triton's matmuls
# off, XLA's merging of matmuls that share an input off, the weights sliced before their matmuls),
# multi30k (the recipe's train.py from an empty compilation cache, then eval.py on test2016;
# each multi30k stage but pyspy runs train.py under benchmarks.start_up: seconds to its first log
# line, first training row, last checkpoint and exit in OUT/results/start_up.md),
# multi30k_warm (the recipe's train.py again, from the cache the multi30k stage filled, and what
# comes before its first log line: imports, the look for a cluster, the backend's start),
# multi30k_one_checkpoint (as multi30k_warm, but only the last step is checkpointed: what the 26
# checkpoints cost the loop), multi30k_switch5ms (as multi30k_warm, with Python's thread switch
# interval at its default 5 ms instead of train.py's 0.5 ms: what the checkpoint saver's turns on
# the interpreter cost the loop), imports (train.py's imports module by module, `python -X
# importtime`, in OUT/results/importtime.txt, and whether the installed packages' compiled
# bytecode is there to be read), bytecode_cache (the stages after it keep the bytecode that
# Python compiles in a cache of their own, PYTHONPYCACHEPREFIX, filled by one import of train.py,
# as an installation compiles it once; imports after it writes importtime_bytecode_cache.txt),
# multi30k_pyspy (multi30k_warm twice under py-spy, $PY_SPY or py-spy on the PATH: which thread
# holds the GIL, then every thread's Python and native frames; speedscope files in OUT/results),
# multi30k_triton (the recipe's train.py from another empty cache with XLA's Triton matmuls,
# which configs/default.py turns off: what they cost in compilation and give in speed),
# multi30k_autotune0 (Triton's matmuls off, as configured, and XLA's autotuning off too:
# cuBLAS's own choice of kernels),
# checkpoint_cost (what a save of the recipe's state costs a loop of Python steps on this host,
# the checkpoints of this checkout against those of 01db0da, one array per leaf),
# base_train (train.py with configs/default.py on Multi30k text, 1,000 steps: its first ~30 s
# share the GPU with the compilation of the closing translation's programs; as configured, its
# rows of 128 take the fused attention's Pallas kernels; base_train_cudnn the same with cuDNN's
# attention, model.attention_implementation=cudnn, and base_train_fused with the layer norm's and
# the loss's Pallas kernels too, model.norm_implementation=pallas and loss_reduction=pallas),
# profile_base_train
# (benchmarks.profile_step of base_train's step at its shapes, packed random rows; with _flax
# flax's step, with _xla_attention XLA's attention instead of Pallas's, with _separate_loss the
# loss's separate passes over the logits instead of one, with _before the checkout in $BEFORE, an
# earlier commit's configs/ and transformer/: a change's effect on the same machine, with _fused
# the layer norm's and the loss's Pallas kernels, with _fused_norm the layer norm's alone, with
# _fused_loss the loss's alone, with _cudnn cuDNN's attention instead of Pallas's), profile_base
# and profile_base_flax (benchmarks.profile_step at base size, 256x64, ours and flax's, traces
# kept),
# profile_multi30k and profile_multi30k_flax (the same at configs/multi30k.py's size, 64x64),
# vs_flax_multi30k (as configured, Triton's matmuls off, and as variants without XLA's dot merger
# and with XLA's defaults; the vs_flax stages time 1 and 5 steps per wait). Logs and results go to
# OUT/<stage>.log and OUT/results/, the machine's versions to OUT/environment.txt; the figures that
# docs/speed.md quotes are printed last.
# Workdirs and the cache stay in /tmp/gpu_speed for later stages. Where the machine sends back only
# a few files, give an OUT outside the returned folder and pack it into one archive there.
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

recipe=(python3 train.py --config=configs/multi30k.py --config.manual_dir="$data"
        --config.compilation_cache_dir="$cache")  # the Multi30k recipe, with the persistent cache

start_up() {  # start_up NAME SECONDS CACHE [KEY=VALUE|--FLAG...]: the recipe under
              # benchmarks.start_up, with those config overrides and flags of its own
  local name=$1 limit=$2 cache_dir=$3 args=()
  shift 3
  for arg in "$@"; do [[ $arg == --* ]] && args+=("$arg") || args+=("--override=$arg"); done
  run "multi30k_start_up_$name" "$limit" python3 -m benchmarks.start_up --manual_dir="$data" \
    --label="$name" --run_to_exit --workdir="$work/recipe_$name" --output="$out/results" \
    --override=compilation_cache_dir="$cache_dir" "${args[@]}"
  cp "$work/recipe_$name/train.log" "$out/multi30k_train_$name.log"
  cp "$work/recipe_$name/metrics.jsonl" "$out/results/multi30k_${name}_metrics.jsonl"
}

for stage in "$@"; do
  case $stage in
    cudnn_check)
      run cudnn_check 90 python3 -m pytest -q -p no:cacheprovider tests/test_model.py -k cudnn ;;
    fused_norm_check)
      run fused_norm_check 240 python3 -m pytest -q -p no:cacheprovider tests/test_fused_norm.py ;;
    loss_check)
      run loss_check 120 python3 -m pytest -q -p no:cacheprovider tests/test_loss.py \
        -k 'online or pallas' ;;
    attention_check)
      run attention_check 240 python3 -m pytest -q -p no:cacheprovider \
        tests/test_fused_attention.py tests/test_model.py -k 'kernels or fused_attention' ;;
    attention_speed)
      run attention_speed 90 python3 -m benchmarks.attention_speed --output="$out/results" \
        --name=attention_speed_gpu ;;
    vs_flax_base)
      run vs_flax_base 240 python3 -m benchmarks.vs_flax --size=base --train_shapes=256x64 \
        --steps_per_call=1,5 --beam_shape= --repeats=10 --flax_dir="$flax" \
        --output="$out/results" --name=vs_flax_base_gpu ;;
    multi30k)
      start_up cold 200 "$cache"
      run multi30k_eval_test 60 python3 eval.py --workdir="$work/recipe_cold" --split=test \
        --output_dir="$out/results/eval_test" ;;
    multi30k_warm)
      start_up warm 240 "$cache" --parts ;;
    multi30k_one_checkpoint)
      start_up one_checkpoint 240 "$cache" checkpoint_every_steps=0 average_last=1 ;;
    multi30k_switch5ms)
      # The warm recipe with Python's default switch interval, which train.py would lower: the
      # 50-step intervals after each checkpoint against multi30k_warm's.
      run multi30k_switch5ms 240 python3 -c 'import runpy, sys; sys.setswitchinterval(5e-3)
sys.setswitchinterval = lambda interval: None
sys.argv = ["train.py", *sys.argv[1:]]; runpy.run_path("train.py", run_name="__main__")' \
        "${recipe[@]:2}" --workdir="$work/recipe_switch5ms" ;;
    imports)
      run imports 60 bash -c 'python3 -X importtime -c "import train" 2>"$0"' \
        "$out/results/importtime${PYTHONPYCACHEPREFIX:+_bytecode_cache}.txt"
      run imports_bytecode 30 python3 -c 'import importlib.util, os, sys
print("bytecode written:", not sys.flags.dont_write_bytecode, "cache:", sys.pycache_prefix)
for name in ("jax", "flax", "optax", "orbax.checkpoint", "tensorflow_datasets", "transformer"):
  source = importlib.util.find_spec(name).origin
  print(name, source, "compiled:", os.path.exists(importlib.util.cache_from_source(source)),
        "writable:", os.access(os.path.dirname(source), os.W_OK))' ;;
    bytecode_cache)
      # An installation compiles its packages' bytecode once; where the image's packages have none
      # and their folders cannot take it, or PYTHONDONTWRITEBYTECODE is set, Python compiles them
      # at every start. From here on, bytecode goes to a cache of its own, filled by one import of
      # train.py.
      unset PYTHONDONTWRITEBYTECODE
      export PYTHONPYCACHEPREFIX=$work/pycache
      run bytecode_cache 120 python3 -c 'import train' ;;
    multi30k_pyspy)
      for mode in gil native; do
        # Native frames need the process paused at each sample: fewer samples.
        [[ $mode == gil ]] && spy=(--gil --nonblocking -r 200) || spy=(--native --idle -r 50)
        run "multi30k_pyspy_$mode" 240 "${PY_SPY:-py-spy}" record --threads "${spy[@]}" \
          -f speedscope -o "$out/results/multi30k_pyspy_$mode.json" -- \
          "${recipe[@]}" --workdir="$work/recipe_pyspy_$mode"
      done ;;
    multi30k_triton)
      start_up triton 120 "$work/jax_cache_triton" xla_flags= ;;
    multi30k_autotune0)
      start_up autotune0 120 "$work/jax_cache_autotune0" \
        "xla_flags=--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=false --xla_gpu_autotune_level=0" ;;
    checkpoint_cost)
      run checkpoint_cost 90 python3 -m benchmarks.checkpoint_cost --baseline=01db0da --rounds=3 \
        --saves=5 --output="$out/results" --label="GPU host" ;;
    base_train|base_train_cudnn|base_train_fused)
      fused=()
      [[ $stage == *cudnn ]] && fused=(--config.model.attention_implementation=cudnn)
      [[ $stage == *fused ]] && fused=(--config.model.norm_implementation=pallas
                                       --config.loss_reduction=pallas)
      run "$stage" 240 python3 train.py --config=configs/default.py --workdir="$work/$stage" \
        --config.dataset=multi30k --config.manual_dir="$data" --config.vocab_size=16000 \
        --config.max_length=128 --config.packing=True --config.num_train_steps=1000 \
        --config.log_every_steps=100 --config.eval_every_steps=0 --config.bleu_every_steps=0 \
        --config.checkpoint_every_secs=0 --config.compilation_cache_dir="$cache" \
        ${fused[@]+"${fused[@]}"}
      cp "$work/$stage/metrics.jsonl" "$out/results/${stage/base_train/base}_metrics.jsonl"
      # The bfloat16 matmul peak right after, for the step's share of it.
      run base_train_peak 60 python3 -c 'import jax.numpy as jnp; from benchmarks import measure
print("bfloat16 matmul peak", measure.matmul_peak(10, jnp.bfloat16))' ;;
    profile_base|profile_base_flax|profile_multi30k|profile_multi30k_flax)
      side=ours; [[ $stage == *flax ]] && side=flax
      size=${stage#profile_}; size=${size%_flax}
      shape=256x64; [[ $size == multi30k ]] && shape=64x64
      run "$stage" 150 python3 -m benchmarks.profile_step --size=$size --shape=$shape --steps=3 \
        --side=$side --flax_dir="$flax" --keep_trace --top=25 --output="$out/results" \
        --name="${stage}_gpu" ;;
    profile_base_train|profile_base_train_flax|profile_base_train_xla_attention|\
    profile_base_train_separate_loss|profile_base_train_before|profile_base_train_fused|\
    profile_base_train_fused_norm|profile_base_train_fused_loss|profile_base_train_cudnn)
      # base_train's step at its shapes before 752b5d9 (192 rows since): 202 packed rows of 128,
      # vocabulary 16000, as the earlier profiles.
      side=ours variant='vocab_size=16000 max_length=128 packing=True' ours=
      case $stage in
        *flax) side=flax ;;
        *xla_attention) variant+=' model.attention_implementation=xla' ;;
        *separate_loss) variant+=' loss_reduction=separate' ;;
        *before) ours=${BEFORE:?BEFORE=DIR: the earlier checkout to profile} ;;
        *fused) variant+=' model.norm_implementation=pallas loss_reduction=pallas' ;;
        *fused_norm) variant+=' model.norm_implementation=pallas' ;;
        *fused_loss) variant+=' loss_reduction=pallas' ;;
        *cudnn) variant+=' model.attention_implementation=cudnn' ;;
      esac
      run "$stage" 150 python3 -m benchmarks.profile_step --size=base --shape=202x128 --packed \
        --variant="$variant" --steps=3 --side=$side --flax_dir="$flax" --top=30 \
        --ours="$ours" --output="$out/results" --name="${stage}_gpu" ;;
    vs_flax_multi30k)
      run vs_flax_multi30k 150 python3 -m benchmarks.vs_flax --train_shapes=64x64 \
        --steps_per_call=1,5 --repeats=10 --variant=xla_flags= \
        --variant="xla_flags='--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=false --xla_disable_hlo_passes=dot-merger'" \
        --flax_dir="$flax" --output="$out/results" --name=vs_flax_multi30k_gpu ;;
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
cat "$out"/imports_bytecode.log 2>/dev/null
for f in "$out"/results/importtime*.txt; do  # the slowest imports, cumulative
  [[ -f $f ]] && { echo "== $f"; sort -t'|' -k2 -n "$f" | tail -n 15; }
done
grep -H -E 'compil|vocabulary trained|BLEU at step|step (50|2600)/' "$out"/multi30k_train_*.log |
  cut -c1-220
exit 0
