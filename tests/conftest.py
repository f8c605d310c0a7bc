"""Shared test set-up: the 8-rank option, and Triton's CPU interpreter for the kernel tests.

Triton's CPU interpreter: on a machine without CUDA, Triton kernels can only run interpreted,
and Triton decides that per kernel when the module defining it is imported (``@triton.jit``
reads ``TRITON_INTERPRET`` then; launches read it again). So this file, which pytest imports
before it collects any test module, sets ``TRITON_INTERPRET=1`` for the whole session on such a
machine: whichever test module (or library code) imports ``moeshard.kernels.*`` first, in
whatever order the tests run, gets the interpreted kernels. Kernel tests take them from the
session fixture ``interpreted_kernels``, which skips (with the reason) only without triton or
with CUDA, and fails loudly if the kernels were imported compiled all the same.
"""

import importlib
import importlib.util
import os
import types

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
# The modules that define Triton kernels, by the name the fixture gives them (``configs`` has none;
# the combine pass belongs to the dispatch backends).
TRITON_KERNEL_MODULES = {"align": "moeshard.kernels.align", "combine": "moeshard.dispatch.combine_kernel",
                         "grouped_gemm": "moeshard.kernels.grouped_gemm", "quant": "moeshard.kernels.quant",
                         "experts": "moeshard.kernels.experts", "quant_rows": "moeshard.kernels.quant_rows",
                         "glu": "moeshard.kernels.glu", "topk": "moeshard.kernels.topk",
                         "loads": "moeshard.kernels.loads", "pdl": "moeshard.kernels.pdl",
                         "layout": "moeshard.kernels.layout", "nvfp4_values": "moeshard.kernels.nvfp4_values",
                         "gemv": "moeshard.kernels.gemv"}

_SAVED_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET")
if HAVE_TRITON and not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_addoption(parser):
    parser.addoption("--world-size-8", action="store_true", default=False,
                     help="also run the multi-rank tests with 8 ranks (slow on few cores)")


def pytest_configure(config):
    config.addinivalue_line("markers", "world_size_8: needs 8 ranks; runs only with --world-size-8")
    config.addinivalue_line("markers", "triton_interpreter: runs Triton kernels in the CPU interpreter (set on "
                                       "every test that uses the interpreted_kernels fixture)")


def pytest_unconfigure(config):
    if _SAVED_TRITON_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _SAVED_TRITON_INTERPRET


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "interpreted_kernels" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.triton_interpreter)
    if config.getoption("--world-size-8"):
        return
    skip = pytest.mark.skip(reason="8-rank run: pass --world-size-8")
    for item in items:
        if "world_size_8" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def interpreted_kernels():
    """The Triton modules, interpreted: a namespace with ``align``, ``combine`` (the dispatch
    backends' combine pass), ``grouped_gemm``, ``quant``, ``quant_rows``, ``glu``, ``topk``,
    ``loads`` (the load counter's record pass), ``pdl`` (programmatic dependent launch), ``layout``
    (the experts' input at padded positions), ``nvfp4_values`` (nvfp4 operands decoded before the GEMMs),
    ``gemv`` (one token's experts as matrix-vector products),
    ``experts`` and ``configs`` (the modules themselves).

    Skipped, with the reason, where triton is not installed or CUDA is available (there
    tests/gpu/test_gpu_kernels.py checks the compiled kernels). Otherwise the tests that use it run
    or fail: a kernel module imported in compiled mode, or ``TRITON_INTERPRET`` not ``1``, is an
    error here, never a skip, so CPU kernel coverage cannot vanish with the test order.
    """
    if not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install triton; CPU interpreter mode needs no GPU)")
    if CUDA:
        pytest.skip("CUDA is available: tests/gpu/test_gpu_kernels.py checks the compiled kernels")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail(f"TRITON_INTERPRET is {os.environ.get('TRITON_INTERPRET')!r}, not '1': tests/conftest.py sets it "
                    "for the session on machines without CUDA; something changed it", pytrace=False)
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    paths = {**TRITON_KERNEL_MODULES, "configs": "moeshard.kernels.configs"}
    modules = {name: importlib.import_module(path) for name, path in paths.items()}
    compiled = sorted(f"{mod.__name__}.{attr}" for mod in modules.values() for attr, value in vars(mod).items()
                      if isinstance(value, JITFunction))
    if compiled:
        pytest.fail(f"Triton kernels imported in compiled mode, not for the CPU interpreter: {compiled}. They were "
                    "imported while TRITON_INTERPRET was not '1': before tests/conftest.py set it (by a plugin, "
                    "say) or while a test had changed it", pytrace=False)
    if not any(isinstance(value, InterpretedFunction) for mod in modules.values() for value in vars(mod).values()):
        pytest.fail(f"no interpreted Triton kernel found in {sorted(m.__name__ for m in modules.values())}: "
                    "update tests/conftest.py's TRITON_KERNEL_MODULES", pytrace=False)
    return types.SimpleNamespace(**modules)


@pytest.fixture
def exact_interpreter(interpreted_kernels, monkeypatch):
    """Correctly rounded float conversions and dot products inside Triton's interpreter (numpy's
    casts and float32 dots are not the GPU's), so that the interpreted kernels' outputs are the
    GPU's numbers, not artefacts that could hide a wrong row. Tests that run kernels in the
    interpreter request it (it implies ``interpreted_kernels``: skipped or failed as that is)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    torch_dtype = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
                   tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    fp8_max = {tl.float8e4nv: 448.0, tl.float8e5: 57344.0}

    def as_torch(data, dtype):
        t = torch.from_numpy(np.ascontiguousarray(data))
        want = torch_dtype[dtype]
        return t if t.dtype == want else t.view(bits[want.itemsize]).view(want)

    def convert_float(data, src, dst, rounding_mode):
        x = as_torch(data, src)
        if dst in fp8_max:  # the GPU's conversion saturates (cvt.rn.satfinite)
            x = x.float().clamp(-fp8_max[dst], fp8_max[dst])
        out = x.to(torch_dtype[dst])
        raw = out.view(bits[out.dtype.itemsize]).numpy()
        return raw.view(getattr(np, f"uint{8 * out.dtype.itemsize}")).reshape(data.shape)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a32 = as_torch(a.data, a.dtype.scalar).float().numpy()
        b32 = as_torch(b.data, b.dtype.scalar).float().numpy()
        return interpreter.TensorHandle(np.matmul(a32, b32).astype(d.data.dtype) + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter, "_convert_float", convert_float)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
