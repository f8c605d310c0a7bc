"""How a checkpoint's fused expert tensors hold gate, up and down, one ``FusedLayout`` each.

moeshard's own layout (``ExpertWeights``, ``MoEWeights``) is ``gate_up_rows``: gate_up
[E, 2I, H], rows [0, I) gate and [I, 2I) up, down [E, H, I]; gate_up biases [E, 2I] likewise.
A checkpoint (or a transformers model in memory) may store them otherwise:

======================  =================================  ===============  ========================
name                    gate_up                            down             who
======================  =================================  ===============  ========================
gate_up_rows            [E, 2I, H], gate rows then up      [E, H, I]        transformers 5 (Mixtral,
                                                                            Qwen, DeepSeek)
interleaved             [E, 2I, H], row 2i gate, 2i+1 up   [E, H, I]        gpt-oss mxfp4 blocks
transposed              [E, H, 2I], gate columns first     [E, I, H]        Llama-4
transposed_interleaved  [E, H, 2I], column 2i gate, 2i+1   [E, I, H]        gpt-oss
stacked                 gate [E*I, H] and up [E*I, H],     [E*I, H]         DBRX (w1, v1, w2)
                        two tensors, expert e's rows        (transposed)
                        [e*I, (e+1)*I)
up_rows                 [E, I, H], up rows alone           [E, H, I]        Nemotron-H (ungated
                        (an ungated activation)                             relu2 experts)
======================  =================================  ===============  ========================

A gate_up bias [E, 2I] follows the layout's gate/up order (interleaved or gate first); a down
bias is [E, H] in every layout but ``stacked``, which has none. ``FusedLayout`` gives the stored
shapes, the reads of one expert's slice [lo, hi) of I, and their conversion into moeshard's
layout, so the checkpoint reader and the transformers integration read any layout the same way.
A ``stacked`` layout stores three tensors (its family's ``fused_names`` name gate, up and down),
the others two (gate_up, down).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FusedLayout:
    """transposed: gate_up is stored [E, H, 2I] and down [E, I, H] (``x @ W``), else [E, 2I, H]
    and [E, H, I] (``x @ W.T``); interleaved: gate and up alternate along the 2I axis (2i gate,
    2i + 1 up), else gate [0, I) then up [I, 2I); stacked: gate, up and down are three tensors
    [E * I, H], expert e's rows [e * I, (e + 1) * I) (down's row i is column i of its [H, I]
    down), DBRX's ``w1``, ``v1``, ``w2``; gated False: the experts are ungated, gate_up holds up
    rows alone ([E, I, H]; ``products`` 1), for an ungated activation (``ActivationKind.gated``)."""

    name: str
    transposed: bool
    interleaved: bool
    stacked: bool = False
    gated: bool = True

    @property
    def products(self) -> int:
        """Rows of gate_up per column of I: 2 (gate and up), 1 for an ungated layout (up alone)."""
        return 2 if self.gated else 1

    @property
    def tensors(self) -> int:
        """How many tensors hold the routed experts: 3 (gate, up, down) stacked, else 2 (gate_up, down)."""
        return 3 if self.stacked else 2

    def stored_shapes(self, E: int, H: int, I: int) -> tuple[tuple[int, ...], ...]:
        """The stored shape of each of the ``tensors`` tensors, in the family's ``fused_names`` order."""
        return ((E * I, H),) * 3 if self.stacked else self.shapes(E, H, I)

    def expert_reads(self, e: int, lo: int, hi: int, I: int) -> list[tuple[int, tuple]]:
        """(which stored tensor, index) of expert e's gate and up of [lo, hi) of I, then its down."""
        if self.stacked:
            rows = (slice(e * I + lo, e * I + hi),)
            return [(0, rows), (1, rows), (2, rows)]
        return [(0, index) for index in self.gate_up_reads(e, lo, hi, I)] + [(1, self.down_read(e, lo, hi))]

    def expert_rows(self, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The reads of ``expert_reads`` -> (gate_up [2w, H], gate rows then up (ungated: [w, H]);
        down [H, w])."""
        if self.stacked:
            return torch.cat(parts[:2], dim=0), parts[2].transpose(0, 1)
        return self.gate_up_rows(parts[:-1]), self.down_rows(parts[-1])

    def canonical_tensors(self, stored: list[torch.Tensor], E: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``tensors`` whole stored tensors of E experts -> (gate_up [E, 2I, H] (ungated
        [E, I, H]), down [E, H, I])."""
        if self.stacked:
            gate, up, down = (t.reshape(E, -1, t.shape[-1]) for t in stored)
            return torch.cat([gate, up], dim=1), down.transpose(1, 2)
        return self.canonical(*stored)

    @property
    def rows(self) -> FusedLayout:
        """The same gate/up order with gate_up [E, 2I, ...] and down [E, H, I] (block-quantized
        formats store the reduction axis last whatever the model's layout)."""
        if not self.gated:
            return self
        return LAYOUTS[{False: "gate_up_rows", True: "interleaved"}[self.interleaved]]

    def shapes(self, E: int, H: int, I: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """The stored (gate_up, down) shapes."""
        P = self.products
        return ((E, H, P * I), (E, I, H)) if self.transposed else ((E, P * I, H), (E, H, I))

    def gate_up_reads(self, e: int, lo: int, hi: int, I: int) -> list[tuple]:
        """Indices into the stored gate_up for expert e's gate and up of [lo, hi) of I: one read
        (interleaved, ungated, or the whole expert) or two (gate part, up part)."""
        if self.interleaved:
            spans = [slice(2 * lo, 2 * hi)]
        elif not self.gated:
            spans = [slice(lo, hi)]
        elif (lo, hi) == (0, I):
            spans = [slice(0, 2 * I)]
        else:
            spans = [slice(lo, hi), slice(I + lo, I + hi)]
        return [(e, slice(None), s) if self.transposed else (e, s) for s in spans]

    def down_read(self, e: int, lo: int, hi: int) -> tuple:
        """Index into the stored down for expert e's [lo, hi) of I."""
        return (e, slice(lo, hi)) if self.transposed else (e, slice(None), slice(lo, hi))

    def gate_up_rows(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The reads of ``gate_up_reads`` (each [2w or w, H], or transposed [H, ...]) -> [2w, H]
        in moeshard's order: gate rows, then up rows."""
        t = torch.cat([p.transpose(0, 1) if self.transposed else p for p in parts], dim=0)
        return torch.cat([t[0::2], t[1::2]]) if self.interleaved else t

    def down_rows(self, part: torch.Tensor) -> torch.Tensor:
        """The read of ``down_read`` -> [H, w]."""
        return part.transpose(0, 1) if self.transposed else part

    def canonical(self, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole stored tensors -> (gate_up [E, 2I, H], down [E, H, I]) in moeshard's layout
        (views where the layout allows, else copies)."""
        if self.transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        if self.interleaved:
            gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
        return gate_up, down

    def canonical_bias(self, gate_up_bias: torch.Tensor) -> torch.Tensor:
        """A stored gate_up bias [..., 2I] -> gate first, then up."""
        if self.interleaved:
            return torch.cat([gate_up_bias[..., 0::2], gate_up_bias[..., 1::2]], dim=-1)
        return gate_up_bias

    def bias_reads(self, e: int, lo: int, hi: int, I: int) -> list[tuple]:
        """Indices into the stored gate_up bias [E, 2I] for expert e's [lo, hi) of I."""
        if self.interleaved:
            return [(e, slice(2 * lo, 2 * hi))]
        if not self.gated:
            return [(e, slice(lo, hi))]
        return [(e, slice(lo, hi)), (e, slice(I + lo, I + hi))]

    def bias_rows(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The reads of ``bias_reads`` -> [2w]: gate, then up."""
        return self.canonical_bias(torch.cat(parts))


LAYOUTS: dict[str, FusedLayout] = {layout.name: layout for layout in (
    FusedLayout("gate_up_rows", transposed=False, interleaved=False),
    FusedLayout("interleaved", transposed=False, interleaved=True),
    FusedLayout("transposed", transposed=True, interleaved=False),
    FusedLayout("transposed_interleaved", transposed=True, interleaved=True),
    FusedLayout("stacked", transposed=False, interleaved=False, stacked=True),
    FusedLayout("up_rows", transposed=False, interleaved=False, gated=False),
)}


def fused_layout(name: str) -> FusedLayout:
    """The descriptor of ``name``; ValueError naming the known layouts."""
    if name not in LAYOUTS:
        raise ValueError(f"fused layout {name!r} is not one of {list(LAYOUTS)}")
    return LAYOUTS[name]
