"""`sparsecache serve`, in two parts: (1) its requests without an engine (`RagPrompts` and the
server's `Rag`: layout, options, the prefix-cache salt, following new versions, bad input,
damage and outages named in one line) on the tiny model; (2) end to end, one real server (vLLM's
CPU build, the default model) on a free 127.0.0.1 port, started and stopped here, asked through
the `openai` client and plain HTTP (slow).

The real server's store holds four short documents about made-up things, one fact per question,
so an answer can only come from its chunk. Every wait and request is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparsecache.errors import ConfigError, StoreError
from sparsecache.ingest.config import EncodeOptions
from sparsecache.ingest.encoder import encode_with
from sparsecache.store import StoreConfig
from sparsecache.vllm.serving import PARAMS_KEY, RagPrompts
from support.corpora import encoded_docs
from support.servers import free_port, stop_server, wait_healthy

try:
    import openai
except ImportError:  # the real server's tests skip (its fixture asks for vllm and openai)
    openai = None


# ================================================================ 1. requests without an engine (tiny model)


CONFIG = StoreConfig(chunk_tokens=64, zarr_chunk_tokens=32, coef_dtype="float16")


@pytest.fixture
def built(tiny_model, tiny_dictionary, embedder, corpus_dir, tmp_path):
    def run():
        encode_with([str(corpus_dir)], tmp_path / "store", tiny_dictionary, tiny_model, CONFIG,
                    EncodeOptions(batch_tokens=256, progress=False), embedder=embedder)
        return tmp_path / "store"
    return run


def test_requests_lay_out_retrieve_within_documents_and_refuse_bad_input(built, tiny_model_dir):
    rag = RagPrompts(built(), model=str(tiny_model_dir))
    req = rag.request("What does assert do?", top_k=3)
    ids = req.kv_transfer_params[PARAMS_KEY]["chunks"]
    assert len(ids) == 3 and [h["id"] for h in req.chunks] == ids
    assert req.kv_transfer_params[PARAMS_KEY]["version"] == rag.store.version
    docs = sorted({c.doc_id for c in rag.store.chunks()})[:2]
    assert {h["doc_id"] for h in rag.request("anything", top_k=20, documents=docs).chunks} == set(docs)
    given = rag.request("anything", chunks=ids[:1])
    assert given.chunks[0]["score"] is None and given.chunks[0]["doc_id"] == req.chunks[0]["doc_id"]
    with pytest.raises(ConfigError, match="empty"):
        rag.request("   ")
    with pytest.raises(StoreError, match="no live chunk"):
        rag.request("anything", chunks=["nope"])
    with pytest.raises(StoreError, match="no document"):
        rag.request("anything", documents=["nope.txt"])


def test_the_cache_salt_separates_kv_that_differs(built, tiny_model_dir):
    """Blended KV depends on the question and the settings; decoded KV (none) on neither."""
    rag = RagPrompts(built(), model=str(tiny_model_dir))
    ids = [c.id for c in rag.store.chunks()][:2]

    def salt(question, **params):
        req = rag.request(question, chunks=ids)
        req.kv_transfer_params[PARAMS_KEY].update(params)
        return req.cache_salt

    assert salt("a?") == salt("a?") != salt("b?")  # the default blends
    assert salt("a?", recompute_ratio=0.5) != salt("a?", recompute_ratio=0.25)
    assert salt("a?", method="none") == salt("b?", method="none") != salt("a?", method="infoflow")
    assert salt("a?", method="none", source="raw") != salt("a?", method="none")
    assert rag.request("a?", chunks=ids).vllm_prompt()["cache_salt"] == salt("a?")


def test_a_following_rag_sees_each_new_version(built, tiny_model_dir, corpus_dir):
    store = built()
    rag = RagPrompts(store, model=str(tiny_model_dir), follow_s=0)
    pinned = RagPrompts(store, model=str(tiny_model_dir))
    first = rag.store.version
    (corpus_dir / "new.txt").write_text("Zebras graze on the savannah in the early morning light.\n")
    built()
    req = rag.request("zebras on the savannah", top_k=1)
    assert req.kv_transfer_params[PARAMS_KEY]["version"] == first + 1 and req.chunks[0]["doc_id"].endswith("new.txt")
    assert pinned.request("zebras", top_k=1).kv_transfer_params[PARAMS_KEY]["version"] == first


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's, on importing vLLM (hidden outside pytest)
def test_serve_stops_at_start_up_with_one_line(built, tmp_path, monkeypatch):
    """No vLLM: how to install it. With vLLM: a store that cannot be opened, or one of another
    model than the one to serve, ends the command before any engine starts."""
    import sys

    from click.testing import CliRunner

    from sparsecache.cli.main import cli

    with monkeypatch.context() as m:
        m.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
        r = CliRunner().invoke(cli, ["serve", str(tmp_path / "none.store")])
    assert r.exit_code == 1 and "bash scripts/setup.sh vllm" in r.output and len(r.output.splitlines()) == 1
    pytest.importorskip("vllm")
    r = CliRunner().invoke(cli, ["serve", str(tmp_path / "none.store")])
    assert r.exit_code == 1 and "no sparsecache store at" in r.output and len(r.output.splitlines()) == 1, r.output
    r = CliRunner().invoke(cli, ["serve", str(built())])  # the tiny model's store, the default model to serve
    assert r.exit_code == 1 and "encoded with model" in r.output and len(r.output.splitlines()) == 1, r.output


def test_the_kv_cache_on_a_cpu_is_sized_from_the_memory_free():
    """`serve`'s rule on a CPU: room for max_seqs requests of max_len tokens, at most half of what
    is free on vLLM's NUMA node, at least one request; a request that cannot fit is one line."""
    from sparsecache.vllm.server import KV_CACHE_SHARE, kv_cache_bytes

    assert kv_cache_bytes(100, 1000, 8, 10**9) == 8 * 100 * 1000
    assert kv_cache_bytes(100, 1000, 10**6, 10**9) == int(KV_CACHE_SHARE * 10**9)
    with pytest.raises(ConfigError, match="free on NUMA node 1.*--max-model-len.*--kv-cache-gb"):
        kv_cache_bytes(10**6, 1000, 1, 10**9, node=1)


def test_a_damaged_local_store_gets_one_line_with_its_status_and_verify_names_the_damage(built, tiny_model_dir):
    """The server's retrieval and layout (`Rag`, no engine) over a local store whose chunk file
    is removed (500: damaged, named) or cannot be read (a directory in its place: 503); a chunk
    read before is still answered, the next request after the repair too, and `verify` names
    the file and the chunk it holds."""
    pytest.importorskip("prometheus_client")
    from sparsecache.kvstore import verify
    from sparsecache.store.reader import chunk_key
    from sparsecache.vllm.server import Rag, ServeConfig, StoreDamaged, StoreDown

    store = built()
    rag = Rag(ServeConfig(str(store), model=str(tiny_model_dir), top_k=1))
    try:
        s = rag.prompts.store
        tokens = s.array("tokens")
        step = tokens.chunks[0]
        chunks = s.chunks()
        spans = s.spans([c.id for c in chunks])

        def files(span):
            return set(range(span[0] // step, (span[1] - 1) // step + 1))

        held = chunks[0]
        assert rag.request("what?", {"chunks": [held.id]}).chunks[0]["id"] == held.id  # read: held in memory
        other, span = next((c, sp) for c, sp in zip(chunks, spans) if not files(sp) & files(spans[0]))
        key = f"{s.manifest.generation}/tokens/{chunk_key(tokens, span[0] // step, 0)}"
        path = store / "data" / key
        data = path.read_bytes()
        path.unlink()
        with pytest.raises(StoreDamaged) as damaged:
            rag.request("what?", {"chunks": [other.id]})
        message = str(damaged.value)
        assert damaged.value.status == 500 and key in message and "sparsecache verify" in message and "\n" not in message
        assert rag.request("what?", {"chunks": [held.id]}).chunks[0]["id"] == held.id
        path.mkdir()  # a file that cannot be read
        with pytest.raises(StoreDown) as down:
            rag.request("what?", {"chunks": [other.id]})
        assert down.value.status == 503 and str(path) in str(down.value) and "\n" not in str(down.value)
        report = verify(store)
        assert not report["ok"] and any(p.startswith(key) for p in report["problems"])
        assert other.id in report["corrupt_chunks"] and held.id not in report["corrupt_chunks"]
        path.rmdir()
        path.write_bytes(data)
        assert rag.request("what?", {"chunks": [other.id]}).chunks[0]["id"] == other.id
    finally:
        rag.close()


def test_the_server_spends_a_requests_ttft_budget_at_its_context_length(built, tiny_model_dir):
    """`serve --ttft-budget` (or a request's `ttft_budget`): the ratio is fixed at layout from the store's
    refit for this device, passed to the connector as the ratio in effect (one salt) and reported with the
    sources; a ratio given wins, and a bad budget is a 400."""
    pytest.importorskip("prometheus_client")
    from sparsecache.query.budget import Costs
    from sparsecache.store import Writer
    from sparsecache.vllm.server import BadRequest, Rag, ServeConfig

    store = built()
    refit = Costs(a_full=10.0, p=2.0, a_store=20.0, s=0.2)
    with Writer(store) as w:
        w.publish_calibration({"cpu": {"method": "none", "label": "none", "costs": refit.to_dict()}},
                              note="calibrated (cpu)")
    rag = Rag(ServeConfig(str(store), model=str(tiny_model_dir), top_k=2, method="infoflow", ttft_budget=0.5))
    try:
        rag.device = "cpu"
        ids = [c.id for c in rag.prompts.store.chunks()][:2]
        req = rag.request("what?", rag.options({"chunks": ids}))
        assert req.params["recompute_ratio"] == pytest.approx(refit.ratio(req.context_tokens, 0.5), abs=1e-4)
        assert rag.sources(req)["recompute_ratio"] == req.params["recompute_ratio"]
        tighter = rag.request("what?", rag.options({"chunks": ids, "ttft_budget": 0.3}))
        assert tighter.params["recompute_ratio"] < req.params["recompute_ratio"]
        assert tighter.cache_salt != req.cache_salt
        given = rag.request("what?", rag.options({"chunks": ids, "recompute_ratio": 0.2}))
        assert given.params["recompute_ratio"] == 0.2
        with pytest.raises(BadRequest, match="ttft"):
            rag.options({"ttft_budget": 3})
        gated = rag.request("what?", rag.options({"chunks": ids, "gate_coverage": 0.8}))  # #94's gate, to the connector
        assert gated.params["gate_coverage"] == 0.8 and gated.cache_salt != req.cache_salt
        with pytest.raises(BadRequest, match="gate-coverage"):
            rag.options({"gate_coverage": 2})
    finally:
        rag.close()


# ================================================================ 2. a real server (vLLM's CPU build, the default model)


DOCS = {
    "velmora.txt": "Velmora is a small town in the hills of the Dresul valley. It was founded in 1788 by salt traders. "
                   "The mayor of Velmora is Ilse Barkri. The market in Velmora is held every Thursday, and most houses "
                   "in the town have red roofs. Visitors often remark on how quiet Velmora is in the early morning.",
    "tharbar.txt": "The Tharbar is a wooden sailing ship that carries barrels along the coast. It was launched in 1902. "
                   "The captain of the Tharbar is Oskar Lindqvist, and the hull of the Tharbar is painted green. The "
                   "home port of the Tharbar is Ostfen, and it has a crew of eleven sailors.",
    "quenmir.txt": "Quenmir Lanterns is a family business that makes lanterns. It opened its first workshop in 1921. "
                   "Quenmir Lanterns employs 42 people, and its headquarters are in Belrov. The company is closed every "
                   "Monday. It was founded by Greta Quenmir.",
    "kelmont.txt": "Kelmont Observatory stands on a ridge above the village of Zanmir. Its main telescope has a mirror "
                   "of 61 centimetres. The observatory was built in 1894 and is run by Pavel Ostrander. Public evenings "
                   "are held on the first Friday of each month.",
}
QUESTIONS = ("What colour is the hull of the Tharbar?", "Who is the mayor of Velmora?",
             "How many people does Quenmir Lanterns employ?", "Who runs Kelmont Observatory?",
             "When was the Tharbar launched?", "On which day is the market held in Velmora?",
             "Where are the headquarters of Quenmir Lanterns?", "How large is the mirror of the Kelmont telescope?")
KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"  # the served name: the store's model


@dataclass
class Server:
    base: str
    root: Path
    proc: subprocess.Popen
    client: "openai.OpenAI"

    def chat(self, question: str, max_tokens: int = 16, **options):
        return self.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0,
            extra_body={"sparsecache": options} if options else None)

    def post(self, path: str, body, key: str | None = KEY) -> tuple[int, dict]:
        """Raw HTTP (bodies the openai client would refuse to send): status and JSON."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        req = urllib.request.Request(self.base + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metrics(self) -> str:
        return urllib.request.urlopen(self.base + "/metrics", timeout=10).read().decode()


def encode(corpus: Path, store: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sparsecache.cli.main", "encode-corpus", str(corpus), "--store", str(store)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    root = tmp_path_factory.mktemp("serve")
    encoded_docs(root, DOCS)
    port = free_port()
    # as a user starts it: none of vLLM's variables (its default thread binding, its KV-cache sizing
    # left to serve), and vLLM's compiled forward (no --enforce-eager)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    log = root / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "sparsecache.cli.main", "serve", str(root / "store"), "--port", str(port),
                                 # the defaults: two chunks (~400 tokens) are over the CPU's cheap-context
                                 # threshold, so these requests take the store path (cheap contexts: below)
                                 "--top-k", "2", "--api-key", KEY, "--",
                                 "--max-model-len", "4096"],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base + "/health", proc, log, 420)
        yield Server(base, root, proc, openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=180, max_retries=0))
    finally:
        stop_server(proc)


@pytest.mark.slow
def test_chat_answers_from_the_chunk_that_holds_the_fact(server):
    """On the server's defaults the chunk that holds the fact is retrieved first and answered from;
    that the answer is full prefill's is a fidelity figure (BENCHMARKS.md), not asserted here: the
    default (infoflow r = 0.1) answers this question otherwise. Recomputing every token (r = 1) costs
    more than prefilling on a CPU, so the server has vLLM prefill the same chunks' text: full prefill,
    which names the colour."""
    r = server.chat(QUESTIONS[0], max_tokens=24)
    assert r.choices[0].message.content.strip()
    sources = r.model_extra["sparsecache"]
    assert sources["chunks"][0]["doc_id"] == "tharbar.txt" and len(sources["chunks"]) == 2
    assert sources["chunks"][0]["score"] > sources["chunks"][1]["score"]
    exact = server.chat(QUESTIONS[0], chunks=[c["id"] for c in sources["chunks"]], recompute_ratio=1.0, max_tokens=24)
    assert "green" in exact.choices[0].message.content.lower(), exact.choices[0].message.content
    assert exact.model_extra["sparsecache"]["method"] == "full"
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]


@pytest.mark.slow
def test_a_stream_yields_the_same_text_with_the_sources_first(server):
    whole = server.chat(QUESTIONS[1], max_tokens=24)
    stream = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=24, temperature=0, stream=True)
    events = list(stream)
    assert events[0].model_extra["sparsecache"] == whole.model_extra["sparsecache"]
    assert all("sparsecache" not in (e.model_extra or {}) for e in events[1:])
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == whole.choices[0].message.content


@pytest.mark.slow
def test_options_choose_the_chunks_and_the_method(server):
    """`documents` restricts retrieval, `chunks` skips it, and recompute_ratio 1.0 is full prefill:
    the same server's answer over the same chunks without the connector (a plain completion of
    the prompt the server laid out gives no such control, so the method is compared by effect:
    r = 1 and r = 0 must be able to differ, and r = 1 must name the mayor, as full prefill does)."""
    only = server.chat(QUESTIONS[1], documents=["kelmont.txt", "quenmir.txt"], top_k=3)
    assert {c["doc_id"] for c in only.model_extra["sparsecache"]["chunks"]} == {"kelmont.txt", "quenmir.txt"}
    velmora = server.chat(QUESTIONS[1], top_k=1).model_extra["sparsecache"]["chunks"][0]
    given = server.chat(QUESTIONS[1], chunks=[velmora["id"]], recompute_ratio=1.0, max_tokens=24)
    assert [c["id"] for c in given.model_extra["sparsecache"]["chunks"]] == [velmora["id"]]
    assert given.model_extra["sparsecache"]["chunks"][0]["score"] is None
    assert "Barkri" in given.choices[0].message.content


@pytest.mark.slow
def test_concurrent_requests_each_answer_as_when_served_alone(server):
    alone = [server.chat(q).choices[0].message.content for q in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: server.chat(q).choices[0].message.content, QUESTIONS))
    assert together == alone


@pytest.mark.slow
def test_completions_take_the_question_as_prompt(server):
    r = server.client.completions.create(model=MODEL, prompt=QUESTIONS[0], max_tokens=16, temperature=0)
    assert r.choices[0].text and r.model_extra["sparsecache"]["chunks"][0]["doc_id"] == "tharbar.txt"
    status, body = server.post("/v1/completions", {"model": MODEL, "prompt": [QUESTIONS[0], QUESTIONS[1]]})
    assert status == 400 and "one string" in body["error"]["message"]
    status, body = server.post("/v1/completions", {"model": MODEL, "prompt": " \n\t "})  # the plan's own check
    assert status == 400 and "the question is empty" in body["error"]["message"]


@pytest.mark.slow
@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": "   "}]}, "no text"),
    ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                 {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "only text content"),
    ({"messages": [{"role": "system", "content": "Be brief."}]}, "no user message"),
    ({"messages": [{"role": "user", "content": "hi"}], "sparsecache": {"top_k": 0}}, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}], "sparsecache": {"top_k": 1000}}, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}], "sparsecache": {"chunks": ["nope"]}}, "no live chunk 'nope'"),
    ({"messages": [{"role": "user", "content": "hi"}], "sparsecache": {"documents": ["nope.txt"]}}, "no document"),
    ({"messages": [{"role": "user", "content": "hi"}], "sparsecache": {"method": "full"}}, "method must be one of"),
    ({"messages": [{"role": "user", "content": "hi"}], "sparsecache": {"recompute_ratio": 2}}, "recompute-ratio"),
    ({"messages": [{"role": "user", "content": "hi"}], "sparsecache": {"colour": "red"}}, "unknown"),
    ({"messages": [{"role": "user", "content": "word " * 5000}]}, "maximum context length"),
    (b'{"model": "x", "messages": [', "JSON"),
])
def test_a_bad_request_gets_400_and_the_next_is_served(server, body, message):
    status, reply = server.post("/v1/chat/completions", body if isinstance(body, bytes) else {"model": MODEL, **body})
    assert status == 400, reply
    assert message in reply["error"]["message"] and reply["error"]["code"] == 400
    assert server.chat(QUESTIONS[0], max_tokens=2).choices[0].message.content


@pytest.mark.slow
def test_the_api_key_guards_the_api_but_not_health(server):
    status, reply = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                                key=None)
    assert status == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0).models.list()
    assert urllib.request.urlopen(server.base + "/health", timeout=10).status == 200
    with urllib.request.urlopen(server.base + "/ready", timeout=10) as r:  # the store's state, open to probes
        ready = json.loads(r.read())
    assert r.status == 200 and ready["reachable"] is True and ready["store"] == str(server.root / "store")
    assert ready["version"] >= 2 and ready["store_errors"] == {}


def value(text: str, name: str, **labels) -> float:
    """The sum of a Prometheus metric's samples with these labels."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and want in line and not line.startswith("#"))


@pytest.mark.slow
def test_metrics_count_requests_retrieval_and_injection(server):
    before = server.metrics()
    # a ratio given: the default's TTFT budget buys r = 0 in contexts this short (the budget's case, query/budget.py)
    server.chat(QUESTIONS[2], max_tokens=2, recompute_ratio=0.25)
    server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": ""}]})
    after = server.metrics()
    assert value(after, "sparsecache_server_requests_total", endpoint="chat", outcome="ok") == \
        value(before, "sparsecache_server_requests_total", endpoint="chat", outcome="ok") + 1
    assert value(after, "sparsecache_server_requests_total", endpoint="chat", outcome="bad_request") == \
        value(before, "sparsecache_server_requests_total", endpoint="chat", outcome="bad_request") + 1
    assert value(after, "sparsecache_server_retrieval_seconds_count") == \
        value(before, "sparsecache_server_retrieval_seconds_count") + 1
    assert value(after, "vllm:sparsecache_requests_total") == value(before, "vllm:sparsecache_requests_total") + 1
    assert value(after, "vllm:sparsecache_recomputed_total") > value(before, "vllm:sparsecache_recomputed_total")


@pytest.mark.slow
def test_a_request_under_the_cheap_context_threshold_is_left_to_vllms_prefill(server):
    before = server.metrics()
    cheap = server.chat(QUESTIONS[0], max_tokens=24, prefill_under=100_000)
    after = server.metrics()
    assert value(after, "vllm:sparsecache_prefilled_cheap_total") == \
        value(before, "vllm:sparsecache_prefilled_cheap_total") + 1
    assert value(after, "vllm:sparsecache_requests_total") == value(before, "vllm:sparsecache_requests_total")
    assert cheap.choices[0].message.content and len(cheap.model_extra["sparsecache"]["chunks"]) == 2  # vLLM's own prefill
    status, reply = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                         "sparsecache": {"prefill_under": -1}})
    assert status == 400 and "prefill-under must be a number of tokens >= 0" in reply["error"]["message"]


@pytest.mark.slow
def test_the_compiled_server_answers_as_sparsecaches_own_loop(server):
    """The server runs vLLM's compiled forward (its default) while the connector blends with
    vLLM's layers in eager Python: each answer is `sparsecache query`'s over the same chunks."""
    from sparsecache.query.session import Session

    ours = Session(server.root / "store")
    for q in QUESTIONS[:3]:
        ids = [c["id"] for c in server.chat(q, max_tokens=1).model_extra["sparsecache"]["chunks"]]
        for method in ("none", "infoflow"):
            served = server.chat(q, chunks=ids, method=method, max_tokens=12).choices[0].message.content
            mine = ours.query(q, chunks=ids, method=method, max_new_tokens=12, prefill_under=0)
            assert served == mine.answer, (q, method)


@pytest.mark.slow
def test_the_prefix_cache_shares_blocks_only_where_the_kv_is_the_same(server):
    """vLLM's prefix cache reuses a request's blocks by its tokens and cache salt. Blended KV
    depends on the question, the method and the ratio; decoded KV (method none) on none of them."""
    ids = [c["id"] for c in server.chat(QUESTIONS[2], max_tokens=1).model_extra["sparsecache"]["chunks"]]
    ask, other = "Who founded Quenmir Lanterns?", "In which year did Quenmir Lanterns open its first workshop?"

    def hits(question, **options) -> float:
        before = value(server.metrics(), "vllm:prefix_cache_hits_total")
        server.chat(question, chunks=ids, max_tokens=1, **options)
        return value(server.metrics(), "vllm:prefix_cache_hits_total") - before

    server.chat(ask, chunks=ids, max_tokens=1, method="none")  # the decoded KV of these chunks, cached
    assert hits(ask) == 0  # a blend reuses neither that nor anything else: none made with this question
    assert hits(ask) > 0  # the same blend again: the same KV, reused
    assert hits(other) == 0  # another question blends other KV
    assert hits(ask, recompute_ratio=0.5) == 0 and hits(ask, method="a3") == 0
    assert hits(other, method="none") > 0  # decoded KV is the same whatever the question


@pytest.mark.slow
def test_a_server_that_cannot_start_says_why_in_one_line(server):
    """Settings that cannot start end the command before vLLM's engine starts, as a user runs it
    (a fresh process): exit status 1 and one line, nothing else (the port here is the running
    server's). The other settings' error lines, through the CLI in this process (each fresh
    process costs ~15 s of imports): a KV cache larger than the memory free, a length beyond the
    model's."""
    from click.testing import CliRunner

    from sparsecache.cli.main import cli

    port = server.base.rsplit(":", 1)[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    r = subprocess.run([sys.executable, "-m", "sparsecache.cli.main", "serve", str(server.root / "store"),
                        "--port", port], capture_output=True, text=True, env=env, timeout=300)
    out = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 1 and len(out) == 1 and "cannot listen on 127.0.0.1:" in out[0], out
    for args, message in ((["--kv-cache-gb", "100000"], "GiB free on NUMA node"),
                          (["--max-model-len", "100000"], "more than the model's 8192 positions")):
        r = CliRunner().invoke(cli, ["serve", str(server.root / "store"), "--port", str(free_port()), *args])
        errors = [line for line in r.output.splitlines() if line.startswith("Error")]  # beside torch's warnings here
        assert r.exit_code == 1 and len(errors) == 1 and message in errors[0], r.output


@pytest.mark.slow
def test_a_new_version_is_served_without_restart_and_requests_in_flight_finish_on_theirs(server, tmp_path):
    """Runs last (it changes the store). An encode of an edited corpus is paused just before it
    publishes; a long streaming request starts on the current version; the encode publishes
    while that request is still generating (its events keep arriving after the new version
    exists). The stream ends with the same text as before the publish and names the old
    version; the next request retrieves from the new one."""
    import threading

    from sparsecache.store import versions

    long = dict(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=200, temperature=0,
                extra_body={"ignore_eos": True})
    before = server.client.chat.completions.create(**long)
    old = before.model_extra["sparsecache"]
    doc = server.root / "corpus" / "velmora.txt"
    doc.write_text(doc.read_text().replace("Ilse Barkri", "Tomas Velkor"))
    paused = tmp_path / "paused"
    writer = encode(server.root / "corpus", server.root / "store",
                    {**os.environ, "SPARSECACHE_PAUSE_AT": "index:1", "SPARSECACHE_PAUSE_FILE": str(paused)})
    events: list = []  # (arrival time, event), read as they come
    try:
        deadline = time.monotonic() + 300
        while not paused.exists():
            assert writer.poll() is None, writer.stdout.read()
            assert time.monotonic() < deadline, "the encode did not reach its publish in 300 s"
            time.sleep(0.5)
        stream = server.client.chat.completions.create(**long, stream=True)
        reader = threading.Thread(target=lambda: events.extend((time.monotonic(), e) for e in stream), daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        while not events:  # the request is in the engine, its chunks' KV read
            assert time.monotonic() < deadline and reader.is_alive(), "no first event in 120 s"
            time.sleep(0.05)
        os.kill(writer.pid, signal.SIGCONT)
        while versions(server.root / "store")[-1] == old["version"]:
            assert time.monotonic() < deadline, "the encode did not publish"
            time.sleep(0.05)
        published = time.monotonic()
        assert writer.wait(timeout=120) == 0, writer.stdout.read()
        reader.join(timeout=300)
        assert not reader.is_alive(), "the stream did not end in 300 s"
    finally:
        if writer.poll() is None:
            writer.kill()
    assert events[-1][0] > published, "the request was still generating when the new version was published"
    assert events[0][1].model_extra["sparsecache"] == old
    text = "".join(e.choices[0].delta.content or "" for _, e in events if e.choices)
    assert text == before.choices[0].message.content
    deadline = time.monotonic() + 60  # the server looks every second and opens the new version in the background
    while True:
        after = server.chat(QUESTIONS[1], top_k=1, max_tokens=4)
        new = after.model_extra["sparsecache"]
        if new["version"] != old["version"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert new["version"] == old["version"] + 1
    assert new["chunks"][0]["doc_id"] == "velmora.txt" and new["chunks"][0]["id"] not in {c["id"] for c in old["chunks"]}
    assert server.proc.poll() is None
