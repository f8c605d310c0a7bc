"""Families' layout tests: many ``moeshard generate`` plans of one world size in one spawn.

``GenerateWorlds(cases, timeout_s)`` is what a module's ``world`` fixture returns. Called with a
key (a world size, a group name, ...), it spawns ``generate_plans`` once for that key's plans,
``cases(key) -> (case keys, plans)`` (every plan of one world size), and returns
``{case key: (plan, per-rank results)}``; later calls with the key return the same. A world that
failed (a rank raised, died or ran past ``timeout_s``) fails every test that asks for it, with
the failure's report.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import pytest

from moeshard.jobs.generate import generate_plans
from moeshard.parallel.spawn import RankFailure, spawn


class GenerateWorlds:
    def __init__(self, cases: Callable[[Any], tuple[Sequence[Hashable], Sequence[Any]]], timeout_s: float) -> None:
        self.cases, self.timeout_s = cases, timeout_s
        self._runs: dict[Hashable, dict | RankFailure] = {}

    def __call__(self, key: Hashable) -> dict:
        if key not in self._runs:
            keys, plans = self.cases(key)
            ws = plans[0].parallel.world_size
            try:
                per_rank = spawn(generate_plans, ws, args=(list(plans),), timeout_s=self.timeout_s,
                                 preload=("moeshard.jobs.generate",))
            except RankFailure as failure:
                self._runs[key] = failure
            else:
                self._runs[key] = {case: (plan, [per_rank[r][i] for r in range(ws)])
                                   for i, (case, plan) in enumerate(zip(keys, plans, strict=True))}
        run = self._runs[key]
        if isinstance(run, RankFailure):
            pytest.fail(f"the {key} run failed:\n{run}")
        return run
