"""torchrun on the GPUs the machine has (one or two): ``torchrun -m moeshard run --device cuda``
joins its world over NCCL (the rendezvous on ``init_from_env``'s helper thread, which sets the
rank's CUDA device for itself) and writes what one process writes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = Path(__file__).resolve().parents[2]


def test_moeshard_run_under_torchrun_on_the_gpus(tmp_path):
    from safetensors.torch import load_file

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    ranks = min(2, torch.cuda.device_count())
    common = ["run", "--random", "qwen2-57b-a14b", "--tokens", "9", "--seed", "3", "--device", "cuda",
              "--timeout", "120"]
    one = subprocess.run([sys.executable, "-m", "moeshard", *common, "--output", str(tmp_path / "one.safetensors")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    tr = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                         "-m", "moeshard", *common, "--dp", "1", "--tp", str(ranks),
                         *(["--ep"] if ranks > 1 else []),  # one rank holds every expert: EP is refused there
                         "--output", str(tmp_path / "tr.safetensors")],
                        env=env, capture_output=True, text=True, timeout=300)
    assert tr.returncode == 0, tr.stdout[-2000:] + tr.stderr[-2000:]
    a = load_file(str(tmp_path / "one.safetensors"))["hidden_states"].float()
    b = load_file(str(tmp_path / "tr.safetensors"))["hidden_states"].float()
    assert a.shape == b.shape == (9, 128)
    assert (a - b).abs().max() <= 1e-4 * max(1.0, float(a.abs().max())), (a - b).abs().max()
