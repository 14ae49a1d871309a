"""`sparsecache serve` through an object-store outage, end to end: a real server (vLLM's CPU build,
a tiny random model with heads of 64 (vLLM's CPU attention takes no smaller), eager) serving a store on a moto S3 server that it reaches through a
proxy this test stalls (connections open, nothing answered: a paused service) and drops.

What must hold: a request during the outage ends within the server's default --store-timeout
(5 s) with an answer (its chunks were read before) or 503 in one line; the process stays up;
/ready and /metrics say so; once the store answers again the server recovers by itself and
answers the same questions as before; a nightly publish during the outage fails in one line and
leaves the store at its last version. Every wait is bounded. The answers of a random model mean
nothing: what is compared is that they are the same.
"""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest
from support.cli import cli_encode
from support.corpora import write_corpus
from support.servers import free_port, stop_server, wait_healthy

pytest.importorskip("vllm")
pytest.importorskip("obstore", reason="needs the s3 extra")
pytestmark = pytest.mark.slow

BOUND = 5.0  # ServeConfig.store_timeout, the default the server runs with here
SLACK = 15.0  # a loaded CI machine: the point is seconds, not the 181 s of the issue
QUESTIONS = ("What does the assert statement do?", "How does break leave a loop?",
             "What does the global statement declare?", "What does del do to a name?")


@dataclass
class Served:
    base: str
    url: str  # the store's s3:// URL
    proc: subprocess.Popen
    proxy: object
    corpus: object
    env: dict
    tiny: tuple = ()
    model: str = ""

    def ask(self, question: str, **options) -> tuple[int, dict, float]:
        """POST a completion; (status, body, seconds it took)."""
        body = {"model": self.model, "prompt": question, "max_tokens": 4, "temperature": 0,
                **({"sparsecache": options} if options else {})}
        req = urllib.request.Request(self.base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read()), time.monotonic() - t
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), time.monotonic() - t

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def until_ready(self, want: int, timeout_s: float = 60) -> dict:
        """Poll /ready until it answers `want` (bounded); its JSON."""
        deadline = time.monotonic() + timeout_s
        while True:
            status, text = self.get("/ready")
            if status == want:
                return json.loads(text)
            assert time.monotonic() < deadline, f"/ready still {status} after {timeout_s:.0f} s: {text}"
            assert self.proc.poll() is None, "the server exited"
            time.sleep(0.5)


def answer(reply: dict) -> tuple[str, list[str]]:
    return reply["choices"][0]["text"], [c["id"] for c in reply["sparsecache"]["chunks"]]


def metric(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and want in line and not line.startswith("#"))


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """(model directory, dictionary directory): the tiny Llama with one KV head of 64."""
    from sparsecache.model import load_model
    from sparsecache.testing import tiny_dictionary, write_tiny_llama

    model = write_tiny_llama(tmp_path_factory.mktemp("tiny64"), head_dim=64, kv_heads=1)
    return model, tiny_dictionary(load_model(str(model)).fingerprint()).save(tmp_path_factory.mktemp("tiny64-dict"))


@pytest.fixture(scope="module")
def served(moto_endpoint, tiny64, tmp_path_factory):
    import boto3

    from sparsecache.testing import OutageProxy

    tiny_model_dir, tiny_dictionary_dir = tiny64
    root = tmp_path_factory.mktemp("outage")
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket="outage")
    url = "s3://outage/store"
    corpus = write_corpus(root / "corpus")
    r = cli_encode(corpus, url, tiny_model_dir, tiny_dictionary_dir)
    assert r.exit_code == 0, r.output
    proxy = OutageProxy(int(moto_endpoint.rsplit(":", 1)[1]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["AWS_ENDPOINT_URL"] = proxy.url  # the server reaches the store through the proxy only
    port = free_port()
    log = root / "serve.log"
    with open(log, "w") as f:
        # the defaults but for: the tiny model, one chunk per question, its ~70-token chunks
        # loaded from the store (the cheap-context rule would let vLLM prefill them), and eager
        # mode (vLLM's compile is test_serve's; here it would only cost start-up time)
        proc = subprocess.Popen([sys.executable, "-m", "sparsecache.cli.main", "serve", url, "--model",
                                 str(tiny_model_dir), "--port", str(port),
                                 "--top-k", "1", "--prefill-under", "0", "--", "--enforce-eager",
                                 "--max-model-len", "1024"],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base + "/health", proc, log, 300)
        s = Served(base, url, proc, proxy, corpus, env, tiny64)
        s.model = json.loads(s.get("/v1/models")[1])["data"][0]["id"]
        yield s
    finally:
        proxy.restore()
        stop_server(proc)
        proxy.close()


def test_requests_during_an_outage_end_within_the_bound_and_the_server_recovers_by_itself(served):
    before = {}
    for q in QUESTIONS[:2]:
        status, reply, _ = served.ask(q)
        assert status == 200, reply
        before[q] = answer(reply)
    # read before, as a cheap context: its tokens are held, its KV was never read
    status, reply, _ = served.ask(QUESTIONS[2], prefill_under=100_000)
    assert status == 200, reply
    assert served.until_ready(200)["reachable"] is True
    metrics = served.get("/metrics")[1]

    served.proxy.stall()
    try:
        for q in QUESTIONS[:2]:  # held in memory: answered as before
            status, reply, took = served.ask(q)
            assert status == 200 and answer(reply) == before[q], reply
            assert took < BOUND + SLACK
        # its tokens are held, its KV is not: the connector's read fails within the bound and
        # vLLM prefills the text instead, counted
        status, reply, took = served.ask(QUESTIONS[2])
        assert status == 200 and reply["choices"][0]["text"] is not None, reply
        assert took < BOUND + SLACK
        # never read: 503 within the bound, one line naming the store, never a library's text
        status, reply, took = served.ask(QUESTIONS[3])
        assert status == 503, reply
        message = reply["error"]["message"]
        assert served.url in message and "keeps retrying" in message and "\n" not in message, message
        assert "Generic S3 error" not in message and took < BOUND + SLACK
        state = served.until_ready(503)  # the poller found it down as well
        assert state["reachable"] is False and state["error"] and state["unreachable_since"]
        status, reply, took = served.ask(QUESTIONS[3])  # known down: refused at once
        assert status == 503 and took < BOUND + SLACK, reply
        served.proxy.drop()  # refused connections instead of silence: the same
        status, reply, took = served.ask(QUESTIONS[3])
        assert status == 503 and took < BOUND + SLACK, reply
        after = served.get("/metrics")[1]
        assert metric(after, "sparsecache_server_store_reachable") == 0
        assert metric(after, "sparsecache_server_store_errors_total", kind="timeout") > 0
        assert metric(after, "sparsecache_server_requests_total", endpoint="completion", outcome="store_unavailable") \
            == metric(metrics, "sparsecache_server_requests_total", endpoint="completion",
                      outcome="store_unavailable") + 3
        assert metric(after, "vllm:sparsecache_store_errors_total") > metric(metrics, "vllm:sparsecache_store_errors_total")
        assert metric(after, "vllm:sparsecache_load_errors_total") > metric(metrics, "vllm:sparsecache_load_errors_total")
        assert served.proc.poll() is None
    finally:
        served.proxy.restore()

    assert served.until_ready(200)["reachable"] is True  # no restart
    for q in QUESTIONS[:2]:
        status, reply, _ = served.ask(q)
        assert status == 200 and answer(reply) == before[q], reply
    status, reply, _ = served.ask(QUESTIONS[3])
    assert status == 200 and reply["sparsecache"]["chunks"], reply
    assert metric(served.get("/metrics")[1], "sparsecache_server_store_reachable") == 1


def test_a_publish_during_an_outage_fails_in_one_line_and_leaves_the_last_version(served):
    from sparsecache.store import versions

    tiny_model_dir, tiny_dictionary_dir = served.tiny
    last = versions(served.url)[-1]  # read past the proxy
    (served.corpus / "new.txt").write_text("Zebras graze on the savannah in the early morning light.\n")
    served.proxy.drop()
    try:
        r = subprocess.run([sys.executable, "-m", "sparsecache.cli.main", "encode-corpus", str(served.corpus),
                            "--store", served.url, "--model", str(tiny_model_dir), "--dict", str(tiny_dictionary_dir),
                            "--chunk-tokens", "64", "--device", "cpu"],
                           capture_output=True, text=True, env=served.env, timeout=300)
    finally:
        served.proxy.restore()
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error")]
    assert r.returncode == 1 and len(errors) == 1 and served.url in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert versions(served.url)[-1] == last
    assert served.until_ready(200)["version"] == last and served.proc.poll() is None


def test_a_damaged_chunk_gets_500_in_one_line_naming_it_and_the_server_stays_up(served):
    """The store answers, but with a chunk object missing (deleted behind the server's back): the
    request that needs it gets 500 naming the object and `sparsecache verify`; verify names it
    too; the server stays up and answers again once the object is back."""
    from sparsecache.kvstore import KVStore, verify
    from sparsecache.store import open_backend
    from sparsecache.store.reader import chunk_key

    store = KVStore.open(served.url)  # past the proxy: the test's own view
    status, reply, _ = served.ask(QUESTIONS[0])
    read = {c["id"] for c in reply["sparsecache"]["chunks"]}
    tokens = store.array("tokens")
    chunk = next(c for c in store.chunks() if c.id not in read and c.token_length)
    key = f"{store.manifest.generation}/tokens/{chunk_key(tokens, chunk.token_offset // tokens.chunks[0], 0)}"
    backend = open_backend(served.url)
    data = backend.get(f"data/{key}")
    backend.delete(f"data/{key}")
    try:
        status, reply, _ = served.ask(QUESTIONS[0], chunks=[chunk.id])
        message = reply["error"]["message"]
        assert status == 500 and key in message and "sparsecache verify" in message and "\n" not in message, reply
        report = verify(served.url)
        assert not report["ok"] and any(p.startswith(key) for p in report["problems"])
        assert chunk.id in report["corrupt_chunks"]
        status, reply, _ = served.ask(QUESTIONS[0])  # what it read before still answers
        assert status == 200 and {c["id"] for c in reply["sparsecache"]["chunks"]} == read
    finally:
        backend.put(f"data/{key}", data)
    status, reply, _ = served.ask(QUESTIONS[0], chunks=[chunk.id])
    assert status == 200 and reply["sparsecache"]["chunks"][0]["id"] == chunk.id
    assert served.proc.poll() is None
