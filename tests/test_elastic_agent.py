"""torchrun as every launcher runs it (ghostvis_core/run/elastic_agent.py): a rank that fails ends the node's
output with the rank's own error and one line naming it, not torchrun's trace; GHOSTVIS_DEBUG=1 keeps torchrun's
report; arguments and exit codes are torchrun's."""

from __future__ import annotations

import os
import subprocess
import sys

from ghostvis_core.launch.cluster.torchrun_command import AGENT_MODULE

RANK = """import os, sys
if os.environ["RANK"] == "1":
    print("error: shard web/00012: checksum mismatch; re-materialize raw_shards partition web/00012", file=sys.stderr)
    sys.exit(3)
print("rank", os.environ["RANK"], "done")
"""


def agent(tmp_path, script: str, *env: tuple[str, str]) -> subprocess.CompletedProcess:
    (tmp_path / "rank.py").write_text(script)
    cmd = [sys.executable, "-m", AGENT_MODULE, "--standalone", "--nproc_per_node=2", str(tmp_path / "rank.py")]
    outside = {k: v for k, v in os.environ.items() if k != "GHOSTVIS_DEBUG"}
    environ = {**outside, "OMP_NUM_THREADS": "1", **dict(env)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=environ, cwd=tmp_path)


def test_a_failed_rank_ends_with_its_error_and_one_line_naming_it(tmp_path):
    proc = agent(tmp_path, RANK)
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "Traceback" not in said and "ChildFailedError" not in said, said[-3000:]
    assert "error: shard web/00012: checksum mismatch" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("torchrun: ") and " rank 1 (local rank 1, pid " in last, last
    assert last.endswith("ended with exit code 3; its own error is above (GHOSTVIS_DEBUG=1 shows torchrun's report)")


def test_debug_keeps_torchruns_report_and_success_is_torchruns_exit_0(tmp_path):
    proc = agent(tmp_path, RANK, ("GHOSTVIS_DEBUG", "1"))
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ChildFailedError" in proc.stderr and "exitcode  : 3" in proc.stderr
    # each rank's line in one write: the two ranks share the node's stdout, and print's pieces interleaved once
    ok = agent(tmp_path, "import os; os.write(1, f\"rank {os.environ['RANK']} done\\n\".encode())\n")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert sorted(line for line in ok.stdout.splitlines() if line.startswith("rank")) == ["rank 0 done", "rank 1 done"]
