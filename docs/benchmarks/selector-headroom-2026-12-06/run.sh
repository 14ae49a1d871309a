#!/bin/bash
# The selector's headroom (#79 item 2): oracle selectors over fid-small (a bench fidelity entities workdir of the CLI default size, SmolLM2, --wrapper shipped), the first 27 questions at k = 8; rows and *.summary.json beside (BENCHMARKS.md "The selector's headroom")
cd /work/runs
python /work/main/scripts/experiments/answer_kl.py fid-small oracle-rows.json --questions 27 \
 --config 'codes.1={"method":"infoflow","recompute_ratio":0.1}' \
 --config 'grad.1={"method":"infoflow","recompute_ratio":0.1,"oracle":"grad"}' \
 --config 'dev.1={"method":"infoflow","recompute_ratio":0.1,"oracle":"deviation"}' \
 --config 'raw.1={"method":"infoflow","recompute_ratio":0.1,"source":"raw"}' \
 --config 'codes.25={"method":"infoflow","recompute_ratio":0.25}' \
 --config 'grad.25={"method":"infoflow","recompute_ratio":0.25,"oracle":"grad"}' \
 --config 'all={"method":"infoflow","recompute_ratio":1.0}' \
 --compare codes.1:grad.1 --compare codes.1:dev.1 --compare raw.1:grad.1 --compare codes.25:grad.25 --compare grad.1:codes.25
echo done
