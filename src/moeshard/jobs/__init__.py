"""The jobs the command line runs on a world of ranks: ``run`` (one checkpoint block on hidden
states, ``moeshard run``) and ``generate`` (a whole transformers model, ``moeshard generate``).

Each job is a plan made and checked in the parent before any rank starts, a rank function that
carries one plan out, and a result; ``world`` runs a list of plans on one world of ranks (the
groups built once per layout, through the dispatch registry), ``failures`` turns what the ranks
raised into the one error the command reports.
"""
