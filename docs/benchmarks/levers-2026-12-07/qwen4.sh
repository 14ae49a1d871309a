#!/bin/bash
# (Restarted 22:46 after ten rows: the quiet TTFT run first, part B's encode paused with SIGSTOP for it, then part A
# with the gates SmolLM2 found within the budget first: qwen4.sh as it ran is this file with PAUSE set to the
# encode's pid.)
# #94 item 5, the Qwen candidates qwen2.sh/qwen3.sh/nbflow.sh left out (SmolLM2 measured them in run.sh, gates.sh,
# gates2.sh, after2.sh): on Qwen's plain store the margin gate at 1 and 3 and the coverage gate at 0.8 over budgets
# 0.5 and 0.35; on the store after 1 neighbour the coverage gate over budget 0.4; a plain store encoded after each
# chunk's TWO nearest neighbours with the default query. Same questions as qwen3.sh (first 341 one-chunk, first 200
# two-chunk dev). Part A (the gates) and part B (the encode, then its rows) run side by side, one thread each; then
# the gates' TTFT beside full prefill and the default in one run with the CPU to itself (q-t4: a copy of q-i5
# without its rows, so that full prefill is timed again in this run), as qttft2.sh. Rows resume.
cd /work/runs
Q=qwen2.5-coder-0.5b
S="--model $Q --k 8 --questions 2000 --entities 320 --filler 4 --split dev --confident-only"
lscpu | grep "Model name"; date
export OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1
part_a() {
  M="infoflow+ttft_budget=0.5+gate_margin=1,infoflow+ttft_budget=0.35+gate_coverage=0.8"
  sparsecache bench fidelity $S --workdir q-i5 --limit 341 --two-chunk retrieval --methods "$M" --json > q-i5-gates.json
  sparsecache bench fidelity $S --workdir q-s2c --limit 200 --two-chunk placed --methods "$M" --json > q-s2c-gates.json
  echo "A gates within SmolLM2's budget rc=$? $(date)"
  G="infoflow+ttft_budget=0.4+gate_coverage=0.8"
  sparsecache bench fidelity $S --workdir qnb-i5 --limit 341 --two-chunk retrieval --methods "$G" --json > qnb-i5-gate.json
  sparsecache bench fidelity $S --workdir qnb-s2c --limit 200 --two-chunk placed --methods "$G" --json > qnb-s2c-gate.json
  echo "A neighbours store, gate rc=$? $(date)"
  M="infoflow+ttft_budget=0.5+gate_coverage=0.8,infoflow+ttft_budget=0.5+gate_margin=3"
  sparsecache bench fidelity $S --workdir q-i5 --limit 341 --two-chunk retrieval --methods "$M" --json > q-i5-gates2.json
  sparsecache bench fidelity $S --workdir q-s2c --limit 200 --two-chunk placed --methods "$M" --json > q-s2c-gates2.json
  echo "A gates over SmolLM2's budget rc=$? $(date)"
}
workdir() {  # $1: the plain-store workdir, $2: its copy with the store after 2 neighbours, full prefill's rows kept
  mkdir -p $2
  cp $1/{corpus.jsonl,questions.json,suite.json} $2/
  [ -d $2/store ] || cp -r qnb2-dev/store $2/store
  [ -f $2/results.json ] || python -c "
import json, sys
rows = json.load(open(sys.argv[1]))['rows']
json.dump({'rows': [r for r in rows if r['label'] == 'full']}, open(sys.argv[2], 'w'))
" $1/results.json $2/results.json
}
part_b() {
  if [ ! -f qnb2-dev/encode.json ]; then
    mkdir -p qnb2-dev
    sparsecache encode-corpus q-i5/corpus.jsonl --store qnb2-dev/store --model $Q --wrapper none \
      --encode-after neighbours --encode-after-chunks 2 --json > qnb2-dev/encode.json 2> qnb2-dev/encode.log || return
  fi
  echo "B encoded $(date)"
  workdir q-i5 qnb2-i5
  workdir q-s2c qnb2-s2c
  D="infoflow+ttft_budget=0.5"
  sparsecache bench fidelity $S --workdir qnb2-i5 --limit 341 --two-chunk retrieval --methods "$D" --json > qnb2-i5.json
  sparsecache bench fidelity $S --workdir qnb2-s2c --limit 200 --two-chunk placed --methods "$D" --json > qnb2-s2c.json
  echo "B after 2 neighbours rc=$? $(date)"
}
quiet() {
echo "quiet TTFT $(date)"; uptime
  mkdir -p q-t4
  cp q-i5/{corpus.jsonl,questions.json,suite.json} q-t4/
  [ -d q-t4/store ] || cp -r q-i5/store q-t4/store
  P="+prefill_under=0"
  M="full+first_layer=tokens$P,infoflow+ttft_budget=0.5$P,infoflow+ttft_budget=0.5+gate_margin=1$P"
  M="$M,infoflow+ttft_budget=0.5+gate_margin=3$P,infoflow+ttft_budget=0.5+gate_coverage=0.8$P"
  M="$M,infoflow+ttft_budget=0.35+gate_coverage=0.8$P"
  sparsecache bench fidelity --model $Q --workdir q-t4 --k 8 --questions 2000 --entities 320 --filler 4 \
    --split dev --limit 10 --two-chunk retrieval --methods "$M" --json > q-ttft4.json
  echo "quiet rc=$? $(date)"; uptime
}
[ -n "$PAUSE" ] && kill -STOP $PAUSE  # the encode (part B) started first in the run as it went
(unset OMP_NUM_THREADS NUMBA_NUM_THREADS; quiet)
if [ -n "$PAUSE" ]; then kill -CONT $PAUSE; else part_b > qwen4-b.log 2>&1 & fi
part_a > qwen4-a.log 2>&1
wait
