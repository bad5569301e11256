"""A worker that fails or hangs on purpose, to test tests/hvdrun.py's error and time-out handling.

    misbehave.py fail DIR   rank 1 exits with code 3 after printing a marker; rank 0 succeeds
    misbehave.py hang DIR   every rank writes its pid to DIR/pid.<rank>, then sleeps forever
No Horovod import: horovodrun sets HOROVOD_RANK for each process it starts.
"""

import os
import sys
import time


def main():
    mode, out_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    if mode == "fail":
        if rank == 1:
            print(f"MISBEHAVE-MARKER rank {rank} failing on purpose", flush=True)
            return 3
        return 0
    if mode == "hang":
        with open(os.path.join(out_dir, f"pid.{rank}"), "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(1)
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main())
