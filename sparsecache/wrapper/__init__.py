"""The chunk wrapper: learned soft tokens encoded around every chunk so that chunks encoded
alone read as they would in context (KV Packet). Its settings (`config`, light: the CLI reads
them), the neutral data it learns from (`data`), learning it by self-distillation with the model
frozen (`learn`), and applying it: loading, encoding wrapped chunks, the placeholders a served
prompt carries (`apply`).

`from sparsecache.wrapper import Wrapper` (any name of `apply`) resolves on first use, so
reading the config does not import torch.
"""


from .. import names_from

__getattr__ = names_from(__name__, "apply")
