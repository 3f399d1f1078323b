"""Seconds per test file from a pytest junit XML, longest first, as the FILE_SECONDS lines of
tests/conftest.py: `python tests/file_seconds.py junit.xml [--min-s 20]`."""
from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def file_seconds(junit: Path) -> Counter[str]:
    totals: Counter[str] = Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = (case.get("classname") or "").split(".")
        name = next((f"{part}.py" for part in module if part.startswith("test_")), None)
        if name:
            totals[name] += float(case.get("time") or 0.0)
    return totals


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("junit", type=Path)
    p.add_argument("--min-s", type=float, default=20.0)
    args = p.parse_args()
    for name, seconds in file_seconds(args.junit).most_common():
        if seconds >= args.min_s:
            print(f'    "{name}": {seconds:.0f},')


if __name__ == "__main__":
    main()
