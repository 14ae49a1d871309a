#!/bin/bash
# #79 item 1's r = 0.1 puzzle on a continuous measure (BENCHMARKS "Where full prefill's answers are lost"):
# a second (a)-format dev suite (100 questions, the CLI's default entities and filler; its first 27 at k = 8),
# KL from full prefill along full prefill's own answer on every question, codes against exact K/V, and the
# chunk_value_scale lever tried at 0.9 / 0.94 / 1.06 (measured at the commit that added it; not kept).
set -e
W=${1:-fid-small}
lscpu | grep "Model name"; date
sparsecache bench fidelity --workdir $W --k 8 --questions 100 --split dev --wrapper shipped --methods none@wrapped --limit 1
python scripts/experiments/answer_kl.py $W rows.json --questions 27 \
  --config 'codes0={"method":"none"}' --config 'raw0={"method":"none","source":"raw"}' \
  --config 'codes.1={"method":"infoflow","recompute_ratio":0.1}' \
  --config 'raw.1={"method":"infoflow","recompute_ratio":0.1,"source":"raw"}' \
  --config 'raw.1s94={"method":"infoflow","recompute_ratio":0.1,"source":"raw","chunk_value_scale":0.94}' \
  --config 'raw0s94={"method":"none","source":"raw","chunk_value_scale":0.94}' \
  --config 'codes.1s90={"method":"infoflow","recompute_ratio":0.1,"chunk_value_scale":0.9}' \
  --config 'codes0s90={"method":"none","chunk_value_scale":0.9}' \
  --config 'codes.1s106={"method":"infoflow","recompute_ratio":0.1,"chunk_value_scale":1.06}' \
  --config 'codes0s106={"method":"none","chunk_value_scale":1.06}' \
  --compare raw0:raw.1 --compare codes0:codes.1 --compare codes.1:raw.1 --compare codes0:raw0 \
  --compare raw.1:raw.1s94 --compare raw0:raw0s94 --compare codes.1:codes.1s90 --compare codes0:codes0s90 \
  --compare codes.1:codes.1s106 --compare codes0:codes0s106
# the README question by ratio (demo store, codes and exact K/V, selection overlap): readme-question-by-ratio.json
