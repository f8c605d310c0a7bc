"""Parallel building blocks: the layout (``config``), its process groups (``groups``), uneven
collectives (``collectives``), sequence-parallel chunking (``sequence``) and starting ranks
(``spawn``: local processes, or ``init_from_env`` under torchrun)."""
