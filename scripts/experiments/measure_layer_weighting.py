"""Weighted OMP with an L5 dictionary learned without per-layer scales: does equal weight per
layer fix layer 0's V, and does that fix perplexity? (No retraining: OMP runs on the scaled
signal over the scaled, renormalised atoms of each layer group and decodes with the original
atoms; it needs one Gram matrix per group, which is why the shipped fix learns the scales
with the atoms instead.) BENCHMARKS.md, "Per-layer scales".

    python scripts/experiments/measure_layer_weighting.py calib/heldout/manual-de calib/heldout/python-docs
"""
import json, sys, torch
from sparsecache.model import load_model, extract_kv, default_prefix_ids
from sparsecache.codec.dictionary import Dictionary
from sparsecache.codec.omp import batch_omp, reconstruct
from sparsecache.codec.signals import to_signals, from_signals
from sparsecache.bench.evaluate import fidelity, passages, EvalConfig
from sparsecache.text.documents import read_documents, token_chunks
torch.manual_seed(0)
model = load_model()
d = Dictionary.load('dictionaries/smollm2-135m-n8192-s32-L5')
L, s = 5, 32
# per-layer rms from the original calibration text (python-docs train)
docs = read_documents(['builtin'], split='train')
chunks = [c for c in token_chunks(docs, model.tokenizer, 256) if len(c) == 256][:16]
ks, vs = zip(*extract_kv(model, chunks, default_prefix_ids(model)))
rms = {'k': torch.stack(ks).square().mean((0, 2, 3)).sqrt(), 'v': torch.stack(vs).square().mean((0, 2, 3)).sqrt()}
print({k: [round(x, 3) for x in v.tolist()] for k, v in rms.items()})

class Weighted:
    def __init__(self, kinds):
        self.kinds = kinds
        self.atoms = {k: d.atoms(k) for k in 'kv'}
    def roundtrip(self, kv, kind):
        D = self.atoms[kind]
        if kind not in self.kinds:
            sig = to_signals(kv, L); G, T, dd = sig.shape
            idx, c = batch_omp(sig.reshape(-1, dd), D, s)
            return from_signals(reconstruct(idx, c, D).view(G, T, -1), L)
        w = (1 / rms[kind]).view(-1, 1, 1)  # [n_layers,1,1]
        sig = to_signals(kv * w, L); G, T, dd = sig.shape
        out = []
        for g in range(G):
            wg = w[g*L:(g+1)*L, 0, 0].repeat_interleave(model.m)  # (L·m)
            Dw = D * wg[:, None]; n = Dw.norm(dim=0); Dn = Dw / n
            idx, c = batch_omp(sig[g], Dn, s)
            out.append(reconstruct(idx, c / n[idx], D))
        return from_signals(torch.stack(out), L)

texts = sys.argv[1:]
res = {}
for t in texts:
    win = passages(model, [t], EvalConfig(passages=8))
    r = fidelity(model, {'plain': Weighted(''), 'weighted_v': Weighted('v'), 'weighted_kv': Weighted('kv')}, win, 512)
    for name, rep in r.items():
        print(t.split('/')[-1], name, 'top1 %.3f ppl %+.1f%% nmse k %.3f v %.3f worst v %.2f (L%d) worst k %.2f' % (
            rep['top1_agreement'], 100*(rep['ppl_reconstructed']/rep['ppl_exact']-1), rep['nmse_k'], rep['nmse_v'],
            max(rep['nmse_v_per_layer']), rep['nmse_v_per_layer'].index(max(rep['nmse_v_per_layer'])), max(rep['nmse_k_per_layer'])), flush=True)
    res[t] = r
json.dump(res, open('layer-weighting.json', 'w'))
