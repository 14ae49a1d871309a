#!/bin/bash
# #79 item 5: the rule's TTFT again, three repeats of the four candidates that decide the switch (the CPU to itself),
# then bench shapes on the real default at k = 2-16 (r = 0.1 and 0.25 across lengths)
cd /work/runs
lscpu | grep "Model name"; date; uptime
for i in 1 2 3; do
  sparsecache bench fidelity --workdir /work/runs/i5-rep$i --k 8 --questions 600 --entities 110 --filler 4 --split dev \
    --limit 10 --wrapper shipped --methods "infoflow:0.1@wrapped,infoflow:0.25@wrapped,infoflow+ttft_budget=0.5@wrapped" --json > i5-rep$i.json
  echo "rep $i rc=$? $(date)"; uptime
done
sparsecache bench shapes --shape default --k 2,4,8,16 --repeats 2 --workdir /work/runs/shapes-default --json > shapes-default.json
echo "shapes rc=$? $(date)"; uptime
