"""Load-balancing layers with one planted fault each, for proving that ``moeshard check`` catches
them (pickled by reference into spawned ranks: tests/ is on sys.path)."""


from moeshard.eplb.moves import MoveStats
from moeshard.eplb.placement import choose_replicas
from moeshard.layer import MoELayer


class ChoosesReplicaByTPRank(MoELayer):
    """Replica choice salted with the TP rank: the TP ranks of one DP rank disagree under SP
    (the output stays right: every replica holds the same weights)."""

    def physical_ids(self, topk_ids, first_row=0):
        if self.placement.is_identity:
            return topk_ids
        salt = self._dp_rank + 7 * self.parallel.tp_rank(self.groups.rank)
        return choose_replicas(topk_ids, self.replica_table, self.replica_count, first_row, salt)


class RebalanceMovesNothing(MoELayer):
    """Adopts the new placement without moving any weight (stale slots after a rebalance)."""

    def rebalance(self, placement):
        old = self.placement
        table, count = placement.tables(self.replica_table.device)
        self.replica_table.copy_(table)
        self.replica_count.copy_(count)
        self.placement = placement
        S, p = old.slots_per_rank, self.parallel.ep_rank(self.groups.rank)
        changed = sum(1 for s in range(p * S, (p + 1) * S) if old.slots[s] != placement.slots[s])
        return MoveStats(changed, changed, 0, 0, 0, 0)


class ReplicasKeepTheirOwnAmax(MoELayer):
    """Replicas of an expert quantize h with their own rows' amax, not the expert's."""

    @property
    def _shares_amax(self):
        return False


class ForgetsTheChunkOffset(MoELayer):
    """Under SP every TP rank chooses replicas as if its chunk started at row 0."""

    def physical_ids(self, topk_ids, first_row=0):
        return super().physical_ids(topk_ids, 0)
