"""How a query's context is laid out, defined once: `prefix | header chunk trailer … | question`.

Every chunk was encoded after the store's shared prefix and, in a wrapped store, a learned header
of soft tokens (negative ids); a wrapped store's chunks are stored ending with their trailer (soft
tokens too). A context puts the prefix first, then each chunk with the header in front of it, then
the question. Full prefill reads the same context as text: the prefix and the chunks' text tokens,
no soft tokens. The session, the query methods, the vLLM prompt and connector and the store's
statistics all take the layout from here (`Store.layout()`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ContextLayout:
    prefix: tuple[int, ...]  # the shared prefix's token ids, first in every context
    header: tuple[int, ...] = ()  # a wrapped store's soft token ids before every chunk; () without a wrapper
    trailer: int = 0  # soft tokens each stored chunk ends with (already in its stored tokens)
    linked: bool = False  # a linked wrapper's: every query recomputes each chunk's trailer (`links`)

    @classmethod
    def of(cls, encoded_after: Sequence[int], soft_tokens: int = 0, linked: bool = False) -> "ContextLayout":
        """The layout of a store whose chunks were encoded after `encoded_after` (the prefix, then a
        wrapped store's soft header ids) with `soft_tokens` soft tokens in all (header + trailer)."""
        prefix = tuple(t for t in encoded_after if t >= 0)
        header = tuple(encoded_after[len(prefix):])
        return cls(prefix, header, soft_tokens - len(header) if soft_tokens else 0, linked)

    def links(self, spans: Iterable[tuple[int, int]]) -> list[int]:
        """The context positions a query recomputes whatever its method (a linked wrapper's trailers:
        the last `trailer` positions of each chunk's span); none otherwise."""
        if not (self.linked and self.trailer):
            return []
        return [p for _, end in spans for p in range(end - self.trailer, end)]

    def chunk_tokens(self, lengths: Iterable[int]) -> int:
        """The tokens chunks of stored `lengths` take in a context, each with the header; the prefix left out."""
        return sum(n + len(self.header) for n in lengths)

    def context_tokens(self, lengths: Iterable[int]) -> int:
        """The tokens before the question: the prefix and the chunks (`chunk_tokens`)."""
        return len(self.prefix) + self.chunk_tokens(lengths)

    def chunks(self, tokens: Iterable[list[int]]) -> list[list[int]]:
        """Each chunk's stored token ids with the header in front, as it sits in a context."""
        return [list(self.header) + list(t) for t in tokens]

    def ids(self, tokens: Iterable[list[int]]) -> list[int]:
        """The context's token ids before the question: the prefix, then every chunk (`chunks`);
        soft tokens keep their negative ids."""
        return list(self.prefix) + [t for c in self.chunks(tokens) for t in c]

    def text(self, tokens: Iterable[list[int]]) -> list[int]:
        """The same context as full prefill reads it: the prefix and the chunks' text tokens."""
        return list(self.prefix) + [t for c in tokens for t in c if t >= 0]

    def text_tokens(self, stored: int, chunks: int) -> int:
        """Text tokens among `stored` tokens of `chunks` stored chunks (each ends with the trailer)."""
        return stored - self.trailer * chunks
