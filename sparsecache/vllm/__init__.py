"""sparsecache inside vLLM: the KV connector (`connector.py`), the model handle its blending
needs (`plugin.py`, a `vllm.general_plugins` entry point) and vLLM's layers as the stack
blending runs on (`stack.py`).

`kv_connector_module_path: "sparsecache.vllm"` names this package; the connector is imported
on first use, so loading the plugin (in every vLLM process) imports nothing heavy.
"""


def __getattr__(name: str):
    if name == "SparsecacheConnector":
        from .connector import SparsecacheConnector

        return SparsecacheConnector
    raise AttributeError(name)
