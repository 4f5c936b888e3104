"""Parquet over s3:// against a real S3-protocol server (moto's, on 127.0.0.1, with signed requests enforced).

Every way users give an endpoint and credentials (the URL's query and user part, ``storage_options`` in fsspec's
or pyarrow's keys, fsspec's configuration, the AWS environment and config files) reaches every form of
``train_files`` (file, list, directory, glob), and gives the rows a local copy gives; a resume over s3:// is
exact; storage failures at setup are named as such (never "matches no file"); an outage longer than pyarrow's
own retries is outlasted by ``read_retry_seconds`` without changing a row, or ends in one error naming the URL,
the row group and the cause; worker processes reading s3:// start clean (not forked from the process using S3),
with the environment of their start, and end when the training process is killed.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import multiprocessing
import multiprocessing.forkserver
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import boto3
import fsspec
import pyarrow.parquet as pq
import pytest
import requests
import torch
import zstandard
from moto.server import ThreadedMotoServer
from support import free_port, make_docs, moto_server, train_tokenizer, write_parquet

from lightning_d9d import PretrainingDataModule
from lightning_d9d.streaming.loading.loader import worker_start_method
from lightning_d9d.streaming.sources.source import RowGroupIndex, resolve_files
from lightning_d9d.streaming.sources.storage import Storage, StorageError

pytestmark = pytest.mark.slow  # every test serves its files from a real S3 server (moto's) on 127.0.0.1

BUCKET = "corpus"
REGION = "us-east-1"


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> dict[str, Any]:
    """A moto server on 127.0.0.1 holding a copy of a local corpus, and a user allowed s3:* with its key."""
    root = tmp_path_factory.mktemp("s3")
    docs = make_docs(240, seed=11, max_words=30, long_every=9, long_words=90)
    paths = write_parquet(root / "data", docs, files=3, row_group_size=10)
    train_tokenizer(docs, root / "tokenizer.json")
    with moto_server() as (server, endpoint):
        yield _served_corpus(root, paths, server, endpoint)


def _served_corpus(root: Path, paths: list[Path], server: Any, endpoint: str) -> dict[str, Any]:
    port = int(endpoint.rsplit(":", 1)[1])
    iam = boto3.client("iam", endpoint_url=endpoint, region_name=REGION, aws_access_key_id="setup",
                       aws_secret_access_key="setup")  # fmt: skip
    iam.create_user(UserName="trainer")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="trainer")["AccessKey"]
    client = boto3.client("s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=key["AccessKeyId"],
                          aws_secret_access_key=key["SecretAccessKey"])  # fmt: skip
    client.create_bucket(Bucket=BUCKET)
    for path in paths:
        client.upload_file(str(path), BUCKET, f"data/{path.name}")
    client.upload_file(str(paths[0]), BUCKET, "other/notes.txt")
    return {"root": root, "port": port, "endpoint": endpoint, "key": key["AccessKeyId"],
            "secret": key["SecretAccessKey"], "server": server}  # fmt: skip


@contextlib.contextmanager
def signed_requests_only(s3: dict) -> Iterator[None]:
    """Make the server check every request's key and signature (moto accepts any by default).

    Only while needed: moto's signature check rejects correctly signed listings whose prefix holds a ``/``, which
    every directory or glob listing does, so listings are tested against an enforcing server only where they must
    be refused.
    """
    requests.post(f"{s3['endpoint']}/moto-api/reset-auth", data=b"0").raise_for_status()
    try:
        yield
    finally:
        requests.post(f"{s3['endpoint']}/moto-api/reset-auth", data=b"inf").raise_for_status()


@pytest.fixture
def aws_env(s3: dict, monkeypatch, tmp_path: Path) -> dict:
    """An AWS environment of nothing but this test's: no real credentials, config files or metadata service."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "FSSPEC_S3", "FSSPEC_S3_ENDPOINT_URL"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    return s3


def url_options(s3: dict, host: str = "127.0.0.1") -> str:
    return f"endpoint_override={host}:{s3['port']}&scheme=http"


def credentials_env(s3: dict, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3["secret"])


def dm_options(s3: dict, train_files: Any, **changes: Any) -> dict:
    options = dict(
        train_files=train_files,
        tokenizer=str(s3["root"] / "tokenizer.json"),
        seq_len=16,
        global_batch_size=4,
        microbatch_size=2,
        num_streams=2,
        num_workers=0,
        tokenizer_batch_size=8,
        bestfit_buffer_size=16,
        steps_per_epoch=12,
    )
    options.update(changes)
    return options


def make_dm(s3: dict, train_files: Any, **changes: Any) -> PretrainingDataModule:
    dm = PretrainingDataModule(**dm_options(s3, train_files, **changes))
    dm.setup("fit")
    return dm


def assert_same_batches(got: list, want: list) -> None:
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.targets, b.targets)
        assert torch.equal(a.position_ids, b.position_ids)


def local_texts(s3: dict) -> list:
    index = RowGroupIndex.scan(resolve_files(str(s3["root"] / "data")), "text")
    return [index.read_texts(g) for g in range(len(index))]


# ---------------------------------------------------------------------------------------------- configuration
def read_all(spec: Any, storage: Storage | None = None) -> list:
    index = RowGroupIndex.scan(resolve_files(spec, storage=storage), "text", storage)
    return [index.read_texts(g) for g in range(len(index))]


def test_every_way_of_giving_the_endpoint_reaches_every_form_of_files(aws_env: dict, monkeypatch, tmp_path) -> None:
    s3, want = aws_env, local_texts(aws_env)
    credentials_env(s3, monkeypatch)
    names = [f"s3://{BUCKET}/data/part-{i:03d}.parquet" for i in range(3)]
    endpoint_url = s3["endpoint"]
    # In the URL, for a glob: the files it expands to keep it (they are opened against it, not the default).
    files = resolve_files(f"s3://{BUCKET}/data/*.parquet?{url_options(s3)}")
    assert files == [f"{name}?{url_options(s3)}" for name in names]
    assert read_all(files) == want
    # storage_options in fsspec/s3fs's keys, for a directory; in pyarrow's keys, for a list of files.
    assert read_all(f"s3://{BUCKET}/data", Storage({"client_kwargs": {"endpoint_url": endpoint_url}})) == want
    pyarrow_keys = {"endpoint_override": f"127.0.0.1:{s3['port']}", "scheme": "http", "region": REGION}
    assert read_all(names, Storage(pyarrow_keys)) == want
    # The AWS environment (AWS_ENDPOINT_URL), for a glob.
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint_url)
    assert read_all(f"s3://{BUCKET}/data/part-00[12].parquet") == want[len(want) // 3 :]
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    # fsspec's configuration for s3 (what FSSPEC_S3_ENDPOINT_URL sets), for a directory.
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": endpoint_url})
    assert read_all(f"s3://{BUCKET}/data/") == want
    monkeypatch.delitem(fsspec.config.conf, "s3")
    # A profile of ~/.aws/config, for a glob.
    (tmp_path / "aws-config").write_text(f"[profile lab]\nregion = {REGION}\nendpoint_url = {endpoint_url}\n")
    monkeypatch.setenv("AWS_PROFILE", "lab")
    assert read_all(f"s3://{BUCKET}/data/*.parquet") == want
    # Without any endpoint the default (AWS itself) is asked: the listing fails, and says so.
    monkeypatch.delenv("AWS_PROFILE")
    monkeypatch.setitem(os.environ, "AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(StorageError, match="cannot list train_files="):
        resolve_files(f"s3://{BUCKET}/data/*.parquet")


def test_credentials_reach_the_server_every_way(aws_env: dict, monkeypatch, tmp_path: Path) -> None:
    s3 = aws_env
    want = local_texts(s3)[: len(local_texts(s3)) // 3]
    name, options = f"s3://{BUCKET}/data/part-000.parquet", url_options(s3)
    endpoint = {"endpoint_url": s3["endpoint"]}
    with signed_requests_only(s3):
        assert read_all(f"s3://{s3['key']}:{quote(s3['secret'], safe='')}@{name[5:]}?{options}") == want
        assert read_all(name, Storage({"key": s3["key"], "secret": s3["secret"], **endpoint})) == want
        client_kwargs = {"aws_access_key_id": s3["key"], "aws_secret_access_key": s3["secret"], **endpoint}
        assert read_all(name, Storage({"client_kwargs": client_kwargs})) == want
        (tmp_path / "aws-credentials").write_text(
            f"[lab]\naws_access_key_id = {s3['key']}\naws_secret_access_key = {s3['secret']}\n"
        )
        monkeypatch.setenv("AWS_PROFILE", "lab")
        assert read_all(f"{name}?{options}") == want
        monkeypatch.delenv("AWS_PROFILE")
        credentials_env(s3, monkeypatch)
        assert read_all(f"{name}?{options}") == want


def test_unknown_storage_options_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"storage_options key 'endpoint' is not a known S3 option; valid keys: "):
        Storage({"endpoint": "http://x"}).filesystem("s3://bucket/x.parquet")
    with pytest.raises(ValueError, match=r"URL 's3://bucket/x.parquet\?host=h': option 'host' is not a known S3"):
        Storage().filesystem("s3://bucket/x.parquet?host=h")
    with pytest.raises(ValueError, match="read_retry_seconds must be a number of seconds >= 0, got -1"):
        PretrainingDataModule(train_files="x", tokenizer="y", read_retry_seconds=-1)
    with pytest.raises(ValueError, match="storage_options must be a dict"):
        PretrainingDataModule(train_files="x", tokenizer="y", storage_options="endpoint=x")


# ---------------------------------------------------------------------------------------------- rows and resume
def test_rows_over_s3_equal_a_local_copys_and_resume_is_exact(aws_env: dict, monkeypatch) -> None:
    s3 = aws_env
    credentials_env(s3, monkeypatch)
    url = f"s3://{BUCKET}/data/*.parquet?{url_options(s3)}"
    local = make_dm(s3, str(s3["root"] / "data"), steps_per_epoch=None)
    remote = make_dm(s3, url, steps_per_epoch=None, num_workers=2)
    assert remote.steps_per_epoch == local.steps_per_epoch > 6
    assert remote.fingerprint == local.fingerprint  # the same data wherever it is read from
    want = list(local.train_dataloader())
    assert_same_batches(list(remote.train_dataloader()), want)

    # Resume over s3:// (through another address of the same server) from step 3: exactly the rest.
    first = make_dm(s3, url, steps_per_epoch=None)
    iterator = iter(first.train_dataloader())
    for _ in range(6):  # 3 steps of 2 microbatches
        next(iterator)
    state = first.state_dict()
    resumed = make_dm(s3, f"s3://{BUCKET}/data?{url_options(s3, 'localhost')}", steps_per_epoch=None)
    resumed.load_state_dict(state)
    assert_same_batches(list(resumed.train_dataloader()), want[6:])


def test_workers_over_s3_start_clean_with_the_environment_of_their_start(aws_env: dict, monkeypatch) -> None:
    """Workers reading s3:// are not forked from this process (a fork would copy its S3 client's state, locks held
    by its threads included) but started by a forkserver; they still read the AWS environment of the moment they
    start, not the one the forkserver started with: here the endpoint (a relay on a port new to this test) and the
    credentials are set only after the forkserver runs."""
    s3 = aws_env
    assert worker_start_method([str(s3["root"] / "data" / "part-000.parquet"), "file:///x.parquet"]) is None
    assert worker_start_method(["memory://corpus/x.parquet"]) is None  # lives in this process: fork sees it
    names = [f"s3://{BUCKET}/data/part-{i:03d}.parquet" for i in range(3)]
    assert worker_start_method([str(s3["root"]), *names]) == "forkserver"
    multiprocessing.forkserver.ensure_running()
    port = free_port()
    relay = start_relay(port, s3["port"])
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        credentials_env(s3, monkeypatch)
        want = list(make_dm(s3, str(s3["root"] / "data"), steps_per_epoch=6).train_dataloader())
        loader = make_dm(s3, names, steps_per_epoch=6, num_workers=2).train_dataloader()
        assert_same_batches(list(loader), want)
        loader.close()
    finally:
        relay.kill()
        relay.wait()


KILLED_TRAINER = """
import os, sys, time
from lightning_d9d import PretrainingDataModule

if __name__ == "__main__":
    dm = PretrainingDataModule(train_files=sys.argv[1], tokenizer=sys.argv[2], seq_len=16, global_batch_size=4,
                               microbatch_size=2, num_streams=2, num_workers=2, steps_per_epoch=12)
    dm.setup("fit")
    batches = iter(dm.train_dataloader())
    next(batches)
    print("reading", flush=True)
    time.sleep(600)
"""


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")
def test_workers_over_s3_end_when_the_training_process_is_killed(aws_env: dict, monkeypatch, tmp_path: Path) -> None:
    """A forkserver's workers are not the training process's children: they still end when it is killed."""
    s3 = aws_env
    credentials_env(s3, monkeypatch)
    script = tmp_path / "train.py"
    script.write_text(KILLED_TRAINER)
    url = f"s3://{BUCKET}/data/*.parquet?{url_options(s3)}"
    trainer = subprocess.Popen([sys.executable, str(script), url, str(s3["root"] / "tokenizer.json")],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert trainer.stdout is not None and trainer.stdout.readline().strip() == "reading"
        started = descendants(trainer.pid)
        assert len(started) >= 3  # the forkserver and its two workers (and multiprocessing's resource tracker)
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 20.0
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in started if alive(pid)]
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"processes outlived the killed training process: {left}"


# ---------------------------------------------------------------------------------------------- failures at setup
@pytest.mark.parametrize("spec", ["data/*.parquet", "data", "data/part-000.parquet"])
def test_refused_credentials_are_reported_as_such_not_as_no_matching_file(aws_env: dict, spec: str) -> None:
    s3, spec = aws_env, f"s3://{BUCKET}/{spec}"
    wrong_secret = {"key": s3["key"], "secret": "not-the-secret", "endpoint_url": s3["endpoint"]}
    unknown_key = {"key": "AKIAUNKNOWNKEY000000", "secret": s3["secret"], "endpoint_url": s3["endpoint"]}
    with signed_requests_only(s3):
        for options, cause in (
            (wrong_secret, "SIGNATURE_DOES_NOT_MATCH|ACCESS_DENIED"),
            (unknown_key, "INVALID_ACCESS|ACCESS_DENIED"),
        ):
            with pytest.raises(StorageError, match=rf"cannot list train_files='{re.escape(spec)}': .*({cause})"):
                setup_with(s3, spec, storage_options=options)
    # A secret in the URL is not repeated in the message.
    with signed_requests_only(s3), pytest.raises(StorageError, match=r"s3://someone:\*\*\*@corpus/") as caught:
        resolve_files(f"s3://someone:hunter2@{spec[5:]}?{url_options(s3)}")
    assert "hunter2" not in str(caught.value)


def test_an_unreachable_endpoint_is_reported_as_such(aws_env: dict, monkeypatch) -> None:
    s3 = aws_env
    credentials_env(s3, monkeypatch)
    closed = free_port()
    spec = f"s3://{BUCKET}/data/*.parquet?endpoint_override=127.0.0.1:{closed}&scheme=http"
    with pytest.raises(StorageError, match=r"cannot list train_files='s3://corpus/data/\*\.parquet\?endpoint_ov.*"
                                           r"(NETWORK_CONNECTION|connect)"):  # fmt: skip
        setup_with(s3, spec)
    # A path that truly matches nothing still says so.
    with pytest.raises(ValueError, match=r"train_files='s3://corpus/nothing/\*\.parquet.*' matches no file"):
        setup_with(s3, f"s3://{BUCKET}/nothing/*.parquet?{url_options(s3)}")


def setup_with(s3: dict, train_files: Any, **changes: Any) -> None:
    PretrainingDataModule(**dm_options(s3, train_files, **changes)).setup("fit")


# ---------------------------------------------------------------------------------------------- outages
# A TCP relay to the server, in a process of its own: stopping it is a real outage (connections refused), and no
# DataLoader worker forked from the test process holds its listening socket open.
RELAY = """
import asyncio, sys

async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()

async def handle(reader, writer):
    upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", int(sys.argv[2]))
    await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]), reuse_address=True)
    print("ready", flush=True)
    await server.serve_forever()

asyncio.run(main())
"""


def start_relay(port: int, upstream: int) -> subprocess.Popen:
    relay = subprocess.Popen([sys.executable, "-c", RELAY, str(port), str(upstream)], stdout=subprocess.PIPE, text=True)
    assert relay.stdout is not None and relay.stdout.readline().strip() == "ready"
    return relay


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_reads_outlast_an_outage_longer_than_pyarrows_retries_without_changing_a_row(
    aws_env: dict, monkeypatch, num_workers: int
) -> None:
    """The store is unreachable mid-stream for 5 s (pyarrow alone gives up after about 2 s of refused connections),
    with the streams in this process or in worker processes."""
    s3 = aws_env
    credentials_env(s3, monkeypatch)
    port = free_port()
    relays = [start_relay(port, s3["port"])]
    url = f"s3://{BUCKET}/data/*.parquet?endpoint_override=127.0.0.1:{port}&scheme=http"
    want = list(make_dm(s3, str(s3["root"] / "data"), steps_per_epoch=30).train_dataloader())
    dm = make_dm(s3, url, steps_per_epoch=30, read_retry_seconds=20, num_workers=num_workers)
    got, iterator = [], iter(dm.train_dataloader())
    got.extend(next(iterator) for _ in range(4))
    relays[0].kill()
    relays[0].wait()
    timer = threading.Timer(5.0, lambda: relays.append(start_relay(port, s3["port"])))
    timer.start()
    started = time.monotonic()
    try:
        got.extend(iterator)
        assert time.monotonic() - started > 4.0  # the stream did wait through the outage
        assert_same_batches(got, want)
    finally:
        timer.join()
        for relay in relays:
            relay.kill()
            relay.wait()


@pytest.mark.slow
def test_an_outage_longer_than_read_retry_seconds_is_one_error_naming_url_row_group_and_cause(
    aws_env: dict, monkeypatch
) -> None:
    s3 = aws_env
    credentials_env(s3, monkeypatch)
    port = free_port()
    # A second server on the same process serves the same buckets (moto's state is per process).
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"s3://{BUCKET}/data/*.parquet?endpoint_override=127.0.0.1:{port}&scheme=http"
    index = RowGroupIndex.scan(resolve_files(url), "text", Storage(read_retry_seconds=3))
    server.stop()
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"cannot read row group 2 of parquet file 's3://corpus/data/part-000"
                                           r"\.parquet\?endpoint_override=127\.0\.0\.1:\d+&scheme=http': still "
                                           r"failing after \d+ attempts over 3 s of retries \(read_retry_seconds\); "
                                           r"last cause: .*NETWORK_CONNECTION"):  # fmt: skip
        index.read_texts(2)
    assert 3.0 <= time.monotonic() - started < 20.0


class FlakyFront:
    """An HTTP front to the moto server on 127.0.0.1 that answers ``503 SlowDown`` (S3's throttling reply) to
    every request until ``failing_until``, and relays requests to the server otherwise."""

    def __init__(self, upstream_port: int):
        self.failing_until = 0.0
        front = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if time.monotonic() < front.failing_until:
                    status, data = (
                        503,
                        b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>",
                    )
                    headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(data)))]
                else:
                    connection = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                    connection.request(self.command, self.path, body, dict(self.headers))
                    response = connection.getresponse()
                    status, data = response.status, response.read()
                    headers = [
                        (k, v) for k, v in response.getheaders() if k.lower() not in ("transfer-encoding", "connection")
                    ]
                    if self.command != "HEAD":  # a HEAD reply keeps the object's length
                        headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
                        headers.append(("Content-Length", str(len(data))))
                    connection.close()
                self.send_response(status)
                for key, value in headers:
                    self.send_header(key, value)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = relay

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
def test_reads_outlast_throttling_and_5xx_without_changing_a_row(aws_env: dict, monkeypatch) -> None:
    s3, want = aws_env, local_texts(aws_env)
    credentials_env(s3, monkeypatch)
    front = FlakyFront(s3["port"])
    try:
        url = f"s3://{BUCKET}/data/*.parquet?endpoint_override=127.0.0.1:{front.port}&scheme=http"
        index = RowGroupIndex.scan(resolve_files(url), "text", Storage(read_retry_seconds=20))
        got = [index.read_texts(g) for g in range(3)]
        front.failing_until = time.monotonic() + 3.0
        started = time.monotonic()
        got += [index.read_texts(g) for g in range(3, len(index))]
        assert time.monotonic() - started >= 3.0 and got == want
        # Throttled for longer than read_retry_seconds: one error naming the cause.
        index = RowGroupIndex.scan(index.files, "text", Storage(read_retry_seconds=1))
        front.failing_until = time.monotonic() + 60.0
        with pytest.raises(StorageError, match=r"cannot read row group 0 of .* last cause: .*(SLOW_DOWN|SlowDown|503)"):
            index.read_texts(0)
    finally:
        front.close()


def test_a_mixture_with_a_source_in_object_storage_trains_the_rows_of_a_local_one(aws_env: dict) -> None:
    """Each source of a mixture reaches its files through the DataModule's storage settings (in forkserver workers,
    as any stream reading object storage)."""
    s3 = aws_env
    storage = {"endpoint_url": s3["endpoint"], "key": s3["key"], "secret": s3["secret"]}
    half = str(s3["root"] / "data" / "part-000.parquet")
    # "local" and "remote" hold one file twice on purpose: the same rows through two ways of reaching them.
    local = make_dm(s3, {"local": half, "remote": str(s3["root"] / "data")}, weights={"local": 1, "remote": 3},
                    allow_shared_files=True)  # fmt: skip
    remote = make_dm(s3, {"local": half, "remote": f"s3://{BUCKET}/data/*.parquet"}, weights={"local": 1, "remote": 3},
                     storage_options=storage, num_workers=2)  # fmt: skip
    assert remote.fingerprint == local.fingerprint
    want = list(local.train_dataloader())
    got = list(remote.train_dataloader())
    assert_same_batches(got, want)
    assert [b.sources.tolist() for b in got] == [b.sources.tolist() for b in want]
    assert {s for b in got for s in b.sources.tolist()} == {0, 1}


def test_jsonl_and_a_token_cache_in_object_storage_give_the_rows_of_local_files(aws_env: dict, tmp_path: Path) -> None:
    """JSONL (zstd) files read from the bucket, and a token cache kept in it, change no row."""
    s3 = aws_env
    storage = {"endpoint_url": s3["endpoint"], "key": s3["key"], "secret": s3["secret"]}
    client = boto3.client("s3", endpoint_url=s3["endpoint"], region_name=REGION, aws_access_key_id=s3["key"],
                          aws_secret_access_key=s3["secret"])  # fmt: skip
    (tmp_path / "jsonl").mkdir()
    for path in sorted((s3["root"] / "data").glob("*.parquet")):
        texts = pq.read_table(path).column("text").to_pylist()
        lines = "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()
        local = tmp_path / "jsonl" / f"{path.stem}.jsonl.zst"
        local.write_bytes(zstandard.ZstdCompressor().compress(lines))
        client.upload_file(str(local), BUCKET, f"jsonl/{local.name}")
    want = list(make_dm(s3, str(tmp_path / "jsonl")).train_dataloader())
    remote = dict(storage_options=storage, token_cache=f"s3://{BUCKET}/cache", num_workers=2)
    assert_same_batches(list(make_dm(s3, f"s3://{BUCKET}/jsonl/", **remote).train_dataloader()), want)
    cached = client.list_objects_v2(Bucket=BUCKET, Prefix="cache/")["Contents"]
    assert any(item["Key"].endswith(".tok") for item in cached)
    assert any("jsonl-layouts" in item["Key"] for item in cached)
    assert_same_batches(list(make_dm(s3, f"s3://{BUCKET}/jsonl/", **remote).train_dataloader()), want)
    parquet = list(make_dm(s3, str(s3["root"] / "data")).train_dataloader())
    for _ in range(2):  # an empty cache, then the one it filled
        assert_same_batches(list(make_dm(s3, f"s3://{BUCKET}/data/*.parquet", **remote).train_dataloader()), parquet)
