"""Many processes on one node, started together: beside the fault-injection suite (one writer
killed at every failpoint), this suite runs what shares a node's user cache or a store at the
same instant, the way a Ray node starts its actors or a host its servers.

Each case runs K = 4 processes (spawned, so each is a real process with its own imports)
released together by a barrier, round after round, each round on a new, empty
$SPARSECACHE_CACHE, and asserts that every process of every round succeeded with the same
result. Race-prone cases run ROUNDS rounds: 6 in the default run (CI), 20 with
SPARSECACHE_RACE_ROUNDS=20, as the counts in BENCHMARKS.md ("Crash safety") were made. Six
are enough for what they guard: the dictionary fetch that failed two Ray encodes in three
(issue: a fixed temporary name, renamed away by the other actor) failed here in most rounds
before the fix.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import re
import threading
import time
import traceback
from pathlib import Path

import pytest

K = 4  # processes started together
ROUNDS = int(os.environ.get("SPARSECACHE_RACE_ROUNDS", "6"))  # rounds of a race-prone case
DEADLINE_S = 600  # every case is bounded: a hung process fails the test, never the CI job


def race(task, *args, k: int = K, rounds: int = ROUNDS, cache: Path, deadline_s: float = DEADLINE_S) -> list[list]:
    """Run `task(i, r, *args)` in k spawned processes, released together by a barrier in each
    of `rounds` rounds, round r on the empty cache directory `cache/r{r}`. Returns each round's
    k results; a process's exception comes back as a string, so the assertion shows it."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(k, timeout=deadline_s), ctx.Queue()
    procs = [ctx.Process(target=_runner, args=(task, args, i, rounds, str(cache), barrier, results), daemon=True)
             for i in range(k)]
    for p in procs:
        p.start()
    out = [[None] * k for _ in range(rounds)]
    end = time.monotonic() + deadline_s
    try:
        for _ in range(k * rounds):
            r, i, result = results.get(timeout=max(1.0, end - time.monotonic()))
            out[r][i] = result
    except queue.Empty:
        pytest.fail(f"{task.__name__}: processes still running after {deadline_s} s: {out}")
    finally:
        for p in procs:
            p.join(max(0.1, end - time.monotonic()))
            if p.is_alive():
                p.kill()
    return out


class Failed(str):
    """A process's exception, as text (picklable whatever the exception was)."""


def _runner(task, args, i, rounds, cache, barrier, results) -> None:
    import torch

    torch.set_num_threads(1)  # K processes on a 2-core machine: one thread each, as Ray gives its actors
    for r in range(rounds):
        os.environ["SPARSECACHE_CACHE"] = f"{cache}/r{r:03d}"
        barrier.wait()
        try:
            result = task(i, r, *args)
        except BaseException as e:  # reported, not raised: the other processes go on
            result = Failed(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}")
        results.put((r, i, result))


def assert_all_same(rounds: list[list]) -> None:
    failed = [(r, i, x) for r, row in enumerate(rounds) for i, x in enumerate(row) if isinstance(x, Failed)]
    assert not failed, f"{len(failed)} of {sum(map(len, rounds))} processes failed; first: round {failed[0][0]}, " \
                       f"process {failed[0][1]}:\n{failed[0][2]}"
    values = {json.dumps(x, sort_keys=True) for row in rounds for x in row}
    assert len(values) == 1, f"processes disagree: {sorted(values)[:3]}"


# ---------------------------------------------------------------- tasks (run in the spawned processes)


def _invoke(*args):
    from click.testing import CliRunner

    from sparsecache.cli.main import cli

    r = CliRunner().invoke(cli, [str(a) for a in args])
    if r.exit_code != 0:
        raise RuntimeError(f"exit {r.exit_code}: {r.output.strip()[-400:]}") from r.exception
    return r.output


def convert_tiny_gguf(i, r, gguf: str):
    from sparsecache.model.gguf import convert_gguf
    from sparsecache.model import load_model
    from sparsecache.paths import cache_root

    path = convert_gguf(Path(gguf), cache_root() / "models" / "tiny-gguf", "tiny-gguf")
    return load_model(str(path)).fingerprint()


def convert_default_model(i, r):
    from sparsecache.model import load_model

    return load_model().fingerprint()


def fetch_dictionary(i, r, url: str):
    from sparsecache.kvstore import KVStore

    return KVStore.open(url).dictionary.fingerprint()


def check_model(i, r, model_dir: str):
    from sparsecache.model.check import ensure_checked
    from sparsecache.model import load_model

    out = json.loads(_invoke("check-model", model_dir, "--json"))
    return [out["fingerprint"], ensure_checked(load_model(model_dir)).passed]  # reads what the others wrote


def query(i, r, url: str, model_dir: str):
    out = json.loads(_invoke("query", url, "What does the global statement do?", "--model", model_dir,
                             "--top-k", 2, "--max-new-tokens", 4, "--json"))
    return [out["answer"], [c["id"] for c in out["chunks"]]]


# ---------------------------------------------------------------- the node's user cache


def test_converting_a_gguf_model(tiny_gguf, tmp_path):
    """The default model's first use converts its GGUF into the cache (model.convert_gguf): a
    tiny GGUF through the same function, 20 rounds of four processes."""
    assert_all_same(race(convert_tiny_gguf, str(tiny_gguf), cache=tmp_path))


@pytest.mark.slow
def test_converting_the_default_model(tmp_path):
    """The real default model (~40 s to convert): one round of four processes, of which one
    converts and three wait for it and load its directory."""
    rounds = race(convert_default_model, rounds=1, cache=tmp_path)
    assert_all_same(rounds)
    assert rounds[0][0]["name"] == "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def small_model_dir(tiny_gguf, tmp_path_factory) -> Path:
    """The tiny GGUF converted: a 2-layer Llama with a 512-token vocabulary, whose logits cost
    a hundredth of the tiny Llama's (49K tokens), so a round of four processes stays short."""
    from sparsecache.model.gguf import convert_gguf

    return convert_gguf(tiny_gguf, tmp_path_factory.mktemp("small") / "model", "small")


@pytest.fixture(scope="module")
def small_dictionary_dir(small_model_dir, tmp_path_factory) -> Path:
    from sparsecache.testing import unit_atoms

    from sparsecache.codec.dictionary import DictConfig, Dictionary
    from sparsecache.model import load_model

    fp = load_model(str(small_model_dir)).fingerprint()
    return Dictionary(unit_atoms(32, 512, 1), unit_atoms(32, 512, 2), DictConfig(512, 4, 1), fp).save(
        tmp_path_factory.mktemp("small-dict"))


@pytest.fixture(scope="module")
def s3_store(moto_endpoint, small_model_dir, small_dictionary_dir, tmp_path_factory):
    """A store on the session's S3 server, encoded once for the module."""
    import boto3

    from support.corpora import write_corpus

    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket="concurrency")
    url = "s3://concurrency/stores/one"
    corpus = write_corpus(tmp_path_factory.mktemp("concurrency") / "corpus")
    _invoke("encode-corpus", corpus, "--store", url, "--model", small_model_dir, "--dict", small_dictionary_dir,
            "--chunk-tokens", 64)
    return url


def encode_with_ray(i, r, corpus: str, url: str, model_dir: str, dict_dir: str):
    """`encode-corpus --workers 2` into this process's own new S3 store; each run starts its own
    Ray cluster, whose actors inherit this round's empty cache."""
    import ray

    try:
        _invoke("encode-corpus", corpus, "--store", f"{url}/r{r}-p{i}", "--model", model_dir, "--dict", dict_dir,
                "--chunk-tokens", 64, "--workers", 2)
    finally:
        ray.shutdown()
    return "ran"


@pytest.mark.long  # ~80 s; test_distributed.py encodes into a new S3 prefix on a fresh node, one at a time
def test_two_distributed_encodes_on_a_fresh_node(s3_store, small_model_dir, small_dictionary_dir, tmp_path):
    """Two `--workers 2` encodes of different S3 stores at once on an empty cache: two drivers
    and four actors unpack the embedder and fetch dictionaries together. One round (it starts
    two Ray clusters on two cores, ~45 s); the fetch itself is raced 20 rounds above."""
    pytest.importorskip("ray", reason="needs the ray extra")
    from support.corpora import write_corpus
    from support.stores import assert_same_live_chunks

    from sparsecache.kvstore import verify

    corpus = write_corpus(tmp_path / "corpus")
    url = s3_store.rsplit("/", 2)[0] + "/ray"
    rounds = race(encode_with_ray, str(corpus), url, str(small_model_dir), str(small_dictionary_dir), k=2, rounds=1,
                  cache=tmp_path / "cache")
    assert_all_same(rounds)
    _invoke("encode-corpus", corpus, "--store", tmp_path / "alone", "--model", small_model_dir, "--dict",
            small_dictionary_dir, "--chunk-tokens", 64)
    for i in range(2):
        assert verify(f"{url}/r0-p{i}")["ok"]
        assert_same_live_chunks(f"{url}/r0-p{i}", tmp_path / "alone")


def test_fetching_a_stores_dictionary(s3_store, tmp_path):
    """What failed the Ray encode: actors fetching the store's dictionary into an empty cache."""
    assert_all_same(race(fetch_dictionary, s3_store, cache=tmp_path))


def test_check_model(small_model_dir, tmp_path):
    """check-model records its result per fingerprint; encode and learn-dict read it."""
    assert_all_same(race(check_model, str(small_model_dir), cache=tmp_path))


def test_querying_one_store(s3_store, small_model_dir, tmp_path):
    """Queries on a fresh node: embedder unpacked, dictionary fetched, all at once. Always 20
    rounds: before its fix this race failed 2 runs in 80, which 6 rounds would often miss."""
    assert_all_same(race(query, s3_store, str(small_model_dir), rounds=max(ROUNDS, 20), cache=tmp_path))


# ---------------------------------------------------------------- one store, several processes

QUESTION = "What does the global statement do?"


def read_until(i, r, store: str, model_dir: str, stop: str, doc_pattern: str):
    """Query `store` until `stop` exists: even processes open the latest version per query (as
    `sparsecache query` does), odd ones keep one Session (as a server does). Returns
    {"queries": n, "errors": [...]}; a chunk naming no document of the corpus is an error
    (what a version deleted under a silent zarr read would return)."""
    from sparsecache.model import load_model
    from sparsecache.query.session import Session

    model = load_model(model_dir)
    session = Session(store, model)
    n, errors, rereads = 0, [], 0
    while not Path(stop).exists() and len(errors) < 5:
        time.sleep(0.05)  # leave the writer some of the two cores
        try:
            if i % 2 == 0:
                rereads += session.rereads
                session = Session(store, model)
            a = session.query(QUESTION, top_k=2, max_new_tokens=2)
            bad = [c for c in a.chunks if not re.fullmatch(doc_pattern, c["doc_id"]) or c["ordinal"] < 0]
            if bad or not a.chunks:
                errors.append(f"version {session.store.version}: chunks {a.chunks} name no document of the corpus")
            n += 1
            Path(stop).with_name(f"queried-{i}").touch()  # the writer goes on until every reader has queried
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    return {"queries": n, "errors": errors, "rereads": rereads + session.rereads}


def _encode(corpus, store, model_dir, dict_dir, *extra):
    return _invoke("encode-corpus", corpus, "--store", store, "--model", model_dir, "--dict", dict_dir,
                   "--chunk-tokens", 64, *extra)


def _run_in_thread(fn, *args, **kwargs):
    out = {}

    def run():
        try:
            out["result"] = fn(*args, **kwargs)
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_readers_while_a_writer_publishes_and_compacts(small_model_dir, small_dictionary_dir, tmp_path):
    """Four processes query while the writer, 20 times, changes the corpus, encodes it and
    compacts, both keeping one version: every version a reader opened is deleted within
    seconds, generations included. No query may fail or return chunks of no document."""
    import random

    from support.corpora import Corpus

    from sparsecache.kvstore import verify
    from sparsecache.store import read_manifest

    corpus = Corpus(tmp_path / "corpus", random.Random(7))
    for _ in range(5):
        corpus.add()
    store, stop = tmp_path / "store", tmp_path / "stop"
    _encode(corpus.root, store, small_model_dir, small_dictionary_dir, "--keep", 1)
    names = r"(r\d{3}-)*[abcmxz]\d{3}\.txt"  # every name Corpus gives a document
    done, out = _run_in_thread(race, read_until, str(store), str(small_model_dir), str(stop), names,
                               rounds=1, cache=tmp_path / "cache")
    versions = set()
    rounds, deadline = 0, time.monotonic() + DEADLINE_S / 2
    try:
        # ROUNDS publish-and-compact rounds, and more until every reader has queried at least
        # once under them (spawned readers load a model first; on a busy machine that is slow)
        while rounds < ROUNDS or (not all((tmp_path / f"queried-{i}").exists() for i in range(K))
                                  and time.monotonic() < deadline):
            rounds += 1
            corpus.mutate(2)
            _encode(corpus.root, store, small_model_dir, small_dictionary_dir, "--keep", 1, "--delete-missing")
            versions.add(read_manifest(store).version)
            _invoke("compact", store, "--keep", 1)
            versions.add(read_manifest(store).version)
    finally:
        stop.touch()
        done.join(DEADLINE_S)
    assert "error" not in out, out.get("error")
    readers = out["result"][0]
    assert all(not isinstance(x, Failed) for x in readers), readers
    assert all(not x["errors"] for x in readers), [x["errors"][:2] for x in readers]
    assert all(x["queries"] >= 1 for x in readers), readers
    assert len(versions) == 2 * rounds and verify(store)["ok"]
    print(f"{sum(x['queries'] for x in readers)} queries by {K} readers over {len(versions)} versions, no error; "
          f"{sum(x['rereads'] for x in readers)} read again at a newer version")


def encode_one_store(i, r, corpus: str, stores: str, model_dir: str, dict_dir: str):
    """encode-corpus into the round's new store; "refused: ..." where another process holds it."""
    from click.testing import CliRunner

    from sparsecache.cli.main import cli

    res = CliRunner().invoke(cli, ["encode-corpus", corpus, "--store", f"{stores}/r{r:03d}", "--model", model_dir,
                                   "--dict", dict_dir, "--chunk-tokens", "64"])
    if res.exit_code == 0:
        return "ran"
    if "store is locked" in res.output:
        return "refused: " + res.output.strip().splitlines()[-1]
    raise RuntimeError(f"exit {res.exit_code}: {res.output.strip()[-400:]}") from res.exception


def test_two_encodes_of_one_store(small_model_dir, small_dictionary_dir, tmp_path):
    """Four encodes of one new store at once: each either runs or is refused naming the
    holder, and the store is what one encode alone makes."""
    from support.corpora import write_corpus
    from support.stores import assert_same_live_chunks

    from sparsecache.kvstore import verify

    corpus = write_corpus(tmp_path / "corpus")
    rounds = race(encode_one_store, str(corpus), str(tmp_path / "stores"), str(small_model_dir),
                  str(small_dictionary_dir), cache=tmp_path / "cache")
    assert not [x for row in rounds for x in row if isinstance(x, Failed)], rounds
    refused = [x for row in rounds for x in row if x.startswith("refused")]
    assert all(re.search(r"being written by pid \d+ on ", x) for x in refused), refused
    assert all("ran" in row for row in rounds)
    _encode(corpus, tmp_path / "alone", small_model_dir, small_dictionary_dir)
    for r in range(len(rounds)):
        assert verify(tmp_path / "stores" / f"r{r:03d}")["ok"]
        assert_same_live_chunks(tmp_path / "stores" / f"r{r:03d}", tmp_path / "alone")
    print(f"{len(refused)} of {K * len(rounds)} encodes refused naming the holder, the rest ran")
