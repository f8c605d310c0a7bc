"""Under torchrun (env:// rendezvous, the user's own), layouts give the single-device result."""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_torchrun_two_ranks_sequence_parallel_and_tp():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HERE / "torchrun_worker.py"), "dp1-tp2-ep;dp2-tp1-ep;dp1-tp2-noep"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        ids = {r["id"].split("/")[0] for r in report["results"]}
        assert ids == {"dp1-tp2-ep", "dp2-tp1-ep", "dp1-tp2-noep"}, ids
        assert all(r["ok"] for r in report["results"]), report
