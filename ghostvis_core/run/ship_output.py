"""Ship a job's output to the store as it runs: `srun ... 2>&1 | python -m ghostvis_core.run.ship_output
--store URI --stage S --run-key K --name slurm/<attempt>/out`.

On a cluster that shares no folder with the Dagster host, the job's output file is on the batch node
only. This reads the job's output on stdin, passes it on to stdout (the node-local `--output` file)
and writes what arrived as numbered chunk objects, `run_file` <name>/<seq>.txt (seq from 00001),
every few seconds and at the end; the launcher streams them into the Dagster log in order. A cancelled
job (SIGTERM) still ships what it had.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from ghostvis_core.store import open_store

SHIP_SECONDS = 3.0


def chunk_name(name: str, seq: int) -> str:
    """The `run_file` name of output chunk `seq` (counted from 1) under `name`."""
    return f"{name}/{seq:05d}.txt"


class Shipper:
    def __init__(self, store_uri: str, stage: str, run_key: str, name: str):
        self.store, self.key, self.name = open_store(store_uri), (stage, run_key), name
        self.pending: list[bytes] = []
        self.lock = threading.Lock()
        self.seq = 0

    def take(self, stream) -> None:
        """Keep every line of `stream` for the next chunk, and pass it on to stdout."""
        for line in stream:
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()
            with self.lock:
                self.pending.append(line)

    def ship(self) -> None:
        """Write what arrived since the last chunk as the next chunk (nothing when nothing arrived)."""
        with self.lock:
            data, self.pending = b"".join(self.pending), []
        if data:
            self.seq += 1
            self.store.write_text(
                "run_file", *self.key, chunk_name(self.name, self.seq), text=data.decode(errors="replace")
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ghostvis_core.run.ship_output",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--store", required=True)
    ap.add_argument("--stage", required=True)
    ap.add_argument("--run-key", required=True)
    ap.add_argument("--name", required=True, help="run_file folder of the chunks, e.g. slurm/<attempt>/out")
    args = ap.parse_args(argv)
    shipper = Shipper(args.store, args.stage, args.run_key, args.name)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())  # a cancelled job: ship what arrived, then end
    reader = threading.Thread(target=shipper.take, args=(sys.stdin.buffer,), daemon=True)
    reader.start()
    while reader.is_alive() and not stopped.is_set():
        reader.join(timeout=SHIP_SECONDS)
        shipper.ship()
    shipper.ship()
    return 0


if __name__ == "__main__":
    sys.exit(main())
