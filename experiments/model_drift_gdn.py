"""The Gated DeltaNet state keepers of ``experiments.model_drift``: every layer's recurrent
state under each precision policy, for ``experiments.gdn_lm.Decoder``.

A keeper is the decoder's ``gdn_step(layer, q, k, v, g, beta) -> y``, with the rows of the
batch grouped by arm (``arm * S + segment``, ``S`` segments), an arm a
``model_drift.PolicySpec`` or None for the exact state:

- ``ReferenceGDN`` (CPU): one ``lowprec.policies.Simulator('gdn', ...)`` per arm and layer in
  fp64 (``a = exp(g)``); the exact arm ``Policy('exact')``.
- ``EmulationGDN`` (GPU; CPU under Triton's interpreter for tiny runs): one emulation cache per
  arm and layer, fp32: ``emulation.gdn_state_update.StateCache`` for every_step and for the
  exact arm (an fp32 state, whose rounding is the identity), advanced by ``gdn_state_update``
  with the output read from the stored state; ``emulation.gdn_replay_decode.GDNReplayCache``
  for the windowed arms, advanced by ``gdn_replay_decode`` (separate_exact keeps an fp32
  recurrence copy, separate_fp16sr an fp16 SR one, shared hi = lo = FORMAT with RN, so only
  element formats there).

Both draw SR words as ``lowprec.policies`` does, so the two agree up to fp32 against fp64.
"""

from __future__ import annotations

import torch

from experiments import gdn_lm
from lowprec.policies import Policy, Simulator, make_policy

__all__ = ["ReferenceGDN", "EmulationGDN", "HI_COPY"]

# windowed arm -> (hi_format, hi_rounding) of its cache; shared's is its own format and rounding
HI_COPY = {"separate_exact": ("fp32", "rn"), "separate_fp16sr": ("fp16", "sr")}


def _shape(model: gdn_lm.GDNLM, segments: int) -> tuple[int, int, int, int]:
    c = model.config
    return (segments, c.linear_num_value_heads, c.linear_value_head_dim, c.linear_key_head_dim)


class ReferenceGDN:
    """``lowprec.policies.Simulator('gdn')`` per arm and layer, fp64 (module docstring)."""

    def __init__(self, model: gdn_lm.GDNLM, arms, c):
        self.S = c.segments
        policies = [Policy("exact", window=c.window) if s is None else
                    make_policy(s.arm, s.fmt, s.rounding, window=c.window, seed=c.seed)
                    for s in arms]
        self.sims = [[Simulator("gdn", p, *_shape(model, c.segments), dtype=torch.float64)
                      for _ in range(model.config.num_hidden_layers)] for p in policies]

    def __call__(self, layer, q, k, v, g, beta):
        a = torch.exp(g)
        S = self.S
        return torch.cat([sims[layer].step(a[i * S:(i + 1) * S], v[i * S:(i + 1) * S],
                                           k[i * S:(i + 1) * S], q[i * S:(i + 1) * S],
                                           beta[i * S:(i + 1) * S])
                          for i, sims in enumerate(self.sims)])


class EmulationGDN:
    """An emulation cache per arm and layer, fp32 (module docstring)."""

    def __init__(self, model: gdn_lm.GDNLM, arms, c):
        from emulation.gdn_replay_decode import GDNReplayCache
        from emulation.gdn_state_update import StateCache

        self.S = c.segments
        self.check = c.device == "cpu"  # on CUDA no per-call counter read (a stream sync)
        shape = _shape(model, c.segments)
        self.caches = []
        for spec in arms:
            layers = []
            for _ in range(model.config.num_hidden_layers):
                if spec is None or spec.arm == "every_step":
                    fmt, rnd = ("fp32", "rn") if spec is None else (spec.fmt, spec.rounding)
                    layers.append(StateCache.empty(*shape, format=fmt, rounding=rnd, seed=c.seed,
                                                   device=c.device))
                    continue
                hi = HI_COPY.get(spec.arm, (spec.fmt, spec.rounding))
                layers.append(GDNReplayCache.empty(
                    *shape, window=c.window, hi_format=hi[0], hi_rounding=hi[1],
                    lo_format=spec.fmt, seed=c.seed, act_dtype=torch.float32, device=c.device))
            self.caches.append(layers)

    def __call__(self, layer, q, k, v, g, beta):
        from emulation.gdn_replay_decode import GDNReplayCache, gdn_replay_decode
        from emulation.gdn_state_update import gdn_state_update

        S = self.S
        # one copy each: a row block of a contiguous tensor is contiguous, as the kernels need
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        ys = []
        for i, layers in enumerate(self.caches):
            cache = layers[layer]
            rows = slice(i * S, (i + 1) * S)
            args = (cache, q[rows], k[rows], v[rows], g[rows], beta[rows])
            if isinstance(cache, GDNReplayCache):
                ys.append(gdn_replay_decode(*args, check_counters=self.check))
            else:
                ys.append(gdn_state_update(*args, output_from="stored",
                                           check_counters=self.check))
        return torch.cat(ys)
