import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--world-size-8", action="store_true", default=False,
                     help="also run the multi-rank tests with 8 ranks (slow on few cores)")


def pytest_configure(config):
    config.addinivalue_line("markers", "world_size_8: needs 8 ranks; runs only with --world-size-8")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--world-size-8"):
        return
    skip = pytest.mark.skip(reason="8-rank run: pass --world-size-8")
    for item in items:
        if "world_size_8" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def exact_interpreter(monkeypatch):
    """Correctly rounded float conversions and dot products inside Triton's interpreter (numpy's
    casts and float32 dots are not the GPU's), so that the interpreted kernels' outputs are the
    GPU's numbers, not artefacts that could hide a wrong row. Tests that run kernels under
    TRITON_INTERPRET=1 request it."""
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
