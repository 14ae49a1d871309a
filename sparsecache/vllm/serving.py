"""A RAG request for an inference engine that reads chunk KV from a store (vLLM + SparsecacheConnector).

The engine is given the prompt as token ids, laid out exactly as the store's KV was made:
the store's shared prefix, the chunks' token ids in order, then the question (the same chat
template `sparsecache query` uses). In a store encoded with a learned wrapper every chunk is
`header chunk trailer`; the engine takes token ids only, so each soft token is given as one
placeholder id (`wrapper.placeholder_id`): its KV comes from the store (stored, or recomputed
from the soft token the store keeps), never from that id. The connector recognises the layout,
checks it token for token, and injects the chunks' decoded KV instead of prefilling them.
A context too short to be worth reading (`query.cheap`) is prefilled by the engine instead, laid out
as text (`RagRequest.as_text`: no soft tokens), which is full prefill.

    rag = RagPrompts("corpus.store")
    req = rag.request("How do I open a file?", top_k=4)
    llm.generate(req.vllm_prompt(), SamplingParams(max_tokens=64, extra_args=req.extra_args()))

No engine is imported here: the same request goes to `vllm serve` through the OpenAI client
(`client.completions.create(model=..., **req.openai_kwargs())`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..kvstore.view import KVStore
from ..model.generate import question_ids
from ..model.gguf import DEFAULT, for_recorded, model_dir, model_name
from ..model.kvmodel import config_fingerprint
from ..query.config import ORDERS, QueryConfig
from ..query.methods.full import text_ids
from ..store import VersionPoller, open_backend
from ..wrapper.apply import placeholder_id, with_placeholders

PARAMS_KEY = "sparsecache"  # kv_transfer_params[PARAMS_KEY] = {"chunks": [...], "version": N}


@dataclass
class RagRequest:
    prompt_token_ids: list[int]
    kv_transfer_params: dict
    chunks: list[dict]  # id, doc_id, ordinal, score of each retrieved chunk, in prompt order
    context_tokens: int  # prefix + chunk tokens: what the connector can supply
    wrapper: str | None = None  # the digest of the store's wrapper (its soft tokens' KV), if any
    # a wrapped store's context as full prefill reads it (prefix and the chunks' text, no soft tokens)
    text_context: list[int] | None = None
    prefilled: bool = False  # laid out for the engine's own prefill (a cheap context), not read from the store

    @property
    def params(self) -> dict:
        """The connector's entry of kv_transfer_params: chunks, version and blend options."""
        return self.kv_transfer_params[PARAMS_KEY]

    @property
    def cache_salt(self) -> str:
        """vLLM's prefix cache keys KV blocks by their tokens and a salt, not by how the KV was
        made: without a salt, a blended context would be reused by a request asking for another
        method, or for full prefill, of the same tokens. Blended KV depends on the question and
        the blend settings, decoded KV (`method: none`) on neither; the salt says exactly that,
        so cached blocks are reused only where they are the same KV (a wrapped store's wrapper too)."""
        p = self.params
        settings = {k: v for k, v in p.items() if k not in ("chunks", "version")}  # chunks: in the tokens already
        question = self.prompt_token_ids[self.context_tokens:] if p.get("method") != "none" else []
        # a wrapper's soft tokens are placeholder ids in the prompt: the salt says which KV they stand for
        material = json.dumps([settings, question] + ([self.wrapper] if self.wrapper else []), sort_keys=True)
        return f"{PARAMS_KEY}-{hashlib.sha256(material.encode()).hexdigest()[:16]}"

    def as_text(self) -> RagRequest:
        """This request laid out as full prefill reads it: a wrapped store's soft tokens left out (the
        engine cannot prefill them, and their placeholder ids are not text). What a cheap context is
        given to the engine as (`query.cheap`); the same request for a store without a wrapper."""
        if self.text_context is None:
            return self
        return RagRequest(self.text_context + self.prompt_token_ids[self.context_tokens:], self.kv_transfer_params,
                          self.chunks, len(self.text_context))

    def vllm_prompt(self) -> dict:
        """The prompt for `vllm.LLM.generate` (a TokensPrompt, with the cache salt)."""
        return {"prompt_token_ids": self.prompt_token_ids, "cache_salt": self.cache_salt}

    def extra_args(self) -> dict:
        """`SamplingParams(extra_args=...)`: how vLLM's offline API carries kv_transfer_params."""
        return {"kv_transfer_params": self.kv_transfer_params}

    def openai_kwargs(self) -> dict:
        """Keyword arguments of `openai.OpenAI().completions.create` against `vllm serve`."""
        return {"prompt": self.prompt_token_ids,
                "extra_body": {"kv_transfer_params": self.kv_transfer_params, "cache_salt": self.cache_salt}}


class RagPrompts:
    """Retrieves chunks from a store and lays out prompts the connector can serve.

    Needs the model's tokenizer and config only (no weights) plus the store's embedder. With
    `follow_s`, it follows the store's newest published version, looked for every `follow_s`
    seconds in a background thread (`VersionPoller`; 0: on every request), and moves requests
    onto a new version once it is ready to serve (opened, index fetched, chunk table read); each
    request is made from one version. `timeout_s` bounds each operation on an object store
    (`ObjectBackend`): a request the store does not answer raises StoreUnavailable.
    """

    def __init__(self, store: str | Path | KVStore, model: str = DEFAULT, device: str = "cpu",
                 follow_s: float | None = None, timeout_s: float | None = None):
        from transformers import AutoConfig, AutoTokenizer

        self.store = store if isinstance(store, KVStore) else KVStore.open(open_backend(store, timeout_s))
        model = for_recorded(model, self.store.attrs.get("model"))
        path = model_dir(model)
        config = AutoConfig.from_pretrained(path)
        self.store.check_model(config_fingerprint(config, model_name(model, config, path)))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model_config = config
        self.placeholder = placeholder_id(config)
        self.device = device
        self._embedder = None
        self.poller = None
        if follow_s is not None:
            self.store.prepare()
            self.poller = VersionPoller(self.store.backend, follow_s, ready=self._move_to,
                                        name="sparsecache-serve-versions")

    def _move_to(self, version: int) -> None:
        """Open `version`, read what its requests need, then make it the one requests start from
        (those in flight keep the store they started with)."""
        self.store = self.store.at(version).prepare()

    def current(self) -> KVStore:
        """The store requests are made from: the newest version made ready when following."""
        if self.poller is not None and self.poller.every_s == 0:
            self.poller()
        return self.store

    def close(self) -> None:
        if self.poller is not None:
            self.poller.close()

    def retrieve(self, question: str, top_k: int, documents: list[str] | None = None,
                 store: KVStore | None = None) -> list[dict]:
        from ..query.session import search_hits

        if self._embedder is None:
            from ..kvstore.index import Embedder

            self._embedder = Embedder(self.store.config.embedder, self.device)
        return search_hits(store or self.current(), self._embedder, question, top_k, documents)

    def request(self, question: str, top_k: int = 4, chunks: list[str] | None = None,
                answer_prefix: str = "", order: str = QueryConfig.order,
                documents: list[str] | None = None) -> RagRequest:
        """The prompt for `question` over the top_k retrieved chunks (among `documents`' when
        given), or the given chunk ids, laid out as `query` lays them out: `order` "reverse"
        puts the first chunk next to the question."""
        if order not in ORDERS:
            raise ConfigError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        from ..query.plan import check_question
        from ..query.session import given_hits

        check_question(question)

        store = self.current()
        if chunks is None:
            hits = self.retrieve(question, top_k, documents, store)
        else:
            if not chunks:
                raise ConfigError("chunks is empty")
            hits = given_hits(store, chunks)
        if not hits:
            raise ConfigError("nothing to answer from: the store returned no chunks")
        if order == "reverse":
            hits = hits[::-1]
        ids = [h["id"] for h in hits]
        context = context_ids(store, ids, self.placeholder)
        prompt = context + question_ids(self.tokenizer, question, answer_prefix)
        params = {PARAMS_KEY: {"chunks": ids, "version": store.version}}
        text = text_ids(store, ids) if store.header() is not None else None
        return RagRequest(prompt, params, hits, len(context), store.config.wrapper, text)


def context_ids(store: KVStore, chunk_ids: list[str], placeholder: int) -> list[int]:
    """The prompt's context as an engine is given it (`ContextLayout.ids`): the store's prefix, then each
    chunk's token ids (`header chunk trailer` in a wrapped store, soft tokens as `placeholder`)."""
    return with_placeholders(store.layout().ids(store.tokens(chunk_ids)), placeholder)
