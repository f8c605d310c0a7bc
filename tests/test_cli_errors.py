"""Every expected failure of ``moeshard`` is one line naming the problem and the value, with the
exit code of ``moeshard.errors.ExitCode``; nothing is computed before a bad option is refused;
output files are checked first, written atomically and never one the run reads; ``--only``
takes every id ``--list`` prints; a run that verifies nothing fails.

In-process (``moeshard.cli.main``), except where ranks must start."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import faults
import procs
import pytest
import torch
from rich.console import Console
from safetensors.torch import save_file

from moeshard.cli import build_parser, main
from moeshard.commands.args import case_ids
from moeshard.commands.check import options
from moeshard.errors import ExitCode
from moeshard.harness import report
from moeshard.harness.cases import MatrixOptions, generate, select_ids
from moeshard.harness.runner import CaseOutcome
from moeshard.jobs.run import ROW_BLOCK, random_hidden_states
from moeshard.outputs import OutputError, atomic_write, atomic_write_text
from moeshard.parallel.spawn import LocalWorld, spawn
from moeshard.parallel.torchrun import RENDEZVOUS_THREAD

ROOT = Path(__file__).resolve().parents[1]


def error_line(capsys, command: str) -> str:
    """The one line the command printed on stderr (exactly one, no traceback)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"moeshard {command}: error: "), err
    return lines[0]


# -- exit codes --------------------------------------------------------------------------------
def test_exit_codes_are_distinct_and_documented():
    codes = [int(c) for c in ExitCode]
    assert len(set(codes)) == len(codes)
    doc = (ROOT / "docs" / "reliability.md").read_text()
    for code in ExitCode:
        assert re.search(rf"^\|\s*{int(code)}\s*\|", doc, re.M), f"exit code {int(code)} ({code.name}) is not documented"


# -- check: --only, nothing verified, layouts, options ------------------------------------------
def _listed(argv: list[str], capsys) -> list[str]:
    assert main(["check", "--list", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"\d+ of \d+ cases valid \(\d+ not applicable by construction\)", lines[-1]), lines[-1]
    return [line.split()[0] for line in lines[:-1]]


@pytest.mark.parametrize("filters", [[], ["--world-sizes", "2"], pytest.param(["--full"], marks=pytest.mark.slow),
                                     ["--layouts", "dp4-tp1-ep"],
                                     ["--world-sizes", "4", "--tokens-per-rank", "0,3,1,2", "--seed", "5"],
                                     ["--world-sizes", "1", "--dtypes", "fp32,bf16,fp16"]])
def test_only_takes_every_id_that_list_prints(filters, capsys):
    """Under any filters, the listed ids -- joined by commas, the way --only reads them -- select
    exactly those cases from the *default* matrix, with the listing's seeds and skip reasons."""
    listed = _listed(filters, capsys)
    args = build_parser().parse_args(["check", *filters])
    opts = options(args)
    want = {c.id: c for c in generate(opts)}
    got = select_ids(generate(MatrixOptions(seed=opts.seed)), list(case_ids([",".join(listed)])), opts.seed)
    assert [c.id for c in got] == listed
    assert all(c == want[c.id] and c.seed == want[c.id].seed for c in got)


def test_dtype_aliases_list_as_case_ids_spell_them_and_once(capsys):
    """``--dtypes fp32`` listed ids with ``fp32`` that ``--only`` refused, and ``fp32,float32`` ran
    every case twice under two ids."""
    aliases = _listed(["--world-sizes", "1", "--dtypes", "fp32,float32,bf16"], capsys)
    assert aliases == _listed(["--world-sizes", "1", "--dtypes", "float32,bfloat16"], capsys)
    assert all("/fp32/" not in i and "/bf16/" not in i for i in aliases)


def test_only_is_repeatable_and_takes_spaces(capsys):
    ids = [i for i in _listed(["--world-sizes", "2"], capsys) if "," in i][:3]
    assert main(["check", "--list", "--only", ids[0], "--only", f"{ids[1]} {ids[2]}"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[:-1]] == ids
    assert main(["check", "--only", "dp2-tp1-ep/all2all/none/float32/mixtral-8x7b/t1"]) == 2
    assert "must give 2 token counts" in error_line(capsys, "check")


def test_list_never_wraps_a_long_id(capsys, monkeypatch):
    """A long preset name makes id + reason longer than the console: --list still prints each
    case on one line, and every id it prints is taken back by --only (a wrapped line once split
    an id at its token counts)."""
    from dataclasses import replace

    from moeshard.presets import PRESETS
    name = "a-preset-name-long-enough-to-push-the-line-past-the-console-width-3.0-a800m"
    monkeypatch.setitem(PRESETS, name, replace(PRESETS["mixtral-8x7b"], name=name))
    ids = _listed(["--presets", name, "--full"], capsys)
    assert ids and all(name in i for i in ids)
    for i in ids[:40]:
        assert _listed(["--only", i], capsys) == [i]


def test_readme_only_example_is_in_the_default_matrix(capsys):
    text = (ROOT / "README.md").read_text()
    example = re.search(r"moeshard check --only '([^']+)'", text).group(1)
    assert "," in example  # two DP ranks: the case that could not be selected before
    default = {c.id: c for c in generate(MatrixOptions())}
    assert example in default and not default[example].skipped
    assert _listed(["--only", example], capsys) == [example]


def test_a_run_with_no_valid_case_fails_with_exit_3(capsys):
    assert main(["check", "--world-sizes", "1", "--backends", "all2all"]) == 3
    # 11 quant configs (5 schemes, 4 deferred, 2 with quantized shared experts) x 2 dtypes
    assert "nothing to verify: 0 of 22 selected cases are valid" in error_line(capsys, "check")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA devices")
def test_check_cuda_without_gpu_fails_with_exit_3(capsys):
    start = time.monotonic()
    assert main(["check", "--device", "cuda"]) == 3
    assert "--device cuda: no CUDA device is visible" in error_line(capsys, "check")
    assert time.monotonic() - start < 10


def test_a_run_where_every_case_was_skipped_here_fails_with_exit_3(capsys, monkeypatch):
    """One GPU, only world-size-2 cases: every valid case is skipped at run time; nothing verified."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["check", "--device", "cuda", "--world-sizes", "2", "--quants", "none"]) == 3
    assert "nothing was verified: every case was skipped on this machine (world size 2 needs 2 GPUs" in \
        capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--world-sizes", "1", "--layouts", "dp2-tp1-ep"],
     "--layouts: dp2-tp1-ep has world size 2, which --world-sizes 1 leaves out"),
    (["--world-sizes", "1", "--layouts", "dp3-tp1-noep"], "--layouts: dp3-tp1-noep has world size 3; moeshard check runs"),
    (["--layouts", "dp1-tp3-noep"], "--layouts: dp1-tp3-noep has world size 3"),
    (["--timeout", "inf"], "--timeout: must be a finite number in (0, 604800], got inf"),
    (["--timeout", "nan"], "--timeout: must be a finite number"),
    (["--timeout", "0"], "--timeout: must be a finite number"),
    (["--seed", "-1"], "--seed: must be an integer in [0, 9223372036854775806], got -1"),
    (["--tokens-per-rank", "999999", "--world-sizes", "1"], "--tokens-per-rank: counts must be in [0, 65536]"),
    (["--tokens-per-rank", "99999999999999999999999", "--world-sizes", "1"],
     "--tokens-per-rank: 99999999999999999999999 is larger"),
    (["--dtypes", "int8"], "--dtypes: dtype: 'int8' is not one of"),
])
def test_check_option_refusals_are_one_line_exit_2(argv, message, capsys):
    assert main(["check", *argv]) == 2
    assert message in error_line(capsys, "check")


def test_check_memory_is_estimated_before_running(capsys, monkeypatch):
    from moeshard.commands import check as check_command

    monkeypatch.setattr(check_command, "available_memory", lambda: 4 * 2**30)
    start = time.monotonic()  # full-size presets on CPU ranks: DeepSeek-V3's would make 45 GB of weights a rank
    assert main(["check", "--size", "full", "--world-sizes", "1,2"]) == 2
    line = error_line(capsys, "check")
    assert time.monotonic() - start < 10
    needs = re.search(r"case \S+@full/\S+ needs about ([\d.]+) GiB of memory on its \d rank\(s\) but 4\.0 GiB is", line)
    assert needs and float(needs.group(1)) > 4, line


# -- output files ------------------------------------------------------------------------------
@pytest.mark.parametrize("where, message", [
    (lambda tmp: tmp, "is a directory"),
    (lambda tmp: tmp / "missing" / "out.json", "does not exist"),
    (lambda tmp: Path("/proc/moeshard/out.json"), "does not exist"),
    (lambda tmp: Path("/proc/moeshard-out.json"), "cannot create a file in directory '/proc'"),
    (lambda tmp: Path("/dev/null"), "is not a regular file"),
])
def test_check_json_path_is_refused_before_running(tmp_path, where, message, capsys):
    start = time.monotonic()
    assert main(["check", "--world-sizes", "1,2", "--json", str(where(tmp_path))]) == 2
    assert message in error_line(capsys, "check")
    assert time.monotonic() - start < 10  # refused before any case ran


def _tiny_checkpoint(path: Path) -> Path:
    path.mkdir()
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0.mlp."
    save_file({p + "gate.weight": torch.randn(4, 16, generator=g),
               p + "experts.gate_up_proj": torch.randn(4, 64, 16, generator=g) / 4,
               p + "experts.down_proj": torch.randn(4, 16, 32, generator=g) / 6}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_hidden_layers": 1, "hidden_size": 16, "moe_intermediate_size": 32,
        "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True}))
    save_file({"hidden_states": torch.randn(5, 16, generator=g)}, str(path / "in.safetensors"))
    return path


@pytest.mark.parametrize("target", ["in.safetensors", "model.safetensors", "config.json", "link-to-input"])
def test_run_never_overwrites_a_file_it_reads(tmp_path, target, capsys):
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    (tmp_path / "link-to-input").symlink_to(ckpt / "in.safetensors")
    before = {f: f.read_bytes() for f in ckpt.iterdir()}
    out = tmp_path / target if target.startswith("link") else ckpt / target
    code = main(["run", "--model", str(ckpt), "--layer", "0", "--input", str(ckpt / "in.safetensors"),
                 "--output", str(out)])
    assert code == 2
    assert "a file this run reads; moeshard never overwrites its own input" in error_line(capsys, "run")
    assert {f: f.read_bytes() for f in ckpt.iterdir()} == before


def test_run_output_written_atomically_and_a_full_disk_is_exit_6(tmp_path, capsys, monkeypatch):
    import safetensors.torch as st

    out = tmp_path / "out.safetensors"
    argv = ["run", "--random", "mixtral-8x7b", "--tokens", "3", "--output", str(out)]
    assert main(argv) == 0
    first = out.read_bytes()
    real_save = st.save_file

    def disk_full(tensors, path, metadata=None):
        real_save(tensors, path, metadata=metadata)
        with open(path, "r+b") as f:
            f.truncate(100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(st, "save_file", disk_full)
    assert main([*argv[:-2], "--seed", "1", "--output", str(out)]) == 6
    assert f"cannot write '{out}': No space left on device" in error_line(capsys, "run")
    assert out.read_bytes() == first and sorted(tmp_path.iterdir()) == [out]  # old file kept, no temporary left

    def silently_short(tensors, path, metadata=None):  # a writer that loses data without saying so
        real_save(tensors, path, metadata=metadata)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 8)

    monkeypatch.setattr(st, "save_file", silently_short)
    assert main([*argv[:-2], "--seed", "1", "--output", str(out)]) == 6
    assert "the file written is incomplete" in error_line(capsys, "run")
    assert out.read_bytes() == first and sorted(tmp_path.iterdir()) == [out]


def test_check_json_full_disk_is_exit_6(tmp_path, capsys, monkeypatch):
    import moeshard.outputs as outputs

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(outputs.os, "fsync", no_space)
    path = tmp_path / "check.json"
    assert main(["check", "--world-sizes", "1", "--quants", "none", "--dtypes", "float32", "--json", str(path)]) == 6
    assert "No space left on device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_keeps_the_old_file_on_any_failure(tmp_path):
    path = tmp_path / "f.txt"
    atomic_write_text(path, "old")
    os.chmod(path, 0o640)
    atomic_write_text(path, "new")
    assert path.read_text() == "new" and path.stat().st_mode & 0o777 == 0o640

    def interrupted(tmp):
        Path(tmp).write_text("half")
        raise KeyboardInterrupt

    link = tmp_path / "link.txt"
    link.symlink_to(path)
    atomic_write_text(link, "through the link")
    assert link.is_symlink() and path.read_text() == "through the link"
    link.unlink()
    atomic_write_text(path, "new")
    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, interrupted)
    with pytest.raises(OutputError, match="cannot write"):
        atomic_write(path, lambda tmp: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    assert path.read_text() == "new" and sorted(tmp_path.iterdir()) == [path]


def test_bench_output_paths_are_checked_first(tmp_path, capsys):
    assert main(["bench", "--json", str(tmp_path)]) == 2
    assert "--json" in error_line(capsys, "bench")


# -- run: bounds, seeds, timeouts, torchrun ----------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--tokens", str(10**9)], "this run needs about"),
    (["--tokens", str(10**30)], "--tokens must be an integer in [0, 2147483647]"),
    (["--dp", "1000"], "world_size=1000 local CPU ranks is more than this machine can run"),
    (["--dp", str(10**12)], "ParallelConfig.dp: must be at most 2147483647"),
    (["--seed", str(2**70)], "--seed: must be an integer in [0, 9223372036854775806]"),
    (["--seed", "-3"], "--seed: must be an integer in [0, 9223372036854775806], got -3"),
    (["--timeout", "inf"], "--timeout: must be a finite number in (0, 604800], got inf"),
    (["--output", "/proc/nowhere/out.safetensors"], "does not exist"),
    (["--layer", "7"], "--layer 7 picks a decoder layer of --model; --random mixtral-8x7b is one random MoE block"),
])
def test_run_refusals_are_one_line_before_anything_starts(argv, message, capsys):
    start = time.monotonic()
    assert main(["run", "--random", "mixtral-8x7b", *argv]) == 2
    assert message in error_line(capsys, "run")
    assert time.monotonic() - start < 10


def test_run_memory_is_estimated_before_allocating(capsys, monkeypatch):
    from moeshard.commands import run as run_command

    monkeypatch.setattr(run_command, "available_memory", lambda: 8 * 2**30)
    start = time.monotonic()
    assert main(["run", "--random", "deepseek-v3", "--full"]) == 2  # every rank would make 45 GB of weights
    assert "GiB of memory" in error_line(capsys, "run") and time.monotonic() - start < 10


def test_each_rank_generates_only_its_rows():
    full = random_hidden_states(2 * ROW_BLOCK + 5, 8, 3, torch.float32)
    for start, stop in [(0, 1), (ROW_BLOCK - 2, ROW_BLOCK + 3), (2 * ROW_BLOCK, 2 * ROW_BLOCK + 5), (7, 7)]:
        assert torch.equal(random_hidden_states(2 * ROW_BLOCK + 5, 8, 3, torch.float32, start, stop), full[start:stop])
    t0 = time.monotonic()  # 10^9 rows of 4096 would be 16 TB: only the block holding the slice is made
    rows = random_hidden_states(10**9, 4096, 0, torch.bfloat16, 5 * 10**8, 5 * 10**8 + 3)
    assert rows.shape == (3, 4096) and time.monotonic() - t0 < 10


def test_stale_rank_variables_do_not_switch_to_torchrun(capsys, monkeypatch):
    for name in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["run", "--random", "mixtral-8x7b"]) == 2
    assert "the environment sets RANK, WORLD_SIZE but not LOCAL_RANK, MASTER_ADDR, MASTER_PORT" in \
        error_line(capsys, "run")


def test_timeout_is_honoured_under_torchrun(capsys, monkeypatch):
    from moeshard.commands import run as run_command

    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    seen = {}

    def fake_init(backend=None, timeout_s=None):
        seen["timeout_s"] = timeout_s
        raise ValueError("stopped by the test")

    monkeypatch.setattr(run_command, "init_from_env", fake_init)
    assert main(["run", "--random", "mixtral-8x7b", "--timeout", "7.5"]) == 2
    assert seen == {"timeout_s": 7.5}


def _stderr_after_abandoned_rendezvous(capfd) -> list[str]:
    """The non-empty lines of the standard error once the rendezvous that the command gave up on
    has ended. In this process that rendezvous goes on inside torch's C++ store client on its
    helper thread after ``main`` returns, and logs its own failure there when it ends, whenever
    that is (the ``moeshard`` command ends the process first: ``cli.entry``, test_torchrun.py's
    subprocess cases). Waiting for it here keeps those lines out of the tests that run next in
    this process; the caller tells them from the command's by their place after its line."""
    for thread in threading.enumerate():
        if thread.name == RENDEZVOUS_THREAD:
            thread.join(60)
            assert not thread.is_alive(), "torch's store client never gave up"
    return [line for line in capfd.readouterr().err.splitlines() if line.strip()]


def test_an_unreachable_torchrun_rendezvous_is_exactly_one_line(capfd, monkeypatch):
    """In this process (the fast sibling of test_torchrun.py's subprocess case): nothing on the
    standard error but the one line, torch's C++ socket log lines included (they go to file
    descriptor 2 directly, so capfd sees them); what the abandoned rendezvous logs after the
    command returned comes after that line (``_stderr_after_abandoned_rendezvous``)."""
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    assert main(["run", "--random", "mixtral-8x7b", "--dp", "2", "--ep", "--timeout", "0.5"]) == 5
    assert time.monotonic() - start < 30
    lines = _stderr_after_abandoned_rendezvous(capfd)
    assert lines[0].startswith("moeshard run: error: rank 1: the torchrun rendezvous at MASTER_ADDR:MASTER_PORT="
                               "127.0.0.1:1 did not complete within 0.5 s (--timeout)"), lines
    assert not [line for line in lines[1:] if line.startswith("moeshard")], lines


@contextlib.contextmanager
def _silent_listener():
    """A port on 127.0.0.1 that accepts connections and never answers (a stray server, a
    firewall's black hole); yields (port, an Event set once a connection was accepted)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop, accepted = threading.Event(), threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])
                accepted.set()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


def _torchrun_env(monkeypatch, rank: int, port) -> None:
    for name, value in (("RANK", str(rank)), ("WORLD_SIZE", "2"), ("LOCAL_RANK", str(rank)),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)


def test_a_rendezvous_that_accepts_and_never_answers_ends_within_the_timeout(capfd, monkeypatch):
    """Edge case from a review: torch's own bound did not hold for a port that accepts and never
    answers, and the run waited as long as the listener lived (190 s with --timeout 5)."""
    with _silent_listener() as (port, _):
        _torchrun_env(monkeypatch, 1, port)
        start = time.monotonic()
        assert main(["run", "--random", "mixtral-8x7b", "--dp", "2", "--ep", "--timeout", "1"]) == 5
        assert time.monotonic() - start < 10
    # Closing the listener ends the abandoned rendezvous; it logs the reset connection after the
    # command's line (``_stderr_after_abandoned_rendezvous``).
    lines = _stderr_after_abandoned_rendezvous(capfd)
    assert lines[0] == (f"moeshard run: error: rank 1: the torchrun rendezvous at MASTER_ADDR:MASTER_PORT=127.0.0.1:"
                        f"{port} did not complete within 1 s (--timeout)"), lines
    assert not [line for line in lines[1:] if line.startswith("moeshard")], lines


@pytest.mark.parametrize("signum, code, line", [(signal.SIGTERM, 143, "moeshard run: terminated by SIGTERM"),
                                                 (signal.SIGINT, 130, "moeshard run: interrupted")])
def test_a_signal_while_the_rendezvous_waits_ends_the_run_at_once(signum, code, line):
    """Edge case from a review: a signal that came while torch's rendezvous waited in C++ was
    answered only when the wait gave up (150 s with --timeout 60), after 38 lines of torch's log."""
    with _silent_listener() as (port, accepted):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent / "src"),
                                                            os.environ.get("PYTHONPATH", "")]),
                   RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        # SIGINT at its default in the command, as a terminal's would be, even where the suite runs
        # in the background of a shell, which starts it with SIGINT ignored.
        proc = subprocess.Popen([sys.executable, "-m", "moeshard", "run", "--random", "mixtral-8x7b", "--dp", "2",
                                 "--ep", "--timeout", "120"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=procs.default_sigint)
        try:
            assert accepted.wait(60), "the rank never reached the rendezvous"
            start = time.monotonic()
            proc.send_signal(signum)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert time.monotonic() - start < 10
    assert proc.returncode == code, err[-3000:]
    assert [x for x in err.splitlines() if x.strip()] == [line], err[-3000:]


@pytest.mark.parametrize("port", ["abc", "99999", "0", " "])
def test_a_bad_master_port_is_refused_naming_it_and_the_rank(capsys, monkeypatch, port):
    _torchrun_env(monkeypatch, 1, port)
    assert main(["run", "--random", "mixtral-8x7b", "--dp", "2", "--ep", "--timeout", "5"]) == 2
    err = capsys.readouterr().err
    assert f"error: init_from_env (rank 1): MASTER_PORT must be a port number in [1, 65535] (as torchrun sets it), " \
           f"got {port!r}" in err, err


@pytest.mark.parametrize("rank,world,local", [(5, "2", "0"), (-1, "2", "0"), (0, "0", "0"), (1, "2", "-1")])
def test_a_rank_outside_its_world_is_refused_not_waited_for(capsys, monkeypatch, rank, world, local):
    """A RANK outside [0, WORLD_SIZE) waited out the whole rendezvous timeout (exit 5) for peers
    that could never come; WORLD_SIZE=0 ended in torch's own text, naming no variable."""
    _torchrun_env(monkeypatch, rank, 29611)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("LOCAL_RANK", local)
    start = time.monotonic()
    assert main(["run", "--random", "mixtral-8x7b", "--tokens", "4", "--timeout", "30"]) == 2
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert (f"error: init_from_env (rank {rank}): the environment needs WORLD_SIZE >= 1, 0 <= RANK < WORLD_SIZE and "
            f"LOCAL_RANK >= 0 (as torchrun sets them), got RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local}") in err, err


def test_a_master_port_in_use_on_rank_0_is_a_refusal_not_a_timeout(capfd, monkeypatch):
    """Rank 0 serves the rendezvous: a port another process holds fails at once (EADDRINUSE), a
    setting to change (exit 2), not a wait that ran out (exit 5)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        _torchrun_env(monkeypatch, 0, port)
        assert main(["run", "--random", "mixtral-8x7b", "--dp", "2", "--ep", "--timeout", "20"]) == 2
    finally:
        taken.close()
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"moeshard run: error: rank 0: the torchrun rendezvous cannot listen at "
                     f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}: the port is in use (EADDRINUSE); choose a free "
                     f"MASTER_PORT"], err


def test_infinite_timeouts_are_refused_by_the_api():
    with pytest.raises(ValueError, match="LocalWorld.timeout_s: must be a finite number"):
        LocalWorld(2, timeout_s=float("inf"))
    with pytest.raises(ValueError, match="spawn.timeout_s: must be a finite number"):
        spawn(faults.sleep_forever, 2, timeout_s=float("nan"))
    with pytest.raises(ValueError, match="LocalWorld: world_size=100000 local CPU ranks"):
        LocalWorld(100_000)


# -- ranks that fail, die or time out in moeshard run -------------------------------------------
def test_run_rank_unexpected_error_is_one_line_exit_4(capsys, monkeypatch):
    import moeshard.jobs.run as runjob

    def no_memory(plan, rank):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(runjob, "_load", no_memory)
    assert main(["run", "--random", "mixtral-8x7b"]) == 4
    line = error_line(capsys, "run")
    assert "rank 0: [enforce fail at alloc_cpu.cpp:127] err == 0." in line and "RuntimeError" in line


@pytest.mark.slow  # 8 s on 2 cores; spawned-world timeouts are exit 5 in test_tiny_timeouts_... too
def test_run_rank_timeout_is_one_line_exit_5(capsys, monkeypatch):
    from moeshard.commands import run as run_command

    monkeypatch.setattr(run_command, "_execute_local",
                        lambda plan, timeout_s: spawn(faults.sleep_forever, 2, timeout_s=timeout_s))
    start = time.monotonic()
    assert main(["run", "--random", "mixtral-8x7b", "--dp", "2", "--timeout", "8"]) == 5
    assert "ranks [0, 1] did not finish within 8 s" in error_line(capsys, "run")
    assert time.monotonic() - start < 60


# -- foreign text is never markup ---------------------------------------------------------------
def test_reasons_are_printed_verbatim_never_as_markup():
    case = generate(MatrixOptions(world_sizes=(1,), quants=("none",), dtypes=("float32",)))[0]
    reason = ("rank 0 raised RuntimeError: [/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
              "closed by peer [127.0.0.1]:2472; [enforce fail at alloc_cpu.cpp:127] [bold]not bold[/] [/] \\")
    outcomes = [CaseOutcome(case, "error", reason), CaseOutcome(case, "skip", "[red]skip reason[/red]")]
    buffer = io.StringIO()
    console = Console(file=buffer, width=400, force_terminal=False)
    report.print_table(console, outcomes)
    report.print_summary_table(console, outcomes)
    report.print_skips(console, outcomes)
    report.print_problems(console, outcomes)
    report.print_summary(console, outcomes, 1.0, "cpu")
    text = buffer.getvalue()
    assert reason in text and "[red]skip reason[/red]" in text


# -- one table of bad paths, sizes and timeouts, for every command -----------------------------
def _gen_model(tmp: Path) -> Path:
    """A directory generate and train accept as far as their options are checked (they are refused first)."""
    return _tiny_checkpoint(tmp / "gen-model")


# Each command: its argv with the output flag last, so that a bad path can be appended.
COMMANDS = {
    "run": lambda tmp: ["run", "--random", "mixtral-8x7b", "--output"],
    "check": lambda tmp: ["check", "--world-sizes", "1", "--quants", "none", "--json"],
    "generate": lambda tmp: ["generate", "--model", str(_gen_model(tmp)), "--input-ids", "1,2", "--output"],
    "train": lambda tmp: ["train", "--model", str(_gen_model(tmp)), "--input-ids", "1,2", "--output"],
    "eplb": lambda tmp: ["eplb", "--tokens", "8", "--json"],
    "bench": lambda tmp: ["bench", "--world-size", "2", "--device", "cpu", "--size", "small", "--json"],
}
BAD_PATHS = {
    "empty": (lambda tmp: "", "expected a file path, got ''"),
    "directory": (lambda tmp: str(tmp), "is a directory"),
    "trailing slash": (lambda tmp: str(tmp / "new") + "/", "names a directory"),
    "missing parent": (lambda tmp: str(tmp / "missing" / "out.json"), "does not exist"),
    "char device /dev/full": (lambda tmp: "/dev/full", "is not a regular file"),
    "char device /dev/null": (lambda tmp: "/dev/null", "is not a regular file"),
    "name too long": (lambda tmp: str(tmp / ("x" * 300)), "the file name is 300 bytes"),
    "unwritable directory": (lambda tmp: "/proc/moeshard-out.json", "cannot create a file in directory '/proc'"),
}


@pytest.mark.parametrize("bad", list(BAD_PATHS))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_refuses_every_bad_output_path_first(command, bad, tmp_path, capsys):
    if command == "bench" and bad == "missing parent":  # bench makes its output directories
        pytest.skip("bench --json creates its directory")
    path, message = BAD_PATHS[bad]
    before = os.stat("/dev/full").st_mode
    start = time.monotonic()
    assert main([*COMMANDS[command](tmp_path), path(tmp_path)]) == 2
    line = error_line(capsys, command)
    assert message in line and ("--json" in line or "--output" in line), line
    assert time.monotonic() - start < 10  # refused before any work
    assert os.stat("/dev/full").st_mode == before  # the device is still a device


BAD_NUMBERS = {
    "timeout nan": (["--timeout", "nan"], "--timeout: must be a finite number"),
    "timeout inf": (["--timeout", "inf"], "--timeout: must be a finite number"),
    "timeout -1": (["--timeout", "-1"], "--timeout: must be a finite number"),
    "timeout 0": (["--timeout", "0"], "--timeout: must be a finite number"),
    "seed -1": (["--seed", "-1"], "--seed: must be an integer in [0, 9223372036854775806], got -1"),
}
NUMBER_COMMANDS = {
    "run": ["run", "--random", "mixtral-8x7b", "--dp", "2"],
    "check": ["check", "--world-sizes", "1,2"],
    "eplb": ["eplb", "--layer", "--device", "cpu"],
    "bench": ["bench", "--world-size", "2", "--device", "cpu", "--size", "small"],
}


@pytest.mark.parametrize("bad", list(BAD_NUMBERS))
@pytest.mark.parametrize("command", list(NUMBER_COMMANDS))
def test_every_command_refuses_bad_timeouts_and_seeds_by_their_flag(command, bad, capsys):
    argv, message = BAD_NUMBERS[bad]
    assert main([*NUMBER_COMMANDS[command], *argv]) == 2
    assert message in error_line(capsys, command)


@pytest.mark.parametrize("argv, message", [
    (["eplb", "--layer", "--device", "cpu", "--policies", "greedy", "--zipf", "3.0", "--experts", "99"],
     "--layer does not read --experts, --zipf, --policies; --experts is for the trace (without --layer)"),
    (["eplb", "--world-size", "4", "--quant", "fp8_block", "--policy", "greedy"],
     "the trace (without --layer) does not read --world-size, --policy, --quant; --world-size is for --layer"),
    (["eplb", "--timeout", "1", "--reps", "3", "--device", "cpu"],
     "the trace (without --layer) does not read --device, --reps, --timeout"),
])
def test_eplb_refuses_a_flag_its_mode_would_ignore(argv, message, capsys):
    """The trace and ``--layer`` read different flags: one given to the other mode was ignored
    (``--layer --policies greedy`` reported the hierarchical policy, exit 0)."""
    assert main(argv) == 2
    assert message in error_line(capsys, "eplb")


def test_check_list_refuses_the_flags_of_a_run(capsys, tmp_path):
    """``--list`` runs nothing: ``--json`` (no file was written, exit 0), ``--explain`` and
    ``--timeout`` with it are refused, naming them."""
    assert main(["check", "--list", "--json", str(tmp_path / "l.json"), "--explain"]) == 2
    assert "--list does not read --json, --explain; --json is for a run (without --list)" in error_line(capsys, "check")
    assert not (tmp_path / "l.json").exists()


@pytest.mark.parametrize("command", ["bench", "eplb", "check"])
def test_the_mode_flag_tables_hold_the_parsers_defaults(command):
    """A flag's default in its command's mode table is the parser's, so a flag left alone is
    never refused and one given a value always is."""
    import importlib

    module = importlib.import_module(f"moeshard.commands.{command}")
    args = build_parser().parse_args([command])
    for flag, attr, default, _ in module._MODE_FLAGS:
        assert getattr(args, attr) == default, (command, flag, getattr(args, attr), default)


@pytest.mark.parametrize("argv, message", [
    (["eplb", "--tokens", "100000000"], "the trace of 8 steps x 8 ranks x 100000000 tokens (--tokens) needs about"),
    (["eplb", "--layer", "--device", "cpu", "--tokens", "100000000"], "--layer with 100000000 --tokens per rank"),
    (["eplb", "--tokens", str(10**12)], "--tokens: must be at most 2147483647"),
    (["eplb", "--reps", "-1", "--layer", "--device", "cpu"], "--reps: must be a positive integer, got -1"),
    (["eplb", "--layer", "--device", "cpu", "--world-size", "3"], "has 16 experts, which do not divide over 3 ranks"),
    (["bench", "--reps", "-1", "--world-size", "2", "--device", "cpu"], "--reps: must be a positive integer, got -1"),
    (["bench", "--world-size", "3", "--device", "cpu", "--size", "small"],
     "--world-size 3: run 'EP3 allgather_reducescatter' of qwen3-30b-a3b (small)"),
    (["bench", "--world-size", "2", "--device", "cpu", "--size", "small", "--prefill-tokens", "100000000"],
     "GiB of memory"),
    (["run", "--random", "mixtral-8x7b", "--tokens", str(10**9)], "this run needs about"),
    (["check", "--world-sizes", ""], "--world-sizes '': no world size given"),
    (["check", "--eplb", "--no-eplb"], "--eplb and --no-eplb contradict each other"),
])
def test_sizes_are_bounded_up_front_with_the_numbers(argv, message, capsys):
    start = time.monotonic()
    assert main(argv) == 2
    assert message in error_line(capsys, argv[0])
    assert time.monotonic() - start < 10


def test_eplb_writes_its_json_atomically_and_the_readme_layer_command_is_valid(tmp_path, capsys):
    from moeshard.bench.eplb_layer import LayerOptions

    # The README's `moeshard eplb --layer --device cpu --world-size 2`: its default slots fit.
    assert LayerOptions(device="cpu", size="small", world_size=2).redundant_per_rank == (0, 2, 8)
    user = tmp_path / "out.json.tmp"  # the name a fixed temporary name would have clobbered
    user.write_text("mine")
    out = tmp_path / "out.json"
    assert main(["eplb", "--tokens", "16", "--ranks", "2", "--experts", "8", "--top-k", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"] and user.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "out.json.tmp"]


def _strict(path: Path):
    """The JSON of ``path``, failing on a NaN / Infinity token (not JSON)."""
    return json.loads(path.read_text(), parse_constant=lambda token: pytest.fail(f"{token} in {path}"))


def test_nonfinite_figures_are_exit_7_or_null_with_their_reason(tmp_path, capsys, monkeypatch):
    """eplb (and bench, through the same refuse_nonfinite) refuse a NaN figure, a broken result:
    exit 7, nothing written; --allow-nonfinite writes strict JSON, the figure null and named under
    "nonfinite". check's JSON writes a case's infinite error (part of its verdict) as null too."""
    import moeshard.eplb.trace as trace

    monkeypatch.setattr(trace, "balancedness", lambda loads: float("nan"))  # a broken computation
    out = tmp_path / "eplb.json"
    argv = ["eplb", "--tokens", "16", "--ranks", "2", "--experts", "8", "--top-k", "2", "--redundant-per-rank", "0,1",
            "--policies", "greedy", "--json", str(out)]
    assert main(argv) == 7
    assert ("the eplb figures hold 2 NaN/Inf value(s) (rows[0].model_balancedness = NaN, rows[1].model_balancedness "
            "= NaN): a broken result, nothing written") in error_line(capsys, "eplb")
    assert not out.exists()
    assert main([*argv, "--allow-nonfinite"]) == 0
    doc = _strict(out)
    assert doc["rows"][0]["model_balancedness"] is None and doc["rows"][0]["balancedness"] is not None
    assert doc["nonfinite"] == [{"field": f"rows[{i}].model_balancedness", "value": "NaN"} for i in (0, 1)]

    case = generate(MatrixOptions(world_sizes=(1,), quants=("none",), dtypes=("float32",)))[0]
    report.write_json(str(tmp_path / "check.json"), [CaseOutcome(case, "fail", "rank 0 returned shape (3,)",
                                                                 max_abs_err=float("inf"))], 1.0, "cpu")
    doc = _strict(tmp_path / "check.json")
    assert doc["cases"][0]["max_abs_err"] is None
    assert doc["nonfinite"] == [{"field": "cases[0].max_abs_err", "value": "Infinity"}]


def test_input_paths_that_cannot_be_read_are_one_line(tmp_path, capsys, monkeypatch):
    import moeshard.outputs as outputs

    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    assert main(["run", "--model", str(tmp_path / "none"), "--layer", "0"]) == 2
    assert "--model '" in error_line(capsys, "run")
    assert main(["run", "--model", str(ckpt / "config.json"), "--layer", "0"]) == 2
    assert "is not a directory" in error_line(capsys, "run")
    assert main(["run", "--model", str(ckpt), "--layer", "0", "--input", str(ckpt)]) == 2
    assert "--input '" in error_line(capsys, "run") and "is a directory" in capsys.readouterr().err + "is a directory"
    # Mode 000 / 111 (root reads them anyway, so the permission answer is planted).
    real_access = os.access
    monkeypatch.setattr(outputs.os, "access", lambda p, mode: False if Path(p) == ckpt else real_access(p, mode))
    assert main(["run", "--model", str(ckpt), "--layer", "0"]) == 2
    assert "cannot be read: Permission denied (a directory needs read and search permission)" in \
        error_line(capsys, "run")
    monkeypatch.setattr(outputs.os, "access",
                        lambda p, mode: False if Path(p).name == "in.safetensors" else real_access(p, mode))
    assert main(["run", "--model", str(ckpt), "--layer", "0", "--input", str(ckpt / "in.safetensors")]) == 2
    assert "--input '" in (line := error_line(capsys, "run")) and "cannot be read: Permission denied" in line


def test_a_refused_standard_output_is_one_line_exit_6(capsys, monkeypatch):
    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("sys.stdout", Full())
    assert main(["check", "--list", "--world-sizes", "1"]) == 6
    assert "cannot write the standard output: No space left on device" in error_line(capsys, "check")


def test_run_output_safetensors_error_is_exit_6(tmp_path, capsys, monkeypatch):
    import safetensors.torch as st
    from safetensors import SafetensorError

    def full(tensors, path, metadata=None):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(st, "save_file", full)
    out = tmp_path / "out.safetensors"
    assert main(["run", "--random", "mixtral-8x7b", "--tokens", "3", "--output", str(out)]) == 6
    assert f"cannot write '{out}'" in error_line(capsys, "run") and list(tmp_path.iterdir()) == []


def test_run_refuses_nonfinite_output_and_conflicting_tokens(tmp_path, capsys, monkeypatch):
    import moeshard.jobs.run as runjob

    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    argv = ["run", "--model", str(ckpt), "--layer", "0", "--input", str(ckpt / "in.safetensors")]
    assert main([*argv, "--tokens", "5"]) == 2
    assert "--tokens 5 conflicts with --input" in error_line(capsys, "run")
    assert main(["run", "--random", "mixtral-8x7b", "--tokens-per-rank", "2,1", "--dp", "2", "--tokens", "16"]) == 2
    assert "but --tokens asks for T=16 tokens" in error_line(capsys, "run")
    real = runjob.read_input_rows
    monkeypatch.setattr(runjob, "read_input_rows", lambda *a: real(*a) * float("nan"))
    out = tmp_path / "out.safetensors"
    assert main([*argv, "--output", str(out)]) == 7
    assert "the output holds 80 NaN/Inf value(s) of 80" in error_line(capsys, "run") and not out.exists()
    assert main([*argv, "--output", str(out), "--allow-nonfinite"]) == 0 and out.exists()


def test_a_checkpoint_with_fused_and_per_expert_copies_is_refused(tmp_path, capsys):
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    g = torch.Generator().manual_seed(1)
    p = "model.layers.0.mlp.experts."
    from safetensors import safe_open
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    # both copies in the file that is read (a file beside model.safetensors would be ignored)
    tensors.update({f"{p}{e}.{n}.weight": torch.randn(*shape, generator=g) for e in range(4)
                    for n, shape in (("gate_proj", (32, 16)), ("up_proj", (32, 16)), ("down_proj", (16, 32)))})
    save_file(tensors, str(ckpt / "model.safetensors"))
    assert main(["run", "--model", str(ckpt), "--layer", "0", "--input", str(ckpt / "in.safetensors")]) == 2
    assert "holds the routed experts twice, fused" in error_line(capsys, "run")


def test_only_dedupes_a_repeated_id(capsys):
    listed = _listed(["--world-sizes", "1"], capsys)
    assert main(["check", "--list", "--only", listed[0], "--only", listed[0]]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[:-1]] == [listed[0]]


def test_single_rank_timeouts_are_enforced(capsys):
    assert main(["run", "--random", "mixtral-8x7b", "--timeout", "1e-9"]) == 5
    assert "rank 0 (in this process) did not finish within 1e-09 s (--timeout 1e-09)" in error_line(capsys, "run")
    assert main(["check", "--world-sizes", "1", "--quants", "none", "--dtypes", "float32", "--timeout", "1e-9"]) == 1
    assert "did not finish within 1e-09 s" in capsys.readouterr().out


def test_tiny_timeouts_on_spawned_worlds_are_exit_5_not_a_bad_descriptor(capsys, monkeypatch):
    from moeshard.parallel.processes import rendezvous_store

    for t in (1e-3, 1e-4, 1e-9):
        store, port = rendezvous_store(2, t)  # the store's construction no longer fails (or double-closes)
        assert port > 0
        del store
    with pytest.raises(Exception) as info:
        spawn(faults.sleep_forever, 2, timeout_s=1e-4)
    assert getattr(info.value, "timed_out", False) and "did not finish within 0.0001 s" in str(info.value)


@pytest.mark.parametrize("text, message", [
    ("3,17,42;;5", "holds an empty prompt (part 2 of the 3 that ';' separates)"),
    ("", "holds an empty prompt (part 1 of the 1 that ';' separates)"),
    ("3,4; ", "holds an empty prompt (part 2 of the 2 that ';' separates)"),
])
def test_generate_prompts_refuse_an_empty_one_anywhere(text, message):
    """``--input-ids "3,17,42;;5"`` dropped the empty prompt and reported the third as prompt 2."""
    from moeshard.commands.generate import parse_prompts

    assert parse_prompts("3,17,42; 5") == ((3, 17, 42), (5,))
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_prompts(text)


@pytest.mark.parametrize("command", ["generate", "train"])
@pytest.mark.parametrize("prompts, message", [
    ([[300, 1]], "prompt 0 holds token ids [300] outside the vocabulary"),
    ([[-1, 1]], "prompt 0 holds [-1, 1]; token ids are integers >= 0"),
])
def test_refusals_of_what_a_prompt_file_holds_name_the_file_option(command, prompts, message, tmp_path, capsys):
    """Prompts read with --input-file were refused under the name --input-ids."""
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(prompts))
    model = _gen_model(tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 64}))
    assert main([command, "--model", str(model), "--input-file", str(path)]) == 2
    line = error_line(capsys, command)
    assert f"--input-file: {message}" in line, line
