"""Start-up checks that look at the machine, made before a process serves anything: the port it is to listen on
is free, the files directory is one it can write (or the S3 bucket named instead is there to use). Each failure is
a ConfigError naming the setting (the `batchgate` command prints it as one line, exit status 2), where it used to
be a traceback, a gateway that never listened, or 503s at request time. The settings' own ranges are checked
before, by `Settings.from_environ`.
"""

from __future__ import annotations

import errno
import secrets
import socket
from pathlib import Path
from typing import Any

from shared.config import ModelSpec, Settings, default_files_dir
from shared.errors import ConfigError
from shared.logs import get_logger

log = get_logger(__name__)


def _address(host: str, port: int) -> tuple[int, int, int, tuple[object, ...]] | str:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        return f"{host!r} is not a host name or address this machine can listen on ({exc})"
    return family, kind, proto, address


def host_problem(host: str) -> str | None:
    """Why `host` is no address to listen on (a name that does not resolve), or None."""
    found = _address(host, 0)
    return found if isinstance(found, str) else None


def listen_problem(host: str, port: int) -> str | None:
    """Why this process cannot listen on `host`:`port` (TCP), or None. Binds a socket as uvicorn and
    prometheus_client do (SO_REUSEADDR) and closes it again at once."""
    found = _address(host, port)
    if isinstance(found, str):
        return found
    family, kind, proto, address = found
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"{host}:{port} is in use by another process"
            if exc.errno == errno.EADDRNOTAVAIL:
                return f"{host} is not an address of this machine"
            return f"cannot listen on {host}:{port} ({exc.strerror or exc})"
    return None


def check_listen(setting: str, host: str, port: int, *, hint: str = "choose another port",
                 host_setting: str = "BATCHGATE_HOST") -> None:
    """A ConfigError naming `setting` when `host`:`port` cannot be listened on (`host_setting` where the host is at
    fault: not an address of this machine)."""
    problem = listen_problem(host, port)
    if problem and problem.endswith("is not an address of this machine"):
        sep = " " if host_setting.startswith("-") else "="
        raise ConfigError(f"{host_setting}{sep}{host}: {problem}; name one of its addresses (127.0.0.1, or 0.0.0.0 "
                          "for all)")
    if problem:
        raise ConfigError(f"{setting}{' ' if setting.startswith('-') else '='}{port}: {problem}; {hint}")


def start_metrics_server(setting: str, port: int, host: str = "127.0.0.1") -> None:
    """prometheus_client's /metrics listener on `host`:`port`; a port it cannot have is a ConfigError naming
    `setting` (BATCHGATE_WORKER_METRICS_PORT, BATCHGATE_DISPATCHER_METRICS_PORT)."""
    from prometheus_client import start_http_server

    hint = "choose another port, or 0 for no /metrics listener"
    check_listen(setting, host, port, hint=hint)  # a clearer word than the OSError below, where it can be had
    try:
        start_http_server(port, addr=host)
    except OSError as exc:  # taken between the check and now
        raise ConfigError(f"{setting}={port}: cannot listen on {host}:{port} ({exc.strerror or exc}); {hint}") \
            from None


def files_dir_problem(directory: str) -> str | None:
    """Why the local file store cannot keep files in `directory`, or None. Creates it as the store would (on its
    first write) and writes and removes a probe file: a file in the way, a directory without write permission or
    a read-only file system all show here."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".batchgate-probe-{secrets.token_hex(4)}"
        probe.write_bytes(b"")
        probe.unlink()
    except FileExistsError:
        return f"{directory} is not a directory"
    except OSError as exc:
        return f"cannot write in {directory} ({exc.strerror or exc})"
    return None


def check_model_cache(settings: Settings) -> None:
    """A ConfigError naming BATCHGATE_MODEL_CACHE when a built-in model must be built there and the directory cannot
    be written (else a traceback from the model loader)."""
    from shared.token_limits import model_dir

    def built(spec: ModelSpec) -> bool:
        directory = model_dir(spec, settings.model_cache_dir)
        return directory is not None and (directory / "config.json").is_file()

    to_build = [spec for spec in settings.models
                if spec.source.startswith("builtin:") and spec.source != "builtin:minilm" and not built(spec)]
    if not to_build:  # models of their own, the packaged encoder, built-ins built already: the cache is only read
        return
    problem = files_dir_problem(settings.model_cache_dir)
    if problem:
        raise ConfigError(f"BATCHGATE_MODEL_CACHE={settings.model_cache_dir}: {problem}; the built-in models are "
                          "built there: name a directory this process can write")


def check_tokenizers(settings: Settings) -> None:
    """A ConfigError where a model's `tokenizer` (the file the gateway counts tokens with) names no tokenizer.json:
    else the gateway would quietly count nothing and leave every token limit to the workers. Only where a gateway
    runs: a worker does not read it (its machine need not have the file)."""
    from shared.token_limits import tokenizer_path

    for spec in settings.models:
        if not spec.tokenizer:
            continue
        path = tokenizer_path(spec, settings.model_cache_dir)
        if path is None or not path.is_file():
            raise ConfigError(f"model {spec.name}: tokenizer {spec.tokenizer!r}: no tokenizer.json there (name the "
                              "file, or a directory holding one; or leave it unset for the model's own)")


S3_CHECK_TIMEOUT_S = 5.0  # the start-up check's own: an unreachable endpoint is not waited on with boto3's retries


def s3_bucket_problem(client: Any, bucket: str) -> str | None:
    """Why the S3 file store cannot use `bucket` through `client` (a boto3 S3 client), or None: it does not exist,
    these credentials may not use it, or there are none. An endpoint that does not answer, or an error S3 may not
    repeat, is no verdict (None, a warning): the bucket is reached again on every request."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    from shared.files import s3_error_code

    try:
        client.head_bucket(Bucket=bucket)
    except NoCredentialsError:
        return "no AWS credentials were found (an instance or task role, AWS_ACCESS_KEY_ID, or a profile)"
    except ClientError as exc:
        code = s3_error_code(exc)
        if code in ("404", "NoSuchBucket", "NotFound"):
            return f"there is no bucket {bucket!r} (create it first)"
        if code in ("403", "AccessDenied", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return f"these credentials may not use bucket {bucket!r} ({code})"
        log.warning("the files bucket could not be checked at start", bucket=bucket, error=repr(exc))
    except BotoCoreError as exc:  # the endpoint did not answer: checked again per request
        log.warning("the files bucket could not be reached at start", bucket=bucket, error=repr(exc))
    return None


def check_file_store(settings: Settings) -> None:
    """A ConfigError naming BATCHGATE_FILES_DIR when the Files and Batch APIs' directory is unusable, or
    BATCHGATE_FILES_S3_BUCKET when the bucket named instead does not exist or cannot be used with these
    credentials (a misconfiguration that would otherwise be a 503 on every upload, asking callers to retry)."""
    if settings.files_s3_bucket:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ConfigError(f"BATCHGATE_FILES_S3_BUCKET={settings.files_s3_bucket}: boto3 is not installed (pip "
                              "install 'batchgate[aws]'); or leave it unset to keep files in BATCHGATE_FILES_DIR") \
                from None
        client = boto3.client("s3", endpoint_url=settings.files_s3_endpoint or None, config=Config(
            connect_timeout=S3_CHECK_TIMEOUT_S, read_timeout=S3_CHECK_TIMEOUT_S, retries={"max_attempts": 1}))
        problem = s3_bucket_problem(client, settings.files_s3_bucket)
        if problem:
            raise ConfigError(f"BATCHGATE_FILES_S3_BUCKET={settings.files_s3_bucket}: {problem}; or leave it unset "
                              "to keep files in BATCHGATE_FILES_DIR")
        return
    directory = settings.files_dir or default_files_dir({})  # as shared.files.file_store picks it
    problem = files_dir_problem(directory)
    if problem:
        raise ConfigError(f"BATCHGATE_FILES_DIR={directory}: {problem}; name a directory this process can write, "
                          "or a bucket with BATCHGATE_FILES_S3_BUCKET")
