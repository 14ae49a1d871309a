"""`sparsecache serve` through an object-store outage, measured as the issue (#72) met it.

Five short documents are encoded with the default model into a store on a local moto S3 server;
`sparsecache serve s3://…/demo --top-k 1` runs on its defaults; two questions are asked; then the
moto process is paused (SIGSTOP: connections accepted, nothing answered) for --pause-s seconds,
during which one question asked before and two new ones are asked and /ready is read; then it
is resumed, and the time until /ready says the store answers again is measured before the same
questions are asked once more. Prints and saves JSON: each request's status, seconds and text,
/ready during and after, the store metrics. Needs vLLM (`scripts/setup.sh vllm`) and
moto[server] (the test extra). Takes ~4 min on 2 cores.

    python scripts/experiments/serve_outage.py --out docs/benchmarks/serve-outage.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

DOCS = {
    "velmora.txt": "Velmora is a small town in the hills of the Dresul valley. It was founded in 1788 by salt traders. "
                   "The mayor of Velmora is Ilse Barkri. The market in Velmora is held every Thursday.",
    "tharbar.txt": "The Tharbar is a wooden sailing ship that carries barrels along the coast. It was launched in 1902. "
                   "The hull of the Tharbar is painted green, and its home port is Ostfen.",
    "quenmir.txt": "Quenmir Lanterns is a family business that makes lanterns. It opened its first workshop in 1921. "
                   "Quenmir Lanterns employs 42 people, and its headquarters are in Belrov.",
    "kelmont.txt": "Kelmont Observatory stands on a ridge above the village of Zanmir. The observatory was built in "
                   "1894 and is run by Pavel Ostrander.",
    "orlin.txt": "The Orlin bridge crosses the river Sava at Tennick. It was opened in 1967 and is 412 metres long.",
}
BEFORE = ("Who is the mayor of Velmora?", "What colour is the hull of the Tharbar?")
NEW = ("How many people does Quenmir Lanterns employ?", "Who runs Kelmont Observatory?")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pause-s", type=float, default=60.0, help="how long the S3 server is paused (default 60)")
    ap.add_argument("--out", type=Path, default=Path("serve-outage.json"), help="where the JSON goes")
    args = ap.parse_args()

    import boto3

    from sparsecache.measure.machine import cpu_model
    from sparsecache.testing import moto_server

    work = Path(tempfile.mkdtemp(prefix="serve-outage-"))
    corpus = work / "corpus"
    corpus.mkdir()
    for name, text in DOCS.items():
        (corpus / name).write_text(text + "\n")
    out: dict = {"cpu": cpu_model(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "pause_s": args.pause_s,
                 "python": platform.python_version()}
    with moto_server() as endpoint:
        moto_pid = _listener_pid(int(endpoint.rsplit(":", 1)[1]))
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="outage-demo")
        url = "s3://outage-demo/demo"
        t = time.monotonic()
        subprocess.run([sys.executable, "-m", "sparsecache.cli.main", "encode-corpus", str(corpus), "--store", url],
                       check=True, capture_output=True)
        out["encode_s"] = round(time.monotonic() - t, 1)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        log = open(work / "serve.log", "w")
        t = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "sparsecache.cli.main", "serve", url, "--top-k", "1",
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while _get(base + "/health")[0] != 200:
                if proc.poll() is not None or time.monotonic() - t > 600:
                    raise SystemExit(f"the server did not start; its log: {work / 'serve.log'}")
                time.sleep(1)
            out["start_s"] = round(time.monotonic() - t, 1)
            out["before"] = [_ask(base, q) for q in BEFORE]
            out["ready_before"] = _get(base + "/ready")
            os.kill(moto_pid, signal.SIGSTOP)
            paused = time.monotonic()
            try:
                out["during"] = [_ask(base, q) for q in (BEFORE[0], *NEW)]
                time.sleep(3)
                out["ready_during"] = _get(base + "/ready")
                out["server_up_during"] = proc.poll() is None
                time.sleep(max(0.0, args.pause_s - (time.monotonic() - paused)))
            finally:
                os.kill(moto_pid, signal.SIGCONT)
            resumed = time.monotonic()
            while _get(base + "/ready")[0] != 200 and time.monotonic() - resumed < 120:
                time.sleep(0.2)
            out["ready_again_after_s"] = round(time.monotonic() - resumed, 2)
            out["after"] = [_ask(base, q) for q in (BEFORE[0], *NEW)]
            metrics = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
            out["metrics"] = [line for line in metrics.splitlines() if not line.startswith("#") and (
                "store" in line or "fallbacks" in line or "load_errors" in line or "server_requests_total" in line)]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    text = json.dumps(out, indent=1)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


def _listener_pid(port: int) -> int:
    """The pid of the process listening on 127.0.0.1:`port` (the moto server)."""
    import psutil

    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
            return c.pid
    raise SystemExit(f"no process listens on port {port}")


def _get(url: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            body = r.read().decode()
            return r.status, json.loads(body) if body.startswith("{") else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError as e:
        return 0, str(e)


def _ask(base: str, question: str) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": question}], "max_tokens": 16,
            "temperature": 0}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=400) as r:
            reply, status = json.loads(r.read()), r.status
    except urllib.error.HTTPError as e:
        reply, status = json.loads(e.read()), e.code
    took = round(time.monotonic() - t, 2)
    if status == 200:
        return {"question": question, "status": status, "s": took, "answer": reply["choices"][0]["message"]["content"],
                "sources": [c["doc_id"] for c in reply["sparsecache"]["chunks"]]}
    return {"question": question, "status": status, "s": took, "error": reply["error"]["message"]}


if __name__ == "__main__":
    main()
