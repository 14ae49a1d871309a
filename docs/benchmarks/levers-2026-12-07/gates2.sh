#!/bin/bash
# #94 item 4's next point: the coverage gate at 0.8 over a lower base budget, so that the mean TTFT lands at 1/2
# of full prefill's (the gate at 0.8 over budget 0.5 cost 0.64x); same workdirs and questions as gates.sh
cd /work/runs
lscpu | grep "Model name"; date
G="infoflow+ttft_budget=0.35+gate_coverage=0.8@wrapped,infoflow+ttft_budget=0.4+gate_coverage=0.8@wrapped"
sparsecache bench fidelity --workdir i5-dev --k 8 --questions 2000 --entities 320 --filler 4 --split dev --limit 682 \
  --wrapper shipped --confident-only --methods "$G" --json > i5-dev-gates2.json
echo "one-chunk rc=$? $(date)"
sparsecache bench fidelity --workdir s2c-dev --k 8 --questions 2000 --entities 320 --filler 4 --split dev --two-chunk placed \
  --wrapper shipped --limit 400 --confident-only --methods "$G" --json > s2c-dev-gates2.json
echo "two-chunk rc=$? $(date)"
