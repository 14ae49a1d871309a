#!/bin/bash
# #94 item 5: the TTFT of qwen3.sh's levers on Qwen beside full prefill and the default in one run, the CPU to itself
# (other jobs stopped for it): the first 10 dev questions, as qttft.sh, in a copy of q-i5 without its rows (q-t2), so
# that full prefill is timed again in this run and not read back from qttft.sh's.
cd /work/runs
mkdir -p q-t2
cp q-i5/{corpus.jsonl,questions.json,suite.json} q-t2/
[ -d q-t2/store ] || cp -r q-i5/store q-t2/store
lscpu | grep "Model name"; date; uptime
P="+prefill_under=0"
M="full+first_layer=tokens$P,infoflow+ttft_budget=0.5$P,chunkflow+ttft_budget=0.5$P,legolink+ttft_budget=0.5$P"
M="$M,infoflow+ttft_budget=0.4+gate_coverage=0.8$P"
sparsecache bench fidelity --model qwen2.5-coder-0.5b --workdir q-t2 --k 8 --questions 2000 --entities 320 --filler 4 \
  --split dev --limit 10 --two-chunk retrieval --methods "$M" --json > q-ttft2.json
echo "rc=$? $(date)"; uptime
