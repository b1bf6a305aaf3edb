"""The object store behind the shared tier (shared.py): the few blocking calls the tier makes, and the real one, an
S3-compatible bucket through boto3. Conditional writes (If-Match / If-None-Match on the ETag read) are what let two
hosts replace one manifest without tearing it."""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path
from typing import Any, BinaryIO, Protocol


class ObjectStore(Protocol):
    """The object-store calls the tier makes (blocking; run in worker threads). `S3Store` is the real one."""

    def get_json(self, key: str) -> tuple[dict[str, Any], str] | None: ...
    def put_json(self, key: str, data: dict[str, Any], etag: str | None) -> bool: ...
    def exists(self, key: str) -> bool: ...
    def put_file(self, key: str, handle: BinaryIO, n_bytes: int) -> None: ...
    def get_file(self, key: str, path: Path) -> int: ...
    def delete(self, key: str) -> None: ...
    def listing(self, prefix: str) -> list[tuple[str, int, float]]: ...


class S3Store:
    """An S3-compatible bucket (AWS, MinIO, Ceph RGW, R2, ...) through boto3, under `s3://BUCKET/PREFIX`.
    Credentials come from boto3's usual sources (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile, a role)."""

    def __init__(self, url: str, endpoint: str | None = None, region: str | None = None) -> None:
        import boto3
        from botocore.config import Config

        parsed = urllib.parse.urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"the shared store must look like s3://BUCKET/PREFIX, not {url!r}")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/") + "/" if parsed.path.strip("/") else ""
        self._client = boto3.client(
            "s3", endpoint_url=endpoint, region_name=region or "us-east-1",
            config=Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5, read_timeout=60,
                          s3={"addressing_style": "path"}))

    def _error_code(self, exc: Exception) -> str:
        response = getattr(exc, "response", None) or {}
        return str((response.get("Error") or {}).get("Code") or "")

    def get_json(self, key: str) -> tuple[dict[str, Any], str] | None:
        try:
            answer = self._client.get_object(Bucket=self.bucket, Key=self.prefix + key)
        except self._client.exceptions.NoSuchKey:
            return None
        data = json.loads(answer["Body"].read())
        return (data if isinstance(data, dict) else {}), str(answer["ETag"])

    def put_json(self, key: str, data: dict[str, Any], etag: str | None) -> bool:
        condition = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
        try:
            self._client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=json.dumps(data).encode(),
                                    ContentType="application/json", **condition)
        except Exception as exc:
            if self._error_code(exc) in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                return False
            raise
        return True

    def exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self.prefix + key)
        except Exception as exc:
            if self._error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def put_file(self, key: str, handle: BinaryIO, n_bytes: int) -> None:
        self._client.upload_fileobj(handle, self.bucket, self.prefix + key)

    def get_file(self, key: str, path: Path) -> int:
        with path.open("wb") as out:
            self._client.download_fileobj(self.bucket, self.prefix + key, out)
        return path.stat().st_size

    def delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=self.prefix + key)

    def listing(self, prefix: str) -> list[tuple[str, int, float]]:
        found = []
        for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                          Prefix=self.prefix + prefix):
            for item in page.get("Contents", []):
                found.append((str(item["Key"])[len(self.prefix):], int(item["Size"]),
                              item["LastModified"].timestamp()))
        return found
