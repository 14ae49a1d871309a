"""What each chunk is encoded after (`StoreConfig.encode_after`, #94): context its K/V has seen.

A query lays retrieved chunks out one after another, but each chunk's K/V was computed after the
prefix alone, so no chunk has read another: that is what the blend's recomputation pays for. A store
is built offline, so it can spend encode time here instead. With `encode_after`:

- `prefix`: nothing between the prefix (and a wrapped store's header) and the chunk; what a query lays out.
- `document`: the chunk(s) before it in its own document (none for a document's first chunk).
- `neighbours`: its nearest chunk(s) of other documents by the store's own embedder (FusionRAG's idea).

How many: `StoreConfig.encode_after_chunks`, the one just before it (or the nearest) next to it.

The context's K/V is not kept: the chunk's own K/V is coded, so the bytes per token do not change. Each
chunk records the ids of what it read in the chunk table's `after` column. The context sits where a
query would put it: `prefix | header context trailer | header chunk trailer`.

The nightly job (the rule `docs/concepts/store.md` states): neighbours are chosen among what the store
will hold once the run publishes, the held documents' stored rows and the chunks of the documents this
run encodes. A held document whose chunks' recorded neighbours (the `after` column) are no longer their
nearest is encoded again (`Plan.refresh`), so the store stays equal to a fresh encode of its corpus, what
each chunk read included; a crashed run's rerun plans the same way from what the store then holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..text.corpus import Chunk, Source, chunks

SEARCH = 32  # nearest candidates looked at beyond the ones wanted (the chunk's own document's are skipped)


@dataclass
class After:
    """Per chunk of a run: the token ids it reads before itself and the ids of the chunks they are."""

    mode: str  # StoreConfig.encode_after
    header: tuple[int, ...] = ()  # a wrapped store's header: the encode's prefix ends with it, and the chunk
    trailer: tuple[int, ...] = ()  # follows its context as a query lays them: context trailer header chunk
    # neighbours mode: chunk id -> [(id, text token ids)] of its nearest chunks, nearest first
    neighbour: dict[str, list[tuple[str, tuple[int, ...]]]] = field(default_factory=dict)
    count: int = 1  # StoreConfig.encode_after_chunks: chunks read before each one
    _previous: dict[str, list[Chunk]] = field(default_factory=dict)  # document mode: the chunks before, by id
    _recent: list[Chunk] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.mode != "prefix"

    def saw(self, chunk: Chunk) -> None:
        """`chunk` came out of its document (every chunk in order, those a resumed run skips too)."""
        if self.mode == "document":
            if not self._recent or self._recent[-1].doc_id != chunk.doc_id or not chunk.ordinal:
                self._recent = []
            if self._recent:
                self._previous[chunk.id] = self._recent[-self.count:]
            self._recent = (self._recent + [chunk])[-self.count:]

    def context(self, chunk: Chunk) -> tuple[list[int], str]:
        """(token ids between the prefix and `chunk`'s header, the ids of the chunks they hold, comma-separated,
        the nearest first). The chunks sit in order, the nearest (or the one just before) next to `chunk`."""
        if self.mode == "document":
            read = [(c.id, tuple(t for t in c.token_ids if t >= 0)) for c in self._previous.pop(chunk.id, [])][::-1]
        elif self.mode == "neighbours":
            read = self.neighbour.get(chunk.id, [])
        else:
            read = []
        tokens = [t for _, ids in reversed(read) for t in (*ids, *self.trailer, *self.header)]
        return tokens, ",".join(i for i, _ in read)


@dataclass
class Plan:
    """A neighbours store's run, planned before any chunk is encoded."""

    neighbour: dict[str, list[tuple[str, tuple[int, ...]]]]  # chunk id -> [(neighbour id, its text ids)], nearest first
    refresh: list[Source]  # documents the store holds unchanged whose chunks' neighbours changed: encoded again


def plan_neighbours(group, held: dict[str, dict], work: list[Source], corpus: dict[str, Source], tokenizer,
                    chunk_tokens: int, embedder, count: int = 1) -> Plan:
    """Every chunk the store will hold once the run publishes, and each one's `count` nearest chunks of
    other documents among them by `embedder` (inner product of unit vectors; a tie to the lower chunk id,
    so that the choice does not depend on the order the chunks came in).

    `group`: the generation the store writes into; `held`: the documents that stay as they are, id ->
    {first, count} of their rows there (the last version's and a crashed run's, less what this run
    deletes or encodes); `work`: the documents this run encodes (chunked and embedded here); `corpus`:
    the corpus's documents by id, so that a held document whose chunks' recorded neighbours (the `after`
    column) are no longer their nearest is encoded again (`Plan.refresh`). A held document the corpus no
    longer has (kept without --delete-missing) keeps its K/V."""
    import faiss

    from ..store.layout import AFTER, legacy_strings, read_strings

    new = [c for s in work for c in chunks(s, tokenizer, chunk_tokens)]
    ids, docs, tokens = [c.id for c in new], [c.doc_id for c in new], [c.token_ids for c in new]
    vectors = [embedder.embed([c.text for c in new]) if new else np.zeros((0, embedder.dim), np.float32)]
    rows = np.sort(np.concatenate([np.arange(d["first"], d["first"] + d["count"]) for d in held.values()]
                                  + [np.zeros(0, np.int64)])).astype(np.int64)
    recorded = []
    if len(rows):
        n = int(rows[-1]) + 1
        legacy = legacy_strings(group)
        column = {c: read_strings(group, c, n, legacy)[rows] for c in ("chunk_id", "doc_id", AFTER)}
        stored = np.asarray(group["tokens"][:])
        starts, lengths = group["token_offset"][:n][rows], group["token_length"][:n][rows]
        ids += [str(x) for x in column["chunk_id"]]
        docs += [str(x) for x in column["doc_id"]]
        tokens += [tuple(int(t) for t in stored[a:a + k] if t >= 0) for a, k in zip(starts, lengths)]
        vectors.append(np.asarray(group["embeddings"][:n][rows], dtype=np.float32))
        recorded = [str(x) for x in column[AFTER]]
    if not ids:
        return Plan({}, [])
    pool = np.ascontiguousarray(np.concatenate(vectors), dtype=np.float32)
    index = faiss.IndexFlatIP(pool.shape[1])
    index.add(pool)
    scores, found = index.search(pool, min(SEARCH + count, len(pool)))
    nearest = [_nearest(i, row, score, docs, ids, count) for i, (row, score) in enumerate(zip(found, scores))]

    def read(i: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(ids[j], tuple(tokens[j])) for j in nearest[i]]

    out = {ids[i]: read(i) for i in range(len(new)) if nearest[i]}
    stale = {docs[len(new) + r] for r, was in enumerate(recorded)
             if was != ",".join(ids[j] for j in nearest[len(new) + r])}
    refresh = [corpus[d] for d in sorted(stale) if d in corpus]
    again = {s.id for s in refresh}  # encoded again, unchanged: the same chunks as their held rows, the same pool
    out.update({ids[i]: read(i) for i in range(len(new), len(ids)) if nearest[i] and docs[i] in again})
    return Plan(out, refresh)


def _nearest(i: int, row: np.ndarray, score: np.ndarray, docs: list[str], ids: list[str], count: int) -> list[int]:
    """The best `count` of `row` (pool positions, best first, with their `score`) from other documents than
    position i's, best first, among equal scores the lowest chunk id first."""
    other = [(-float(sc), ids[j], j) for j, sc in zip(row.tolist(), score.tolist()) if j >= 0 and docs[j] != docs[i]]
    return [j for _, _, j in sorted(other)[:count]]
