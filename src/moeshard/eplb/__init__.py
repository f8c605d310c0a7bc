"""Expert-parallel load balancing (EPLB): redundant replicas of hot experts, placed by a balancing
policy from the loads the layer counts, moved between ranks at run time.

* ``placement``: ``Layout`` (E logical experts, P ranks, redundant slots per rank), ``Placement``
  (the logical expert of every physical slot), ``choose_replicas`` (the replica of each routed copy);
* ``policies``: ``greedy`` and ``hierarchical``, pure ``(loads, layout) -> Placement``;
  ``rank_loads`` and ``balancedness``;
* ``loads``: ``LoadCounter``, tokens per logical expert over a running window, on the device;
* ``moves``: ``plan_moves`` and ``move_slots``, what ``MoELayer.rebalance`` runs;
* ``trace``: the synthetic skewed trace behind ``moeshard eplb``.

The layer side is ``MoELayer(placement=...)``, ``MoELayer.expert_loads()``,
``MoELayer.reset_expert_loads()`` and ``MoELayer.rebalance(placement)``.
"""

from moeshard.eplb.placement import Layout, Placement, choose_replicas
from moeshard.eplb.policies import (
           POLICIES,
           balancedness,
           get_policy,
           greedy,
           hierarchical,
           rank_loads,
)

__all__ = [
           "POLICIES",
           "Layout",
           "Placement",
           "balancedness",
           "choose_replicas",
           "get_policy",
           "greedy",
           "hierarchical",
           "rank_loads",
]
