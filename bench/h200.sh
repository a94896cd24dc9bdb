#!/usr/bin/env bash
# streamoe on the H200 machine with MLX's CUDA backend (shared/device/README.md installs MLX into /root/site;
# the project runs from the repository root: no install needed). Writes results under $OUT. From the repo root:
#   STEPS="..." bash bench/h200.sh lease  # a whole lease as one command, resent unchanged in every call (see `lease` below)
#   bash bench/h200.sh stage     # (carry .whl1, then .whl2, made here by bench/h200_wheels.sh) a part of the wheels
#   bash bench/h200.sh install   # (after both) MLX's CUDA build joined and extracted, the wheels installed into /root/site
#   bash bench/h200.sh setup     # synth + convert the full-size checkpoint (q4,q3; EXPERTS=q4: q4 only) into /root/bench
#   bash bench/h200.sh gputest   # the GPU exactness tests (pytest -m gpu) on tiny and small synthetic checkpoints, the families'
#                                first (a run cut off by its time limit still names what passed and what failed)
#   bash bench/h200.sh compare   # streamoe vs stock mlx-lm side by side: resident and --cap 4 (q4), --cap 4 (q3); the capped
#                                runs twice, interleaved with a fixed guess gate (a 0.8 precision, no waste
#                                budget: `wastebudget`); each capped run reports the share of decode the disk was busy
#   bash bench/h200.sh gpuexact  # the GPU tests a change to the decode step's kernels must pass first (bits across caps,
#                                compiled against op by op, the run ahead, hidden states, grouped experts, the families)
#   bash bench/h200.sh gpuwarp   # the GPU tests of the warp-a-row kernels alone (experts, dense layers, router, delta rule)
#   bash bench/h200.sh gpurest   # test_gpu.py's last tests (quantized KV on; the ones a cut gputest run has not reached)
#   bash bench/h200.sh gpuhost   # the GPU tests of the host tier (records by the copy engine and by the upload ring) and
#                                of capped decode never copying a pool
#   bash bench/h200.sh gpuqmm    # the GPU tests of one group spanning K (kernels.quantized_matmul: quantized_matmul against
#                                the CPU, quantized KV across caps), then the families' (gpt_oss's tiny model has K = 64)
#   bash bench/h200.sh prepare   # setup and gputest side by side (a fresh machine compiles kernels for minutes;
#                                GPUTEST_LIMIT=seconds cuts gputest, not setup, so a call ends within its own limit)
#   bash bench/h200.sh capped    # streamoe alone at --cap 4, q4 and q3 (when only the streamed path changed)
#   bash bench/h200.sh fill      # a record's copy into its slot against the disk read (upload-ring advice off / on; from
#                                host-mapped MLX arrays, the device reading them; CUDA's copy engine from host memory straight
#                                into the slots, no host copy, no kernel), and the bus
#   bash bench/h200.sh parts     # a resident decode step part by part (mixers, MoE block, head) against mlx-lm's modules
#   bash bench/h200.sh prefill-parts  # the same parts on a 256-token prefill block, and the routed experts per pick against
#                                grouped by expert (one gather_qmm batch of up to 16 rows per expert)
#   bash bench/h200.sh grouped   # (no checkpoint) a prefill step's routed experts per pick against grouped by expert, `rows`
#                                pairs to a gather_qmm batch, grouped on the host or the device (bench/experts_grouped.py)
#   bash bench/h200.sh experts-qmv  # (no checkpoint) a decode step's routed experts as one warp a row against gather_qmm
#                                (bench/experts_qmv.py: the kernel's difference from the float32 product, device ms a call)
#   bash bench/h200.sh kernels   # (after setup) one resident decode step's kernels timed by Nsight Compute, streamoe's and
#                                mlx-lm's: device ms a token against its wall clock, and where it goes (bench/gpu_kernels.py);
#                                VARIANT=experts_qmv: streamoe once more with that setting (bench/gpu_parts.py's `variant`)
#   bash bench/h200.sh rounds    # resident decode: stock stream_generate then Engine.generate back to back, 7 rounds (ROUNDS=);
#                                VARIANTS=delta_rule_warps: then the delta-rule kernel in blocks of 32 threads (the same bits);
#                                experts_qmv, delta_rule_warp_rows: a warp a row; route_kernel: the router's top-k as one
#                                kernel; warp_kernels: the three; dense_qmv: one token's dense 4-bit layers a warp a row
#                                (each other bits than as is)
#   bash bench/h200.sh sampling  # sampled (checkpoint defaults, with penalties, inside a JSON schema) against greedy decode,
#                                resident and --cap 4
#   bash bench/h200.sh sampling-resident  # the same, resident only (the JSON-constrained mode's cost against greedy), 11 rounds: best runs
#                                (ROUNDS=, TOKENS=; MODES=greedy,sampled: those two alone, each round's pair back to back)
#   bash bench/h200.sh prefill   # long prompts (2K, 8K, 32K tokens; PROMPTS=) at --cap 4, q4 and q3 (EXPERTS=q4: q4 only), and q4 resident (CAPS=4: not)
#                                (compute alone): prefill time against the disk
#   bash bench/h200.sh longctx   # --ctx 131072 at --cap 4 with bf16, q8 and q4 KV side by side: plan, hot tier, decode
#   bash bench/h200.sh sampling-small  # the same, resident, on the small layers with the real vocabulary (no full checkpoint)
#   bash bench/h200.sh hosttier  # (after setup) --cap 4 without and with a host tier (--host-cap 24: every expert in host memory read by the device, gathered first and in place; the host tier by the copy engine and through the upload ring; RUNS=...,4:8,8:16 adds the curve): tok/s
#                                against the disk and the host->slot copy speed of the same run (bench/host_tier.py)
#   bash bench/h200.sh devcpu    # gpt-oss (float32, bfloat16) and qwen3_moe tiny through the engine, every kernel call
#                                replayed on the CPU: the first that differs, with its inputs (bench/device_vs_cpu.py);
#                                first quantized_matmul alone, GPU against CPU and against itself rerun, over dtypes, bits, modes, K and M (--qmm-sweep)
#   FAMILY=qwen3_moe bash bench/h200.sh family  # (FREE=1: every other checkpoint removed first, for disk room) a full-size
#                                synthetic checkpoint of FAMILY (qwen3_moe, gpt_oss, mixtral) in its own expert format: resident decode
#                                against stock mlx-lm in interleaved rounds, then --cap 4 against the disk and against
#                                each layer waiting for its picks (`decodeahead`; ABLATE=, CAPPED_ONLY=1, ROUNDS_ONLY=1)
#   bash bench/h200.sh peers     # (after `setup` too: its conversion is made again after the repack) long-prompt prefill at --cap 4 beside mlx-vlm's expert offload
#                                at the same expert budget and resident mlx-lm (bench/prefill_peers.py; PROMPTS=, ENGINES=)
#   FAMILY=qwen3_moe bash bench/h200.sh routing  # (no checkpoint) bench/routing.py on the family's full size, all its layers
#   bash bench/h200.sh cgroups   # what memory cgroups the machine offers root; where none is mounted, cgroup2 mounted at
#                                /sys/fs/cgroup (then `hosttier` runs each --host-cap run in a cgroup of that size)
#   bash bench/h200.sh hostprof  # (after setup) --cap 4 --host-cap 24 under cProfile: host reads, the host tier, and the host tier with MLX's CUDA graphs
#                                off: where a capped token's host time goes
# A fresh machine spends ~3 minutes compiling kernels on its first runs: `prepare` hides them behind `setup`. The
# whole `gputest` takes over 500 s there (beside `setup`, more): cut it (GPUTEST_LIMIT) and run `gpurest` next. A
# machine idle for 30 s between calls is given back (and everything installed on it lost): plan the next call first.
# (Saving the compiled kernels for the next lease does not work: 55 MB compressed, more than a lease sends back.)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
S=/root/bench
EXPERTS=${EXPERTS:-q4,q3}
OUT=${OUT:-/tmp/out}
mkdir -p "$S" "$OUT"
export PYTHONPATH=/root/site:$REPO PYTHONUNBUFFERED=1
# results are named after the card that ran them (h100, h200; "gpu" where nvidia-smi names neither) and record
# the code: CODE=<commit> in the command (the machine's copy of the tree has no git), as STREAMOE_CODE
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -o -i -m1 "h[0-9][0-9][0-9]" | tr "A-Z" "a-z")
CARD=${CARD:-gpu}
export STREAMOE_CODE=${CODE:-${STREAMOE_CODE:-}}
# the memory cgroup `cgroups` made where the process's own group could not hold capped children
[ ! -f /root/lease/cgroup ] || export STREAMOE_CGROUP="$(cat /root/lease/cgroup)"
cd "$REPO"
# a test past TEST_LIMIT seconds: every thread's stack, then the run ends (a timer thread: a signal would wait for MLX)
PYTEST="python3 -m pytest -vv -rA --durations=0 --tb=short -p no:cacheprovider -o timeout=${TEST_LIMIT:-240} -o timeout_method=thread -m gpu"
# The tests named, less those an earlier run of this step passed on this machine (a step cut by a call's end runs
# again in the next call, from where it was cut); what passes is noted in /root/lease/passed-STEP.
gpu_tests() {
  local passed=/root/lease/passed-$STEP skip=()
  mkdir -p /root/lease
  if [ -f "$passed" ]; then while read -r t; do skip+=(--deselect "$t"); done < "$passed"; fi
  $PYTEST "$@" ${skip[@]+"${skip[@]}"} 2>&1 | tee >(grep --line-buffered -oE '^[^ ]+::[^ ]+ PASSED' | awk '{print $1; fflush()}' >> "$passed")
}
STEP=${1:-}
needs_checkpoint() {  # whether a step (STEP+VAR=value...) works on `setup`'s Qwen3.6 checkpoint
  case "${1%%+*}" in gputest|gpuexact|gpuwarp|gpurest|gpuhost|gpuqmm|grouped|devcpu|sampling-small|family|routing|cgroups|experts-qmv) return 1 ;; esac
}
case "$1" in
  lease)
    # The same command in every call of a lease, so nothing has to be decided between calls (an idle machine is
    # given back after 30 s): `STEPS="gpurest rounds+VARIANTS=experts_qmv prefill+EXPERTS=q4" bash bench/h200.sh lease`,
    # carrying .whl1 and .whl2 in the first two calls (.whl3 in any later one, for `peers`). It stages and installs the
    # wheels (those that arrive later too), runs `setup` beside
    # the steps that need no checkpoint, then the steps in order (STEP+VAR=value+...: the step with those settings), each
    # once per machine, each cut at the call's end (LIMIT seconds, 560; a step cut so runs once more in the next call, a
    # test step without the tests it passed). Resend it until it prints "lease: all done".
    D=/root/lease; mkdir -p "$D"; end=$((SECONDS + ${LIMIT:-560}))
    bash "$0" stage 2>/dev/null || true  # a call without wheels stages nothing
    if [ ! -f "$D/installed" ]; then
      if ! ls /root/stage/mlx_cuda.tar.xz.part.ab >/dev/null 2>&1 || ! ls /root/stage/mlx_cuda.tar.xz.part.aa >/dev/null 2>&1; then
        echo "lease: not installed; parts here: $(cd /root/stage && ls -- *.part.* 2>/dev/null | sed 's/.*part\.//' | tr '\n' ' ')(carry .whl1, then .whl2)"
        exit 0
      fi
      bash "$0" install && touch "$D/installed"
    elif ls /root/stage/*.whl >/dev/null 2>&1; then  # wheels carried after the install (.whl3)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site /root/stage/*.whl && rm /root/stage/*.whl
    fi
    setup="" needs=""  # setup only where a step needs the Qwen3.6 checkpoint
    for step in $STEPS; do ! needs_checkpoint "$step" || needs=1; done
    if [ -n "$needs" ] && [ ! -f "$D/setup.done" ]; then
      # the conversion holds every expert format a step names (prefill+EXPERTS=q3 beside EXPERTS=q4: both)
      formats=$EXPERTS; for step in $STEPS; do
        case "$step" in *+EXPERTS=*) e=${step#*+EXPERTS=}; formats="$formats,${e%%+*}" ;; esac; done
      formats=$(echo "$formats" | tr , '\n' | awk 'NF && !seen[$0]++' | paste -sd, -)
      { timeout $((end - SECONDS)) env EXPERTS="$formats" bash "$0" setup > "$OUT/setup.log" 2>&1 && touch "$D/setup.done"; } &
      setup=$!
    fi
    for step in ${STEPS:?STEPS=the steps to run}; do
      mark="$D/${step//[^A-Za-z0-9_.=-]/_}"
      [ -f "$mark" ] && continue
      if needs_checkpoint "$step"; then
        [ -z "$setup" ] || wait "$setup" || true; setup=""
        [ -f "$D/setup.done" ] || { echo "lease: $step skipped: no checkpoint (setup.log)"; continue; }
      fi
      [ $((end - SECONDS)) -gt 20 ] || break
      echo "lease: $step ($((end - SECONDS)) s left)"
      name=${step%%+*}; settings=""; [ "$step" = "$name" ] || settings=${step#*+}
      rc=0; timeout $((end - SECONDS)) env ${settings//+/ } bash "$0" "$name" || rc=$?
      if [ "$rc" = 124 ] && [ $((end - SECONDS)) -le 5 ] && [ ! -f "$mark.cut" ]; then  # cut by the call's end: once
        touch "$mark.cut"; echo "lease: $step cut by the call's end: the next call runs it again"; break
      fi
      echo "$rc" > "$mark"; echo "lease: $step rc $rc"
    done
    [ -z "$setup" ] || wait "$setup" || true
    for step in $STEPS; do [ -f "$D/${step//[^A-Za-z0-9_.=-]/_}" ] || { echo "lease: not done: $step"; exit 0; }; done
    echo "lease: all done"
    ;;
  stage)
    mkdir -p /root/stage && { ! ls .whl?/* >/dev/null 2>&1 || cp .whl?/* /root/stage/; }
    ;;
  install)
    # the wheels first, then the CUDA build's tree over theirs (pip --target would skip a folder that exists)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site /root/stage/*.whl && rm /root/stage/*.whl
    cat /root/stage/mlx_cuda.tar.xz.part.a? | python3 -c "import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/root/site', filter='tar')"
    rm /root/stage/mlx_cuda.tar.xz.part.a?
    python3 -c "import mlx.core as mx, mlx_lm; print(mx.__version__, mx.default_device())"
    ;;
  setup)
    [ -f "$S/full-ckpt/model.safetensors.index.json" ] || python3 -m streamoe.cli synth "$S/full-ckpt" --size full 2>/dev/null
    [ -f "$S/full-conv/manifest.json" ] || python3 -m streamoe.cli convert "$S/full-ckpt" "$S/full-conv" --experts "$EXPERTS" 2>/dev/null
    ;;
  gputest)
    gpu_tests tests/test_gpu_families.py tests/test_gpu.py | tee -a "$OUT/gputest-${CARD}.log"
    ;;
  gpuexact)
    # what a change to the decode step's kernels must keep, first: logits across caps, tiers and runs (the host tier
    # at every pair of caps, a prompt's logprobs, long prefill chunks), sampled tokens across caps, the compiled step
    # against the step built op by op, the run ahead, hidden states against mlx-lm, the grouped experts' bits, and
    # every family's bits and tokens; the warp-a-row kernels (experts, delta rule) against their references
    { gpu_tests tests/test_gpu.py -k "warp or router or delta_rule or across_caps_prefetch or prompt_logprobs or compiled_decode_step or run_ahead or hidden_states or grouped or sampled_decode or long_prefill or many_blocks or host_tier" || true
      gpu_tests tests/test_gpu_families.py; } | tee -a "$OUT/gputest-exact-${CARD}.log"
    ;;
  gpuwarp)
    # the warp-a-row kernels alone (experts, dense layers, the router's top-k, the delta rule) against their references
    gpu_tests tests/test_gpu.py -k "warp or router or delta_rule or never_copies" | tee -a "$OUT/gputest-warp-${CARD}.log"
    ;;
  gpurest)
    # quantized KV last: on code 16549e3 and 413b791 its q4 case ran past 400 s (a hang or a slow compile)
    { gpu_tests tests/test_gpu.py -k "run_ahead or compiled_decode_step or float32_matmul or upload_ring or in_place or delta_rule or one_group or grouped or many_blocks or hidden_states or never_copies or prompt_logprobs" || true
      gpu_tests tests/test_gpu.py -k quantized_kv; } | tee -a "$OUT/gputest-rest-${CARD}.log"
    ;;
  gpuhost)
    gpu_tests tests/test_gpu.py -k "host_tier or never_copies" | tee -a "$OUT/gputest-host-${CARD}.log"
    ;;
  gpuqmm)
    { gpu_tests tests/test_gpu.py -k "one_group or quantized_kv" || true
      gpu_tests tests/test_gpu_families.py; } | tee -a "$OUT/gputest-qmm-${CARD}.log"
    ;;
  prepare)
    bash "$0" setup > "$OUT/setup.log" 2>&1 &
    status=0; timeout "${GPUTEST_LIMIT:-3600}" bash "$0" gputest || status=$?  # a failing or cut test still waits for setup
    wait
    exit $status
    ;;
  capped)
    for q in q4 q3; do
      python3 -m bench.gpu_compare --ckpt "$S/full-ckpt" --model "$S/full-conv" --caps 4 --experts $q --skip-mlx-lm \
        --out "$OUT/gpu-capped-${CARD}-$q.json" | grep -v '^ '
    done
    ;;
  fill)
    python3 -m bench.fill --model "$S/full-conv" --experts q4 --name "$OUT/fill-${CARD}" | tail -30
    ;;
  rounds)
    python3 -m bench.gpu_parts --ckpt "$S/full-ckpt" --model "$S/full-conv" --experts q4 --skip-parts --variants "${VARIANTS:-}" \
      --rounds "${ROUNDS:-7}" --out "$OUT/gpu-rounds-${CARD}.json" | grep -v '^ '
    ;;
  experts-qmv)
    python3 -m bench.experts_qmv --out "$OUT/experts-qmv-${CARD}.json"
    ;;
  kernels)
    # one resident decode step's kernels under Nsight Compute, each engine in its own process (bench/gpu_kernels.py)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    # VARIANT=experts_qmv (one of bench/gpu_parts.py's settings): streamoe once more with it, as streamoe_VARIANT
    for e in streamoe mlx_lm ${VARIANT:+streamoe_$VARIANT}; do
      engine=$e setting=as_is; [ "$e" = "streamoe_${VARIANT:-}" ] && engine=streamoe setting=$VARIANT
      timeout 240 "$NCU" --profile-from-start off --metrics gpu__time_duration.sum --cache-control none --clock-control none --csv \
        --print-units base --log-file "$OUT/kernels-$e.csv" python3 -m bench.gpu_kernels --engine $engine --variant $setting \
        --ckpt "$S/full-ckpt" --model "$S/full-conv" --steps "${STEPS_PROFILED:-1}" 2>&1 | { grep -v "^==PROF==" || true; } | tail -5
    done
    python3 -m bench.gpu_kernels --parse streamoe="$OUT/kernels-streamoe.csv" mlx_lm="$OUT/kernels-mlx_lm.csv" \
      ${VARIANT:+streamoe_$VARIANT="$OUT/kernels-streamoe_$VARIANT.csv"} \
      --steps "${STEPS_PROFILED:-1}" --out "$OUT/gpu-kernels-${CARD}.json" | head -60
    gzip -f "$OUT"/kernels-*.csv
    ;;
  sampling)
    python3 -m bench.sampling --model "$S/full-conv" --caps resident,4 --tokens 64 --rounds 3 --ctx 1024 \
      --name "$OUT/sampling-${CARD}" | grep -v '^ '
    ;;
  sampling-resident)
    python3 -m bench.sampling --model "$S/full-conv" --caps resident --tokens "${TOKENS:-64}" --rounds "${ROUNDS:-11}" \
      --ctx 1024 ${MODES:+--modes "$MODES"} --name "$OUT/sampling-resident-${CARD}${MODES:+-$(echo "$MODES" | tr , -)}" \
      | grep -v '^ '
    ;;
  prefill)
    for q in ${EXPERTS//,/ }; do
      python3 -m bench.prefill --model "$S/full-conv" --caps "${CAPS:-$([ $q = q4 ] && echo resident,4 || echo 4)}" --experts $q \
        --prompts "${PROMPTS:-2048,8192,32768}" --warmup 512 \
        --out "$OUT/prefill-${CARD}-$q-$(echo "${PROMPTS:-2048,8192,32768}" | tr , -)" | grep -v '^ '
    done
    ;;
  longctx)
    python3 -m bench.long_context "$S/full-conv" --cap 4 --ctx 131072 --kv bfloat16,q8,q4 --out "$OUT/long-context-${CARD}.json" \
      | grep -v '^ '
    ;;
  sampling-small)
    [ -f "$S/sv-conv/manifest.json" ] || { python3 -m streamoe.cli synth "$S/sv-ckpt" --size small-vocab 2>/dev/null &&
      python3 -m streamoe.cli convert "$S/sv-ckpt" "$S/sv-conv" --experts q4 2>/dev/null; }
    python3 -m bench.sampling --model "$S/sv-conv" --caps resident --tokens 64 --rounds 5 \
      --name "$OUT/sampling-small-vocab-${CARD}" | grep -v '^ '
    ;;
  hosttier)
    python3 -m bench.host_tier --model "$S/full-conv" --runs "${RUNS:-4,4:24,4:24+STREAMOE_HOST_READS_FORM=direct,4:24+STREAMOE_HOST_READS=0,4:24+STREAMOE_HOST_READS=0+STREAMOE_COPY_ENGINE=0}" --tokens 40 --work /root \
      --name "$OUT/host-tier-${CARD}" | grep -v '^ '
    ;;
  devcpu)
    timeout 240 python3 -m bench.device_vs_cpu --qmm-sweep --reruns 30 --name "$OUT/device-vs-cpu-${CARD}-qmm-sweep" | grep -v -E "\"distinct_outputs\": 1}$" || true
    for run in gpt_oss:float32 gpt_oss:bfloat16 qwen3_moe:float32; do
      python3 -m bench.device_vs_cpu --family "${run%:*}" --dtype "${run#*:}" \
        --name "$OUT/device-vs-cpu-${CARD}-${run%:*}-${run#*:}" 2>/dev/null | grep -E 'finite_prefill|weights_unlike|"kernel"|nonfinite|max_abs_diff|"first_bad": null'
    done
    ;;
  family)
    F=${FAMILY:?FAMILY=qwen3_moe, gpt_oss or mixtral}
    X=$([ "$F" = gpt_oss ] && echo mxfp4 || echo q4)
    # FREE=1: every other checkpoint and conversion removed first (Mixtral-8x7B's pair is 51 GB of the 64 GiB disk)
    if [ -n "${FREE:-}" ]; then
      for d in "$S"/*-ckpt "$S"/*-conv; do case "$d" in "$S/$F-"*) ;; *) rm -rf "$d" ;; esac; done
    fi
    [ -f "$S/$F-ckpt/model.safetensors.index.json" ] || python3 -m streamoe.cli synth "$S/$F-ckpt" --family "$F" --size full 2>/dev/null
    [ -f "$S/$F-conv/manifest.json" ] || python3 -m streamoe.cli convert "$S/$F-ckpt" "$S/$F-conv" 2>/dev/null
    # CAPPED_ONLY=1: only the capped runs; TAG names their file (e.g. with MLX_USE_CUDA_GRAPHS=0 as a setting)
    [ -n "${CAPPED_ONLY:-}" ] || python3 -m bench.gpu_parts --ckpt "$S/$F-ckpt" --model "$S/$F-conv" --experts $X \
      --skip-parts --variants "${VARIANTS:-}" --rounds 5 --out "$OUT/family-rounds-${CARD}-$F.json" | grep -v '^ '
    # the capped runs (at CAP, 4; Mixtral-8x7B's fixed accounts need more: CAP=12) twice, each beside the other setting
    # of running layers ahead of their picks and of queueing each layer's mixer once built, and without the routed
    # experts queued on their own; then one under cProfile: where a capped token's host time goes when nearly every
    # pick is in memory
    # ROUNDS_ONLY=1: the rounds alone
    C=${CAP:-4}
    [ -n "${ROUNDS_ONLY:-}" ] || python3 -m bench.gpu_compare --ckpt "$S/$F-ckpt" --model "$S/$F-conv" --caps "$C" --experts $X --skip-mlx-lm \
      --rounds 2 --ablate "${ABLATE-decodeahead@$C,eagermixer@$C,queueoutput@$C,profile@$C}" --out "$OUT/family-capped-${CARD}-$F${TAG:-}.json" | grep -v '^ '
    ;;
  peers)
    # the checkpoint, mlx-vlm's repack of it and the q4 conversion: 57 GB of the 64 GiB disk, so the repack first
    # (it wants twice the checkpoint's size free: a conversion `setup` made goes until it is built, then comes back
    # as q4 alone) and the Qwen3.6 directories of `setup` are reused, not duplicated
    [ -f "$S/full-ckpt/model.safetensors.index.json" ] || python3 -m streamoe.cli synth "$S/full-ckpt" --size full 2>/dev/null
    [ -f "$S/peers/offload/offload_index.json" ] || rm -rf "$S/full-conv"
    [ ! -d "$S/full-conv/experts/q3" ] || rm -rf "$S/full-conv"  # no room for q3 beside the repack: q4 again, alone
    [ -f "$S/peers/offload/offload_index.json" ] || python3 -m mlx_vlm.moe_offload --build "$S/full-ckpt" --out "$S/peers/offload"
    [ -f "$S/full-conv/manifest.json" ] || python3 -m streamoe.cli convert "$S/full-ckpt" "$S/full-conv" --experts q4 2>/dev/null
    python3 -m bench.prefill_peers --ckpt "$S/full-ckpt" --model "$S/full-conv" --cap 4 --prompts "${PROMPTS:-2048,8192}" \
      --experts q4 --warmup 512 --work "$S/peers" --engines "${ENGINES:-streamoe,mlx-vlm,mlx-lm}" \
      --out "$OUT/prefill-peers-${CARD}-$(echo "${PROMPTS:-2048,8192}" | tr , -)" | grep -v '^ '
    ;;
  routing)
    # how FAMILY's full-size synthetic routes, all its layers deep, as stock mlx-lm decodes it (bench/routing.py;
    # the 2-core machine cannot decode it): the share of picks its busiest quarter of experts takes
    F=${FAMILY:-qwen3_moe}
    python3 -m bench.routing --family "$F" --size full --scratch "$S/routing-$F" --name "routing-$F-full-$CARD" \
      | grep -v '^ ' && cp "bench/results/routing-$F-full-$CARD.json" "$OUT/"
    rm -rf "$S/routing-$F"
    ;;
  cgroups)
    # what memory cgroups the machine offers root; where none is mounted, cgroup2 is
    # mounted at /sys/fs/cgroup, so the steps after (hosttier: a cgroup equal to --host-cap) and the tests that take
    # a capped cgroup (tests/conftest.py capped_cgroup) find one
    usable() { python3 -c "from tests.conftest import cgroup_dir; print(cgroup_dir())"; }
    {
      echo "own: $(tr '\n' ' ' < /proc/self/cgroup)"; echo "fs: $(stat -fc %T /sys/fs/cgroup 2>&1)"
      grep -E '^CapEff' /proc/self/status; grep cgroup /proc/mounts || echo "no cgroup mounted"
      echo "usable: $(usable)"
      if [ "$(usable)" = None ] && ! grep -q " /sys/fs/cgroup " /proc/mounts; then
        mount -t cgroup2 none /sys/fs/cgroup 2>&1 && echo "mounted cgroup2 at /sys/fs/cgroup: $(cat /sys/fs/cgroup/cgroup.controllers)"
        echo "usable now: $(usable)"
      fi
      own=/sys/fs/cgroup$(sed -n 's/^0:://p' /proc/self/cgroup)
      if [ "$(usable)" = None ] && [ -f /sys/fs/cgroup/cgroup.controllers ]; then
        # own group: its controllers, what it gives its children, how many processes share it (v2 lets a group
        # with processes give its children no controller, and the others are the machine's, not ours to move)
        echo "own group: controllers '$(cat "$own/cgroup.controllers" 2>&1)' subtree '$(cat "$own/cgroup.subtree_control" 2>&1)'" \
          "processes $(wc -l < "$own/cgroup.procs" 2>&1)"
        echo "root: controllers '$(cat /sys/fs/cgroup/cgroup.controllers)' subtree '$(cat /sys/fs/cgroup/cgroup.subtree_control)'"
        # a group of our own at the root (no processes: memory can be given to its children), named to the
        # later steps by /root/lease/cgroup -> STREAMOE_CGROUP (tests/conftest.py cgroup_dir)
        g=/sys/fs/cgroup/streamoe_bench
        grep -qw memory /sys/fs/cgroup/cgroup.subtree_control || echo +memory > /sys/fs/cgroup/cgroup.subtree_control
        mkdir -p "$g" /root/lease && echo "$g" > /root/lease/cgroup && echo "usable at the root: $(STREAMOE_CGROUP=$g usable)"
        [ "$(STREAMOE_CGROUP=$g usable)" != None ] || rm -f /root/lease/cgroup
      fi
      true
    } 2>&1 | tee "$OUT/cgroups-${CARD}.txt"
    ;;
  hostprof)
    python3 -m bench.host_tier --model "$S/full-conv" --tokens 24 --work /root --profile --name "$OUT/host-tier-variants-${CARD}" \
      --runs 4:24,4:24+STREAMOE_HOST_READS=0,4:24+STREAMOE_HOST_READS=0+MLX_USE_CUDA_GRAPHS=0 | grep -v '^ '
    ;;
  parts)
    python3 -m bench.gpu_parts --ckpt "$S/full-ckpt" --model "$S/full-conv" --experts q4 --out "$OUT/gpu-parts-${CARD}-q4.json"
    ;;
  prefill-parts)
    python3 -m bench.gpu_parts --ckpt "$S/full-ckpt" --model "$S/full-conv" --experts q4 --parts-tokens 256 --rounds 0 \
      --out "$OUT/gpu-parts-${CARD}-q4-prefill-block.json" | grep -v '^ '
    ;;
  grouped)
    python3 -m bench.experts_grouped --tokens "${TOKENS:-256,1024,4096}" --rows "${ROWS:-8,16,32,64}" --dtype "${DTYPE:-bfloat16}" \
      --formats "${FORMATS:-q4,q3}" \
      --name "$OUT/experts-grouped-${CARD}-${DTYPE:-bfloat16}" | grep -v '^ '
    ;;
  compare)
    python3 -m bench.gpu_compare --ckpt "$S/full-ckpt" --model "$S/full-conv" --caps resident,4 --experts q4 \
      --ablate wastebudget@4 --rounds 2 --out "$OUT/gpu-compare-${CARD}-q4.json" | grep -v '^ '
    python3 -m bench.gpu_compare --ckpt "$S/full-ckpt" --model "$S/full-conv" --caps 4 --experts q3 --skip-mlx-lm \
      --ablate wastebudget@4 --rounds 2 --out "$OUT/gpu-compare-${CARD}-q3.json" | grep -v '^ '
    ;;
esac
