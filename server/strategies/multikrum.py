"""Multi-Krum (Blanchard et al. 2017; El Mhamdi et al. 2018): the mean of the
num_clients_to_keep updates of best Krum score, as Flower's MultiKrum
(flwr/serverapp/strategy/multikrum.py: keeps 1 unless told, which is Krum). The scores, the
memory bound and the weighting are Krum's (krum.py); only the table row differs."""

from __future__ import annotations

from fedgpu.server.strategies.krum import Krum


class MultiKrum(Krum):
    name = "multikrum"
