#!/usr/bin/env python3
"""Stand-ins for nvidia-smi, dcgmi and dmesg (symlinks to this file) that print recorded output in
the real tools' formats (tests/test_gpu_health.py, the dev-cluster GPU health test). Faults come
from CKPTSUP_FAKE_GPU ("xid79,ecc,...") or, per node, from the file CKPTSUP_FAKE_GPU_FILE
("<node>: <faults>" lines; the node is SLURMD_NODENAME or CKPTSUP_NODE).

faults: xid79 xid13 (kernel log), dcgm_xid48, ecc, retire, remap, remap_failed, throttle,
        diagfail, dmesg_restricted, smi_fails"""
import os
import sys


def faults() -> set[str]:
    found = set(filter(None, os.environ.get("CKPTSUP_FAKE_GPU", "").split(",")))
    path = os.environ.get("CKPTSUP_FAKE_GPU_FILE")
    node = os.environ.get("SLURMD_NODENAME") or os.environ.get("CKPTSUP_NODE", "")
    if path and os.path.exists(path):
        for line in open(path):
            name, _, listed = line.partition(":")
            if name.strip() == node:
                found |= {f.strip() for f in listed.split(",") if f.strip()}
    return found


BUS = ["00000000:18:00.0", "00000000:2A:00.0"]


def nvidia_smi(args: list[str], f: set[str]) -> int:
    if "smi_fails" in f:
        print("Unable to determine the device handle for GPU0000:2A:00.0: Unknown Error", file=sys.stderr)
        return 255
    if args == ["-L"]:
        for i in range(2):
            print(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-5a4b1c2d-0000-1111-2222-33334444555{i})")
        return 0
    if args and args[0].startswith("--query-gpu="):
        for i in range(2):
            bad = i == 1
            ecc = "3" if bad and "ecc" in f else "0"
            retire = "Yes" if bad and "retire" in f else "[N/A]"
            thermal = "Active" if bad and "throttle" in f else "Not Active"
            print(f"{i}, {BUS[i]}, {ecc}, {retire}, Not Active, {thermal}, Not Active, Not Active")
        return 0
    if args and args[0].startswith("--query-remapped-rows="):
        for i in range(2):
            bad = i == 1
            pending = "Yes" if bad and "remap" in f else "No"
            failed = "Yes" if bad and "remap_failed" in f else "No"
            print(f"{BUS[i]}, 0, {1 if bad and ('remap' in f or 'remap_failed' in f) else 0}, {pending}, {failed}")
        return 0
    print(f"nvidia-smi stand-in: unknown arguments {args}", file=sys.stderr)
    return 2


def dcgmi(args: list[str], f: set[str]) -> int:
    if args[:1] == ["dmon"]:
        print("#Entity   XIDERR\nID\nGPU 0     0")
        print(f"GPU 1     {48 if 'dcgm_xid48' in f else 0}")
        return 0
    if args[:1] == ["diag"]:
        print("Successfully ran diagnostic for group.")
        print("+---------------------------+------------------------------------------------+")
        print("| Diagnostic                | Result                                         |")
        print("+===========================+================================================+")
        print("|-----  Metadata  ----------+------------------------------------------------|")
        print("| DCGM Version              | 3.3.5                                          |")
        print("|-----  Deployment  --------+------------------------------------------------|")
        print("| Denylist                  | Pass                                           |")
        print("| NVML Library              | Pass                                           |")
        print(f"| Page Retirement/Row Remap | {'Fail' if 'diagfail' in f else 'Pass'}                                           |")
        print("| Inforom                   | Pass                                           |")
        print("+---------------------------+------------------------------------------------+")
        return 226 if "diagfail" in f else 0
    return 2


def dmesg(f: set[str]) -> int:
    if "dmesg_restricted" in f:
        print("dmesg: read kernel buffer failed: Operation not permitted", file=sys.stderr)
        return 1
    print("[    0.000000] Linux version 6.1.0-18-amd64 (debian-kernel@lists.debian.org)")
    print("[   12.345678] nvidia-nvlink: Nvlink Core is being initialized, major device number 238")
    if "xid13" in f:
        print("[ 5021.123456] NVRM: Xid (PCI:0000:18:00): 13, pid=4242, name=python, Graphics Exception: "
              "ESR 0x404490=0x80000001")
    if "xid79" in f:
        print("[ 8123.456789] NVRM: Xid (PCI:0000:2a:00): 79, pid='<unknown>', name=<unknown>, "
              "GPU has fallen off the bus.")
    return 0


def dispatch(name: str, args: list[str]) -> int:
    f = faults()
    if name == "nvidia-smi":
        return nvidia_smi(args, f)
    if name == "dcgmi":
        return dcgmi(args, f)
    if name == "dmesg":
        return dmesg(f)
    return 2


def main() -> int:
    return dispatch(os.path.basename(sys.argv[0]), sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
