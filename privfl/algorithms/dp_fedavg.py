"""DP-FedAvg with client-level privacy (McMahan et al., ICLR 2018): each client's model change is clipped to L2 norm C,
the server adds Gaussian noise of std z * C to the unweighted sum and divides by the number of participants.

The clip is the channel's :class:`NormClip`, applied by the release pipeline; the noise is added by the pipeline
(``local`` placement) or by the aggregator (``central``, a trusted server, the paper's setting). Weights are uniform:
example counts would make a client's influence, and hence the sensitivity, data-dependent.

Adaptive clipping (``clip="adaptive"``, ``PrivacyConfig.clip_quantile``; Andrew et al., NeurIPS 2021, their
client-level algorithm): round t clips at the broadcast C_t. Each client sends its change over C_t, clipped to norm 1
by the pipeline (so the ``update`` channel's sensitivity, noise and secure-aggregation range are fixed before the run
while C_t moves; the server multiplies the sum back by C_t), and on a channel of its own, ``clip_count``, its
centred bit [||change|| <= C_t] - 1/2 (norm 1/2: ``NormClip(0.5)``). The round's z is split by the one rule
(``accounting.calibration.calibrate``: each channel its ``budget_share`` of rho; the count gets
``PrivacyConfig.clip_share``), both channels are charged in every ledger, and the server moves the clip by
Andrew et al.'s geometric step on the noisy count over the *expected* number of participants (a public fact:
sampling rate x clients), ``record_level.AdaptiveClip.step``. Everything the clip rule reads is released and
noised; the clip itself is post-processing, broadcast like the model. The count's noise is that of a sum over the
round's participants: with few participants per round (10 here) its share of the budget buys a coarse estimate
(README, "Adaptive clipping").
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from privfl.algorithms.base import ClientOutput
from privfl.algorithms.fedavg import FedAvg
from privfl.core.channels import NormClip
from privfl.privacy.record_level import AdaptiveClip
from privfl.privacy.units import channel as unit_channel


class DPFedAvg(FedAvg):
    name = "dp_fedavg"
    units = ("client",)  # the privacy units it gives a guarantee at: client level only
    unit_hint = "for record-level DP use dpsgd_fedavg"
    supports_privacy = True
    adaptive_clipping = True  # PrivacyConfig.clip_quantile: the clip follows a quantile of the clients' change norms
    # Client-level noise on the average is z*C/n per coordinate (z ~ 6 for epsilon 3 over 20 rounds, n = 10), so
    # the total noise grows with sqrt(#parameters): a logistic regression on 2x2-pooled images (1,970 weights)
    # with a small clip is what keeps a 10-client federation above chance (see the README's measurements).
    defaults = {"hidden": (), "pool": 2, "local_epochs": 2, "lr": 0.1, "clip": 0.1}

    def __init__(self, fed, privacy, model=None, loss=None, optimizer=None, metrics=None):
        super().__init__(fed, privacy, model=model, loss=loss, optimizer=optimizer, metrics=metrics)
        #: adaptive clipping (``PrivacyConfig.clip_quantile``, private runs), and the round's clip C_t (broadcast)
        self.adaptive = AdaptiveClip.of(privacy)
        self.current_clip = float(privacy.clip)
        if self.adaptive:
            self.broadcast_state = ("global_params", "current_clip")

    def channels(self):
        if not self.adaptive:
            return [unit_channel(self.privacy, "update", (self.dim,), description="local model change, clipped to C")]
        share = self.adaptive.share
        return [unit_channel(self.privacy, "update", (self.dim,), client=NormClip(1.0), budget_share=1.0 - share,
                             description="local model change over the round's clip C_t, clipped to norm 1"),
                unit_channel(self.privacy, "clip_count", (1,), client=NormClip(0.5), budget_share=share,
                             description="adaptive clipping: [norm of the local model change <= C_t] - 1/2")]

    def _local_updates(self, clients, datasets, rngs, *, vectorised: bool):
        for k, out in super()._local_updates(clients, datasets, rngs, vectorised=vectorised):
            if self.adaptive:
                change = np.asarray(out.values["update"], dtype=np.float64)
                norm, clip = float(np.linalg.norm(change)), self.current_clip
                # clipped to C_t, then over C_t, written so that no clip and no change can overflow it: norm <= 1
                scaled = change / clip if norm <= clip else change / norm
                out = ClientOutput({"update": scaled, "clip_count": np.array([float(norm <= clip) - 0.5])},
                                   weight=out.weight, metrics=out.metrics)
            yield k, out

    def server_update(self, aggregates, round):
        if not self.adaptive:
            return super().server_update(aggregates, round)
        agg = aggregates["update"]  # released in units of the round's clip: FedAvg's step on it times C_t
        super().server_update({"update": replace(agg, total=agg.total * self.current_clip)}, round)
        count = float(np.asarray(aggregates["clip_count"].total, dtype=np.float64)[0])
        expected = self.privacy.sampling_rate * self.public.n_clients  # public: never the round's realised count
        self.current_clip = self.adaptive.step(self.current_clip, count, expected)

    def round_clip(self) -> float | None:
        return self.current_clip if self.adaptive else None

    def release_weight(self, dataset, client: int = 0) -> float:
        return 1.0
