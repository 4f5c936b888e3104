"""Storage: the filesystem behind a file or URL, configured as object-storage users configure it, and retried reads.

An ``s3://`` URL opens a pyarrow ``S3FileSystem`` whose options come from, later ones winning: the AWS environment
(credentials and region through the SDK's chain; the endpoint, ``AWS_ENDPOINT_URL[_S3]`` or the profile's
``endpoint_url``, read here because pyarrow does not), fsspec's ``s3`` config, ``storage_options`` (s3fs's keys or
pyarrow's), and the URL itself (``s3://KEY:SECRET@bucket/path?endpoint_override=host:port&scheme=http``). Other
schemes go to pyarrow, or to fsspec with ``storage_options``. A failure other than absence raises
:class:`StorageError` naming the URL, never mistaken for no match; reads retry transient failures with backoff for
``read_retry_seconds``, and a row group is read whole or not at all, so a retry returns the same rows.

Trade-off: pyarrow reports S3 failures as ``OSError`` text, so transient ones are recognised by AWS error names and
anything unrecognised fails at once rather than hiding behind retries.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote

import pyarrow as pa
import pyarrow.fs as pafs

from lightning_d9d.core.urls import redact

T = TypeVar("T")

DEFAULT_READ_RETRY_SECONDS = 120.0

# pyarrow S3FileSystem keyword arguments accepted as they are (in storage_options or the URL's query).
_PYARROW_S3_KEYS = frozenset(
    {
        "access_key",
        "secret_key",
        "session_token",
        "anonymous",
        "region",
        "request_timeout",
        "connect_timeout",
        "scheme",
        "endpoint_override",
        "role_arn",
        "session_name",
        "external_id",
        "load_frequency",
        "proxy_options",
        "allow_delayed_open",
        "allow_bucket_creation",
        "allow_bucket_deletion",
        "check_directory_existence_before_creation",
        "force_virtual_addressing",
        "tls_ca_file_path",
        "retry_strategy",
    }
)
# fsspec/s3fs (and botocore) names for the same things.
_FSSPEC_S3_KEYS = {"key": "access_key", "secret": "secret_key", "token": "session_token", "anon": "anonymous"}
_CLIENT_KWARGS = {
    "region_name": "region",
    "aws_access_key_id": "access_key",
    "aws_secret_access_key": "secret_key",
    "aws_session_token": "session_token",
}
_CONFIG_KWARGS = {"connect_timeout": "connect_timeout", "read_timeout": "request_timeout", "region_name": "region"}
_BOOL_QUERY_KEYS = {
    "anonymous",
    "allow_delayed_open",
    "allow_bucket_creation",
    "allow_bucket_deletion",
    "force_virtual_addressing",
}
_FLOAT_QUERY_KEYS = {"request_timeout", "connect_timeout", "load_frequency"}

# AWS SDK error names (as pyarrow prints them) and HTTP statuses that a later attempt may not meet again.
_TRANSIENT = re.compile(
    r"NETWORK_CONNECTION|curlCode|Could not connect|Couldn't connect|Connection refused|Connection reset|"
    r"timed out|[Tt]imeout|TIMEOUT|SLOW_DOWN|SlowDown|THROTTL|Throttl|TooManyRequests|SERVICE_UNAVAILABLE|"
    r"ServiceUnavailable|INTERNAL_FAILURE|InternalError|HTTP status 5\d\d|HTTP status 429|response code:? 5\d\d|"
    r"Broken pipe|EOF occurred|Empty reply|Recv failure|Send failure"
)
# Failures no retry mends, even when their text also mentions a connection.
_PERMANENT = re.compile(
    r"ACCESS_DENIED|AccessDenied|INVALID_ACCESS_KEY_ID|InvalidAccessKeyId|SIGNATURE_DOES_NOT_MATCH|"
    r"SignatureDoesNotMatch|UNRECOGNIZED_CLIENT|Forbidden|HTTP status 403|NO_SUCH_BUCKET|NoSuchBucket|"
    r"NO_SUCH_KEY|NoSuchKey|INVALID_CLIENT_TOKEN|ExpiredToken|EXPIRED_TOKEN"
)


class StorageError(OSError):
    """Listing, opening or reading a file failed for a reason other than bad data (network, access, credentials)."""


def is_transient(err: BaseException) -> bool:
    """Whether ``err`` is a failure that retrying later may mend (connection, timeout, 5xx, throttling)."""
    if isinstance(err, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    text = str(err)
    return isinstance(err, OSError) and not _PERMANENT.search(text) and bool(_TRANSIENT.search(text))


def split_query(url: str) -> tuple[str, str]:
    """``(url without its query, query)``; a ``?`` not followed by ``name=value`` pairs is a glob character."""
    if "://" not in url:
        return url, ""
    match = re.search(r"\?(\w+=[^/?]*)$", url)
    return (url[: match.start()], match.group(1)) if match else (url, "")


def parse_url(url: str) -> tuple[str, str, str, str]:
    """``(scheme, user part, path with bucket, query)`` of a URL whose path may hold glob characters."""
    base, query = split_query(url)
    scheme, rest = base.split("://", 1)
    netloc, _, path = rest.partition("/")
    userinfo, _, host = netloc.rpartition("@")
    return scheme.lower(), userinfo, f"{host}/{path}" if path else host, query


def canonical(url: str) -> str:
    """``url`` without its query and user part: the same file whatever endpoint or credentials reach it."""
    if "://" not in url:
        return url
    scheme, _, path, _ = parse_url(url)
    return f"{scheme}://{path}"


def _parse_bool(name: str, value: str) -> bool:
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"URL option {name}={value!r} must be true or false")


def _split_endpoint(endpoint: str) -> dict[str, str]:
    """``http://host:port`` → ``endpoint_override=host:port, scheme=http`` (pyarrow wants them apart)."""
    if "://" not in endpoint:
        return {"endpoint_override": endpoint}
    scheme, rest = endpoint.split("://", 1)
    return {"endpoint_override": rest.rstrip("/"), "scheme": scheme}


def s3_options(storage_options: Mapping[str, Any]) -> dict[str, Any]:
    """Map fsspec/s3fs ``storage_options`` (or pyarrow's keys) to ``S3FileSystem`` arguments; ValueError otherwise."""
    out: dict[str, Any] = {}
    for name, value in storage_options.items():
        if name in _PYARROW_S3_KEYS:
            out[name] = value
        elif name in _FSSPEC_S3_KEYS:
            out[_FSSPEC_S3_KEYS[name]] = value
        elif name == "endpoint_url":
            out.update(_split_endpoint(str(value)))
        elif name == "use_ssl":
            out.setdefault("scheme", "https" if value else "http")
        elif name in ("client_kwargs", "config_kwargs"):
            known = _CLIENT_KWARGS if name == "client_kwargs" else _CONFIG_KWARGS
            for key, item in dict(value).items():
                if key == "endpoint_url" and name == "client_kwargs":
                    out.update(_split_endpoint(str(item)))
                elif key in known:
                    out[known[key]] = item
                else:
                    raise ValueError(
                        f"storage_options[{name!r}][{key!r}] is not supported for s3:// (pyarrow reads S3); "
                        f"supported: {sorted([*known, 'endpoint_url'] if name == 'client_kwargs' else known)}"
                    )
        elif name == "profile":
            raise ValueError(
                "storage_options['profile'] is not supported for s3:// (pyarrow's S3 client takes no profile): "
                "set the AWS_PROFILE environment variable instead"
            )
        else:
            valid = sorted([*_PYARROW_S3_KEYS, *_FSSPEC_S3_KEYS, "endpoint_url", "use_ssl", "client_kwargs",
                            "config_kwargs"])  # fmt: skip
            raise ValueError(f"storage_options key {name!r} is not a known S3 option; valid keys: {valid}")
    return out


def _url_options(url: str) -> dict[str, Any]:
    """S3FileSystem arguments carried in an ``s3://`` URL: ``KEY:SECRET@`` and the query."""
    _, userinfo, _, query = parse_url(url)
    out: dict[str, Any] = {}
    if userinfo:
        key, _, secret = userinfo.partition(":")
        out["access_key"], out["secret_key"] = unquote(key), unquote(secret)
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name in _BOOL_QUERY_KEYS:
            out[name] = _parse_bool(name, value)
        elif name in _FLOAT_QUERY_KEYS:
            out[name] = float(value)
        elif name in _PYARROW_S3_KEYS and name not in ("proxy_options", "retry_strategy"):
            out[name] = value
        elif name == "endpoint_url":
            out.update(_split_endpoint(value))
        else:
            raise ValueError(
                f"URL {redact(url)!r}: option {name!r} is not a known S3 option; use endpoint_override, scheme, "
                "region, access_key, secret_key, session_token, anonymous, connect_timeout, request_timeout, ..."
            )
    return out


@dataclass(frozen=True)
class Storage:
    """How to reach the files: the user's ``storage_options`` and how long reads retry.

    Picklable (worker processes rebuild their own filesystems); it decides no row, so it is part of no fingerprint.

    Attributes:
        options: fsspec-style ``storage_options``, passed to the filesystem of every URL.
        read_retry_seconds: how long a read keeps retrying transient failures after the first one.
        s3_attempts: attempts pyarrow's own retry strategy makes per request, before this module's retries.
    """

    options: Mapping[str, Any] = field(default_factory=dict)
    read_retry_seconds: float = DEFAULT_READ_RETRY_SECONDS
    s3_attempts: int = 3

    def filesystem(self, spec: str) -> tuple[pafs.FileSystem, str]:
        """``(filesystem, path inside it)``; ValueError for bad options or a scheme nothing can open."""
        if "://" not in spec:
            return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(spec))
        scheme = spec.split("://", 1)[0].lower()
        if scheme in ("s3", "s3a"):
            options = {
                **_aws_config_endpoint(),
                **s3_options(_fsspec_config(scheme)),
                **s3_options(self.options),
                **_url_options(spec),
            }
            return _cached_filesystem(options, self.s3_attempts), parse_url(spec)[2]
        if not self.options:
            try:
                return pafs.FileSystem.from_uri(spec)
            except (pa.ArrowInvalid, ValueError):
                pass  # not a scheme pyarrow knows natively (e.g. memory://, hf://): fsspec's
        try:
            import fsspec
        except ImportError as err:
            raise ValueError(f"cannot open {redact(spec)!r}: pyarrow does not know its scheme and fsspec is not "
                             "installed") from err  # fmt: skip
        fs, path = fsspec.core.url_to_fs(spec, **dict(self.options))
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path

    def filesystems(self, specs: Sequence[str]) -> list[tuple[pafs.FileSystem, str]]:
        """:meth:`filesystem` of every spec, each S3 filesystem made once for all URLs of the same options (making
        one reads the AWS configuration); ValueError as :meth:`filesystem`."""
        made: dict[tuple[str, str, str], pafs.FileSystem] = {}
        out: list[tuple[pafs.FileSystem, str]] = []
        local = pafs.LocalFileSystem()
        for spec in specs:
            if "://" not in spec:
                out.append((local, os.path.abspath(os.path.expanduser(spec))))
            elif spec.split("://", 1)[0].lower() in ("s3", "s3a"):
                scheme, userinfo, path, query = parse_url(spec)
                fs = made.get((scheme, userinfo, query))
                if fs is None:
                    fs = made[(scheme, userinfo, query)] = self.filesystem(spec)[0]
                out.append((fs, path))
            else:
                out.append(self.filesystem(spec))
        return out

    def retrying(self, action: Callable[[], T], describe: Callable[[], str], on_retry: Callable[[], None]) -> T:
        """Run ``action``, retrying transient failures with backoff for ``read_retry_seconds``.

        Args:
            action: the read.
            describe: what was being read, for the error.
            on_retry: called before each retry (drop a handle that may be broken).

        Raises:
            StorageError: a permanent failure at once, or a transient one that outlasted the retry time.
            Exception: any other error of ``action``, unchanged.
        """
        deadline, delay, attempts = None, 0.5, 0
        while True:
            try:
                return action()
            except OSError as err:
                if isinstance(err, StorageError):
                    raise
                attempts += 1
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + self.read_retry_seconds
                if not is_transient(err):
                    if isinstance(err, FileNotFoundError) or not _looks_like_storage(err):
                        raise
                    raise StorageError(f"cannot read {describe()}: {err}") from err
                if now >= deadline:
                    raise StorageError(
                        f"cannot read {describe()}: still failing after {attempts} attempts over "
                        f"{self.read_retry_seconds:g} s of retries (read_retry_seconds); last cause: {err}"
                    ) from err
                time.sleep(min(delay, max(0.0, deadline - now)))
                delay = min(delay * 2, 8.0)
                on_retry()


def _looks_like_storage(err: OSError) -> bool:
    """An object store's access or credential failure (as opposed to bad file contents)."""
    return bool(_PERMANENT.search(str(err))) or isinstance(err, PermissionError)


def _aws_config_endpoint() -> dict[str, str]:
    """The endpoint the AWS environment names (pyarrow's S3FileSystem constructor reads none of them itself)."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):
            return _split_endpoint(os.environ[name])
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
    path = os.path.expanduser(os.environ.get("AWS_CONFIG_FILE", "~/.aws/config"))
    config = configparser.ConfigParser(interpolation=None)
    try:
        config.read(path)
    except configparser.Error:
        return {}  # the SDK reports a broken config file itself
    section = "default" if profile == "default" else f"profile {profile}"
    endpoint = config.get(section, "endpoint_url", fallback=None)
    return _split_endpoint(endpoint) if endpoint else {}


def _fsspec_config(scheme: str) -> dict[str, Any]:
    try:
        import fsspec.config
    except ImportError:
        return {}
    return dict(fsspec.config.conf.get(scheme, {}) or fsspec.config.conf.get("s3", {}))


_FILESYSTEMS: dict[tuple[int, str], pafs.FileSystem] = {}
_FILESYSTEMS_LOCK = threading.Lock()


def _cached_filesystem(options: dict[str, Any], attempts: int) -> pafs.FileSystem:
    """One S3FileSystem per process and option set (a forked child builds its own: SDK state does not fork)."""
    # The AWS environment is part of the key: the SDK reads it when a filesystem is made.
    environment = sorted((name, value) for name, value in os.environ.items() if name.startswith("AWS_"))
    key = (os.getpid(), json.dumps([options, attempts, environment], sort_keys=True, default=repr))
    with _FILESYSTEMS_LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            options = dict(options)
            options.setdefault("retry_strategy", pafs.AwsStandardS3RetryStrategy(max_attempts=attempts))
            try:
                fs = _FILESYSTEMS[key] = pafs.S3FileSystem(**options)
            except TypeError as err:
                raise ValueError(f"bad S3 options {sorted(options)}: {err}") from err
        return fs


def with_query(url: str, query: str) -> str:
    """``url`` with ``query`` (a spec's options) appended, so an expanded file keeps its spec's endpoint."""
    return f"{url}?{query}" if query else url
