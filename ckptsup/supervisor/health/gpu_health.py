"""GPU health beyond a device count: what shows first when a GPU goes bad at scale.

  gpu_xid       XID errors: NVRM lines in the kernel log (`dmesg`; `kernel.dmesg_restrict` may hide
                it, which is reported, not failed) and DCGM's last-XID field 230 (`dcgmi dmon -e
                230 -c 1`) when DCGM is installed. XIDs are kernel log events, not an nvidia-smi
                query. One of [health] gpu_fatal_xids (default: ECC/row-remap/NVLink/fallen off the
                bus/GSP) makes the node unhealthy; others (13, 31, 43: the application's) are listed.
  gpu_ecc       `nvidia-smi --query-gpu`: volatile uncorrected ECC errors above
                [health] gpu_max_uncorrected_ecc, or a page retirement pending (needs a reset)
  gpu_remap     `nvidia-smi --query-remapped-rows`: a row remap pending or failed (needs a reset / RMA)
  gpu_throttle  `nvidia-smi --query-gpu` clock throttle reasons active among [health] gpu_fatal_throttle
  gpu_diag      `dcgmi diag -r 1` (quick deployment diagnostics) when DCGM is installed and
                [health] dcgm_diag = auto

Parsers are pure (the real tools' output formats; tests feed recorded output and run stand-in
executables); `gpu_checks` runs the tools through `run`, each bounded by [health] timeout_s.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

from ...config import AUTO, HealthConfig

XID_LINE = re.compile(r"NVRM: Xid \((?P<pci>[^)]*)\): (?P<xid>\d+)")
QUERY_FIELDS = ("index", "pci.bus_id", "ecc.errors.uncorrected.volatile.total", "retired_pages.pending",
                "clocks_throttle_reasons.hw_slowdown", "clocks_throttle_reasons.hw_thermal_slowdown",
                "clocks_throttle_reasons.hw_power_brake_slowdown", "clocks_throttle_reasons.sw_thermal_slowdown")
THROTTLES = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")
REMAP_FIELDS = ("gpu_bus_id", "remapped_rows.correctable", "remapped_rows.uncorrectable", "remapped_rows.pending",
                "remapped_rows.failure")
DETAIL_MAX = 300


@dataclass(frozen=True)
class Ran:
    rc: int
    out: str
    err: str = ""


Runner = Callable[[Sequence[str], float], "Ran | None"]   # None: the tool is not installed


def run_tool(which: Callable[[str], str | None] = shutil.which) -> Runner:
    def run(argv: Sequence[str], timeout_s: float) -> Ran | None:
        exe = which(argv[0])
        if exe is None:
            return None
        try:
            proc = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout_s,
                                  stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired:
            return Ran(rc=-1, out="", err=f"timed out after {timeout_s:g}s")
        except OSError as err:
            return Ran(rc=-1, out="", err=err.strerror or str(err))
        return Ran(rc=proc.returncode, out=proc.stdout, err=proc.stderr)
    return run


# ---- parsers (pure) ---------------------------------------------------------------------------

def kernel_xids(text: str) -> list[tuple[str, int]]:
    """(pci, xid) per NVRM Xid line, in order."""
    return [(m.group("pci"), int(m.group("xid"))) for m in XID_LINE.finditer(text)]


def dcgm_xids(text: str) -> dict[str, int]:
    """`dcgmi dmon -e 230 -c 1`: gpu id -> its last XID (0: none; N/A skipped)."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "GPU" and parts[2].isdigit():
            out[parts[1]] = int(parts[2])
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.split(",")]


def _number(cell: str) -> int | None:
    return int(cell) if cell.isdigit() else None


def _yes(cell: str) -> bool:
    return cell.strip().lower() in ("yes", "active", "1", "true")


def query_gpus(text: str) -> list[dict[str, Any]]:
    """`nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits`; [N/A] is unknown."""
    rows: list[dict[str, Any]] = []
    for line in text.splitlines():
        cells = _cells(line)
        if len(cells) != len(QUERY_FIELDS) or not cells[0].isdigit():
            continue
        rows.append({"index": int(cells[0]), "bus": cells[1], "ecc_uncorrected": _number(cells[2]),
                     "retirement_pending": _yes(cells[3]),
                     "throttle": [name for name, cell in zip(THROTTLES, cells[4:]) if _yes(cell)]})
    return rows


def remapped_rows(text: str) -> list[dict[str, Any]]:
    """`nvidia-smi --query-remapped-rows=<REMAP_FIELDS> --format=csv,noheader`."""
    rows: list[dict[str, Any]] = []
    for line in text.splitlines():
        cells = _cells(line)
        if len(cells) != len(REMAP_FIELDS) or not cells[0]:
            continue
        rows.append({"bus": cells[0], "uncorrectable": _number(cells[2]), "pending": _yes(cells[3]),
                     "failure": _yes(cells[4])})
    return rows


def diag_failures(text: str) -> list[str]:
    """The tests `dcgmi diag` reports as Fail (its table: `| <test> | Fail ... |`)."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[1].lower().startswith("fail"):
            out.append(cells[0])
    return out


# ---- checks ---------------------------------------------------------------------------------

def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= DETAIL_MAX else text[: DETAIL_MAX - 3] + "..."


class Finding(NamedTuple):
    """One check's verdict; health.py turns it into its CheckResult."""

    name: str
    ok: bool
    detail: str


def _result(name: str, ok: bool, detail: str) -> Finding:
    return Finding(name=name, ok=ok, detail=_clip(detail))


def check_xids(health: HealthConfig, run: Runner) -> list[Finding]:
    seen: list[str] = []
    fatal: list[str] = []
    notes: list[str] = []
    kernel = run(["dmesg"], health.timeout_s)
    if kernel is not None and kernel.rc == 0:
        for pci, xid in kernel_xids(kernel.out):
            (fatal if xid in health.gpu_fatal_xids else seen).append(f"XID {xid} on {pci}")
    elif kernel is not None:
        notes.append(f"kernel log unreadable ({_clip(kernel.err or kernel.out) or f'rc {kernel.rc}'}; "
                     "kernel.dmesg_restrict?)")
    dcgm = run(["dcgmi", "dmon", "-e", "230", "-c", "1"], health.timeout_s)
    if dcgm is not None and dcgm.rc == 0:
        for gpu, xid in dcgm_xids(dcgm.out).items():
            if xid:
                (fatal if xid in health.gpu_fatal_xids else seen).append(f"XID {xid} on GPU {gpu} (DCGM)")
    if kernel is None and dcgm is None:
        return []
    if fatal:
        return [_result("gpu_xid", False, "; ".join(fatal + seen))]
    detail = "; ".join(seen) + (" (not in gpu_fatal_xids)" if seen else "") or "no XID"
    return [_result("gpu_xid", True, "; ".join([detail, *notes]))]


def check_nvidia_smi(health: HealthConfig, run: Runner) -> list[Finding]:
    query = run(["nvidia-smi", f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits"],
                health.timeout_s)
    if query is None:
        return []
    if query.rc != 0:
        return [_result("gpu_ecc", False, f"nvidia-smi --query-gpu exit {query.rc}: {query.err or query.out}")]
    rows = query_gpus(query.out)
    ecc = [f"GPU {r['index']}: {r['ecc_uncorrected']} uncorrected ECC" for r in rows
           if isinstance(r["ecc_uncorrected"], int) and r["ecc_uncorrected"] > health.gpu_max_uncorrected_ecc]
    ecc += [f"GPU {r['index']}: page retirement pending (reset the GPU)" for r in rows if r["retirement_pending"]]
    throttled = [f"GPU {r['index']}: {', '.join(t for t in r['throttle'] if t in health.gpu_fatal_throttle)}"
                 for r in rows if any(t in health.gpu_fatal_throttle for t in r["throttle"])]
    out = [_result("gpu_ecc", not ecc, "; ".join(ecc) or f"{len(rows)} GPU(s): ECC within "
                                                        f"{health.gpu_max_uncorrected_ecc}, no retirement pending"),
           _result("gpu_throttle", not throttled, "; ".join(throttled) or "no fatal throttle reason active")]
    remap = run(["nvidia-smi", f"--query-remapped-rows={','.join(REMAP_FIELDS)}", "--format=csv,noheader"],
                health.timeout_s)
    if remap is not None and remap.rc == 0:
        bad = [f"{r['bus']}: row remap {'failed' if r['failure'] else 'pending (reset the GPU)'}"
               for r in remapped_rows(remap.out) if r["failure"] or r["pending"]]
        out.append(_result("gpu_remap", not bad, "; ".join(bad) or "no row remap pending or failed"))
    return out


def check_diag(health: HealthConfig, run: Runner) -> list[Finding]:
    if health.dcgm_diag != AUTO:
        return []
    diag = run(["dcgmi", "diag", "-r", "1"], max(health.timeout_s, 120.0))
    if diag is None:
        return []
    failed = diag_failures(diag.out)
    if diag.rc != 0 or failed:
        what = ", ".join(failed) if failed else f"exit {diag.rc}: {diag.err or diag.out}"
        return [_result("gpu_diag", False, f"dcgmi diag -r 1 failed: {what}")]
    return [_result("gpu_diag", True, "dcgmi diag -r 1 passed")]


def gpu_checks(health: HealthConfig, run: Runner) -> list[Finding]:
    """Every GPU check whose tool is installed (none installed: no result)."""
    return [*check_xids(health, run), *check_nvidia_smi(health, run), *check_diag(health, run)]
