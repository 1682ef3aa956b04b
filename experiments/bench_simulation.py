"""Simulation speed: privfl's federated round against hand-written loops, printed as ``key=value`` lines measured
side by side in one run (``torch.set_num_threads(1)``, BLAS pools limited to one thread everywhere).

- ``fedavg_over_hand_100`` / ``fedavg_over_hand_1000``: one privfl FedAvg round (``Simulation``, vectorised executor,
  every release through its client's pipeline and ledger, test-set evaluation) over one round of a hand-written
  PyTorch FedAvg loop (one model, parameters loaded per client, ``torch.optim.SGD``, weighted average, the same
  evaluation), MLP 784-100-10, 100 and 1,000 IID clients of MNIST-5k. Goal <= 1.0.
- ``dpsgd_over_hand_100``: one record-level DP-SGD FedAvg round (``dpsgd_fedavg``, epsilon 3) over a hand-written
  opacus loop with the same noise multiplier, clip, sampling rate, steps and noise mode (``GradSampleModule`` +
  ``DPOptimizer`` per client, ``secure_mode`` as privfl's default secure noise), 100 clients. Goal <= 1.3.
- ``clients_per_s_tiny``: clients trained and released per second in one FedAvg round of 10,000 clients of a
  1,970-weight model (logistic regression on 2x2-pooled MNIST, ``FederationConfig(hidden=(), pool=2)``). MNIST-5k
  has 4,000 training images, so each client holds 8 drawn from them (clients overlap; the compute is what is timed).

Each ratio is the median of per-repeat ratios, privfl and the hand loop alternating, so load on a shared machine
hits both alike. Run: ``python experiments/bench_simulation.py`` (a few minutes on 2 cores).

Usage: python experiments/bench_simulation.py [--repeats 3] [--smoke]

``--smoke``: one repeat, and every federation shrunk to a few clients of 8 MNIST-5k images each (4 and 8 clients for
the FedAvg ratios, 4 for DP-SGD, 40 for ``clients_per_s_tiny``); every phase runs and every key is printed under its
default name (``fedavg_over_hand_1000`` then measures 8 clients), in seconds: a smoke test, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import statistics
import time
import warnings

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from privfl import FederationConfig, PrivacyConfig, make_algorithm, make_federated
from privfl.data import federated_from_arrays
from privfl.runtime.engine import Simulation

NON_PRIVATE = PrivacyConfig(epsilon=math.inf, delta=1e-5)


def _process_seconds(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def privfl_round(name: str, data, fed: FederationConfig, privacy: PrivacyConfig) -> Simulation:
    """A simulation set up beforehand (noise calibrated for ``fed.rounds``) whose ``run`` then times one round."""
    sim = Simulation(make_algorithm(name, fed, privacy), data, fed, privacy)
    sim.prepare()
    sim.prepare = lambda: None  # keep the prepared state
    sim.fed = dataclasses.replace(fed, rounds=1)
    return sim


def _hand_mlp(data, seed: int):
    """The MLP 784-100-10 a user writes by hand, its starting parameters and the clients' tensors."""
    torch.manual_seed(seed)
    x0 = data.train_parts[0].x
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(np.prod(x0.shape[1:])), 100),
                                torch.nn.ReLU(), torch.nn.Linear(100, data.num_classes))
    global_state = [p.detach().clone() for p in model.parameters()]
    return model, global_state, [p.tensors() for p in data.train_parts]


def hand_fedavg_round(data, fed: FederationConfig, seed: int = 0):
    """The naive FedAvg round a user writes by hand in PyTorch."""
    model, global_state, parts = _hand_mlp(data, seed)
    test_x, test_y = data.test.tensors()
    rng = np.random.default_rng(seed)

    def one_round():
        total = [torch.zeros_like(p) for p in global_state]
        weight = 0.0
        for x, y in parts:
            with torch.no_grad():
                for p, g in zip(model.parameters(), global_state):
                    p.copy_(g)
            opt = torch.optim.SGD(model.parameters(), lr=fed.lr, momentum=fed.momentum)
            for _ in range(fed.local_epochs):
                order = torch.as_tensor(rng.permutation(len(x)))
                for s in range(0, len(x), fed.batch_size):
                    idx = order[s:s + fed.batch_size]
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                    opt.step()
            with torch.no_grad():
                for t, p in zip(total, model.parameters()):
                    t.add_(p, alpha=len(x))
            weight += len(x)
        with torch.no_grad():
            for g, t in zip(global_state, total):
                g.copy_(t / weight)
            for p, g in zip(model.parameters(), global_state):
                p.copy_(g)
            (model(test_x).argmax(1) == test_y).float().mean()
    return one_round


def hand_opacus_round(data, fed: FederationConfig, sim: Simulation, seed: int = 0):
    """A hand-written opacus DP-SGD FedAvg round with privfl's schedule and noise multiplier for these clients."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    from privfl.privacy.record_level import dpsgd_schedule

    alg = sim.algorithm
    schedule = dpsgd_schedule(alg, 0)
    z = alg.noise_multiplier(schedule)
    model, global_state, parts = _hand_mlp(data, seed)
    gen = torch.Generator().manual_seed(seed)

    def one_round():
        total = [torch.zeros_like(p) for p in global_state]
        for x, y in parts:
            with torch.no_grad():
                for p, g in zip(model.parameters(), global_state):
                    p.copy_(g)
            gsm = GradSampleModule(model)
            opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=fed.lr, momentum=fed.momentum),
                              noise_multiplier=z, max_grad_norm=sim.privacy.clip,
                              expected_batch_size=schedule.expected_batch, generator=gen,
                              secure_mode=sim.privacy.secure_noise)
            sampler = UniformWithReplacementSampler(num_samples=len(x), sample_rate=schedule.sample_rate,
                                                    generator=gen, steps=schedule.steps_per_epoch)
            for _ in range(schedule.epochs):
                for batch in sampler:
                    opt.zero_grad()
                    if len(batch):
                        idx = torch.as_tensor(batch)
                        torch.nn.functional.cross_entropy(gsm(x[idx]), y[idx]).backward()
                    else:
                        for p in gsm.parameters():
                            p.grad_sample = torch.zeros((0, *p.shape))
                    opt.step()
            gsm._close()
            with torch.no_grad():
                for t, p in zip(total, model.parameters()):
                    t.add_(p)
        with torch.no_grad():
            for g, t in zip(global_state, total):
                g.copy_(t / len(parts))
    return one_round


def ratio(make_ours, hand, repeats: int) -> tuple[float, float]:
    """Median over repeats of (ours / hand) in wall time and in CPU time, the two alternating. ``make_ours()`` sets
    up a fresh privfl round (a ledger row is released once), untimed."""
    make_ours().run(), hand()  # warm up
    walls, cpus = [], []
    for _ in range(repeats):
        w1, c1 = _process_seconds(make_ours().run)
        w2, c2 = _process_seconds(hand)
        walls.append(w1 / w2)
        cpus.append(c1 / c2)
    return statistics.median(walls), statistics.median(cpus)


def tiny_federation(n_clients: int, per_client: int = 8, seed: int = 0):
    base = make_federated("mnist5k", 10, partition="iid", seed=seed)
    x = np.concatenate([p.x for p in base.train_parts])
    y = np.concatenate([p.y for p in base.train_parts])
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(n_clients):
        idx = rng.choice(len(x), size=per_client, replace=False)
        parts.append((x[idx], y[idx]))
    return federated_from_arrays(parts, (base.test.x, base.test.y), task="classification",
                                 num_classes=base.num_classes, name="mnist5k-tiny", design_size=per_client)


# the clients of each phase by default, and under --smoke (where the keys keep their default names)
SIZES = {"fedavg": (100, 1000), "dpsgd": 100, "tiny": 10_000}
SMOKE_SIZES = {"fedavg": (4, 8), "dpsgd": 4, "tiny": 40}


def iid_federation(n_clients: int, smoke: bool):
    """``n_clients`` IID clients of MNIST-5k, or under ``--smoke`` ``n_clients`` clients of 8 of its images each."""
    return tiny_federation(n_clients) if smoke else make_federated("mnist5k", n_clients, partition="iid", seed=0)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each ratio (the FedAvg ones: 2x + 1)")
    parser.add_argument("--smoke", action="store_true", help="one repeat, a few clients (a smoke test; seconds)")
    args = parser.parse_args(argv)
    repeats = 1 if args.smoke else args.repeats
    sizes = SMOKE_SIZES if args.smoke else SIZES
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Full backward hook")  # opacus's hooks on inputs without grad
    print(f"machine={platform.machine()} cpus={os.cpu_count()} cpu_model={_cpu_model()} "
          f"python={platform.python_version()} torch={torch.__version__} torch_threads=1")
    fed = FederationConfig(rounds=1, hidden=(100,), local_epochs=1, batch_size=32, lr=0.05)
    for label, n in zip(SIZES["fedavg"], sizes["fedavg"]):
        data = iid_federation(n, args.smoke)
        assert privfl_round("fedavg", data, fed, NON_PRIVATE).vectorised
        wall, cpu = ratio(lambda: privfl_round("fedavg", data, fed, NON_PRIVATE), hand_fedavg_round(data, fed),
                          2 * repeats + 1)  # short rounds: more repeats for a steadier median
        print(f"fedavg_over_hand_{label}={wall:.2f}")
        print(f"fedavg_over_hand_{label}_cpu={cpu:.2f}")

    data = iid_federation(sizes["dpsgd"], args.smoke)
    private = PrivacyConfig(epsilon=3.0, delta=1e-5, unit="example", clip=1.0)
    dp_fed = FederationConfig(rounds=20, hidden=(100,), local_epochs=1, batch_size=8, lr=0.05)
    sim = privfl_round("dpsgd_fedavg", data, dp_fed, private)
    wall, cpu = ratio(lambda: privfl_round("dpsgd_fedavg", data, dp_fed, private),
                      hand_opacus_round(data, dp_fed, sim), repeats)
    print(f"dpsgd_over_hand_100={wall:.2f}")
    print(f"dpsgd_over_hand_100_cpu={cpu:.2f}")

    tiny = tiny_federation(sizes["tiny"])
    tiny_fed = FederationConfig(rounds=1, hidden=(), pool=2, local_epochs=1, batch_size=8, lr=0.1)
    sim = privfl_round("fedavg", tiny, tiny_fed, NON_PRIVATE)
    assert sim.vectorised and sim.algorithm.dim == 1970
    sim.run()  # warm up
    seconds = min(_process_seconds(privfl_round("fedavg", tiny, tiny_fed, NON_PRIVATE).run)[0]
                  for _ in range(repeats))
    print(f"clients_per_s_tiny={sizes['tiny'] / seconds:.0f}")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip().replace(" ", "_")
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    with threadpool_limits(limits=1, user_api="blas"):
        main()
