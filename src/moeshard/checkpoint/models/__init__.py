"""Model families beyond the built-in entries of ``families.FAMILIES``: one module per family (or
per group of model types that share one config reader), each registering its ``ModelFamily``
entries with ``register_family`` at import, and any routing or activation kind they need with
``register_routing`` / ``register_activation``, so that every stage reads them as data.

The ``moeshard.checkpoint`` package imports this package once, after ``families``, so every
family is known wherever ``FAMILIES`` is read. A new module is one import line below.
"""

from moeshard.checkpoint.models import (
    afmoe,  # noqa: F401  afmoe, hy_v3
    aria,  # noqa: F401  aria_text, aria
    cohere2_moe,  # noqa: F401
    dbrx,  # noqa: F401
    deepseek_ocr2,  # noqa: F401  deepseek_ocr2_text
    deepseek_routed,  # noqa: F401  mimo_v2_flash, beam
    deepseek_v2,  # noqa: F401
    deepseek_v3_style,  # noqa: F401  glm4_moe, glm4_moe_lite, dots1, exaone_moe, deepseek_v32, glm_moe_dsa, solar_open,
    # axk2, sarvam_moe, sarvam_mla, dots3_note_text, axk1
    deepseek_v4,  # noqa: F401
    ernie,  # noqa: F401
    flint,  # noqa: F401
    gemma4,  # noqa: F401
    glm5_next,  # noqa: F401  glm5_next_text
    gpt_oss,  # noqa: F401
    granite,  # noqa: F401
    hunyuan,  # noqa: F401
    hy_v4,  # noqa: F401  hy_v4, hy_v4_vl_text
    inkling,  # noqa: F401  inkling_text
    inkling2,  # noqa: F401  inkling2_text, inkling2_loop_text
    jamba,  # noqa: F401
    jetmoe,  # noqa: F401
    kimi_linear,  # noqa: F401  kimi_linear, bailing_hybrid
    kolibri1,  # noqa: F401
    laguna,  # noqa: F401
    lara_mini,  # noqa: F401
    lfm2_moe,  # noqa: F401
    llama4,  # noqa: F401
    longcat_flash,  # noqa: F401
    mellum,  # noqa: F401
    minimax,  # noqa: F401
    minimax_m2,  # noqa: F401
    minimax_m3,  # noqa: F401  minimax_m3_vl_text, minimax_m3_vl
    mistral4,  # noqa: F401
    nemotron_h,  # noqa: F401
    olmoe,  # noqa: F401
    phimoe,  # noqa: F401
    qwen3_5_moe,  # noqa: F401  qwen3_5_moe_text, qwen4_exp_text
    qwen3_next,  # noqa: F401
    qwen3_vl_moe,  # noqa: F401  qwen3_vl_moe_text
    refusals,  # noqa: F401
    unlimited_ocr,  # noqa: F401  unlimited_ocr_text
    zaya,  # noqa: F401
)
