"""A RAG request for an inference engine that reads chunk KV from a store (vLLM + SparsecacheConnector).

The engine is given the prompt as token ids, laid out exactly as the store's KV was made:
the store's shared prefix, the chunks' token ids in order, then the question (the same chat
template `sparsecache query` uses). The connector recognises that layout, checks it token
for token, and injects the chunks' decoded KV instead of prefilling them.

    rag = RagPrompts("corpus.store")
    req = rag.request("How do I open a file?", top_k=4)
    llm.generate(req.vllm_prompt(), SamplingParams(max_tokens=64, extra_args=req.extra_args()))

No engine is imported here: the same request goes to `vllm serve` through the OpenAI client
(`client.completions.create(model=..., **req.openai_kwargs())`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .blend import question_ids
from .errors import ConfigError
from .model import DEFAULT, DEFAULT_NAME, config_fingerprint, model_dir
from .query_config import ORDERS, QueryConfig
from .store import Store

PARAMS_KEY = "sparsecache"  # kv_transfer_params[PARAMS_KEY] = {"chunks": [...], "version": N}


@dataclass
class RagRequest:
    prompt_token_ids: list[int]
    kv_transfer_params: dict
    chunks: list[dict]  # id, doc_id, ordinal, score of each retrieved chunk, in prompt order
    context_tokens: int  # prefix + chunk tokens: what the connector can supply

    def vllm_prompt(self) -> dict:
        """The prompt for `vllm.LLM.generate` (a TokensPrompt)."""
        return {"prompt_token_ids": self.prompt_token_ids}

    def extra_args(self) -> dict:
        """`SamplingParams(extra_args=...)`: how vLLM's offline API carries kv_transfer_params."""
        return {"kv_transfer_params": self.kv_transfer_params}

    def openai_kwargs(self) -> dict:
        """Keyword arguments of `openai.OpenAI().completions.create` against `vllm serve`."""
        return {"prompt": self.prompt_token_ids, "extra_body": {"kv_transfer_params": self.kv_transfer_params}}


class RagPrompts:
    """Retrieves chunks from a store and lays out prompts the connector can serve.

    Needs the model's tokenizer and config only (no weights) plus the store's embedder.
    """

    def __init__(self, store: str | Path | Store, model: str = DEFAULT, device: str = "cpu"):
        from transformers import AutoConfig, AutoTokenizer

        self.store = store if isinstance(store, Store) else Store.open(store)
        path = model_dir(model)
        config = AutoConfig.from_pretrained(path)
        self.store.check_model(config_fingerprint(config, DEFAULT_NAME if model == DEFAULT else path.name))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.device = device
        self._embedder = None

    def retrieve(self, question: str, top_k: int) -> list[dict]:
        from .session import retrieve

        if self._embedder is None:
            from .index import Embedder

            self._embedder = Embedder(self.store.config.embedder, self.device)
        return retrieve(self.store, self._embedder, question, top_k)

    def request(self, question: str, top_k: int = 4, chunks: list[str] | None = None,
                answer_prefix: str = "", order: str = QueryConfig.order) -> RagRequest:
        """The prompt for `question` over the top_k retrieved chunks (or the given chunk ids),
        laid out as `query` lays them out: `order` "reverse" puts the first chunk next to the question."""
        if order not in ORDERS:
            raise ConfigError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        hits = self.retrieve(question, top_k) if chunks is None else [{"id": c} for c in chunks]
        if order == "reverse":
            hits = hits[::-1]
        ids = [h["id"] for h in hits]
        prefix = self.store.prefix()[0]
        context = prefix + [t for toks in self.store.tokens(ids) for t in toks]
        prompt = context + question_ids(self.tokenizer, question, answer_prefix)
        params = {PARAMS_KEY: {"chunks": ids, "version": self.store.version}}
        return RagRequest(prompt, params, hits, len(context))
