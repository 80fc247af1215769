"""A fault soak against the undisturbed run: the short pretraining run (smoke preset, 12 steps, a checkpoint every
4) on two separate hosts (tests/hosts.py: network and mount namespaces; the store in an S3 bucket, MLflow a tracking
server), the torchrun launcher with rank 0 away from the Dagster host. Once undisturbed, once with six faults of
different kinds (tests/faults.py `run_soak`: a second launch of the same identity, a 30 s S3 outage, a rank
SIGKILLed, a preemption, a hang, rank 0's node killed).

Printed: the goodput of each (productive seconds over the wall, from the ledger's timeline: `ghostvis goodput`) and
where the disturbed run's wall went by category, the seconds, steps and token slots each fault cost (its time after
its last kept work, the wait to the next launch and that launch's restart), the work each preemption lost (steps
trained past the checkpoint it committed, read from the ledger: goal <= 1 step), whether the weights are bitwise
the undisturbed run's. Needs root (namespaces), like the tests that use the hosts.

    .venv/bin/python benchmarks/fault_soak.py [--home PATH]
"""

from __future__ import annotations

import json
import re
import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ghostvis_core.data.ledger import Ledger  # noqa: E402
from ghostvis_core.data.ledger.goodput import ledger_goodput  # noqa: E402
from ghostvis_core.data.ledger.records import PartRow  # noqa: E402
from ghostvis_core.run.train import checkpoint as ckpt  # noqa: E402
from ghostvis_core.store import open_store  # noqa: E402
from ghostvis_pipeline.goodput_command import goodput_lines  # noqa: E402
from tests.conftest import copy_home, materialize_pretrain  # noqa: E402
from tests.faults import OUTAGE_S, SOAK_HANG_S, run_soak  # noqa: E402
from tests.hosts import HOST_ADDR, another_home, make_hosts, move_store_to_bucket, start_servers  # noqa: E402

GOAL_LOST_STEPS = 1


def launch_argv(hosts) -> list[str]:
    argv = materialize_pretrain(
        kind="torchrun",
        torchrun={
            "nnodes": 2,
            "rdzv_endpoint": f"{HOST_ADDR}:29400",
            "hosts": ["gv1"],
            "node_shell": f"{hosts.nodesh} {{host}}",
            "cpus_per_node": 1,
        },
    )
    config = json.loads(argv[-1])
    config["ops"]["pretrain"]["config"]["overrides"]["runtime.hang_timeout_s"] = str(SOAK_HANG_S)
    return [*argv[:-1], json.dumps(config)]


def new_run(hosts, store: str, dest: Path, known: set[str]) -> tuple[Path, str]:
    """The store's pretraining runs and ledger as a folder store, and the one run key not in `known`."""
    folder = hosts.download(store, dest, "checkpoints/pretrain", "runs/pretrain", "ledger")
    (run_key,) = {p.name for p in (folder / "checkpoints" / "pretrain").iterdir()} - known
    return folder, run_key


def final_weights(store_dir: Path, run_key: str) -> bytes:
    return (
        ckpt.latest_complete(store_dir / "checkpoints" / "pretrain" / run_key).path / "model.safetensors"
    ).read_bytes()


def lost_per_preemption(chain: list[PartRow], log: str) -> list[int]:
    """For each `preempted at step N`: steps trained after N that the ledger does not hold (the next part of the
    chain starts at N + 1 when none was lost; a part ending at N proves N was committed)."""
    lost = []
    for at in (int(m) for m in re.findall(r"preempted at step (\d+)", log)):
        ends = [p.step_last for p in chain]
        firsts = [p.step_first for p in chain]
        lost.append(0 if at in ends and at + 1 in firsts else at - max(e for e in ends if e < at))
    return lost


def main() -> int:
    ap = C.arguments(__doc__)
    ap.add_argument("--home", type=Path, help="a demo home (`ghostvis demo --preset smoke`); built when not given")
    args = ap.parse_args()
    with C.work_folder("fault-soak") as wd:
        hosts = make_hosts(wd / "hosts", secret=f"gvBench{secrets.token_hex(8)}")
        try:
            demo = args.home or wd / "demo"
            if not args.home:
                C.build_demo_home(demo, stages=("pretrain",))
            known = {p.name for p in (demo / "store" / "checkpoints" / "pretrain").iterdir()}
            copy_home(demo, hosts.home)
            start_servers(hosts)
            move_store_to_bucket(hosts)
            argv = launch_argv(hosts)

            home, store = another_home(hosts, demo, "calm")
            t0 = time.time()
            hosts.run(argv, home, GHOSTVIS_STORE=store)
            calm_wall = time.time() - t0
            calm_dir, run_key = new_run(hosts, store, wd / "calm", known)

            home, store = another_home(hosts, demo, "soak")
            logs = wd / "first.log", wd / "second.log"
            soak_wall = run_soak(hosts, argv, home, store, run_key, logs)
            soak_dir, _ = new_run(hosts, store, wd / "soak", known)
            log = logs[0].read_text()
            ledger = Ledger.in_store(open_store(str(soak_dir)))
            chain = ledger.chain(run_key)
            lost = lost_per_preemption(chain, log)
            same = final_weights(soak_dir, run_key) == final_weights(calm_dir, run_key)
            calm, soak = (
                ledger_goodput(Ledger.in_store(open_store(str(calm_dir))), run_key),
                ledger_goodput(ledger, run_key),
            )
            print(f"undisturbed: {calm_wall:.0f} s measured, goodput {calm.goodput:.1%} of {calm.wall_s:.1f} s")
            print(f"with 6 faults (a {OUTAGE_S} s outage, a {SOAK_HANG_S} s hang timeout): {soak_wall:.0f} s measured")
            print("\n".join(goodput_lines(soak)))
            print(
                f"weights bitwise the undisturbed run's: {same}; "
                f"ledger parts: {len(chain)}, steps 1..{chain[-1].step_last}"
            )
            print(
                C.goal(
                    "steps lost per preemption (max)",
                    float(max(lost, default=0)),
                    GOAL_LOST_STEPS,
                    higher_is_better=False,
                )
            )
            print(
                C.kv_line(
                    {
                        "calm_wall_s": calm_wall,
                        "calm_goodput": calm.goodput,
                        "soak_wall_s": soak_wall,
                        "soak_goodput": soak.goodput,
                        "launches": soak.launches,
                        "redone_steps": soak.redone_steps,
                        "tokens_thrown_away": soak.tokens_thrown_away,
                        **{f"fault{f.launch}_{f.reason}_s": f.seconds for f in soak.faults},
                        "lost_steps_per_preemption": max(lost, default=0),
                        "bitwise_same": int(same),
                        "goal_met": int(max(lost, default=0) <= GOAL_LOST_STEPS),
                    }
                )
            )
            return 0
        finally:
            hosts.stop()


if __name__ == "__main__":
    C.main_wrapper(main)
