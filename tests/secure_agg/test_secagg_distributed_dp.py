"""Quantise, add distributed discrete Gaussian shares, securely sum, decode: the path the release pipeline takes."""

import math

import numpy as np
import pytest

from privfl.mechanisms.discrete_gaussian import (discrete_gaussian_variance, distributed_discrete_gaussian_event,
                                          local_sigma, sample_discrete_gaussian)
from privfl.secure_agg import ClientSession, ProtocolAbort, Quantiser, ServerSession, SessionConfig, noise_headroom, run_round

pytestmark = pytest.mark.timeout(120)


def test_noisy_secure_sum_carries_the_central_noise_and_aborts_below_n_min():
    rng = np.random.default_rng(0)
    n, n_min, d, central = 10, 8, 4000, 40.0
    sigma = local_sigma(central, n_min)
    headroom = noise_headroom(central * math.sqrt(n / n_min))  # up to n shares may be summed
    q = Quantiser(low=-1.0, high=1.0, bits=32, n_clients=n, noise_headroom=headroom)
    x = {f"c{i}": rng.uniform(-1, 1, size=d) for i in range(n)}
    ints = {k: q.to_integers(v, rng) for k, v in x.items()}
    words = {k: q.encode(ints[k] + sample_discrete_gaussian(sigma, d, rng=rng)) for k in x}

    result = run_round(words, bits=32, min_inputs=n_min, drop_at={"masked_input": ["c0", "c1"]})
    assert len(result.included) == n_min
    noise = q.centred(result.sum) - sum(ints[k] for k in result.included)
    var = n_min * discrete_gaussian_variance(sigma)
    assert abs(noise.var() - var) < 5 * var * math.sqrt(2 / d)
    assert np.allclose(q.decode_sum(result.sum, n_min), sum(x[k] for k in result.included),
                       atol=n_min * q.step + 8 * math.sqrt(var) * q.step)

    with pytest.raises(ProtocolAbort):
        run_round(words, bits=32, min_inputs=n_min, drop_at={"masked_input": ["c0", "c1", "c2"]})

    event = distributed_discrete_gaussian_event(l2_sensitivity=q.rounded_l2_sensitivity(math.sqrt(d), d),
                                                sigma=sigma, n_min=n_min, n_max=n, dimension=d)
    assert event.rho > 0


def test_clients_can_be_driven_through_generic_handle_and_dict_transport():
    config = SessionConfig.create(range(1, 6), bits=16, dimension=5)
    wire = SessionConfig.from_dict(config.to_dict())  # every party rebuilds the public config from the wire
    values = {c: np.full(5, c, dtype=np.uint64) for c in config.client_ids}
    server = ServerSession(wire)
    clients = {c: ClientSession(wire, c, values[c]) for c in config.client_ids}
    from privfl.secure_agg import message_from_dict

    def deliver(message, handler):
        reply = handler(message_from_dict(message.to_dict()))
        assert server.receive(message_from_dict(reply.to_dict()))

    for c in clients:
        server.receive(message_from_dict(clients[c].advertise_keys().to_dict()))
    for c, m in server.key_directories().items():
        deliver(m, clients[c].handle)
    for c, m in server.share_deliveries().items():
        deliver(m, clients[c].handle)
    request = server.unmask_request()
    for c in request.alive:
        deliver(request, clients[c].handle)
    assert server.finalize().sum.tolist() == [15] * 5
