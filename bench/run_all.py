"""Run every benchmark in bench/ (each prints its own ratio against a baseline measured in the
same run). `make bench`. Some need the dev cluster; they start it themselves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main() -> int:
    failed = []
    for script in sorted(Path(__file__).parent.glob("bench_*.py")):
        print(f"\n=== {script.name} ===", flush=True)
        if subprocess.run([sys.executable, str(script)]).returncode != 0:
            failed.append(script.name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
