"""The registries are the only places a new scheme or backend touches.

tests/extension_example.py adds ``int8_token`` (a codec and one registry entry) and
``local_blocks`` (a backend handing out the ``EXPERT_BLOCKS`` layout, and one registry entry),
exactly as CONTRIBUTING.md describes. Here they run through the layer, the reference and the
verification harness on one and two ranks, and every registered scheme is checked complete.
"""

import extension_example
import pytest
import torch

from moeshard.config import QuantConfig
from moeshard.dispatch.registry import BACKENDS, support
from moeshard.experts.base import EXPERT_BLOCKS, FLAT
from moeshard.harness.cases import MatrixOptions, generate
from moeshard.harness.runner import Runner
from moeshard.layer import MoELayer
from moeshard.parallel.config import ParallelConfig
from moeshard.presets import PRESETS
from moeshard.quant import (
    KERNEL_MODES,
    QuantizedActivations,
    get_scheme,
    quantize_activations,
    quantize_weight,
    register_scheme,
    scheme_names,
)
from moeshard.reference import reference_forward
from moeshard.tolerances import compare
from moeshard.weights import MoEWeights


@pytest.fixture
def extended():
    extension_example.ensure_registered()
    yield
    extension_example.unregister()


def test_every_registered_scheme_is_complete():
    modes = [get_scheme(s).kernel_mode for s in scheme_names() if get_scheme(s).kernel_mode is not None]
    assert len(modes) == len(set(modes)) and set(modes) <= set(KERNEL_MODES)
    for name in scheme_names():
        s = get_scheme(name)
        assert s.name == name and s.summary and 0 <= s.quant_error < 1
        assert s.slice_align >= 1 and s.dim_multiple >= 1
        if not s.quantized:
            assert name == "none" and not s.per_tensor_activation and s.quant_error == 0
            continue
        c = s.codec
        x = torch.randn(3, 64)
        w = torch.randn(2, 32, 64)
        q, qw = quantize_activations(x, name), quantize_weight(w, name)
        assert q.data.dtype == c.data_dtype and q.shape == (3, 64) and qw.shape == (2, 32, 64)
        assert (q.tensor_scale is not None) == c.tensor_scale == s.per_tensor_activation
        assert (q.row_scale is None) == (c.row_scale_dtype is None)
        assert (qw.global_scale is not None) == c.has_global
        # quantize -> dequantize stays within the scheme's own error bound on plain inputs
        for got, want in ((q.dequantize(), x), (qw.dequantize(), w)):
            assert ((got - want).norm() / want.norm()) < s.quant_error
        assert s.quant_error > 0


def test_registry_refuses_incomplete_or_clashing_schemes():
    fp8 = get_scheme("fp8_token")
    with pytest.raises(ValueError, match="a scheme of that name is registered already"):
        register_scheme(fp8)
    with pytest.raises(ValueError, match="kernel_mode 2 is not a free mode"):
        register_scheme(type(fp8)("fp8_token_copy", fp8.codec, 2, 0.1, "clash"))
    with pytest.raises(ValueError, match="only 'none' may have no codec"):
        register_scheme(type(fp8)("empty", None, None, 0.1, "no codec"))
    with pytest.raises(ValueError, match=r"QuantConfig.scheme: 'int4' is not one of \['none', 'fp8_tensor'"):
        QuantConfig("int4")


def test_a_new_scheme_runs_through_layer_and_reference(extended):
    q = quantize_activations(torch.tensor([[1.0, -0.5, 0.25, 127.0]]), "int8_token")
    assert q.data.tolist() == [[1, 0, 0, 127]] and q.row_scale.item() == 1.0  # round half to even
    cfg = PRESETS["deepseek-v3"].config("small", torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    w = MoEWeights.random(cfg, g)
    x = torch.randn(21, cfg.hidden_size, generator=g).to(cfg.dtype)
    for quant in (QuantConfig("int8_token"), QuantConfig("int8_token", True)):
        layer = MoELayer(cfg, quant=quant, weights=w)
        assert isinstance(layer.experts.weights.gate_up.data, torch.Tensor)
        assert layer.experts.gate_up_proj.dtype == torch.int8
        out = layer(x)
        err, atol, rtol, ok = compare(out, reference_forward(x, w, cfg, quant, accumulation=layer.accumulation),
                                      cfg.dtype, quant.scheme)
        assert ok, (quant, err)
    plain = reference_forward(x, w, cfg).out
    rel = float((out.double() - plain).norm() / plain.norm())
    assert 1e-4 < rel < get_scheme("int8_token").quant_error


def test_a_new_backend_with_expert_blocks(extended):
    cfg = PRESETS["qwen2-57b-a14b"].config("small")
    g = torch.Generator().manual_seed(5)
    w = MoEWeights.random(cfg, g)
    for T in (0, 1, 9):
        x = torch.randn(T, cfg.hidden_size, generator=g)
        for quant in (QuantConfig(), QuantConfig("fp8_tensor"), QuantConfig("int8_token", True)):
            layer = MoELayer(cfg, quant=quant, weights=w, backend="local_blocks")
            d = layer.backend.dispatch(x, layer.route(x)) if T else None
            if d is not None:
                assert d.input.layout == EXPERT_BLOCKS and d.input.num_rows == cfg.num_experts * T
                assert int(d.input.block_counts.sum()) == T * cfg.top_k
                assert isinstance(d.input.x, QuantizedActivations) == (quant.quantized and not quant.defer_input_quant)
            ok = compare(layer(x), reference_forward(x, w, cfg, quant), cfg.dtype, quant.scheme)[3]
            assert ok, (T, quant)
    # A kernel that takes flat rows only is refused this backend, with the reason.
    ok, reason = support("local_blocks", QuantConfig(), ParallelConfig(), kernel_layouts=(FLAT,))
    assert not ok and "local_blocks hands the experts 'expert_blocks' rows" in reason


def test_the_harness_runs_the_extensions_on_spawned_ranks(extended):
    opts = MatrixOptions(world_sizes=(1, 2), quants=("int8_token", "int8_token+defer"), dtypes=("float32",),
                         backends=("local", "local_blocks", "all2all", "allgather_reducescatter"))
    cases = [c for c in generate(opts) if not c.skipped]
    assert {c.backend for c in cases} == {"local", "local_blocks", "all2all", "allgather_reducescatter"}
    assert {c.world_size for c in cases} == {1, 2} and all("int8_token" in c.id for c in cases)
    outcomes = Runner(layer_factory=extension_example.layer).run(cases)
    assert [o.status for o in outcomes] == ["pass"] * len(cases), [(o.case.id, o.reason) for o in outcomes]


def test_unregistering_restores_the_default_matrix(extended):
    extension_example.unregister()
    assert "int8_token" not in scheme_names() and "local_blocks" not in BACKENDS
    assert not any("int8_token" in c.id or "local_blocks" in c.id for c in generate(MatrixOptions(world_sizes=(1,))))


def test_the_registry_decides_which_groups_a_backend_needs():
    """Which layouts need the gloo side group is the backends' entries' business alone: one helper
    reads them (``side_group_needed`` / ``build_groups``), and no other module of the package
    decides a side channel itself."""
    import re
    from pathlib import Path

    from moeshard.dispatch.registry import BACKENDS, ep_backends, side_group_needed
    from moeshard.parallel.config import ParallelConfig

    ep, no_ep = ParallelConfig(2, 1, True), ParallelConfig(2, 1, False)
    for name, spec in BACKENDS.items():
        for device in ("cpu", "cuda"):
            want = device in spec.side_group_on and spec.layouts == "ep"
            assert side_group_needed(ep, device, [name]) == want, (name, device)
            assert not side_group_needed(no_ep, device, [name])
    assert side_group_needed(ep, "cuda") == any("cuda" in BACKENDS[b].side_group_on for b in ep_backends())
    with pytest.raises(ValueError, match=r"unknown backend\(s\) \['nope'\]"):
        side_group_needed(ep, "cpu", ["nope"])
    src = Path(__file__).resolve().parents[1] / "src" / "moeshard"
    deciders = sorted(str(p.relative_to(src)) for p in src.rglob("*.py")
                      if re.search(r"side_channel\s*=", p.read_text()) and p.name not in ("registry.py", "groups.py"))
    assert deciders == [], f"modules deciding a side channel themselves: {deciders}"


@pytest.mark.parametrize("flag, method, missing", [
    ("combine_final", "combine_final", "combine_final"),
    ("payload_first", "dispatch_payload", "payload and dispatch_payload"),
])
def test_backend_capabilities_are_declared_by_the_registry_and_refused_when_missing(extended, flag, method, missing):
    """What the layer's forward may ask of a backend beyond dispatch and combine is a capability
    in its registry entry, not discovered by looking for a method: the one-pass combine with the
    shared experts (``BackendSpec.combine_final``) and the payload made before the routing
    (``payload_first``, which only ``local`` has: its payload needs no collective). Every
    built-in entry's flag matches what its backend has, and an entry that claims a capability for
    a backend without its method is refused when the layer is built, with the backend's name."""
    import dataclasses

    from moeshard.dispatch.base import BackendContext
    from moeshard.dispatch.registry import register_backend, unregister_backend

    cfg = PRESETS["qwen2-57b-a14b"].config("small")
    for name, spec in BACKENDS.items():
        if spec.layouts == "no_ep":
            backend = spec.factory(BackendContext(cfg, QuantConfig()))
            assert callable(getattr(backend, method, None)) == getattr(spec, flag), name
    assert [n for n, spec in BACKENDS.items() if getattr(spec, flag)] == ["local"]
    w = MoEWeights.random(cfg, torch.Generator().manual_seed(6))
    claimed = dataclasses.replace(BACKENDS["local_blocks"], name=f"local_blocks_{flag}", **{flag: True})
    register_backend(claimed)
    try:
        with pytest.raises(TypeError, match=f"local_blocks: its registry entry says {flag}=True but the "
                                            f"backend has no {missing}"):
            MoELayer(cfg, weights=w, backend=claimed.name)
    finally:
        unregister_backend(claimed.name)
