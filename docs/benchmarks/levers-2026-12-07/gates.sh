#!/bin/bash
# #94 item 4: the confidence gate on the same dev questions as run.sh (its workdirs, full prefill's rows reused):
# coverage (a scorer's ratio raised up to 2x until its tokens hold C of the question's attention) and margin (prefill
# where the blended first token leads the runner-up by less than M nats), over the default and chunkflow
cd /work/runs
lscpu | grep "Model name"; date
G="infoflow+ttft_budget=0.5+gate_coverage=0.6@wrapped,infoflow+ttft_budget=0.5+gate_coverage=0.8@wrapped,chunkflow+ttft_budget=0.5+gate_coverage=0.8@wrapped,infoflow+ttft_budget=0.5+gate_margin=1@wrapped,infoflow+ttft_budget=0.5+gate_margin=3@wrapped"
sparsecache bench fidelity --workdir i5-dev --k 8 --questions 2000 --entities 320 --filler 4 --split dev --limit 682 \
  --wrapper shipped --confident-only --methods "$G" --json > i5-dev-gates.json
echo "one-chunk rc=$? $(date)"
sparsecache bench fidelity --workdir s2c-dev --k 8 --questions 2000 --entities 320 --filler 4 --split dev --two-chunk placed \
  --wrapper shipped --limit 400 --confident-only --methods "$G" --json > s2c-dev-gates.json
echo "two-chunk rc=$? $(date)"
