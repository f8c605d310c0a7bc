"""moeshard on a torch older than the one installed: nothing newer than the floor is needed to start.

pyproject.toml's ``torch>=`` floor (and the reasoning next to it) is below the torch in this
environment, and only one CPU build of torch is at hand. So a fresh interpreter removes the
attributes that newer torch versions added and that moeshard uses only optionally (looked up when
needed, or with a fallback), then imports every moeshard module, builds the CLI's parser and
lists the cases of ``moeshard check``. A module that touches one of them at import (as
``torch.float8_e8m0fnu``, torch 2.7+, once did) fails this test instead of every command on an
older torch.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from moeshard.checkpoint.experts import scale_dtypes
from moeshard.checkpoint.reader import torch_dtype

# (module, attribute, what moeshard does without it): recent torch APIs it uses only optionally.
NEWER = [
    ("torch", "float8_e8m0fnu", "torch 2.7+; UE8M0 checkpoint scales are then refused as an unknown dtype"),
    ("torch", "_grouped_mm", "GroupedExperts multiplies expert by expert"),
    ("torch", "_scaled_grouped_mm", "the bench leaves that baseline out"),
    ("torch.distributed", "all_gather_single", "torch 2.13's name; all_gather_into_tensor before"),
]

SCRIPT = textwrap.dedent("""
    import importlib, pkgutil, sys
    import torch
    import torch.distributed

    for module, attr, _ in {newer!r}:
        owner = sys.modules[module]
        if hasattr(owner, attr):
            delattr(owner, attr)
        assert not hasattr(owner, attr), (module, attr)

    import moeshard
    names = [m.name for m in pkgutil.walk_packages(moeshard.__path__, "moeshard.")]
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:  # optional packages: the kernels' triton, the plots' matplotlib
            if (exc.name or "").split(".")[0] not in ("triton", "matplotlib"):
                raise
    print(f"imported {{len(names)}} modules")

    from moeshard import cli
    cli.build_parser()
    sys.exit(cli.main(["check", "--list", "--world-sizes", "1"]))
""")


def test_package_and_cli_start_without_newer_torch_attributes():
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(newer=NEWER)], capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "imported " in out and " cases valid" in out, out[-4000:]


def test_ue8m0_scales_are_looked_up_when_needed(monkeypatch):
    assert torch_dtype("F8_E8M0") is torch.float8_e8m0fnu and torch_dtype("BF16") is torch.bfloat16
    assert scale_dtypes() == (torch.float32, torch.bfloat16, torch.float8_e8m0fnu)
    assert torch_dtype("F8_E4M3FNUZ") is None
    monkeypatch.delattr(torch, "float8_e8m0fnu")
    assert torch_dtype("F8_E8M0") is None and scale_dtypes() == (torch.float32, torch.bfloat16)
