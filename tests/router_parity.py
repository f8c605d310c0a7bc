"""For the family tests: router parity in the model dtype, and a model's logits before and after
its blocks are swapped in memory (``swapped_logits``).

Router parity: in transformers' own bf16 forward, every
MoE block's router input, routed by moeshard's block (``MoEBlock.route``: the family's
``router_dtype``), gives the logits transformers' router computed, bit for bit, and the experts it
chose, except where the values it selects on tie exactly (``torch.topk`` breaks a tie its own
way, moeshard towards the lower expert index): bf16 logits tie far more often than fp32 ones. The
same inputs routed with fp32 logits show whether the precision is visible at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IDS = torch.tensor([[3, 17, 42, 5, 9, 1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14]])


@dataclass(frozen=True)
class RouterParity:
    """Over every MoE block of one forward: rows routed; rows whose experts differ from
    transformers' where the values selected on do not tie; rows whose experts differ on a tie;
    rows whose moeshard logits differ from transformers' (by any bit); the same with fp32 logits
    (``router_dtype="fp32"``); blocks whose selection bias differs from the one transformers adds."""

    rows: int
    ids_differ: int
    ties: int
    logits_differ: int
    fp32_logits_differ: int
    biases_differ: int


def _transformers_choice(output) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A transformers router's output -> (logits [T, E], chosen experts int64 [T, K], sorted; None
    when the router returns its logits alone). The routers return (logits, weights, ids) in
    transformers 5.24 and some (ids, weights, logits) in 5.17, so the parts are told apart by
    dtype and width (logits: E columns, weights: K < E). Llama-4's returns (scores, zero off the
    chosen, logits). 5.17's Jamba router is a Linear, its logits alone (the block hands its
    experts the ids, which ``bf16_router_parity`` reads there). JetMoE's returns the slots sorted
    by expert (positions in the flattened [T, K] choice), the rows, the weights, the rows per
    expert (a list) and the logits: each slot's expert follows from the counts."""
    if len(output) == 5 and isinstance(output[3], list):
        slots, _, _, counts, logits = output
        flat = torch.empty_like(slots)
        flat[slots] = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        return logits, flat.reshape(logits.shape[0], -1).sort(dim=-1).values
    ints = [t for t in output if not t.is_floating_point()]
    if ints:
        logits = max((t for t in output if t.is_floating_point()), key=lambda t: t.shape[-1])
        return logits, ints[0].sort(dim=-1).values
    if len(output) == 1:
        return output[0], None
    scores, logits = output
    k = int((scores[0] > 0).sum())
    return logits, scores.topk(k, dim=-1).indices.sort(dim=-1).values


def bf16_router_parity(tf, model_dir: str) -> RouterParity:
    """Runs ``IDS`` through transformers' model (``from_pretrained`` in bfloat16) and routes each
    MoE block's router input with the block ``load_sharded_model`` builds for that layer."""
    from moeshard.checkpoint.hf_model import model_class
    from moeshard.integrations.transformers import MoEBlock, find_moe_blocks, load_sharded_model, moe_model_info
    from moeshard.router import router_logits

    plain = model_class(tf.AutoConfig.from_pretrained(model_dir)).from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    info = moe_model_info(plain)
    family = info.family
    seen: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    hooks = []
    biases: dict[int, torch.Tensor] = {}  # layer -> the selection bias transformers adds, fp32 [E]
    for layer, block in find_moe_blocks(plain).items():
        router = block.get_submodule(family.router)
        owner, _, leaf = family.correction_bias.rpartition(".")
        bias = getattr(block, family.block_bias) if family.block_bias else \
            getattr(router.get_submodule(owner) if owner else router, leaf, None)
        if isinstance(bias, torch.Tensor):
            biases[layer] = bias.detach().reshape(-1).float()

        def record(_m, args, out, layer=layer):
            logits, ids = _transformers_choice(out if isinstance(out, tuple) else (out,))
            seen.append((layer, args[0].reshape(-1, args[0].shape[-1]), logits.float(), ids))

        def handed(_m, args, layer=layer):  # a router of logits alone: the ids the block hands its experts
            if seen and seen[-1][0] == layer and seen[-1][3] is None:
                tensors = [t for t in args if isinstance(t, torch.Tensor)]
                ids = next((t for t in tensors if not t.is_floating_point()), None)
                if ids is None:
                    # 5.17's Aria hands its experts the router's logits, and they take the top
                    # top_k of them with torch.topk (Aria's topk_softmax selection).
                    logits = next(t for t in tensors if t.shape[-1] == info.moe.num_experts)
                    ids = logits.topk(info.moe.top_k, dim=-1).indices
                seen[-1] = (*seen[-1][:3], ids.sort(dim=-1).values)
        hooks.append(router.register_forward_hook(record))
        experts = getattr(block, "experts", None)
        if isinstance(experts, torch.nn.Module):
            hooks.append(experts.register_forward_pre_hook(handed))
    with torch.no_grad():
        plain(IDS)
    for hook in hooks:
        hook.remove()
    ours = {m.layer_index: m for m in load_sharded_model(model_dir, dtype="bfloat16").modules()
            if isinstance(m, MoEBlock)}
    rows = ids_differ = ties = logits_differ = fp32_differ = 0
    biases_differ = sum(not torch.equal(ours[layer]._selection_bias().float(), bias)
                        for layer, bias in biases.items() if ours[layer].cfg.use_correction_bias)
    with torch.no_grad():
        for layer, x, logits, ids in seen:
            assert ids is not None, f"layer {layer}: transformers' router gave no ids and its experts got none"
            block = ours[layer]
            got = block.route(x)
            assert got.logits is not None
            rows += x.shape[0]
            choice = _selected_on(got.logits, block)
            for row in (got.topk_ids.sort(dim=-1).values != ids).any(dim=-1).nonzero().flatten().tolist():
                mine, theirs = set(got.topk_ids[row].tolist()), set(ids[row].tolist())
                tie = sorted(choice[row, sorted(mine - theirs)].tolist()) == sorted(choice[row, sorted(theirs - mine)].tolist())
                ties, ids_differ = ties + tie, ids_differ + (not tie)
            logits_differ += int((got.logits != logits).any(dim=-1).sum())
            router_bias = getattr(block.hf_router, block.router_bias_name) if block.cfg.routing_kind.router_bias else None
            wide = router_logits(x, block.hf_router.get_parameter(block.router_weight), "fp32", router_bias)
            fp32_differ += int((wide != logits).any(dim=-1).sum())
    assert rows, f"{model_dir}: no MoE block ran"
    return RouterParity(rows, ids_differ, ties, logits_differ, fp32_differ, biases_differ)


def _selected_on(logits: torch.Tensor, block) -> torch.Tensor:
    """fp32 [T, E]: the values a routing kind selects on, up to a monotone map: the scores plus
    the selection bias for a kind with one, else the logits; for a kind that scores in the model
    dtype, the scores rounded to it (two logits apart can round to one score)."""
    cfg = block.cfg
    in_model_dtype = cfg.routing_kind.score_dtype == "model"
    if not (cfg.use_correction_bias or in_model_dtype):
        return logits
    values = logits.to(cfg.dtype) if in_model_dtype else logits
    scores = values.softmax(dim=-1) if cfg.routing_kind.scores == "softmax" else values.sigmoid()
    if not cfg.use_correction_bias:
        return scores.float()
    bias = block._selection_bias()
    return (scores + (bias if in_model_dtype else bias.float()).view(1, -1)).float()


def swapped_logits(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(transformers' logits, the logits after ``shard_moe_blocks``) of ``model`` on ``ids``; the
    model keeps moeshard's blocks afterwards."""
    from moeshard.integrations.transformers import shard_moe_blocks

    with torch.no_grad():
        want = model(ids).logits
        shard_moe_blocks(model)
        return want, model(ids).logits
