#!/bin/bash
# #79 item 5/7: the new default (infoflow, --ttft-budget 0.5, wrapped store) on every question of #69's test splits,
# read once after the choice; full prefill's rows (and the former default's on the confident ones) from 2026-11-29
# The workdirs: a copy of docs/benchmarks/fidelity69-2026-11-29/test-{entities,cloze,records}/ each (suite, questions and
# the 2026-11-29 rows: full prefill on every question, the former default on the confident ones); the stores re-encoded.
# Summaries: python summarise.py WORKDIR/results.json OUT.json
cd /work/runs
export OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 MKL_NUM_THREADS=1
lscpu | grep "Model name"; date
M="infoflow+ttft_budget=0.5@wrapped"
sparsecache bench fidelity --workdir /work/runs/t-cloze --format cloze --k 8 --questions 60 --split test --wrapper shipped --methods "$M" --json > t-cloze.json
echo "cloze rc=$? $(date)"
sparsecache bench fidelity --workdir /work/runs/t-records --format records --k 8 --questions 300 --entities 40 --split test --limit 44 --wrapper shipped --methods "$M" --json > t-records.json
echo "records rc=$? $(date)"
sparsecache bench fidelity --workdir /work/runs/t-entities --k 8 --questions 1000 --entities 160 --filler 4 --split test --limit 400 --wrapper shipped --methods "$M" --json > t-entities.json
echo "entities rc=$? $(date)"
