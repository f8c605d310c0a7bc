"""``moeshard bench``: GPU performance of the expert kernels and the layer, as ratios against
ceilings and baselines measured in the same run.

One concern per module:

* ``device``    refuse without CUDA; describe the machine and software.
* ``timing``    CUDA-event timing with warm-up, L2 flush between repetitions, CUDA-graph replay.
* ``ceilings``  dense bf16 matmul rate (8192^3) and device copy bandwidth.
* ``workload``  named shapes (presets at full size), random weights on the GPU, realistic
                routing, FLOP and weight-byte counts.
* ``baselines`` ``torch._grouped_mm`` (GEMMs only), the portable ``GroupedExperts`` pipeline,
                a per-expert loop, ``torch._scaled_grouped_mm`` for row-scaled fp8.
* ``runner``    runs every (model, tokens, quant) case and derives the ratios.
* ``targets``   the performance targets, evaluated on a run's records.
* ``tune``      tile-shape sweeps of the grouped GEMM (``--tune``).
* ``report``    rich table, JSON, PNG plot of the ratios.
"""
