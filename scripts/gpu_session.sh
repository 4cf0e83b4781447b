#!/usr/bin/env bash
# One GPU lease, many checks: run the named sections in order, each under its own time limit, logs and JSON
# under $OUT, and a one-line verdict per section at the end (the device tool returns only the tail).
#
#   scripts/gpu_session.sh kernels bench_tp1 moe ...      (on the GPU machine, from the repository root)
#
# Sections:
#   env          nvidia-smi, JAX devices, Python packages the rest needs
#   kernels      gpu-marked kernel tests (attention, grouped matmul, quantized matmul, no-copy HLO), except:
#   attn_groups  the attention kernel at every GQA group size 1..16 x head dims 64/80/96/128/256
#   kv_write     the paged-cache write alone (bench_kernels' kv_write: the engine's scatter against a plain one, 2-4,096
#                tokens into a Llama-3-8B-sized layer): $OUT/kv_write.json
#   heads        attention kernel timing at every GQA group / head dim beside today's shapes
#   attn_prefill the prefill attention kernel: its gpu-marked tests, then bench_kernels' prefill section (ours, the
#                one-warpgroup kernel and JAX's attention_mgpu at Llama-3-8B and Qwen3-30B-A3B heads)
#   gmm          grouped matmul vs ragged_dot at Qwen3-30B-A3B expert shapes
#   gmm_tests    the gpu-marked grouped matmul tests alone
#   pair_tests   the gpu-marked per-pair (gather_matmul) tests alone
#   moe_parity   the gpu-marked MoE engine test: expert kernels against the reference path
#   gmm_quick    gmm with the tuned tilings only, bf16 and int8 weights (a first look that fits beside the tests)
#   gmm_prefill  gmm at the 4k-token prefill shape, bf16, with every tiling variant (rows vs rows_ws)
#   moe_block    one Qwen3-30B-A3B MoE layer at the engine's decode and prefill shapes: time, kernels, glue
#   swiglu_sms   the fused SwiGLU expert kernel's stream against its CTA count (scripts/swiglu_sm_probe.py):
#                $OUT/swiglu_sm_probe.json
#   swiglu       the fused per-pair SwiGLU kernel: its gpu-marked tests (and gather_matmul's), then one MoE layer
#                at the decode buckets with it (engine), without it (pairs3) and at other tilings
#   describe     llm.describe() of Llama-3-8B shape on one GPU (per-device weight/KV bytes, collectives)
#   bench_tp1    the run of record's command (Llama-3-8B, bf16): TP=1 figures to hold within 3% of latest.json
#   itl_chunks   the ITL sweep (concurrency 1/4/8) under prefill chunk caps ITL_CAPS (long_prefill_token_threshold)
#   mixed_cap    the run of record's 1000/1000 and 128/128 grids and ITL sweep (MC_PER_SLOT requests per client, 2)
#                under each mixed-step prefill cap in MC_CAPS (mixed_prefill_token_cap; default "0 256"), closed loop
#                or, with MC_RATE, Poisson arrivals of MC_RATE requests a second: $OUT/mixed_cap_<N>.json
#   moe          Qwen3-30B-A3B shape on one GPU: decode MBU, 1000/1000, prefill MFU
#   starts       cold then warm start of the bench's engine, each in its own process (warm_start_s)
#   defaults     LLM("llama-3-8b") with no knobs beside the tuned engine on 1000/1000 (defaults_fraction_of_tuned)
#   record       the run of record (bench_tp1 plus ITL sweep 1/4/8, 4 requests a client: with 2, the uncapped ITL
#                ratio at concurrency 8 has ranged 1.46-4.33 between runs), carrying starts.json and defaults.json
#   spec_shapes  speculative decoding's verify-step cost curve, Llama-3-8B target + Llama-3.2-1B-shaped draft,
#                k=2,4 (one call's worth); spec_k8 adds k=8 and spec_real the measured SmolLM2 run to the same
#                JSON (bench_spec --update into docs/benchmarks/spec.json of this tree, copied to $OUT)
#   spec_real    needs /tmp/smollm2.gguf (joined from two carried halves, DESIGN.md) and the gguf wheel
#   spec_test    the gpu-marked spec test (same needs)
#   pipeline_test  the gpu-marked pipelined-step test
#   transfer     packed host-to-device transfers: their tests (gpu-marked ones too), the pipelined-step GPU test,
#                and scripts/bench_transfer.py (placing a step's arrays, packed vs one copy per array)
#   timeline_ab  scripts/pipeline_timeline.py --timeline-only (64 constrained rows, Llama-3-8B shape) on the
#                tree in .ab_old (a git worktree, carried) and then on this one; needs serve_wheels/ carried
#   structured   structured output's cost through the server and in the engine alone (bench_serve_gpu.py
#                --structured-only); needs serve_wheels/ from scripts/serve_wheels.sh carried
#   serve        the whole of bench_serve_gpu.py: structured, then the server against offline (same needs)
#   structured_si8  the two server runs of `structured` again with `--stream-interval 8` (same needs)
#   structured_thread  the two server runs of `structured` with the engine on a thread of the server's process
#                (`--no-engine-process`, the layout before the engine process): the same-lease baseline
#   structured_proc  the same two server runs with the engine in its own process (`jaxinfer serve`'s default)
#   trace_grid   profiler traces of whole offline grid runs (TG_WORKLOADS, default 128x128:256 sharegpt:128), the run
#                of record's engine: device busy fraction, idle gaps, host events in them ($OUT/trace_grid_*.json)
#   q_tilings    scripts/bench_quantized.py's tiling sweeps (fp8 W8A8 at M >= 256, weight-only at M = 1):
#                $OUT/quantized_tilings.json
#   ab_q_decode  bench_quantized.py's batch-1 decode (Q_ONLY formats, default int8) on the tree in .ab_old, then on
#                this one: $OUT/ab_q_decode_old.json, $OUT/ab_q_decode_new.json
#   q_mscale     weight-only int8/int4 from M = 16 to 8,192: Pallas vs dequantize + dot vs bf16 ($OUT/quantized_mscale.json)
#   q_xla_paths  one joined Llama-3-8B layer from 1 row to 2,048: the Pallas weight-only kernel against XLA's dot on
#                the quantized codes and W8A8 int8 / fp8 dots, beside bf16 ($OUT/quantized_xla_paths.json)
#   q_followup   the gpu-marked quantized tests, the kernels section (M = 1 streams) and int8's batch-1 loop traced:
#                what per-channel int8 on XLA's dot left to run ($OUT/quantized.json, $OUT/trace_int8/)
#   q_tests      the quantized matmul kernels' gpu-marked tests, and the model's forward on them (test_quantization)
#   q_occupancy  bench_quantized.py's occupancy_m1 sweep (K step x steps in flight x split-K at M = 1):
#                $OUT/quantized_occupancy.json
#   q_b1_kernels Llama-3-8B's batch-1 decode bucket for bf16, int8, int4 (plain order on a GPU) and chunk-halves
#                int4: ms per iteration, the costliest kernels, compiled HLO ($OUT/q_b1_<format>.json, $OUT/hlo_<format>/)
#   q_b1_trace   the same formats' batch-1 decode traced (scripts/trace_engine.py), single steps against the
#                multi-step loop: $OUT/trace_<format>/
#   q_zeros      int4 zero points inside the kernel (gpu.ZEROS_IN_KERNEL) against the wrapper's term: the gpu test,
#                one layer at M = 1, batch-1 decode: $OUT/quantized_zeros.json
#   q_unpadded   activation rows handed to the quantized kernel unpadded (gpu.UNPADDED_ROWS): its gpu-marked test,
#                then Llama-3-8B batch-1 decode, bf16, int8 and int8_unpadded: $OUT/quantized_unpadded.json
#   q_kernels, q_decode, q_offline   bench_quantized.py's kernels / decode / offline sections, each adding to
#                $OUT/quantized.json (issue 15's GPU figures; run q_kernels first, it measures the ceilings);
#                Q_ONLY=a,b passes --only (decode formats, offline run keys)
#   ab_decode_grid  decode (batch 1 and 64, end to end and device only) and the 1000/1000 and 128/128 grids of
#                .ab_old (a git worktree, carried) and then this tree: $OUT/ab_decode_grid.jsonl
#   xla_flags    scripts/ab_xla_flags.py: decode (end to end and device only) under each of XF_SETS (XLA_FLAGS values
#                separated by ';', an empty one for the defaults), one process each; XF_ARGS go to jaxinfer bench
#                (default: Llama-3-8B, batches 1 and 64): $OUT/xla_flags.jsonl
#   trace_b1     scripts/trace_engine.py at batch 1, Llama-3-8B: pipelined single steps against the multi-step loop
#                (overlapped), 16 engine steps each: $OUT/trace_b1.json and the raw Perfetto traces
#   trace_multi_b1  trace_b1 for the multi-step loop alone, then batch-1 decode at 16 iterations per call:
#                $OUT/trace_multi_b1.json, $OUT/b1_steps16.json
#   single_step  scripts/profile_single_step.py: one decoding row's single step in token buckets SS_BUCKETS (2 16)
#                under compiler options SS_VARIANTS (engine: as the engine compiles each bucket): step, device and host launch time: $OUT/single_step.json
#   final_vs_streamed  decode batches FS_BATCHES (1 2 4 8), 256 tokens, as generate's requests (multi-step calls) and
#                streamed (single steps), plus device-only figures, after the pipeline and no-copy gpu tests:
#                $OUT/final_vs_streamed.json
#   ab_b1        batch-1 decode (end to end and device only) of .ab_old (a git worktree, carried) and this tree,
#                alternating twice: $OUT/ab_b1.jsonl
#   attn_access  scripts/attention_access_ceiling.py: decode attention's KV reads alone (copy-only kernels, the
#                kernel's per-head boxes and whole pages) beside the kernel: $OUT/attn_access.json (after the
#                copy kernels' gpu-marked test)
#   moe_b1_kernels  scripts/profile_decode_buckets.py for Qwen3-30B-A3B's batch-1 bucket: its 80 costliest kernels
#                and the compiled decode HLO: $OUT/moe_b1_kernels.json, $OUT/decode_rows2*.hlo.txt
#   skinny       scripts/bench_skinny_gemm.py at 2 rows on Qwen3-30B-A3B's q/k/v and output projection (SKINNY_SHAPES,
#                SKINNY_CANDIDATES); $OUT/skinny.json
#   moe_b1_variants  scripts/moe_b1_variants.py: Qwen3-30B-A3B's batch-1 decode loop under code variants (MBV_VARIANTS,
#                default "qkv_split nopad": the 29th session's tree, and the tree), one process, no
#                warmup: ms per iteration, launches per iteration by kernel, compiled HLO ($OUT/moe_b1_variants.json)
#   moe_b1_steps Qwen3-30B-A3B batch-1 decode (end to end and device only) at 8, 16 and 32 decode steps per call,
#                one process each: $OUT/moe_b1_steps{8,16,32}.json (is batch 1 bound by a per-call cost?);
#                MOE_B1_STEPS="8 32" picks the counts
#   trace_moe_b1 scripts/trace_engine.py at batch 1, Qwen3-30B-A3B, the multi-step loop (overlapped), 16 engine steps
#   ab_moe_b1    ab_b1 for Qwen3-30B-A3B (one run of each tree): $OUT/ab_moe_b1.jsonl
#   ab_grid      issue 12's TP=1 bar: the run of record's fixed grids and decode at batch 1 through the public
#                API, the 11-22 tree (.ab_old, a git worktree of 014cf88, carried) then this one
#                (scripts/ab_prefill.py --workload grid); JSON lines in $OUT/ab_grid.jsonl
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export OUT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
declare -A VERDICT

run() {  # run NAME SECONDS CMD...: log to $OUT/NAME.log, remember pass/fail
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  VERDICT[$name]="rc=$rc $((SECONDS - start))s $(grep -E '^[0-9]+ passed|passed|failed|error' "$OUT/$name.log" | tail -1 | cut -c1-90)"
}

q_format() {  # q_format NAME=QUANTIZATION[/INT4_PACK] (Q_B1_FORMATS' entries): sets $name, $q and $pack
  name=${1%%=*}
  local spec=${1#*=}
  q=${spec%%/*} pack=
  [[ $spec == */* ]] && pack=${spec#*/}
}

for section in "$@"; do
  case $section in
    env)
      run env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import jax; print(jax.__version__, jax.devices())"' ;;
    kernels)
      run kernels 580 python3 -m pytest -q -m gpu --durations=10 -k "not every_group" tests/pallas_kernels \
        tests/engine/test_no_copies.py ;;
    attn_groups)
      run attn_groups 270 python3 -m pytest -q -m gpu --durations=10 -k every_group tests/pallas_kernels ;;
    attn_prefill)
      run attn_prefill_tests 200 python3 -m pytest -q -m gpu -k "prefill_kernel or long_prefill" \
        tests/pallas_kernels/test_ragged_paged_attention_gpu.py
      run attn_prefill 200 python3 scripts/bench_kernels.py --sections ceilings,prefill --out "$OUT/prefill_attention.json" ;;
    attn_access)
      run attn_access_test 120 python3 -m pytest -q -m gpu -k access_ceiling tests/pallas_kernels/test_ragged_paged_attention_gpu.py
      run attn_access 300 python3 scripts/attention_access_ceiling.py --out "$OUT/attn_access.json" ;;
    kv_write)
      run kv_write 150 python3 scripts/bench_kernels.py --sections kv_write --out "$OUT/kv_write.json" ;;
    heads)
      run heads 400 python3 scripts/bench_kernels.py --sections ceilings,decode,heads --out "$OUT/bench_heads.json" ;;
    gmm)
      run gmm 500 python3 scripts/bench_grouped_matmul.py --out "$OUT/gmm.json" ;;
    skinny)
      run skinny_bench 280 python3 scripts/bench_skinny_gemm.py --rows 2 --shapes ${SKINNY_SHAPES:-qwen3moe_qkv qwen3moe_o} \
        --candidates ${SKINNY_CANDIDATES:-xla_kn xla_split_k4 xla_split_k4_norm} --out "$OUT/skinny.json" ;;
    gmm_tests)
      run gmm_tests 300 python3 -m pytest -q -m gpu --durations=5 tests/pallas_kernels/test_grouped_matmul.py ;;
    pair_tests)
      run pair_tests 200 python3 -m pytest -q -m gpu -k gather tests/pallas_kernels/test_grouped_matmul.py ;;
    moe_parity)
      run moe_parity 300 python3 -m pytest -q -m gpu tests/test_parity_moe.py ;;
    gmm_quick)
      run gmm_quick 280 python3 scripts/bench_grouped_matmul.py --no-variants --weights bf16,int8 \
        --out "$OUT/gmm_quick.json" ;;
    gmm_prefill)
      run gmm_prefill 200 python3 scripts/bench_grouped_matmul.py --tokens 4096 --weights bf16 \
        --out "$OUT/gmm_prefill.json" ;;
    moe_block)
      run moe_block 200 python3 scripts/profile_moe_block.py --out "$OUT/moe_block.json" ;;
    swiglu_sms)
      run swiglu_sms 120 python3 scripts/swiglu_sm_probe.py --out "$OUT/swiglu_sm_probe.json" ;;
    swiglu)
      run swiglu_tests 240 python3 -m pytest -q -m gpu -k "swiglu or gather or routing" tests/pallas_kernels/test_grouped_matmul.py \
        tests/pallas_kernels/test_moe_routing.py
      run swiglu_block 300 python3 scripts/profile_moe_block.py --cases 2:1,16:1,16:8 --out "$OUT/moe_block_swiglu.json" \
        --impls ${SWIGLU_IMPLS:-engine,engine_topk,pairs3,engine:64x128x128x3xrows,engine:128x64x128x3} ;;
    describe)
      run describe 300 python3 -c 'from jaxinfer import LLM; from jaxinfer.describe import format_description as f
llm = LLM("llama-3-8b", random_weights=True, dtype="bfloat16", max_num_seqs=64, max_model_len=2048, decode_steps_per_call=8, use_tqdm=False)
print(f(llm.describe()))' ;;
    bench_tp1)
      run bench_tp1 590 python3 -m jaxinfer.cli bench --hf-json docs/benchmarks/hf_h100_128.json --memory-fraction 0.85 \
        --grid 1000x1000:192 128x128:256 sharegpt:128 2048x2048:32 --sweep-requests-per-slot 1 --plot none \
        --out "$OUT/bench_tp1.json" ;;
    starts)
      run starts 280 python3 scripts/bench_warmup.py --memory-fraction 0.85 --out "$OUT/starts.json" ;;
    defaults)
      run defaults 300 python3 -m jaxinfer.cli bench --hf skip --memory-fraction 0.85 --defaults-check \
        --sections grid --grid 1000x1000:192 --plot none --out "$OUT/defaults.json" ;;
    record)
      run record 590 python3 -m jaxinfer.cli bench --hf-json docs/benchmarks/hf_h100_128.json --memory-fraction 0.85 \
        --grid 1000x1000:192 128x128:256 sharegpt:128 2048x2048:32 --concurrency 1 4 8 --sweep-requests-per-slot 4 \
        --decode-steps 256 \
        --plot none --carry $(ls docs/benchmarks/{starts,defaults,cpu}.json 2>/dev/null) --out "$OUT/latest.json" ;;
    itl_chunks)
      # Issue 14's ITL ratio at concurrency 1 / 4 / 8 (1024/128 requests) under each prefill chunk cap in ITL_CAPS
      # (long_prefill_token_threshold; 0 is today's default): a long prompt arriving mid-decode takes several
      # shorter steps. One bench each: $OUT/itl_cap<N>.json.
      for cap in ${ITL_CAPS:-0 256 512}; do
        run itl_cap$cap 300 python3 -m jaxinfer.cli bench --hf skip --memory-fraction 0.85 --sections sweep \
          --concurrency 1 4 8 --sweep-requests-per-slot 4 --long-prefill-token-threshold $cap --plot none \
          --out "$OUT/itl_cap$cap.json"
      done ;;
    mixed_cap)
      for cap in ${MC_CAPS:-0 256}; do
        run mixed_cap_$cap 290 python3 -m jaxinfer.cli bench --hf skip --memory-fraction 0.85 --sections grid sweep \
          --grid 1000x1000:192 128x128:256 --concurrency 1 4 8 --sweep-requests-per-slot ${MC_PER_SLOT:-2} --plot none \
          --mixed-prefill-token-cap $cap ${MC_RATE:+--sweep-request-rate $MC_RATE} --out "$OUT/mixed_cap_$cap.json"
      done ;;
    moe)
      run moe 590 python3 -m jaxinfer.cli bench --model qwen3-30b-a3b --hf skip --memory-fraction 0.85 \
        --grid 1000x1000:128 --concurrency --decode-batches 1 64 --plot none --out "$OUT/moe_1gpu.json" ;;
    spec_shapes)
      run spec_shapes 560 python3 scripts/bench_spec.py --parts shapes --ks 2 4 --out docs/benchmarks/spec.json
      cp docs/benchmarks/spec.json "$OUT/spec.json" ;;
    spec_real)
      run spec_real 300 python3 scripts/bench_spec.py --parts measured --real-model /tmp/smollm2.gguf \
        --update --out docs/benchmarks/spec.json
      cp docs/benchmarks/spec.json "$OUT/spec.json" ;;
    spec_k8)
      run spec_k8 300 python3 scripts/bench_spec.py --parts shapes --ks 8 --update --out docs/benchmarks/spec.json
      cp docs/benchmarks/spec.json "$OUT/spec.json" ;;
    transfer)
      run transfer_tests 300 python3 -m pytest -q tests/engine/test_transfer.py tests/engine/test_batcher.py
      run pipeline_test 400 python3 -m pytest -q -m gpu tests/engine/test_pipeline.py
      run transfer 300 python3 scripts/bench_transfer.py --out "$OUT/transfer.json" ;;
    timeline_ab)
      python3 -m pip install -q --no-index --find-links serve_wheels --target /tmp/serve_site "llguidance>=1.9" \
        >"$OUT/serve_pip.log" 2>&1
      for tree in .ab_old .; do
        name=timeline_$([ "$tree" = . ] && echo new || echo old)
        run "$name" 280 env PYTHONPATH=$tree:/tmp/serve_site python3 scripts/pipeline_timeline.py \
          --tokenizer serve_wheels/tokenizer --timeline-only
        sed -n '/^{/,$p' "$OUT/$name.log" >"$OUT/$name.json"
      done ;;
    pipeline_test)
      run pipeline_test 400 python3 -m pytest -q -m gpu tests/engine/test_pipeline.py ;;
    structured|serve|structured_si8|structured_thread|structured_proc)
      python3 -m pip install -q --no-index --find-links serve_wheels --target /tmp/serve_site fastapi uvicorn \
        sse-starlette prometheus-client "llguidance>=1.9" aiohttp >"$OUT/serve_pip.log" 2>&1
      only=(); [ "$section" = structured ] && only=(--structured-only)
      [ "$section" = structured_si8 ] && only=(--structured-only --server-only --stream-interval 8)
      [ "$section" = structured_thread ] && only=(--structured-only --server-only --no-engine-process)
      [ "$section" = structured_proc ] && only=(--structured-only --server-only --engine-process)
      run "$section" 590 env PYTHONPATH=$PYTHONPATH:/tmp/serve_site python3 scripts/bench_serve_gpu.py \
        "${only[@]}" --tokenizer serve_wheels/tokenizer --out "$OUT/serve_$section.json" ;;
    ab_grid)
      run ab_grid 590 bash -c 'for t in .ab_old .; do PYTHONPATH=$t python3 scripts/ab_prefill.py --label $t \
        --workload grid --repeats 2 | tee -a "$OUT/ab_grid.jsonl"; done' ;;
    q_tilings)
      run q_tilings 500 python3 scripts/bench_quantized.py --sections ceilings,tilings_fp8,tilings_m1 \
        --out "$OUT/quantized_tilings.json" ;;
    q_xla_paths)
      run q_xla_paths 420 python3 scripts/bench_quantized.py --fresh --sections ceilings,xla_paths --out "$OUT/quantized_xla_paths.json" ;;
    q_followup)
      # What the twenty-fifth session left to run on a GPU after per-channel int8 moved to XLA's dot: every
      # gpu-marked quantized test (the model-level one among them), the M = 1 streams (XLA's dot with one row padded
      # to two beside the kernel) and int8's batch-1 loop traced. The offline figures are q_offline's.
      run q_followup_tests 300 python3 -m pytest -q -m gpu tests/test_quantization.py tests/pallas_kernels/test_quantized_matmul.py
      run q_followup_kernels 300 python3 scripts/bench_quantized.py --fresh --sections ceilings,kernels --out "$OUT/quantized.json"
      mkdir -p "$OUT/trace_int8"
      run q_followup_trace 280 python3 scripts/trace_engine.py --batch 1 --memory-fraction 0.85 --overlap-only \
        --single-step-max-rows 0 --quantization int8 --out "$OUT/trace_int8/trace.json" ;;
    q_mscale)
      run q_mscale 400 python3 scripts/bench_quantized.py --sections ceilings,m_scale --out "$OUT/quantized_mscale.json" ;;
    q_tests)
      run q_tests 400 python3 -m pytest -q -m gpu --durations=5 tests/pallas_kernels/test_quantized_matmul.py \
        tests/test_quantization.py ;;
    q_occupancy)
      run q_occupancy 450 python3 scripts/bench_quantized.py --sections ceilings,occupancy_m1 \
        --out "$OUT/quantized_occupancy.json" ;;
    q_b1_kernels)
      # Llama-3-8B's batch-1 decode bucket per weight format: ms per iteration and the 40 costliest kernels
      # (Q_B1_FORMATS: name=quantization[/int4 pack: 2 plain, 64 chunk halves], "none" for bf16); compiled HLO of
      # each, gzipped, under $OUT/hlo_<name>.
      for f in ${Q_B1_FORMATS:-bf16=none int8=int8 int4=int4 int4_halves=int4/64}; do
        q_format "$f"
        mkdir -p "$OUT/hlo_$name"
        run q_b1_$name 240 python3 scripts/profile_decode_buckets.py --rows 1 --max-num-seqs 8 --top 40 \
          --memory-fraction 0.85 --quantization "$q" ${pack:+--int4-pack $pack} --out "$OUT/q_b1_$name.json" \
          --hlo-dir "$OUT/hlo_$name"
        gzip -f "$OUT/hlo_$name"/*.txt 2>/dev/null  # the text is too large to come back from the device as is
      done ;;
    q_b1_trace)
      # Batch-1 decode of Llama-3-8B per weight format (Q_B1_FORMATS as in q_b1_kernels), traced: pipelined single
      # steps against the multi-step loop, device busy fraction and the host's events in the gaps.
      for f in ${Q_B1_FORMATS:-int8=int8 int4=int4}; do
        q_format "$f"
        mkdir -p "$OUT/trace_$name"
        run q_b1_trace_$name 280 python3 scripts/trace_engine.py --batch 1 --memory-fraction 0.85 --overlap-only \
          --single-step-max-rows 8 0 --quantization "$q" ${pack:+--int4-pack $pack} --out "$OUT/trace_$name/trace.json"
      done ;;
    q_zeros)
      # gpu.ZEROS_IN_KERNEL's measurement: its gpu-marked test, one layer at M = 1 with the zero points added by the
      # wrapper and inside the kernel, then Llama-3-8B batch-1 decode with int4 both ways beside bf16.
      run q_zeros_test 200 python3 -m pytest -q -m gpu -k "zero_points or gpu_kernels_inside" \
        tests/pallas_kernels/test_quantized_matmul.py tests/test_quantization.py
      run q_zeros_layer 200 python3 scripts/bench_quantized.py --fresh --sections ceilings,zeros --out "$OUT/quantized_zeros.json"
      run q_zeros_decode 450 python3 scripts/bench_quantized.py --sections decode --only bf16,int4,int4_zeros_outside \
        --out "$OUT/quantized_zeros.json" ;;
    q_unpadded)
      run q_unpadded_test 200 python3 -m pytest -q -m gpu -k unpadded tests/pallas_kernels/test_quantized_matmul.py
      run q_unpadded_decode 400 python3 scripts/bench_quantized.py --sections decode --only bf16,int8,int8_unpadded \
        --out "$OUT/quantized_unpadded.json" ;;
    q_kernels)
      run q_kernels 300 python3 scripts/bench_quantized.py --fresh --sections ceilings,kernels --out "$OUT/quantized.json" ;;
    q_decode)
      run q_decode 500 python3 scripts/bench_quantized.py --sections decode --out "$OUT/quantized.json" \
        ${Q_ONLY:+--only "$Q_ONLY"} ;;
    q_offline)
      run q_offline 550 python3 scripts/bench_quantized.py --sections offline --out "$OUT/quantized.json" \
        ${Q_ONLY:+--only "$Q_ONLY"} ;;
    ab_q_decode)
      for tree in .ab_old .; do
        name=ab_q_decode_$([ "$tree" = . ] && echo new || echo old)
        run "$name" 280 bash -c "cd $tree && PYTHONPATH=\$PWD python3 scripts/bench_quantized.py --sections decode \
          --only ${Q_ONLY:-int8} --out $OUT/$name.json"
      done ;;
    ab_decode_grid)
      run ab_decode_grid 590 python3 scripts/ab_bench.py --trees .ab_old . --repeats 1 --out "$OUT/ab_decode_grid.jsonl" \
        -- --hf skip --memory-fraction 0.85 --sections decode decode_device grid --decode-batches 1 64 \
        --grid 1000x1000:192 128x128:256 ;;
    xla_flags)
      IFS=';' read -r -a sets <<<"${XF_SETS:-}"
      flag_args=(); for f in "${sets[@]:-}"; do flag_args+=("--flags=$f"); done
      # shellcheck disable=SC2086 - XF_ARGS is a list of bench arguments
      run xla_flags 590 python3 scripts/ab_xla_flags.py --out "$OUT/xla_flags.jsonl" --timeout "${XF_TIMEOUT:-250}" \
        "${flag_args[@]}" -- ${XF_ARGS:---model llama-3-8b --memory-fraction 0.85 --decode-batches 1 64 --max-num-seqs 64 --max-num-batched-tokens 512} ;;
    trace_b1)
      run trace_b1 400 python3 scripts/trace_engine.py --batch 1 --memory-fraction 0.85 --max-num-batched-tokens 512 \
        --single-step-max-rows 8 0 --overlap-only --calls 16 --out "$OUT/trace_b1.json" ;;
    trace_multi_b1)
      # Batch-1 decode in the multi-step loop only (what generate's requests run): where its ~0.2 ms a token
      # over the device-only iteration goes; then the same decode at 16 iterations per call.
      run trace_multi_b1 300 python3 scripts/trace_engine.py --batch 1 --memory-fraction 0.85 --max-num-batched-tokens 512 \
        --single-step-max-rows 0 --overlap-only --calls 16 --out "$OUT/trace_multi_b1.json"
      run b1_steps16 280 python3 -m jaxinfer.cli bench --hf skip --memory-fraction 0.85 --sections decode decode_device \
        --decode-batches 1 --decode-steps 256 --decode-steps-per-call 16 --plot none --out "$OUT/b1_steps16.json" ;;
    single_step)
      run single_step 500 python3 scripts/profile_single_step.py --buckets ${SS_BUCKETS:-2 16} --variants ${SS_VARIANTS:-engine} \
        --out "$OUT/single_step.json" ;;
    final_vs_streamed)
      # Small decode batches that nobody streams (generate's) run multi-step calls, streamed ones single steps
      # (Engine.decodes_singly): both timed in one engine, end to end, with the device-only figures beside them.
      run final_vs_streamed_test 300 python3 -m pytest -q -m gpu tests/engine/test_pipeline.py tests/engine/test_no_copies.py
      run final_vs_streamed 590 python3 -m jaxinfer.cli bench --hf skip --memory-fraction 0.85 \
        --sections decode decode_streamed decode_device --decode-batches ${FS_BATCHES:-1 2 4 8} --decode-steps 256 \
        --plot none --out "$OUT/final_vs_streamed.json" ;;
    ab_b1)
      run ab_b1 590 python3 scripts/ab_bench.py --trees .ab_old . --repeats 2 --out "$OUT/ab_b1.jsonl" -- \
        --hf skip --memory-fraction 0.85 --sections decode decode_device --decode-batches 1 ;;
    moe_b1_kernels)
      run moe_b1_kernels 400 python3 scripts/profile_decode_buckets.py --model qwen3-30b-a3b --rows 1 --max-num-seqs 2 \
        --memory-fraction 0.85 --top 80 --out "$OUT/moe_b1_kernels.json" --hlo-dir "$OUT" ;;
    moe_b1_variants)
      run moe_b1_variants 500 python3 scripts/moe_b1_variants.py --variants ${MBV_VARIANTS:-qkv_split nopad} --budget-s 400 \
        --out "$OUT/moe_b1_variants.json" --hlo-dir "$OUT" ;;
    moe_b1_steps)
      for n in ${MOE_B1_STEPS:-8 16 32}; do
        run moe_b1_steps$n 280 python3 -m jaxinfer.cli bench --model qwen3-30b-a3b --hf skip --memory-fraction 0.85 \
          --sections decode decode_device --decode-batches 1 --decode-steps 128 --decode-steps-per-call $n --plot none \
          --out "$OUT/moe_b1_steps$n.json"
      done ;;
    trace_grid)
      for w in ${TG_WORKLOADS:-128x128:256 sharegpt:128}; do
        run trace_grid_${w//[:x]/_} 300 python3 scripts/trace_engine.py --workload $w --memory-fraction 0.85 \
          --max-num-seqs 256 --out "$OUT/trace_grid_${w//[:x]/_}.json"
      done ;;
    trace_moe_b1)
      run trace_moe_b1 400 python3 scripts/trace_engine.py --model qwen3-30b-a3b --batch 1 --memory-fraction 0.85 \
        --max-num-batched-tokens 256 --overlap-only --calls 16 --out "$OUT/trace_moe_b1.json" ;;
    ab_moe_b1)
      run ab_moe_b1 590 python3 scripts/ab_bench.py --trees .ab_old . --repeats 1 --out "$OUT/ab_moe_b1.jsonl" -- \
        --model qwen3-30b-a3b --hf skip --memory-fraction 0.85 --sections decode decode_device --decode-batches 1 ;;
    spec_test)
      JAXINFER_SMOLLM2_GGUF=/tmp/smollm2.gguf run spec_test 300 python3 -m pytest -q -m gpu tests/test_bench_spec.py ;;
    *) echo "unknown section $section" ;;
  esac
done

echo "=== verdicts"  # every run's (a section may make several), in name order
for name in $(printf '%s\n' "${!VERDICT[@]}" | sort); do echo "$name: ${VERDICT[$name]}"; done
for name in $(printf '%s\n' "${!VERDICT[@]}" | sort); do echo "--- $name (tail)"; tail -12 "$OUT/$name.log"; done
