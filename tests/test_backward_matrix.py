"""`moeshard check --backward`: gradient cases of the matrix against the fp64 single-device
reference, and the planted wrong backwards (tests/faults.py) that they catch and --explain names.

One Runner run for the clean cases (one world per world size), one world per fault."""

import json

import faults
import pytest

from moeshard.cli import main
from moeshard.harness.cases import MatrixOptions, case_from_id, generate
from moeshard.harness.runner import Runner


def _grad_cases(world_sizes, **filters):
    opts = MatrixOptions(world_sizes=world_sizes, backward=True, eplb="off", **filters)
    return [c for c in generate(opts) if c.grad]


# Cases of world size 2 in make test: every backend under SP (which runs its EP dispatch and
# combine), TP, EP, both dtypes, one token under SP (fewer than tp: an empty rank), and the parts
# the families bring: gpt-oss's router and expert biases under TP (the down bias added once, on TP
# rank 0) and under SP (they travel with their expert), Llama-4's weights on the input under EP,
# Cohere2-MoE's shared_scale and sigmoid of the selected logits, DeepSeek-V3's correction bias
# (no gradient) and groups; Qwen2-MoE's shared-expert gate is the CLI case's. The world-size-1
# case is the CLI test's; DP, the other EP cases, the other routing kinds (their gradients against
# transformers' routers: tests/test_routing_grads.py) and world size 4 run in make test-slow (the
# same code paths in other groups; DP's reduction is also in tests/test_backward_functions.py and
# the planted faults below).
CASES_2 = (
    "dp1-tp2-noep/local/none/float32/gpt-oss-120b/t5/grad",
    "dp2-tp1-ep/all2all/none/bfloat16/llama4-scout/t5,2/grad",
    "dp1-tp2-ep/allgather_reducescatter/none/bfloat16/cohere2-moe/t1/grad",
    "dp1-tp2-ep/all2all/none/float32/deepseek-v3/t7/grad",
    "dp1-tp2-ep/low_latency/none/bfloat16/gpt-oss-120b/t3/grad",
)
SLOW_CASES = (
    "dp1-tp1-noep/local/none/float32/phi-3.5-moe/t5/grad",
    "dp2-tp1-noep/local/none/bfloat16/ernie-4.5-21b-a3b/t0,3/grad",
    "dp2-tp1-ep/allgather_reducescatter/none/float32/deepseek-v2/t3,0/grad",
    "dp2-tp1-ep/low_latency/none/float32/granite-3b-moe/t1,4/grad",
)
CLI_CASE = "dp1-tp1-noep/local/none/bfloat16/qwen2-57b-a14b/t5/grad"  # one rank: runs in this process


def _run(cases, factory=None, explain=""):
    kwargs = {} if factory is None else {"layer_factory": factory}
    return Runner(case_timeout_s=60, explain=explain, **kwargs).run(cases)


def test_gradient_cases_of_every_backend_pass_at_world_size_2():
    cases = [case_from_id(i) for i in CASES_2]
    matrix = {(c.parallel, c.backend) for c in _grad_cases((1, 2)) if not c.skipped}
    covered = {(c.parallel, c.backend) for c in (*cases, *map(case_from_id, (*SLOW_CASES, CLI_CASE)))}
    assert covered == matrix  # with the slow ones and the CLI's: every layout x backend that runs
    assert {c.parallel.name for c in cases} >= {"dp1-tp2-noep", "dp2-tp1-ep", "dp1-tp2-ep"}
    outcomes = _run(cases)
    failed = [(o.case.id, o.status, o.reason) for o in outcomes if o.status != "pass"]
    assert not failed, failed
    assert all(o.err_to_bound is not None and 0 <= o.err_to_bound <= 1 for o in outcomes)


@pytest.mark.slow
def test_the_other_gradient_cases_pass_at_world_sizes_1_2_and_4():
    """One rank, DP, the EP cases without SP at world size 2 and every world-size-4 case (dp2 x
    tp2 SP, dp4 EP, tp4): the code paths of the cases above, with other groups."""
    cases = [case_from_id(i) for i in SLOW_CASES] + [c for c in _grad_cases((4,)) if not c.skipped]
    assert len(cases) == len(SLOW_CASES) + 22
    failed = [(o.case.id, o.status, o.reason) for o in _run(cases) if o.status != "pass"]
    assert not failed, failed


def test_quantized_schemes_are_listed_not_applicable_with_the_backwards_reason():
    cases = _grad_cases((2,), layouts=None, backends=("all2all",))
    fp8 = [c for c in cases if c.quant.name == "fp8_block" and c.parallel.enable_ep]
    assert fp8 and all(c.skipped and "quant 'fp8_block' has no backward" in c.reason for c in fp8)
    assert [c for c in cases if c.quant.name == "none" and not c.skipped]
    for c in cases:  # every id is accepted back, as --only takes it
        assert case_from_id(c.id) == c and c.id.endswith("/grad")
    with pytest.raises(ValueError, match="gradient cases run without load balancing"):
        case_from_id("dp2-tp1-ep/all2all/none/float32/mixtral-8x7b/t1,0/eplb-r1-one-greedy/grad")


@pytest.fixture(scope="module")
def faulty():
    """One world of 2 runs a case per planted fault (``faults.ThreeWrongBackwards``: each fault
    acts only on the layouts that have its collective), every case explained."""
    ids = {"sp_gather": "dp1-tp2-ep/allgather_reducescatter/none/float32/deepseek-v3/t7/grad",
           "dp": "dp2-tp1-noep/local/none/float32/qwen2-57b-a14b/t3,5/grad",
           "doubled": "dp2-tp1-ep/low_latency/none/bfloat16/mixtral-8x7b/t5,2/grad"}
    outcomes = _run([case_from_id(i) for i in ids.values()], faults.ThreeWrongBackwards, explain="all")
    return dict(zip(ids, outcomes, strict=True))


def test_a_summed_sp_all_gather_backward_is_caught_and_named_at_sp_gather(faulty):
    o = faulty["sp_gather"]
    assert o.status == "fail" and "x the reference" in o.reason, o.reason
    first = o.stages.first
    assert (first.stage, first.rank, first.token) == ("sp_gather", 0, 0), o.explanation
    assert "2.00x the reference: the 2 TP ranks' gradients were summed" in o.stages.headline
    assert o.stages.wrong["sp_gather"] == {0: 4, 1: 3}  # every row of both chunks (7 tokens: 4 and 3)


def test_a_missing_dp_reduction_is_caught_and_named_after_reduce_gradients(faulty):
    o = faulty["dp"]
    assert o.status == "fail"
    first = o.stages.first
    assert (first.stage, first.kind) == ("reduced", "not_reduced"), o.explanation
    assert "params" not in o.stages.wrong and "x" not in o.stages.wrong  # each rank's own share was right
    assert "after reduce_gradients: it was not summed, expected the sum over 'dp' (2 ranks)" in o.stages.headline


def test_a_doubled_expert_gradient_is_caught_and_named_by_parameter_and_expert(faulty):
    o = faulty["doubled"]
    assert o.status == "fail" and "2x the reference" in o.reason, o.reason
    first = o.stages.first
    assert first.stage == "params" and first.kind.startswith("experts.") and first.expert in range(4), o.explanation
    assert "2.00x the reference" in o.stages.headline and "before reduce_gradients" in o.stages.headline
    assert {"params", "reduced"} <= set(o.stages.wrong)  # the router's missing DP reduction comes after
    assert "x" not in o.stages.wrong and "topk_weights" not in o.stages.wrong


def test_cli_backward_explains_a_clean_case_and_writes_json(tmp_path, capsys):
    case_id = CLI_CASE
    path = tmp_path / "out.json"
    assert main(["check", "--backward", "--only", case_id, "--explain", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "local backward" in out and "every stage of the forward and the backward within its bound" in out
    (doc,) = json.loads(path.read_text())["cases"]
    assert doc["id"] == case_id and doc["backward"] is True and doc["status"] == "pass"
    assert "topk_weights" in doc["stages"]["lines"][0] and "reduced" in doc["stages"]["lines"][0]
