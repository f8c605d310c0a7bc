"""Model families beyond the built-in entries of ``families.FAMILIES``: one module per family (or
per group of model types that share one config reader), each registering its ``ModelFamily``
entries with ``register_family`` at import, and any routing or activation kind they need with
``register_routing`` / ``register_activation``, so that every stage reads them as data.

``moeshard.checkpoint.families`` imports this package once, after its own entries, so every
family is known wherever ``FAMILIES`` is read. A new module is one import line below.
"""

from moeshard.checkpoint.models import cohere2_moe as cohere2_moe
from moeshard.checkpoint.models import deepseek_v2 as deepseek_v2
from moeshard.checkpoint.models import ernie as ernie
from moeshard.checkpoint.models import granite as granite
from moeshard.checkpoint.models import hunyuan as hunyuan
from moeshard.checkpoint.models import jamba as jamba
from moeshard.checkpoint.models import mellum as mellum
from moeshard.checkpoint.models import minimax as minimax
from moeshard.checkpoint.models import olmoe as olmoe
from moeshard.checkpoint.models import phimoe as phimoe
from moeshard.checkpoint.models import qwen3_5_moe as qwen3_5_moe
from moeshard.checkpoint.models import qwen3_next as qwen3_next
from moeshard.checkpoint.models import refusals as refusals
