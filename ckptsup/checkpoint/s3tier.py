"""The S3-compatible object tier (boto3; bench/bench_s3_client.py says why).

Layout: s3://bucket/prefix/step_<N>/<file> plus s3://bucket/prefix/step_<N>/manifest.json.
S3 has no rename, so the manifest object is the commit marker and is written LAST, after every
data object was uploaded and checked; listing ignores step prefixes without one, and delete
removes the manifest FIRST. Each data object carries our hash in its metadata, computed while
the upload streams the file (one read), and compared with the manifest before publishing.
"""

from __future__ import annotations

import functools
import io
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ManifestError
from .commit import abort, commit, make_tmp_dir, parse_step, step_dir_name
from .hashing import CHUNK, algorithm_of, new_hasher
from .manifest import MANIFEST_NAME, Manifest, load_manifest
from .tier_base import TierError, TierKind, expand_tier_path

HASH_META = "ckptsup-hash"
MULTIPART_THRESHOLD = 64 << 20
MULTIPART_CHUNK = 64 << 20


def _translated(method):
    """botocore's errors -> TierError (one line, names the store), so callers handle one
    hierarchy and the promoter knows what is worth retrying."""
    @functools.wraps(method)
    def wrapper(self: "S3Tier", *args: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return method(self, *args, **kwargs)
        except (BotoCoreError, ClientError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise TierError(f"s3://{self.bucket}/{self.prefix}: {type(err).__name__}: {first[:300]}") from err
    return wrapper


class _HashingReader(io.RawIOBase):
    """A file object that hashes what boto3 reads from it. boto3's transfer manager reads a
    non-seekable stream sequentially (multipart parts in order), so the hash is of the bytes sent."""

    def __init__(self, path: Path, algorithm: str) -> None:
        self._f = open(path, "rb", buffering=0)
        self.hasher = new_hasher(algorithm)
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        got = self._f.readinto(buf)
        if got:
            self.hasher.update(memoryview(buf)[:got])
            self.count += got
        return got or 0

    def close(self) -> None:
        self._f.close()
        super().close()


def parse_s3_url(url: str) -> tuple[str, str]:
    match = re.match(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?$", url)
    if not match:
        shown = re.sub(r"^(s3://)[^/@]*@", r"\1***@", url)   # never echo credentials put in a URL
        hint = "; put credentials in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, never in the URL" if shown != url else ""
        raise CheckpointError(f"object store {shown!r} is not s3://bucket[/prefix] (bucket: 3-63 lowercase letters, digits, '.', '-'){hint}")
    return match.group(1), (match.group(2) or "").strip("/")


class S3Tier:
    kind = TierKind.OBJECT

    def __init__(self, *, url: str, client: Any = None, endpoint_url: str = "", region: str = "us-east-1",
                 name: str = "object", node: str = "", job_id: str = "",
                 connect_timeout_s: float = 5.0, read_timeout_s: float = 60.0) -> None:
        self.name = name
        self.bucket, self.prefix = parse_s3_url(expand_tier_path(url, node=node, job_id=job_id))
        try:
            import boto3
            from boto3.s3.transfer import TransferConfig
        except ImportError:
            raise CheckpointError("the object tier needs boto3: pip install 'ckptsup[s3]'") from None
        if client is None:
            from botocore.config import Config

            # Short timeouts and few botocore retries: the promoter's tenacity loop owns retrying,
            # and a dead endpoint must fail fast rather than hold a promotion worker for minutes.
            client = boto3.client("s3", endpoint_url=endpoint_url or None, region_name=region,
                                  config=Config(connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
                                                retries={"max_attempts": 2, "mode": "standard"}))
        self.client = client
        self.transfer = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_CHUNK,
                                       max_concurrency=4, use_threads=True)

    @classmethod
    def from_config(cls, storage: Any, *, node: str = "", job_id: str = "") -> "S3Tier":
        client = None
        if storage.s3_access_key_id and storage.s3_secret_access_key:
            import boto3
            from botocore.config import Config

            client = boto3.client("s3", endpoint_url=storage.s3_endpoint_url or None, region_name=storage.s3_region,
                                  aws_access_key_id=storage.s3_access_key_id,
                                  aws_secret_access_key=storage.s3_secret_access_key,
                                  config=Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 2, "mode": "standard"}))
        return cls(url=storage.object_store, client=client, endpoint_url=storage.s3_endpoint_url,
                   region=storage.s3_region, node=node, job_id=job_id)

    def __repr__(self) -> str:
        return f"S3Tier({self.name}, s3://{self.bucket}/{self.prefix})"

    def key(self, step: int, relpath: str = "") -> str:
        parts = [p for p in (self.prefix, step_dir_name(step), relpath) if p]
        return "/".join(parts)

    # ---- reading ------------------------------------------------------------------------

    @_translated
    def get_manifest(self, step: int) -> Manifest | None:
        from botocore.exceptions import ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(step, MANIFEST_NAME))["Body"].read()
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        try:
            return Manifest.from_json(body, source=f"s3://{self.bucket}/{self.key(step, MANIFEST_NAME)}")
        except ManifestError:
            return None

    def _object_matches(self, key: str, size: int, hash_value: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return False
            raise
        return head["ContentLength"] == size and head.get("Metadata", {}).get(HASH_META) == hash_value

    @_translated
    def has_copy(self, step: int, manifest: Manifest) -> bool:
        mine = self.get_manifest(step)
        if mine is None or mine.checkpoint_id != manifest.checkpoint_id:
            return False
        return all(self._object_matches(self.key(step, f.path), f.size, f.hash) for f in manifest.files)

    @_translated
    def list_steps(self) -> list[int]:
        steps = []
        paginator = self.client.get_paginator("list_objects_v2")
        base = f"{self.prefix}/" if self.prefix else ""
        for page in paginator.paginate(Bucket=self.bucket, Prefix=base, Delimiter="/"):
            for cp in page.get("CommonPrefixes", []):
                step = parse_step(cp["Prefix"][len(base):].rstrip("/"))
                if step is not None and self.get_manifest(step) is not None:
                    steps.append(step)
        return sorted(steps)

    # ---- writing ------------------------------------------------------------------------

    @_translated
    def put(self, step_dir: Path) -> None:
        step_dir = Path(step_dir)
        manifest = load_manifest(step_dir)
        step = manifest.step
        existing = self.get_manifest(step)
        if existing is not None:
            if existing.checkpoint_id != manifest.checkpoint_id:
                raise CheckpointError(f"{self.key(step)} already holds checkpoint {existing.checkpoint_id}; refusing to mix it with {manifest.checkpoint_id}")
            if self.has_copy(step, manifest):
                return
        for entry in manifest.files:
            key = self.key(step, entry.path)
            if self._object_matches(key, entry.size, entry.hash):
                continue  # uploaded by an earlier, interrupted promotion
            self._upload_verified(step_dir / entry.path, key, entry.hash, entry.size)
        # The commit marker, last.
        self.client.put_object(Bucket=self.bucket, Key=self.key(step, MANIFEST_NAME), Body=manifest.to_json().encode(),
                               ContentType="application/json")

    def _upload_verified(self, path: Path, key: str, expected_hash: str, size: int) -> None:
        reader = _HashingReader(path, algorithm_of(expected_hash))
        try:
            self.client.upload_fileobj(reader, self.bucket, key, Config=self.transfer,
                                       ExtraArgs={"Metadata": {HASH_META: expected_hash}})
        finally:
            reader.close()
        actual = reader.hasher.hexdigest()
        if reader.count != size or actual != expected_hash:
            self.client.delete_object(Bucket=self.bucket, Key=key)
            raise CheckpointError(f"{path}: uploaded {reader.count} bytes hashing {actual}, manifest says {size} bytes {expected_hash}; "
                                  f"the source is damaged, not promoting it")

    @_translated
    def fetch(self, step: int, dest_dir: Path) -> Path:
        manifest = self.get_manifest(step)
        if manifest is None:
            raise CheckpointError(f"s3://{self.bucket}/{self.key(step)} has no manifest: not a checkpoint on this tier")
        tmp = make_tmp_dir(dest_dir, step=step, attempt=manifest.attempt)
        try:
            for entry in manifest.files:
                self._download_verified(self.key(step, entry.path), tmp / entry.path, entry.hash, entry.size)
            return commit(tmp, manifest, checkpoint_dir=dest_dir, fence=False)
        except BaseException:
            if tmp.exists():
                abort(tmp)
            raise

    def _download_verified(self, key: str, dest: Path, expected_hash: str, size: int) -> None:
        os.makedirs(dest.parent, mode=0o700, exist_ok=True)
        hasher = new_hasher(algorithm_of(expected_hash))
        body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
        count = 0
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            for chunk in body.iter_chunks(chunk_size=CHUNK):
                hasher.update(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
                count += len(chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        actual = hasher.hexdigest()
        if count != size or actual != expected_hash:
            raise CheckpointError(f"s3://{self.bucket}/{key}: {count} bytes hashing {actual}, manifest says {size} bytes {expected_hash}")

    @_translated
    def delete(self, step: int) -> None:
        # Uncommit first: once the manifest is gone no reader will pick the half-deleted rest.
        self.client.delete_object(Bucket=self.bucket, Key=self.key(step, MANIFEST_NAME))
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.key(step) + "/"):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})

    @_translated
    def abort_incomplete_uploads(self, *, older_than_s: float = 3600.0, now: datetime | None = None) -> int:
        """Abort multipart uploads under our prefix started more than older_than_s ago (left by a
        killed promotion; a live one is younger); returns how many."""
        now = now or datetime.now(timezone.utc)
        count = 0
        paginator = self.client.get_paginator("list_multipart_uploads")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
            for upload in page.get("Uploads", []):
                if (now - upload["Initiated"]).total_seconds() < older_than_s:
                    continue
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                count += 1
        return count
