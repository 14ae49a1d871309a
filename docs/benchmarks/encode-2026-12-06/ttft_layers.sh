lscpu | grep "Model name"
Q="Which RFC does the uuid module follow?"
for i in 1 2 3; do
 for L in omp workqueue; do
  NUMBA_THREADING_LAYER=$L sparsecache query ${1:-demo.store} "$Q" --compare --json > ttft-$L-$i.json 2> ttft-$L-$i.err
  python -c "
import json,sys; r=json.load(open('ttft-$L-$i.json'))
def find(d, path=''):
    if isinstance(d, dict):
        for k, v in d.items():
            if 'ttft' in k.lower() and not isinstance(v,(dict,list)): print('$L', '$i', path + k, v)
            find(v, path + k + '.')
find(r)
"
 done
done
