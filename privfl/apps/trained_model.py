"""The model a run trained, as the run's JSON describes it (:func:`trained_model_description`: ``"model"``, and
:func:`user_model_description` for the user's own module) and as ``--save-model`` writes it (:func:`save_model`:
torch state_dicts). ``privfl run`` and ``privfl compare`` both use it. torch is imported only when a model is
described or saved.
"""

from __future__ import annotations

import os


#: what the user's own module is in algorithms where it is not the whole trained model (elsewhere: the trained model,
#: in place of the built-in architecture)
USER_MODEL_ROLES = {"hbfl": "the clients' local models (the released meme is privfl's: model, hidden)",
                    "fedbnr": "the feature extractor under the random Fourier features"}


def module_description(net) -> dict:
    """A torch module as the run JSON describes it: its class, the module that defines it, its parameter count."""
    return {"class": type(net).__name__, "module": type(net).__module__,
            "parameters": int(sum(p.numel() for p in net.parameters()))}


def user_model_description(model) -> dict:
    """The user's own model (an ``nn.Module``, or a zero-argument factory: built once, with torch's random state
    left as it was) as :func:`module_description` describes it, with the factory's name when it is one."""
    import torch

    if isinstance(model, torch.nn.Module):
        return module_description(model)
    with torch.random.fork_rng(devices=[]):  # describing the model must not move the run's generator
        out = {**module_description(model()), "factory": getattr(model, "__qualname__", type(model).__name__)}
    return out


def trained_model_description(algorithm, fed, user_model=None) -> dict | None:
    """The model a run trained, for its JSON (``"model"``): the global model's class, defining module and parameter
    count, and ``"own": true`` with the user's module or the built-in architecture's name, hidden widths and pooling;
    FedBNR's Bayesian linear regression (features and the size of its posterior mean); FedBNN's per-client models
    (the first one's description and their number); None where the algorithm holds none of these."""
    try:
        return _trained_model_description(algorithm, fed, user_model)
    except (AttributeError, TypeError, RuntimeError):  # a state a runtime did not keep: the run stands without it
        return None


def _trained_model_description(algorithm, fed, user_model) -> dict | None:
    import numpy as np
    import torch

    built_in = {"own": False, "name": fed.model, "hidden": fed.hidden, "pool": fed.pool}
    own = {"own": True} if user_model is not None and algorithm.name not in USER_MODEL_ROLES else built_in
    net = algorithm.global_model() if callable(getattr(algorithm, "global_model", None)) else None
    if isinstance(net, torch.nn.Module):
        return {**module_description(net), **own}
    posterior = getattr(algorithm, "posterior", None)
    if posterior is not None and hasattr(posterior, "mean"):
        features = getattr(algorithm, "feature_map", None)
        features = getattr(features, "__self__", features)  # a kernel network's bound features method
        out = {"class": "BLRPredictor", "module": "privfl.algorithms.fedbnr",
               "parameters": int(np.size(posterior.mean)), "posterior": "Bayesian linear regression on "
               f"{int(np.size(posterior.mean))} kernel features", "features": type(features).__name__}
        if hasattr(features, "linear_share"):
            out["linear_share"] = features.linear_share
        if user_model is not None:
            out["extractor"] = user_model_description(user_model)
        return out
    models = getattr(algorithm, "models", None)
    if isinstance(models, dict) and models:
        first = models[min(models)]
        return {**module_description(first), **own, "per_client": len(models)}
    return None


def trained_state(algorithm) -> dict:
    """The trained model(s) of ``algorithm`` as torch state_dicts: the global model's (FedAvg family, FOLA's mean,
    HBFL's meme model at the global posterior), or, for FedBNN, one personalised model per client
    (``{"client_<k>": state_dict}``), or FedBNR's last-layer posterior (``mean``, ``precision`` tensors)."""
    import copy

    import torch

    from privfl.errors import ConfigurationError
    from privfl.training.local import load_flat_parameters

    if callable(getattr(algorithm, "global_model", None)):
        return algorithm.global_model().state_dict()
    vector = getattr(algorithm, "global_params", None)
    if vector is None and algorithm.name == "fola":
        vector = getattr(algorithm, "mean", None)
    model = getattr(algorithm, "model", None)
    if model is not None and vector is not None:
        model = copy.deepcopy(model)
        load_flat_parameters(model, vector)
        return model.state_dict()
    models = getattr(algorithm, "models", None)
    if isinstance(models, dict) and models:
        return {f"client_{k}": m.state_dict() for k, m in sorted(models.items())}
    posterior = getattr(algorithm, "posterior", None)
    if posterior is not None:
        return {"mean": torch.as_tensor(posterior.mean), "precision": torch.as_tensor(posterior.precision)}
    raise ConfigurationError(f"{algorithm.name} holds no trained model to save; drop --save-model")


def save_model(algorithm, path: str) -> str:
    """Write :func:`trained_state` with ``torch.save``; returns the path."""
    import torch

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save(trained_state(algorithm), path)
    return path


__all__ = ["USER_MODEL_ROLES", "module_description", "save_model", "trained_model_description", "trained_state",
           "user_model_description"]
