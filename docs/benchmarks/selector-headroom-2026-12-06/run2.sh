#!/bin/bash
cd /work/runs
export OMP_NUM_THREADS=1
python /work/main/scripts/experiments/answer_kl.py fid-small oracle2-rows.json --questions 27 \
 --config 'att.1={"method":"infoflow","recompute_ratio":0.1,"oracle":"attention"}' \
 --config 'gself.1={"method":"infoflow","recompute_ratio":0.1,"oracle":"grad-self"}' \
 --config 'gnorm.1={"method":"infoflow","recompute_ratio":0.1,"oracle":"gradnorm"}' \
 --config 'gnself.1={"method":"infoflow","recompute_ratio":0.1,"oracle":"gradnorm-self"}'
echo done
