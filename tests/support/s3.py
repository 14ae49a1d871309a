"""Object storage for the tests (the s3 extra): a moto S3 server on 127.0.0.1 and a fresh bucket per test."""

from __future__ import annotations


import pytest




@pytest.fixture(scope="session")
def moto_endpoint():
    """An S3-compatible server (moto) on a free 127.0.0.1 port for this test session; the
    standard AWS_* variables point obstore (and so sparsecache) at it."""
    import shutil

    from sparsecache.testing import moto_server

    pytest.importorskip("obstore", reason="needs the s3 extra")
    if shutil.which("moto_server") is None:
        pytest.skip("needs moto[server] (the test extra)")
    with moto_server() as url:
        yield url


@pytest.fixture
def s3_url(moto_endpoint, request):
    """A fresh bucket on the session's moto server; returns an s3:// URL with a prefix in it."""
    import re

    import boto3

    bucket = re.sub(r"[^a-z0-9-]", "-", f"t{id(request)}-{request.node.name.lower()}")[:60].strip("-")
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/stores/one"
