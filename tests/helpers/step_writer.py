"""A task of a many-task srun step (tests/test_step_lines.py): from a common start time, writes
LINES lines of 1 to 20,000 bytes (seeded by its task id) to its stdout, each line whole or as
step_lines pieces, one write() per line, as the agents write frames."""

import os
import random
import sys
import time

from ckptsup import step_lines


def main() -> None:
    start, lines, mode = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    task = os.environ.get("SLURM_PROCID", "0")
    rng = random.Random(int(task))
    while time.time() < start:
        time.sleep(0.001)
    for i in range(lines):
        line = f"{{\"task\":{task},\"i\":{i},\"fill\":\"{'x' * rng.randint(1, 20_000)}\"}}\n".encode()
        os.write(1, step_lines.pieces(line, f"task{task}".encode()) if mode == "pieces" else line)
        time.sleep(rng.random() * 0.002)


if __name__ == "__main__":
    main()
