#!/bin/bash
cd /work/runs
S=/work/main/scripts/experiments/answer_kl.py
python $S fid-small puzzle/kl27-dense.json --questions 27 --store store-dense \
  --config 'dense0={"method":"none"}' --config 'dense.1={"method":"infoflow","recompute_ratio":0.1}' \
  --config 'dense.25={"method":"infoflow","recompute_ratio":0.25}'
python $S fid-small puzzle/kl27-plain.json --questions 27 --store store \
  --config 'plaincodes0={"method":"none"}' --config 'plainraw0={"method":"none","source":"raw"}'
python $S fid-small puzzle/kl27-r25.json --questions 27 \
  --config 'codes.25={"method":"infoflow","recompute_ratio":0.25}' --config 'raw.25={"method":"infoflow","recompute_ratio":0.25,"source":"raw"}'
echo done
