"""Networks of the seed papers (MLP, LeNet5, CNN1, CNN2), their mean-field Gaussian Bayesian twins, and flat-vector
views of a model's parameters and of a Bayesian model's (mean, precision)."""

from privfl.models.bayes import (REPARAMETERIZATIONS, BayesConv2d, BayesLinear, BayesModule, GaussianPrior,
                                 bayes_modules, bayesian_twin, deterministic, gaussian_kl, inverse_softplus, is_bayesian, reset_std,
                                 set_generator, set_sampling, softplus)
from privfl.models.errors import ModelConfigError
from privfl.models.nets import (CNN1, CNN2, MLP, MODELS, BayesianMLP, LeNet5, PrivflNet, make_bayesian_model,
                                make_model)
from privfl.models.priors import ModelPrior, model_kl_divergence
from privfl.models.vectors import (gaussian_layout, get_mean_precision, num_parameters, parameter_layout,
                                   parameters_to_vector, set_mean_precision, split_gaussian_vectors,
                                   vector_to_parameters)

__all__ = [
    "BayesConv2d", "BayesLinear", "BayesModule", "BayesianMLP", "CNN1", "CNN2", "GaussianPrior", "LeNet5", "MLP",
    "MODELS", "ModelConfigError", "ModelPrior", "PrivflNet", "REPARAMETERIZATIONS", "bayes_modules", "bayesian_twin", "deterministic",
    "gaussian_kl", "gaussian_layout", "get_mean_precision", "inverse_softplus", "is_bayesian", "make_bayesian_model",
    "make_model", "model_kl_divergence", "num_parameters", "parameter_layout", "parameters_to_vector", "reset_std",
    "set_generator", "set_mean_precision", "set_sampling", "softplus", "split_gaussian_vectors",
    "vector_to_parameters",
]
