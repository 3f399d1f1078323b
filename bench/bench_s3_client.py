"""Which S3 client for the object tier: boto3 vs obstore (vs fsspec/s3fs when installable),
measured in one run against a moto_server on 127.0.0.1 started here.

Each client uploads the same checkpoint-shaped files (several shards plus one file above the
multipart threshold), downloads them and lists the prefix. Throughput is relative to boto3 in the
same run. moto_server is a single Python process, so absolute numbers measure it as much as the
client; the ratio, the CPU time the client itself burns, and the features (multipart, metadata,
streaming with our own hashing) are what the choice rests on.

    .venv/bin/python bench/bench_s3_client.py [--shards 8] [--shard-mb 16] [--big-mb 160] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUCKET = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(port: int) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen([str(exe) if exe.exists() else "moto_server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto_server did not start")


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def bench_boto3(url: str, files: list[Path], prefix: str) -> dict:
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
    cfg = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=4)
    t0, c0 = time.perf_counter(), cpu_s()
    for f in files:
        client.upload_file(str(f), BUCKET, f"{prefix}/{f.name}", Config=cfg, ExtraArgs={"Metadata": {"ckptsup-hash": "x"}})
    put_s, put_cpu = time.perf_counter() - t0, cpu_s() - c0
    t0, c0 = time.perf_counter(), cpu_s()
    for f in files:
        body = client.get_object(Bucket=BUCKET, Key=f"{prefix}/{f.name}")["Body"]
        for _ in body.iter_chunks(chunk_size=8 << 20):
            pass
    get_s, get_cpu = time.perf_counter() - t0, cpu_s() - c0
    t0 = time.perf_counter()
    listed = sum(len(p.get("Contents", [])) for p in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix))
    list_s = time.perf_counter() - t0
    assert listed == len(files)
    return {"put_s": put_s, "get_s": get_s, "list_s": list_s, "put_cpu_s": put_cpu, "get_cpu_s": get_cpu}


def bench_obstore(url: str, files: list[Path], prefix: str) -> dict:
    import obstore as obs
    from obstore.store import S3Store

    store = S3Store(BUCKET, endpoint=url, region="us-east-1", access_key_id="testing", secret_access_key="testing",
                    client_options={"allow_http": True})
    t0, c0 = time.perf_counter(), cpu_s()
    for f in files:
        obs.put(store, f"{prefix}/{f.name}", f, chunk_size=64 << 20, max_concurrency=4)
    put_s, put_cpu = time.perf_counter() - t0, cpu_s() - c0
    t0, c0 = time.perf_counter(), cpu_s()
    for f in files:
        for _ in obs.get(store, f"{prefix}/{f.name}").stream(min_chunk_size=8 << 20):
            pass
    get_s, get_cpu = time.perf_counter() - t0, cpu_s() - c0
    t0 = time.perf_counter()
    listed = sum(len(batch) for batch in obs.list(store, prefix=prefix))
    list_s = time.perf_counter() - t0
    assert listed == len(files), listed
    return {"put_s": put_s, "get_s": get_s, "list_s": list_s, "put_cpu_s": put_cpu, "get_cpu_s": get_cpu}


def s3fs_status() -> str:
    try:
        import s3fs  # noqa: F401
    except ImportError:
        return ("not installed: s3fs needs aiobotocore, which pins botocore to an older minor release than the "
                "boto3 this project uses (pip would downgrade it), so fsspec's S3 backend was not measured")
    return "installed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--shard-mb", type=int, default=16)
    parser.add_argument("--big-mb", type=int, default=160, help="one file above the 64 MiB multipart threshold")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")

    workdir = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    port = free_port()
    moto = start_moto(port)
    url = f"http://127.0.0.1:{port}"
    try:
        files = []
        for i in range(args.shards):
            files.append(workdir / f"__{i}_0.distcp")
            files[-1].write_bytes(os.urandom(args.shard_mb << 20))
        files.append(workdir / "big.distcp")
        files[-1].write_bytes(os.urandom(args.big_mb << 20))
        total = sum(f.stat().st_size for f in files)
        import boto3

        boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        clients = {"boto3": bench_boto3}
        try:
            import obstore  # noqa: F401

            clients["obstore"] = bench_obstore
        except ImportError:
            pass
        results: dict[str, list[dict]] = {name: [] for name in clients}
        for r in range(args.rounds):
            for name, fn in (clients.items() if r % 2 == 0 else reversed(list(clients.items()))):
                results[name].append(fn(url, files, f"{name}-{r}"))
    finally:
        moto.terminate()
        moto.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)

    def best(name: str, key: str) -> float:
        return min(x[key] for x in results[name])

    report = {"bytes": total, "files": len(files), "s3fs": s3fs_status(), "clients": {}}
    for name in results:
        report["clients"][name] = {
            "put_mb_s": round(total / best(name, "put_s") / 1e6, 1), "get_mb_s": round(total / best(name, "get_s") / 1e6, 1),
            "list_ms": round(best(name, "list_s") * 1e3, 1),
            "client_cpu_s_per_gb_put": round(best(name, "put_cpu_s") / total * 1e9, 2),
            "client_cpu_s_per_gb_get": round(best(name, "get_cpu_s") / total * 1e9, 2),
        }
    if "obstore" in report["clients"]:
        b, o = report["clients"]["boto3"], report["clients"]["obstore"]
        report["obstore_vs_boto3"] = {"put": round(o["put_mb_s"] / b["put_mb_s"], 2), "get": round(o["get_mb_s"] / b["get_mb_s"], 2)}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{len(files)} files, {total / 1e6:.0f} MB, moto_server on 127.0.0.1, best of {args.rounds}:")
    for name, row in report["clients"].items():
        print(f"  {name:<8} put {row['put_mb_s']:7.1f} MB/s  get {row['get_mb_s']:7.1f} MB/s  list {row['list_ms']:6.1f} ms  "
              f"client CPU {row['client_cpu_s_per_gb_put']:.2f} s/GB put, {row['client_cpu_s_per_gb_get']:.2f} s/GB get")
    if "obstore_vs_boto3" in report:
        print(f"  obstore / boto3: put x{report['obstore_vs_boto3']['put']}, get x{report['obstore_vs_boto3']['get']}")
    print(f"  fsspec/s3fs: {report['s3fs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
