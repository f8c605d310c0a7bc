"""Families with parts of their own on the GPU's inference path: Gemma 4 (the decoder layer's routing
handed to moeshard's experts, the tanh-approximate GELU epilogue of the Triton kernels), JetMoE
(the bias on the block's output), DeepSeek-V4 (its blocks' routing, the first layer's by token id,
handed to moeshard's experts; the clamped SwiGLU epilogue), A.X-K1 (the norm of the block's
output), ZAYA (its MLP router's picks, a skip among them, handed to experts without a router),
LongCat-Flash (its zero-computation picks added after the layer), Inkling's text model (routed
experts normalized with its shared ones, their picks handed over) and Nemotron-H (ungated relu2
experts in a latent space, the Triton gate_up's ungated epilogue, beside Mamba-2 layers). A family the installed
transformers lacks, or cannot run in bfloat16 (then moeshard's refusal is checked), is skipped. A
tiny random model from ``scripts/make_tiny_moe.py`` loaded by ``load_sharded_model`` on the GPU in bfloat16, whose
experts run on the Triton kernels, against transformers on the GPU: its logits are as far from
transformers' float32 logits as transformers' own bfloat16 logits are (twice that, plus one bf16
step of the logits' scale), so a wrong epilogue, routing or bias fails (the CPU proofs in float32
are tests/test_families_softmax.py)."""

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
tf = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import make_tiny_moe  # noqa: E402 - a script of this repository

IDS = [[3, 17, 42, 5, 9, 1, 2, 3, 60, 61, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


@pytest.mark.parametrize("family", ["gemma4_text", "jetmoe", "deepseek_v4", "axk1", "zaya", "longcat_flash",
                                    "inkling_text", "nemotron_h"])
def test_family_in_bfloat16_on_cuda_is_as_close_to_float32_as_transformers(tmp_path, family):
    from moeshard.checkpoint.hf_config import read_hf_config
    from moeshard.experts import GroupedExperts
    from moeshard.integrations.transformers import load_sharded_model
    from moeshard.layer import MoELayer

    try:
        make_tiny_moe.make(str(tmp_path), family, dtype="float32", seed=3)
    except ValueError as exc:
        pytest.skip(f"transformers {tf.__version__}: {exc}")
    try:
        read_hf_config(tmp_path).moe_config(torch.bfloat16)
    except ValueError as exc:  # transformers 5.17's DeepSeek-V4 cannot run in bfloat16: refused, not run
        with pytest.raises(ValueError, match="cannot run"):
            load_sharded_model(tmp_path, dtype="bfloat16", device="cuda")
        pytest.skip(str(exc))
    ids = torch.tensor(IDS, device="cuda")
    with torch.no_grad():
        exact = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()(ids).logits
        theirs = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval()(ids).logits
        model = load_sharded_model(tmp_path, dtype="bfloat16", device="cuda")
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        assert layers and all(type(m.kernel) is not GroupedExperts for m in layers)  # the Triton kernels
        ours = model(ids).logits
    their_err = float((theirs.float() - exact).abs().max())
    our_err = float((ours.float() - exact).abs().max())
    bound = 2 * their_err + 2**-7 * float(exact.abs().max())
    assert our_err <= bound, (family, our_err, their_err, bound)
