"""Cost of the per-example DP Fisher: one local epoch of plain SGD against the same epoch with FOLA's online,
per-example-clipped Fisher accumulated from each step's own backward pass (``privfl.training.fisher.GradientRecorder``), side
by side in one run (interleaved repeats, medians). Goal: ``dp_fisher_over_plain <= 2``.

Also measured, for context: FOLA's example-level epoch shape (a separate Fisher pass per step), and opacus DP-SGD
(ghost clipping) alone and with that Fisher pass.

    .venv/bin/python experiments/bench_fisher.py [--n 2048] [--batch 64] [--hidden 500,300] [--repeats 5] [--smoke]

``--smoke`` sets the sizes to their smallest (``--n 64 --batch 32 --hidden 16 --repeats 1``; flags given with it
win): every variant runs and every key is printed in seconds, a smoke test whose values are not a measurement.

Prints ``key=value`` lines. Data are random 784-dimensional inputs (MNIST-sized; FOLA's 784-500-300-10 MLP by default).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import torch
from torch import nn

from privfl.privacy.record_level import DPSGDSchedule, dpsgd_train
from privfl.training.fisher import FisherAccumulator, GradientRecorder
from privfl.models import make_model
from privfl.training.local import batches


SMOKE = {"n": 64, "batch": 32, "hidden": "16", "repeats": 1}


def sgd_epoch(model, x, y, batch, rng, fisher: FisherAccumulator | None = None, separate_pass: bool = False):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    recorder = GradientRecorder(model) if fisher is not None and not separate_pass else None
    if recorder is not None:
        recorder.__enter__()
    try:
        for idx in batches(len(x), batch, rng):
            t = torch.as_tensor(idx)
            if fisher is not None and separate_pass:
                fisher.add(model, x[t], y[t], idx)
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x[t]), y[t]).backward()
            if recorder is not None:
                fisher.add_recorded(recorder, idx, scale=float(len(idx)))
            opt.step()
    finally:
        if recorder is not None:
            recorder.__exit__(None, None, None)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hidden", default="500,300")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--skip-opacus", action="store_true")
    p.add_argument("--smoke", action="store_true", help="smallest sizes (a smoke test; seconds)")
    args = p.parse_args(argv)
    if args.smoke:  # the smallest sizes as defaults, so that a flag given with --smoke still wins
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    hidden = tuple(int(h) for h in args.hidden.split(",") if h)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.n, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (args.n,), generator=g)
    torch.manual_seed(0)
    base = make_model("mlp", (1, 28, 28), 10, hidden=hidden)
    dim = sum(p.numel() for p in base.parameters())

    def fresh():
        m = make_model("mlp", (1, 28, 28), 10, hidden=hidden)
        m.load_state_dict(base.state_dict())
        return m

    variants = {
        "plain": lambda: sgd_epoch(fresh(), x, y, args.batch, np.random.default_rng(1)),
        "dp_fisher": lambda: sgd_epoch(fresh(), x, y, args.batch, np.random.default_rng(1),
                                       FisherAccumulator(dim, args.n, clip=args.clip, max_visits=1)),
        "fisher_pass": lambda: sgd_epoch(fresh(), x, y, args.batch, np.random.default_rng(1),
                                         FisherAccumulator(dim, args.n, clip=args.clip, max_visits=1),
                                         separate_pass=True),
    }
    if not args.skip_opacus:
        schedule = DPSGDSchedule.for_client(args.n, args.batch, 1)
        variants["opacus_dpsgd"] = lambda: dpsgd_train(fresh(), x, y, schedule, noise_multiplier=1.0, clip=args.clip,
                                                       lr=0.05, momentum=0.0, rng=np.random.default_rng(1))

        def dpsgd_with_fisher():
            model = fresh()
            fisher = FisherAccumulator(dim, args.n, clip=args.clip, max_visits=1)
            chunks = np.array_split(np.random.default_rng(2).permutation(args.n), schedule.steps_per_epoch)

            def fisher_pass(epoch, step):
                ids = chunks[step]
                fisher.add(model, x[torch.from_numpy(ids)], y[torch.from_numpy(ids)], ids)

            dpsgd_train(model, x, y, schedule, noise_multiplier=1.0, clip=args.clip, lr=0.05, momentum=0.0,
                        rng=np.random.default_rng(1), before_step=fisher_pass)

        variants["opacus_dpsgd_fisher"] = dpsgd_with_fisher

    for fn in variants.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():  # interleaved, so background load hits every variant alike
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model=mlp-784-{'-'.join(map(str, hidden))}-10")
    print(f"parameters={dim}")
    print(f"examples_per_epoch={args.n}")
    print(f"batch_size={args.batch}")
    print(f"threads={args.threads}")
    print(f"repeats={args.repeats}")
    for name in variants:
        print(f"{name}_epoch_s={med[name]:.4f}")
    print(f"dp_fisher_over_plain={med['dp_fisher'] / med['plain']:.3f}")
    print(f"fisher_pass_over_plain={med['fisher_pass'] / med['plain']:.3f}")
    if not args.skip_opacus:
        print(f"opacus_dpsgd_over_plain={med['opacus_dpsgd'] / med['plain']:.3f}")
        print(f"opacus_dpsgd_fisher_over_opacus_dpsgd={med['opacus_dpsgd_fisher'] / med['opacus_dpsgd']:.3f}")


if __name__ == "__main__":
    main()
