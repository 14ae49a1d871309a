"""Compaction: copy the live rows into a new generation without tombstones, publish it."""

from __future__ import annotations

from ..codec.config import DictConfig
from ..errors import ConfigError
from ..failpoints import failpoint
from .layout import CODE_ARRAYS, Indexer, create_generation, now, put, store_config, text_columns
from .reader import Store
from .versions import Manifest, read_manifest
from .writer import Writer


def compact(where, indexer: Indexer, keep: int = 2) -> Manifest:
    """Copy the live rows of the latest version into a new generation, publish it as the next
    version with an index `indexer` builds, then drop versions beyond the newest `keep`."""
    if keep < 1:
        raise ConfigError("--keep must be at least 1")
    with Writer(where) as w:
        b = w.backend
        base = read_manifest(b)
        attrs = w.attrs()
        old = Store(b, attrs, base)
        name = f"g{int(base.generation[1:]) + 1:06d}"
        create_generation(b, name, store_config(attrs), DictConfig(**attrs["dictionary_config"]),
                          attrs["model"]["layers"], attrs["embed_dim"])
        w.write_into(base, name)
        columns = (*text_columns(old.group), "ordinal", "token_length")
        table = {col: old.column(col) for col in (*columns, "embeddings")}
        docs, tok, row = {}, 0, 0
        for doc_id, d in base.documents.by_first():
            rows = slice(d["first"], d["first"] + d["count"])
            t0 = old.row_span(d["first"])[0] if d["count"] else 0
            span = slice(t0, t0 + d["tokens"])
            put(w.group["tokens"], old.array("tokens")[span], tok, axis=0)
            for a in CODE_ARRAYS:
                put(w.group[a], old.array(a)[:, span], tok, axis=1)
            chunk_rows = [{col: table[col][r] for col in columns}
                          for r in range(rows.start, rows.stop)]
            w.write_rows(row, tok, chunk_rows, table["embeddings"][rows])
            docs[doc_id] = {**d, "first": row, "token_offset": tok}
            row, tok = row + d["count"], tok + d["tokens"]
            failpoint("append")
        m = Manifest(base.version + 1, name, tok, row, created=now(), note=f"compacted from v{base.version}",
                     _backend=b)
        w.write_documents(m, docs, (), base)  # a new generation: the whole table, one segment
        w.write_index(m, w.group, indexer, base)  # and one index over it
        failpoint("index")
        w.publish_manifest(m)  # also drops pending.json: it pointed into the old generation
        w.prune(keep)
        return m
