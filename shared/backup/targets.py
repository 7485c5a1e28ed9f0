"""Where backups go: a local directory or an S3-compatible object store (AWS S3, MinIO, R2, B2…).

A target is named by a URL: ``/path`` or ``file:///path`` for a directory, ``s3://bucket[/prefix]`` for an
object store. S3 goes through boto3 (AWS's own client, the most widely used and maintained one; every
S3-compatible store is tested against it), which takes its credentials and endpoint from its usual
sources — the environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``,
``AWS_REGION``) or a profile — so nothing secret is ever an argument (a process listing shows argv). The
calls are blocking: callers run them in a thread.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlparse

from shared.backup.manifest import BackupError
from shared.files import PRIVATE, write_atomic

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import HeadObjectOutputTypeDef


class TargetError(BackupError):
    """A target that cannot be used: unreachable, refused credentials, no such bucket, a bad URL."""


class Target(Protocol):
    url: str

    def put(self, name: str, data: bytes) -> None: ...

    def get(self, name: str) -> bytes | None:
        """The object's bytes, None when there is none."""
        ...

    def exists(self, name: str) -> bool: ...

    def check(self) -> None:
        """:class:`TargetError` unless the target can be written (reachable, authorised, existing)."""
        ...

    def list(self, prefix: str) -> list[str]:
        """The names under ``prefix`` (sorted)."""
        ...

    def delete(self, name: str) -> None:
        """Remove the object (none is no error)."""
        ...

    def modified(self, name: str) -> float | None:
        """When the object was last written (epoch seconds), None when there is none."""
        ...


class DirectoryTarget:
    """Objects as files under a directory (0600 files, 0700 directories)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    def _path(self, name: str) -> Path:
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise TargetError(f"{self.url}: bad object name {name!r}")
        return self.root.joinpath(*parts)

    def put(self, name: str, data: bytes) -> None:
        path = self._path(name)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_atomic(path, data, mode=PRIVATE)
        except OSError as exc:
            raise TargetError(f"{self.url}: cannot write {name}: {exc.strerror or exc}") from None

    def get(self, name: str) -> bytes | None:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TargetError(f"{self.url}: cannot read {name}: {exc.strerror or exc}") from None

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def delete(self, name: str) -> None:
        try:
            self._path(name).unlink(missing_ok=True)
        except OSError as exc:
            raise TargetError(f"{self.url}: cannot delete {name}: {exc.strerror or exc}") from None

    def modified(self, name: str) -> float | None:
        try:
            return self._path(name).stat().st_mtime
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TargetError(f"{self.url}: cannot read {name}: {exc.strerror or exc}") from None

    def check(self) -> None:
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise TargetError(f"{self.url}: cannot create the directory: {exc.strerror or exc}") from None
        if not os.access(self.root, os.W_OK):
            raise TargetError(f"{self.url}: not writable")

    def list(self, prefix: str) -> list[str]:
        if not self.root.is_dir():
            raise TargetError(f"{self.url}: no such directory")
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file())


class S3Target:
    """Objects in a bucket of an S3-compatible store, under an optional prefix."""

    def __init__(
        self, bucket: str, prefix: str = "", client: S3Client | None = None, credentials: dict[str, str] | None = None
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        if client is None:
            import boto3

            given = _client_settings(credentials or {})
            client = boto3.client(
                "s3",
                aws_access_key_id=given.get("aws_access_key_id"),
                aws_secret_access_key=given.get("aws_secret_access_key"),
                aws_session_token=given.get("aws_session_token"),
                endpoint_url=given.get("endpoint_url"),
                region_name=given.get("region_name"),
            )
        self._s3 = client

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _fail(self, what: str, exc: Exception) -> TargetError:
        from botocore.exceptions import ClientError, NoCredentialsError

        if isinstance(exc, NoCredentialsError):
            cause = "no credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile)"
        elif isinstance(exc, ClientError):
            error = exc.response.get("Error", {})
            cause = f"{error.get('Code', '?')}: {error.get('Message', '')}".rstrip(": ")
        else:
            cause = f"unreachable ({type(exc).__name__}: {exc})"
        return TargetError(f"{self.url}: {what}: {cause}")

    def check(self) -> None:
        try:
            self._s3.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            if _missing(exc):
                raise TargetError(f"{self.url}: NoSuchBucket: bucket {self.bucket} does not exist") from None
            raise self._fail("cannot use the bucket", exc) from None

    def put(self, name: str, data: bytes) -> None:
        try:
            self._s3.put_object(Bucket=self.bucket, Key=self._key(name), Body=data)
        except Exception as exc:
            raise self._fail(f"cannot write {name}", exc) from None

    def get(self, name: str) -> bytes | None:
        try:
            reply = self._s3.get_object(Bucket=self.bucket, Key=self._key(name))
            return reply["Body"].read()
        except Exception as exc:
            if _missing(exc):
                return None
            raise self._fail(f"cannot read {name}", exc) from None

    def _head(self, name: str) -> HeadObjectOutputTypeDef | None:
        """The object's metadata, None when there is no such object."""
        try:
            return self._s3.head_object(Bucket=self.bucket, Key=self._key(name))
        except Exception as exc:
            if _missing(exc):
                return None
            raise self._fail(f"cannot check {name}", exc) from None

    def exists(self, name: str) -> bool:
        return self._head(name) is not None

    def delete(self, name: str) -> None:
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=self._key(name))
        except Exception as exc:
            raise self._fail(f"cannot delete {name}", exc) from None

    def modified(self, name: str) -> float | None:
        head = self._head(name)
        return head["LastModified"].timestamp() if head is not None else None

    def list(self, prefix: str) -> list[str]:
        names: list[str] = []
        strip = len(self.prefix) + 1 if self.prefix else 0
        try:
            pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
            for page in pages:
                names.extend(o["Key"][strip:] for o in page.get("Contents", []))
        except Exception as exc:
            raise self._fail("cannot list", exc) from None
        return sorted(names)


CREDENTIAL_SETTINGS = {
    "AWS_ACCESS_KEY_ID": "aws_access_key_id",
    "AWS_SECRET_ACCESS_KEY": "aws_secret_access_key",
    "AWS_SESSION_TOKEN": "aws_session_token",
    "AWS_ENDPOINT_URL": "endpoint_url",
    "AWS_REGION": "region_name",
}
"""The environment variables an S3 target's settings are known by, and boto3's argument for each: what a
scheduled backup takes from the operator's environment once, sealed, since the cluster runs it later."""


def credentials_from_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The S3 settings of :data:`CREDENTIAL_SETTINGS` set in ``environ`` (default: this process's)."""
    environ = dict(os.environ) if environ is None else environ
    found = {name: environ[name] for name in CREDENTIAL_SETTINGS if environ.get(name)}
    if "AWS_REGION" not in found and environ.get("AWS_DEFAULT_REGION"):
        found["AWS_REGION"] = environ["AWS_DEFAULT_REGION"]
    return found


def _client_settings(credentials: dict[str, str]) -> dict[str, str]:
    return {CREDENTIAL_SETTINGS[k]: v for k, v in credentials.items() if k in CREDENTIAL_SETTINGS and v}


def _missing(exc: Exception) -> bool:
    from botocore.exceptions import ClientError

    if not isinstance(exc, ClientError):
        return False
    return exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound")


def open_target(url: str, credentials: dict[str, str] | None = None) -> Target:
    """The target ``url`` names (see the module's docstring); :class:`TargetError` for a bad one.
    ``credentials`` (:data:`CREDENTIAL_SETTINGS` names) override boto3's usual sources for S3."""
    if not url:
        raise TargetError("target: give a directory or s3://bucket[/prefix]")
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise TargetError(f"target {url}: no bucket (s3://bucket[/prefix])")
        return S3Target(parsed.netloc, parsed.path, credentials=credentials)
    if parsed.scheme == "file":
        return DirectoryTarget(Path(parsed.path))
    if parsed.scheme:
        raise TargetError(f"target {url}: unknown scheme {parsed.scheme!r} (a directory, file:// or s3://)")
    return DirectoryTarget(Path(os.path.abspath(url)))
