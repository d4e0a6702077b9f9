"""CuTe DSL kernels of ReplaySSM decode for the H200 (sm_90a; compiles on the CPU).

Import the submodules (importing this package stays free of CUDA and cutlass):

    cute_kernels.cache                 ReplayCache, StateCache: the packed caches, their checks
    cute_kernels.replay_decode         mamba2_replay_decode: one decode step (both kernels)
    cute_kernels.replay_output         mamba2_replay_output: the non-flush step
    cute_kernels.replay_output_config  its configuration and the rules that pick it
    cute_kernels.replay_output_warp    its warp-level pieces (conversions, dots, decay weights)
    cute_kernels.replay_flush          mamba2_replay_flush: the flush
    cute_kernels.replay_flush_config   its configuration and defaults (flush_config)
    cute_kernels.replay_flush_fold     its ring folds on the tensor cores
    cute_kernels.state_update          mamba2_state_update: the conventional step (the baseline)
    cute_kernels.numerics              rounding math (SR, RN, E4M3/E2M1, Philox) on DSL scalars
    cute_kernels.ptx                   the inline-PTX helpers
    cute_kernels.tensor_core           mma.sync and its operand helpers

Names and argument order are those of `emulation/`; docs/kernels.md draws thread ownership,
docs/performance.md holds the measurements behind every default.
"""
