"""Under torchrun (env:// rendezvous, the user's own), layouts give the single-device result."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.slow  # 12 s on 2 cores; the run and failing-rank torchrun tests stay in `make test`
def test_torchrun_two_ranks_sequence_parallel_and_tp(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HERE / "torchrun_worker.py"), "dp1-tp2-ep;dp2-tp1-ep;dp1-tp2-noep", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        ids = {r["id"].split("/")[0] for r in report["results"]}
        assert ids == {"dp1-tp2-ep", "dp2-tp1-ep", "dp1-tp2-noep"}, ids
        assert all(r["ok"] for r in report["results"]), report


def test_moeshard_run_under_torchrun_matches_one_process(tmp_path):
    """`torchrun -m moeshard run` joins torchrun's world and writes what one process writes."""
    from safetensors.torch import load_file

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    common = ["run", "--random", "qwen2-57b-a14b", "--tokens", "9", "--seed", "3"]
    one = subprocess.run([sys.executable, "-m", "moeshard", *common, "--output", str(tmp_path / "one.safetensors")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    tr = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                         "-m", "moeshard", *common, "--dp", "1", "--tp", "2", "--ep",
                         "--output", str(tmp_path / "tr.safetensors")],
                        env=env, capture_output=True, text=True, timeout=300)
    assert tr.returncode == 0, tr.stdout[-2000:] + tr.stderr[-2000:]
    a = load_file(str(tmp_path / "one.safetensors"))["hidden_states"]
    b = load_file(str(tmp_path / "tr.safetensors"))["hidden_states"]
    assert a.shape == b.shape == (9, 128)
    assert (a - b).abs().max() < 1e-5


def test_a_failing_rank_under_torchrun_says_which_collectives_it_entered_last(tmp_path):
    """No parent diffs the ranks under torchrun: each rank's error line names its last
    collectives, so the two lines show where the ranks part."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    tr = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                         str(HERE / "torchrun_faulty_run.py"), "--random", "mixtral-8x7b", "--tokens", "6",
                         "--dp", "2", "--ep", "--backend", "all2all", "--dtype", "float32", "--timeout", "30"],
                        env=env, capture_output=True, text=True, timeout=300)
    assert tr.returncode != 0
    lines = [line for line in (tr.stdout + tr.stderr).splitlines() if "moeshard run: error:" in line]
    by_rank = {r: [line for line in lines if f"error: rank {r} raised" in line] for r in (0, 1)}
    (one,) = by_rank[1]
    assert "RuntimeError: planted: combine refuses on rank 1" in one, lines
    assert "its last collectives: " in one and "all_to_allv #3 (ep" in one and "< dispatch: returned" in one, one
    assert "all_to_allv #4" not in one, one  # rank 1 never entered the combine's all-to-all
    (zero,) = by_rank[0]
    assert "all_to_allv #4 (ep" in zero and "< combine: raised" in zero, zero  # rank 0 was inside it


# about 8 s on 2 cores (an interpreter start and a bounded connect); in make test, in-process:
# test_cli_errors.py::test_an_unreachable_torchrun_rendezvous_is_exactly_one_line
@pytest.mark.slow
def test_an_unreachable_torchrun_rendezvous_is_one_line_exit_5():
    """A torchrun environment whose MASTER_ADDR:MASTER_PORT answers nothing: the rendezvous fails
    within --timeout, as exit 5 with one line naming the address and the timeout: nothing else on
    stderr (torch's own C++ log lines about the socket are held back and dropped), no traceback."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]),
               RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    proc = subprocess.run([sys.executable, "-m", "moeshard", "run", "--random", "mixtral-8x7b", "--dp", "2", "--ep",
                           "--timeout", "2"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 5, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    last = lines[-1]
    assert last.startswith("moeshard run: error: rank 1: the torchrun rendezvous at MASTER_ADDR:MASTER_PORT=127.0.0.1:1 "
                           "did not complete within 2 s (--timeout)"), last


def test_the_command_ends_without_waiting_for_a_rendezvous_it_gave_up_on():
    """Edge case from a loaded machine: after the rendezvous timed out, its helper thread was still
    inside torch's C++ store client, and finalizing the interpreter around it aborted the process
    (exit 134 and a C++ backtrace after the error line) in 3 of 8 runs. ``cli.entry`` ends the
    process itself while such a thread lives, its output flushed. Here the thread never returns
    and is not a daemon: finalization would wait on it for ever, so the test fails by timeout
    unless the command ends the process itself, with the command's exit code and output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    script = ("import sys, threading, time\n"
              "from moeshard import cli\n"
              "from moeshard.parallel.torchrun import RENDEZVOUS_THREAD\n"
              "threading.Thread(target=time.sleep, args=(600,), name=RENDEZVOUS_THREAD).start()\n"
              "sys.argv = ['moeshard', 'backends']\n"
              "raise SystemExit(cli.entry())\n")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "all2all" in proc.stdout  # the table was flushed before the process ended


def test_torchrun_ranks_started_with_different_options_are_refused_naming_them(tmp_path):
    """Edge case from a review: two nodes started by hand with another --seed each computed on other
    inputs, and the run ended with exit 0 (its output 1.98 off the one-seed run's). Paths may
    differ from node to node; options may not."""
    import socket

    with socket.socket() as probe:  # a free port for the rendezvous rank 0 serves
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = []
    for rank, seed in ((0, "0"), (1, "1")):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, "-m", "moeshard", "run", "--random", "mixtral-8x7b", "--dp", "2",
                                       "--ep", "--tokens", "6", "--seed", seed, "--timeout", "60", "--output",
                                       str(tmp_path / f"out{rank}.safetensors")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=120)[1])
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, err) in enumerate(zip(procs, outs, strict=True)):
        assert proc.returncode == 2, err[-3000:]
        assert [line for line in err.splitlines() if line.strip()] == [
            f"moeshard run: error: rank {rank}: the ranks were started with different options: seed: rank 0=0, "
            f"rank 1=1"], err[-3000:]
    assert list(tmp_path.iterdir()) == []
