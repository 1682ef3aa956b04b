"""Per-example Fisher: the hooks equal the torch.func reference, the recorder reads a training step's own backward,
and the accumulated, clipped, capped Fisher moves by at most C^2 on neighbouring data."""

import numpy as np
import pytest
import torch
from torch import nn

from privfl.errors import ConfigurationError
from privfl.training.fisher import (FisherAccumulator, GradientRecorder, per_example_fisher, per_example_gradients,
                           unsupported_parameters)




def mlp(dtype=torch.float64, bias=True):
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 9, bias=bias), nn.ReLU(), nn.Linear(9, 7), nn.ReLU(),
                         nn.Linear(7, 4)).to(dtype)


def convnet(dtype=torch.float64):
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(3, 4, 3, stride=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(4 * 2 * 2, 5)).to(dtype)


def data(shape, n=13, classes=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(n, *shape, generator=g, dtype=dtype), torch.randint(0, classes, (n,), generator=g)


def reference(model, x, y, clip):
    g = per_example_gradients(model, x, y)
    c = torch.ones(len(x), dtype=g.dtype) if clip is None else (clip / (g.norm(dim=1) + 1e-6)).clamp(max=1.0)
    return (c[:, None] ** 2 * g ** 2).sum(dim=0), g.norm(dim=1)


@pytest.mark.parametrize("clip", [None, 0.3])
@pytest.mark.parametrize("make, shape, classes", [(mlp, (12,), 4), (lambda: mlp(bias=False), (3, 4), 4),
                                                  (convnet, (2, 8, 8), 5)])
def test_hooks_equal_the_torch_func_reference(make, shape, classes, clip):
    model = make()
    x, y = data(shape, classes=classes)
    ref, norms = reference(model, x, y, clip)
    got = per_example_fisher(model, x, y, clip=clip, method="hooks")
    torch.testing.assert_close(got.squared, ref, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(got.norms, norms, rtol=1e-6, atol=1e-12)
    if clip is not None:
        assert got.norms.max() > clip  # the clip was active
    assert all(p.grad is None for p in model.parameters())  # a Fisher pass leaves the model's gradients alone


def test_float32_hooks_agree_with_float64_reference():
    model32, model64 = mlp(torch.float32), mlp(torch.float64)
    x, y = data((12,))
    ref, _ = reference(model64, x, y, 0.5)
    got = per_example_fisher(model32, x.float(), y, clip=0.5)
    torch.testing.assert_close(got.squared.double(), ref, rtol=1e-4, atol=1e-7)


def test_recorder_reads_a_mean_loss_training_step():
    model = mlp()
    x, y = data((12,))
    with GradientRecorder(model) as rec:
        loss = nn.functional.cross_entropy(model(x), y) + 0.1 * sum(p.pow(2).sum() for p in model.parameters())
        loss.backward()  # the penalty flows to the parameters, not through the layers' outputs
        got = rec.batch_fisher(None, scale=len(x))
    ref, _ = reference(model, x, y, None)
    torch.testing.assert_close(got.squared, ref, rtol=1e-6, atol=1e-12)
    # hooks are removed on exit: further passes record nothing
    model(x).sum().backward()
    assert all(layer.inputs is None for layer in rec.layers)


def test_unsupported_layers_fall_back_to_torch_func():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3)).double()
    x, y = data((6,), classes=3)
    assert unsupported_parameters(model) == ["1.weight", "1.bias"]
    with pytest.raises(ConfigurationError, match="LayerNorm|1.weight"):
        GradientRecorder(model)
    got = per_example_fisher(model, x, y, clip=1.0)  # auto -> func
    g = torch.stack([torch.cat([t.reshape(-1) for t in torch.autograd.grad(
        nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters()))]) for i in range(len(x))])
    c = (1.0 / (g.norm(dim=1) + 1e-6)).clamp(max=1.0)
    torch.testing.assert_close(got.squared, (c[:, None] ** 2 * g ** 2).sum(0), rtol=1e-6, atol=1e-12)


def _accumulate(model, x, y, batches, clip, max_visits):
    acc = FisherAccumulator(sum(p.numel() for p in model.parameters()), len(x), clip=clip, max_visits=max_visits,
                            dtype=torch.float64)
    for ids in batches:
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids):
            acc.add(model, x[torch.from_numpy(ids)], y[torch.from_numpy(ids)], ids)
    return acc


@pytest.mark.parametrize("seed", range(6))
def test_accumulated_clipped_fisher_moves_by_at_most_c_squared_on_neighbouring_data(seed):
    """Add/remove one record: every batch loses that record (others keep their ids), the per-visit Fisher moves by
    at most C^2 however often the record was sampled (the cap), and without the cap it could move by more."""
    rng = np.random.default_rng(seed)
    model = mlp()
    n, epochs, clip = 10, 3, float(rng.uniform(0.05, 2.0))
    x, y = data((12,), n=n, seed=seed)
    batches = [rng.choice(n, size=rng.integers(0, 6), replace=False) for _ in range(12)]  # Poisson-like repeats
    j = int(rng.integers(n))
    batches[0] = np.append(batches[0][batches[0] != j], j)  # j is sampled at least once
    neighbour = [b[b != j] for b in batches]
    full = _accumulate(model, x, y, batches, clip, epochs)
    without = _accumulate(model, x, y, neighbour, clip, epochs)
    moved = float((full.per_visit() - without.per_visit()).norm())
    assert 0 < moved <= full.record_bound() * (1 + 1e-9) == clip ** 2 * (1 + 1e-9)
    assert full.visits.max() <= epochs
    # the statistic counts record j's admitted visits exactly: its own clipped squared gradient each time
    own = per_example_fisher(model, x[j:j + 1], y[j:j + 1], clip=clip).squared
    visits_j = min(epochs, sum(int(j in b) for b in batches))
    torch.testing.assert_close(full.total - without.total, visits_j * own, rtol=1e-9, atol=1e-12)


def test_the_cap_bounds_a_repeatedly_sampled_record():
    model = mlp()
    x, y = data((12,), n=4)
    clip = 0.1
    batches = [np.array([0, 1])] * 5  # record 0 sampled five times
    one = per_example_fisher(model, x[:1], y[:1], clip=clip).squared
    assert 0 < float(one.norm()) <= clip ** 2  # ||c g (.) c g||_2 <= ||c g||_2^2 <= C^2
    drop = [b[b != 0] for b in batches]
    capped = _accumulate(model, x, y, batches, clip, 2).total - _accumulate(model, x, y, drop, clip, 2).total
    uncapped = _accumulate(model, x, y, batches, clip, None).total - _accumulate(model, x, y, drop, clip, None).total
    torch.testing.assert_close(capped, 2 * one, rtol=1e-9, atol=1e-12)  # two admitted visits, then weight 0
    torch.testing.assert_close(uncapped, 5 * one, rtol=1e-9, atol=1e-12)  # unbounded without the cap
    assert FisherAccumulator(3, 2, clip=clip).record_bound() == float("inf")


def test_accumulator_validates_its_arguments():
    with pytest.raises(ConfigurationError):
        FisherAccumulator(3, 2, clip=0.0)
    with pytest.raises(ConfigurationError):
        FisherAccumulator(3, 2, max_visits=0)
    with pytest.raises(ConfigurationError):
        per_example_fisher(mlp(), *data((12,)), method="loop")
