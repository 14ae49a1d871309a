"""The model: loading it (a packaged GGUF converted once, or a Hugging Face directory), its
K/V captured before RoPE (`kvmodel`), its fingerprint (what dictionaries and stores record of
it), its cache assembled from stored K/V and recomputed in place (`cache`, on the layer
`stack`), prefill and greedy generation (`generate`), and the gate every model passes before a
dictionary or a store is built for it (`check`).

`from sparsecache.model import load_model` (any name of `kvmodel`, or of `gguf`: `default_model_dir`)
resolves on first use, so importing a light part (`fingerprint`, `gguf`) does not import torch.
"""


from .. import names_from

__getattr__ = names_from(__name__, "kvmodel", "gguf")
