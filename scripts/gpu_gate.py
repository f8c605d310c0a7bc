"""The GPU gate: everything CI cannot run, in one command on whatever GPUs the machine has.

    PYTHONPATH=src python3 scripts/gpu_gate.py [--out DIR] [--budget-s 540]     # or: make gpu-check

Steps, each with its own time limit (the whole gate fits one 10-minute device call):

1. ``pytest tests/gpu`` (the kernel tests against the reference, the multi-GPU tests where
   there are GPUs enough), in parallel workers, with a JUnit report;
2. ``moeshard check --device cuda --backward`` at every world size the machine allows (1, 2, 4,
   8 up to the GPU count): the forward matrix and the gradient cases;
3. a short ``moeshard bench`` (experts and layer, bf16 and fp8, one prefill and two decode
   token counts for two models);
4. a short ``moeshard bench --backward`` (Qwen3 at 4096 tokens: the experts' and the layer's
   backward, and that its weight gradients equal ``torch._grouped_mm`` autograd's);
5. ``moeshard generate --device cuda --compare`` of a tiny random Qwen3-MoE model (made by
   ``scripts/make_tiny_moe.py``) in float32: the same ids as transformers alone on the GPU and
   logits within the table (the command's exit code judges float32 runs);
6. ``moeshard train --device cuda --compare`` of the same model in float32, three SGD steps in two
   micro-batches, clipped, on a linear schedule with one warmup step: the losses of transformers
   alone on the GPU doing the same within 1e-4 relative (the exit code judges it); the trained
   model saved (``--save``);
7. ``moeshard generate --device cuda --compare`` of that saved model: moeshard and transformers
   read it, the same ids;
8. two AdamW steps of the tiny model saved with their optimizer state, a third resumed from it
   (``--resume``), and three steps in one run, on the GPU: the resumed model within 1e-4 of the
   three-step one (``scripts/checkpoint_diff.py``; a third step from a fresh AdamW would be about
   1e-2 away).

It writes ``DIR/summary.json`` (machine, software, commit, date, each step's command, exit code,
wall time and counts; ``passed`` is true only if every step passed) and one log per step, then
packs them into ``DIR.tar.gz`` (fewer than 8 files come back from a device call). DIR defaults
to ``results/<machine>/gate`` (``<machine>``: ``h200`` for one H200, ``h200x2`` for two, ...).
Exit code 0 only if every step passed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def machine_name() -> str:
    """``h200``, ``h200x2``, ... from the first GPU's name and the GPU count."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_gate: no CUDA device here; the gate runs on the GPU machine")
    n = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    model = (re.findall(r"\b([A-Z]\d{2,4}[A-Z]?)\b", name) or [name.replace(" ", "-")])[0].lower()
    return model if n == 1 else f"{model}x{n}"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"  # the device copy of the tree may have no .git


class Budget:
    """The gate's whole time limit: a step gets its own limit or what is left, whichever is less."""

    def __init__(self, total_s: float) -> None:
        self.deadline = time.monotonic() + total_s

    def limit(self, step_s: float) -> float:
        return max(1.0, min(step_s, self.deadline - time.monotonic()))


def run_step(name: str, cmd: list[str], out: Path, limit_s: float, env: dict[str, str]) -> dict:
    """Run one step with its log in ``out/<name>.log``; a step past its limit is killed and fails."""
    log = out / f"{name}.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = proc.wait()
            timed_out = True
    wall = time.monotonic() - t0
    step = {"name": name, "command": " ".join(cmd), "rc": rc, "timed_out": timed_out, "limit_s": limit_s,
            "wall_s": round(wall, 1), "log": log.name, "passed": rc == 0 and not timed_out}
    print(f"[gate] {name}: {'passed' if step['passed'] else 'FAILED'} (rc {rc}{', timed out' if timed_out else ''}, "
          f"{wall:.0f} s)", flush=True)
    return step


def _pytest_counts(junit: Path) -> dict:
    if not junit.exists():
        return {}
    try:
        root = ET.parse(junit).getroot()
    except ET.ParseError:
        return {}
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    counts["failed_ids"] = failed[:50]
    return counts


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="output folder (default results/<machine>/gate); it is packed into "
                   "<folder>.tar.gz beside it")
    p.add_argument("--workers", type=int, default=None, help="pytest workers (default: CPU count - 2, at most 14)")
    p.add_argument("--commit", default=None, help="the commit of the tree being gated, when the copy's .git is "
                   "not that tree's (a device machine gets the working tree, not always its history)")
    p.add_argument("--budget-s", type=float, default=540.0, help="time limit of the whole gate (default 540 s)")
    p.add_argument("--skip", default="", help="comma list of steps to leave out "
                   "(gpu-tests, check, bench, bench-backward, generate, train; skipping train skips "
                   "generate-trained and the AdamW save, resume and comparison steps)")
    args = p.parse_args(argv)

    import torch

    machine = machine_name()
    gpus = torch.cuda.device_count()
    out = Path(args.out) if args.out else ROOT / "results" / machine / "gate"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")
    py = sys.executable
    workers = args.workers or max(1, min(14, (os.cpu_count() or 4) - 2))
    world_sizes = ",".join(str(w) for w in (1, 2, 4, 8) if w <= gpus)
    skip = {s for s in args.skip.split(",") if s}
    tiny = Path(tempfile.mkdtemp(prefix="moeshard-gate-model-"))

    budget = Budget(args.budget_s)
    steps = []
    if "gpu-tests" not in skip:
        # 452 tests took 280 s on one H100 (14 workers); the limit leaves room as the suite grows.
        steps.append(run_step("gpu-tests", [py, "-m", "pytest", "tests/gpu", "-q", "-n", str(workers), "-p", "no:cacheprovider",
                                            f"--junitxml={out / 'gpu-tests.xml'}"], out, budget.limit(360), env))
        steps[-1].update(_pytest_counts(out / "gpu-tests.xml"))
    if "check" not in skip:
        steps.append(run_step("check", [py, "-m", "moeshard", "check", "--device", "cuda", "--world-sizes", world_sizes,
                                        "--backward", "--json", str(out / "check.json")], out, budget.limit(150), env))
        summary = (_json(out / "check.json") or {}).get("summary")
        if summary:
            steps[-1]["summary"] = summary
    if "bench" not in skip:
        steps.append(run_step("bench", [py, "-m", "moeshard", "bench", "--models", "mixtral-8x7b,deepseek-v3",
                                        "--quants", "none,fp8_tensor,fp8_block", "--prefill-tokens", "4096",
                                        "--decode-tokens", "1,128", "--reps", "5", "--no-baselines",
                                        "--json", str(out / "bench.json")], out, budget.limit(120), env))
    if "bench-backward" not in skip:
        steps.append(run_step("bench-backward", [py, "-m", "moeshard", "bench", "--backward", "--models", "qwen3-30b-a3b",
                                                 "--prefill-tokens", "4096", "--reps", "3",
                                                 "--json", str(out / "bench-backward.json")], out, budget.limit(90), env))
    if "generate" not in skip:
        made = run_step("make-tiny-model", [py, "scripts/make_tiny_moe.py", str(tiny / "m"), "--family", "qwen3_moe"],
                        out, budget.limit(60), env)
        steps.append(made)
        if made["passed"]:
            steps.append(run_step("generate", [py, "-m", "moeshard", "generate", "--model", str(tiny / "m"),
                                               "--input-ids", "3,17,42;5,6,7,8", "--max-new-tokens", "8", "--device",
                                               "cuda", "--dtype", "float32", "--compare",
                                               "--output", str(out / "generate.json")], out, budget.limit(120), env))
            result = _json(out / "generate.json")
            if result is not None:
                c = result.get("comparison") or {}
                steps[-1]["result"] = {k: c.get(k) for k in ("same_ids", "max_abs_logit_diff", "within_tolerance")}
        if made["passed"] and "train" not in skip:
            steps.append(run_step("train", [py, "-m", "moeshard", "train", "--model", str(tiny / "m"),
                                            "--input-ids", "3,17,42;5,6,7,8", "--steps", "3", "--lr", "0.05",
                                            "--optimizer", "sgd", "--device", "cuda", "--dtype", "float32",
                                            "--micro-batches", "2", "--max-grad-norm", "1.0", "--lr-schedule",
                                            "linear", "--warmup-steps", "1", "--save", str(tiny / "trained"),
                                            "--compare", "--output", str(out / "train.json")], out, budget.limit(90), env))
            result = _json(out / "train.json")
            if result is not None:
                c = result.get("comparison") or {}
                steps[-1]["result"] = {k: c.get(k) for k in ("max_loss_rel_diff", "within_tolerance",
                                                             "grad_norm_rel_diff")}
            if steps[-1]["passed"]:
                steps.append(run_step("generate-trained", [py, "-m", "moeshard", "generate", "--model",
                                                           str(tiny / "trained"), "--input-ids", "3,17,42;5,6",
                                                           "--max-new-tokens", "4", "--device", "cuda", "--compare",
                                                           "--output", str(out / "generate-trained.json")],
                                      out, budget.limit(60), env))
            adamw = ["--input-ids", "3,17,42;5,6,7,8", "--lr", "0.01", "--optimizer", "adamw", "--device", "cuda",
                     "--dtype", "float32"]
            steps.append(run_step("train-adamw", [py, "-m", "moeshard", "train", "--model", str(tiny / "m"),
                                                  "--steps", "2", *adamw, "--save", str(tiny / "adamw"),
                                                  "--output", str(out / "train-adamw.json")], out, budget.limit(60), env))
            if steps[-1]["passed"]:
                steps.append(run_step("train-resume", [py, "-m", "moeshard", "train", "--model", str(tiny / "adamw"),
                                                       "--steps", "1", *adamw, "--resume", "--save",
                                                       str(tiny / "resumed"), "--output", str(out / "train-resume.json")],
                                      out, budget.limit(60), env))
            if steps[-1]["passed"] and steps[-1]["name"] == "train-resume":
                steps.append(run_step("train-adamw-three", [py, "-m", "moeshard", "train", "--model", str(tiny / "m"),
                                                            "--steps", "3", *adamw, "--save", str(tiny / "three"),
                                                            "--output", str(out / "train-adamw-three.json")],
                                      out, budget.limit(60), env))
                if steps[-1]["passed"]:
                    # Resumed after two steps, the model is the three-step run's: the moments came back.
                    # A fresh AdamW for the third step moves it by about lr (1e-2): far beyond 1e-4.
                    steps.append(run_step("resume-equals-three", [py, "scripts/checkpoint_diff.py", str(tiny / "resumed"),
                                                                  str(tiny / "three"), "--atol", "1e-4", "--json",
                                                                  str(out / "resume-equals-three.json")],
                                          out, budget.limit(30), env))

    summary = {
        "machine": machine, "gpus": gpus, "gpu_name": torch.cuda.get_device_name(0),
        "torch": torch.__version__, "cuda": torch.version.cuda, "commit": args.commit or _commit(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "PYTHONPATH=src python3 scripts/gpu_gate.py" + (" " + " ".join(argv) if argv else ""),
        "steps": steps, "passed": bool(steps) and all(s["passed"] for s in steps),
    }
    try:
        import triton

        summary["triton"] = triton.__version__
    except ImportError:
        summary["triton"] = None
    fd, tmp = tempfile.mkstemp(prefix=".summary.", dir=out)
    with os.fdopen(fd, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, out / "summary.json")
    with tarfile.open(str(out) + ".tar.gz", "w:gz") as tar:
        tar.add(out, arcname=out.name)
    print(f"[gate] {'PASSED' if summary['passed'] else 'FAILED'}: {out / 'summary.json'} and {out}.tar.gz", flush=True)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
