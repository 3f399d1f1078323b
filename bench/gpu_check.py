"""The GPU proof (issue 25; docs/gpu.md): every GPU path of ckptsup measured in one budgeted run on a
lent device, one JSON of figures plus a human summary.

    python bench/gpu_check.py --budget-s 300 --out $OUT/gpu_check.json     # on the device
    python bench/gpu_check.py --dry-run --out /tmp/gpu_check.json          # every code path, CPU, tiny

Parts (bench/gpu_parts.py): env, async_save, restore, memory_tier, restart, gpu_health, nccl.
Each part gets a share of --budget-s; a part whose share (or the whole budget) is spent, or whose
prerequisite is missing, is skipped with the reason; a part that raises is recorded as failed
and the next one runs. The JSON (and the summary beside it, <out>.txt) is rewritten after every
part, and a watchdog thread writes it and exits when the budget plus a grace is overrun (a hung
CUDA call cannot keep the figures of the parts before it from coming back).

No network, no Slurm, one GPU. --dry-run: cuda -> cpu, tiny sizes, nvidia-smi & co. from
tests/helpers/gpu_tools (recorded output) and "missing"; no timing claims.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
if __name__ == "__main__":   # the parts import Skip/Context from here: one module, not a second copy
    sys.modules["gpu_check"] = sys.modules[__name__]
try:   # the carried wheel on the device (docs/gpu.md); the working tree elsewhere
    import ckptsup  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

SCHEMA = "ckptsup-gpu-check/1"
WRITE_RESERVE_S = 5.0      # kept back from the budget for the last write
WATCHDOG_GRACE_S = 60.0    # past the budget: write what there is and exit


class Skip(Exception):
    """A part (or a step of one) did not run: the reason is recorded."""


@dataclass
class Context:
    dry_run: bool
    device: str                 # "cuda" or "cpu"
    work: Path
    budget_s: float
    args: argparse.Namespace
    start: float = field(default_factory=time.monotonic)
    part_deadline: float = 0.0
    shared: dict[str, Any] = field(default_factory=dict)   # what a later part uses (model, checkpoint dir)

    def global_left(self) -> float:
        return self.start + self.budget_s - WRITE_RESERVE_S - time.monotonic()

    def left(self) -> float:
        """Seconds left to the running part (its share, and never past the whole budget)."""
        return min(self.part_deadline - time.monotonic(), self.global_left())

    def need(self, seconds: float, what: str) -> None:
        """Skip the rest of the part unless `seconds` are left for `what`."""
        if self.left() < seconds:
            raise Skip(f"budget: {self.left():.0f}s left of this part's share, {what} needs ~{seconds:.0f}s")


@dataclass(frozen=True)
class Part:
    name: str
    share: float                 # of the budget
    min_s: float                 # skipped when less is left
    # -> {"figures": {...}, "checks": {name: bool} (correctness, everywhere), "targets": {name: bool}
    #    (speed, claimed on a GPU only), "skipped_steps": {step: why}, "notes": str}
    run: Callable[[Context], dict[str, Any]]
    needs: tuple[str, ...] = ()  # parts whose shared results it uses


class Report:
    def __init__(self, out: Path, ctx: Context) -> None:
        self.out = out
        self.ctx = ctx
        self.lock = threading.Lock()
        self.data: dict[str, Any] = {"schema": SCHEMA, "dry_run": ctx.dry_run, "device": ctx.device,
                                     "budget_s": ctx.budget_s, "argv": sys.argv[1:], "complete": False,
                                     "started_unix": round(time.time(), 3), "parts": {}}

    def part(self, name: str, entry: dict[str, Any]) -> None:
        with self.lock:
            self.data["parts"][name] = entry
        self.write()

    def write(self, *, final: bool = False, note: str = "") -> None:
        with self.lock:
            self.data["elapsed_s"] = round(time.monotonic() - self.ctx.start, 3)
            self.data["complete"] = final
            if note:
                self.data["note"] = note
            self.data["summary"] = summary_lines(self.data)
            body = json.dumps(self.data, indent=1, default=str)
            self.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.out.with_name(self.out.name + ".tmp")
            tmp.write_text(body + "\n")
            os.replace(tmp, self.out)
            self.out.with_suffix(".txt").write_text("\n".join(self.data["summary"]) + "\n")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def summary_lines(data: dict[str, Any]) -> list[str]:
    """The human summary: one block per part, its checks marked PASS/FAIL."""
    from ckptsup.textsafe import literal

    head = "DRY RUN (cpu, tiny sizes: no timing claims)" if data.get("dry_run") else f"device {data.get('device')}"
    lines = [f"ckptsup gpu_check — {head}; budget {data.get('budget_s')}s, elapsed {data.get('elapsed_s')}s"
             f"{'' if data.get('complete') else ' (INCOMPLETE)'}"]
    env = data.get("parts", {}).get("env", {}).get("figures", {})
    if env:
        lines.append("  " + ", ".join(f"{k} {literal(v, limit=80)}" for k, v in env.items() if k in
                                       ("python", "torch", "cuda", "gpu", "gpu_memory_gib", "ckptsup")))
    for name, entry in data.get("parts", {}).items():
        status = entry.get("status")
        line = f"[{status:7s}] {name} ({entry.get('elapsed_s', 0):.1f}s of {entry.get('share_s', 0):.0f}s)"
        if entry.get("reason"):
            line += f": {literal(entry['reason'], limit=300)}"
        lines.append(line)
        for key, value in entry.get("figures", {}).items():
            if name != "env" and not isinstance(value, (dict, list)):
                lines.append(f"    {key} = {literal(_fmt(value), limit=120)}")
        for key, ok in entry.get("checks", {}).items():
            lines.append(f"    {'PASS' if ok else 'FAIL'} {key}")
        for key, met in entry.get("targets", {}).items():
            verdict = "(dry run, no claim)" if data.get("dry_run") else ("TARGET MET" if met else "TARGET MISSED")
            lines.append(f"    {verdict} {key}")
        for key, why in entry.get("skipped_steps", {}).items():
            lines.append(f"    skipped {key}: {literal(why, limit=200)}")
    return lines


def run_parts(parts: list[Part], ctx: Context, report: Report) -> None:
    shares = sum(p.share for p in parts)
    cumulative = 0.0
    for part in parts:
        share_s = ctx.budget_s * part.share / shares
        cumulative += share_s
        entry: dict[str, Any] = {"share_s": round(share_s, 1)}
        t0 = time.monotonic()
        # a part gets at least its share, and what earlier parts left unspent (never past the whole budget)
        ctx.part_deadline = max(t0 + share_s, ctx.start + cumulative)
        missing = [n for n in part.needs if report.data["parts"].get(n, {}).get("status") != "ran"]
        try:
            if missing:
                raise Skip(f"needs part(s) {', '.join(missing)}, which did not run")
            if ctx.global_left() < part.min_s:
                raise Skip(f"budget: {ctx.global_left():.0f}s left of the whole run, this part needs ~{part.min_s:.0f}s")
            entry.update(part.run(ctx))
            entry["status"] = "ran"
        except Skip as why:
            entry.update(status="skipped", reason=str(why))
        except BaseException as err:   # a part's failure (a CUDA error, OOM, a bug) must not lose the others
            if isinstance(err, KeyboardInterrupt):
                raise
            entry.update(status="failed", reason=f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}",
                         traceback=traceback.format_exc()[-3000:])
        entry["elapsed_s"] = round(time.monotonic() - t0, 3)
        report.part(part.name, entry)
        print("\n".join(summary_lines({"parts": {part.name: entry}, "dry_run": ctx.dry_run})[1:]), flush=True)


def start_watchdog(ctx: Context, report: Report) -> None:
    def fire() -> None:
        report.write(note=f"watchdog: the run overran its budget by {WATCHDOG_GRACE_S:.0f}s; parts not listed did not finish")
        print("gpu_check: watchdog fired, figures so far written", file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(ctx.budget_s + WATCHDOG_GRACE_S, fire)
    timer.daemon = True
    timer.start()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=300.0, help="whole run (default 300)")
    p.add_argument("--out", default="bench/out/gpu_check.json", help="the JSON (its summary: same name, .txt)")
    p.add_argument("--dry-run", action="store_true", help="every part on the CPU with tiny sizes, recorded nvidia-smi")
    p.add_argument("--state-gb", type=float, default=8.5, help="model + AdamW state on the GPU (default 8.5, >= 8)")
    p.add_argument("--memory-gb", type=float, default=1.0, help="state of the memory-tier part (default 1)")
    p.add_argument("--work-dir", default=None, help="checkpoints and run dirs (default: a temp dir, removed after)")
    p.add_argument("--parts", default="", help="comma-separated subset of parts (default: all)")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import shutil

    from gpu_parts import PARTS, pick_device

    device = "cpu" if args.dry_run else pick_device()
    if args.dry_run:
        args.state_gb = min(args.state_gb, 0.006)
        args.memory_gb = min(args.memory_gb, 0.002)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="ckptsup-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    os.chmod(work, 0o700)
    ctx = Context(dry_run=args.dry_run, device=device, work=work, budget_s=args.budget_s, args=args)
    report = Report(Path(args.out), ctx)
    report.write()
    start_watchdog(ctx, report)
    wanted = {n for n in args.parts.split(",") if n}
    unknown = wanted - {p.name for p in PARTS}
    if unknown:
        print(f"gpu_check: unknown part(s) {', '.join(sorted(unknown))}; choose from "
              f"{', '.join(p.name for p in PARTS)}", file=sys.stderr)
        return 2
    try:
        run_parts([p for p in PARTS if not wanted or p.name in wanted], ctx, report)
    finally:
        report.write(final=True)
        if not args.keep and args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"gpu_check: {args.out} and {Path(args.out).with_suffix('.txt')}", flush=True)
    failed = [n for n, e in report.data["parts"].items() if e.get("status") == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
