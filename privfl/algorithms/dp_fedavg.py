"""DP-FedAvg with client-level privacy (McMahan et al., ICLR 2018): each client's model change is clipped to L2 norm C,
the server adds Gaussian noise of std z * C to the unweighted sum and divides by the number of participants.

The clip is the channel's :class:`NormClip`, applied by the release pipeline; the noise is added by the pipeline
(``local`` placement) or by the aggregator (``central``, a trusted server, the paper's setting). Weights are uniform:
example counts would make a client's influence, and hence the sensitivity, data-dependent.
"""

from __future__ import annotations

from privfl.algorithms.fedavg import FedAvg
from privfl.privacy.units import channel as unit_channel


class DPFedAvg(FedAvg):
    name = "dp_fedavg"
    units = ("client",)  # the privacy units it gives a guarantee at: client level only
    unit_hint = "for record-level DP use dpsgd_fedavg"
    supports_privacy = True
    # Client-level noise on the average is z*C/n per coordinate (z ~ 6 for epsilon 3 over 20 rounds, n = 10), so
    # the total noise grows with sqrt(#parameters): a logistic regression on 2x2-pooled images (1,970 weights)
    # with a small clip is what keeps a 10-client federation above chance (see the README's measurements).
    defaults = {"hidden": (), "pool": 2, "local_epochs": 2, "lr": 0.1, "clip": 0.1}

    def channels(self):
        return [unit_channel(self.privacy, "update", (self.dim,), description="local model change, clipped to C")]

    def release_weight(self, dataset, client: int = 0) -> float:
        return 1.0
