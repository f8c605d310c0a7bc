"""Gradients through the layer's collectives: ``torch.autograd.Function``s whose backward is the
reverse communication (``collectives``: TP and SP; ``routed``: every backend's dispatch and
combine), and what may be trained at all (``support``).

The convention every backward here assumes (the *replicated loss*): the TP ranks of one DP rank
hold the same tokens and compute the same loss from the same output rows, so the gradient that
arrives at the layer's output is the same on every TP rank of a DP rank (it may differ between
DP ranks). Under it

    forward                               backward
    TP all-reduce of partial sums         identity (each TP rank already holds dL/d(sum))
    TP copy (x, weights into TP slices)   all-reduce of the partial gradients over TP
    SP: keep this TP rank's rows          all-gather the rows' gradients over TP
    SP: all-gather the rows               keep this TP rank's rows (never sum the replicas)
    dispatch / combine of a backend       the reverse all-to-all / reduce-scatter / all-gather

A layer whose forward needs none of these (one device, or nothing requires grad) never enters
this package: the inference path pays nothing for it.
"""
