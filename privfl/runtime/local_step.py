"""What a private client sends when its local step cannot, or need not, run on its records: one rule for every
runtime (the in-process :class:`privfl.runtime.engine.Simulation`, Flower's ClientApp in :mod:`privfl.flower.app`).

- **A local step that raised.** In a private run, an exception (``Exception``, not ``BaseException``) raised by the
  algorithm's local step itself (``client_update``, ``client_updates``, the client half's) depends on the client's
  records: one far-out record can overflow a float, break a Cholesky factor, make a posterior NaN. An error in the
  release's place would tell the server so, uncharged. The client releases instead the data-independent fallback of
  every channel (``ReleasePipeline.failed_step_values``: zeros, a probability channel's uniform rows, a DP-SGD-trained
  channel's with the run plan's planned event) with the weight the algorithm would have sent
  (``FederatedAlgorithm.private_release_weight``), through its release pipeline, charged and noised as usual; only a
  :class:`privfl.core.release.LocalStepFailed` warning, on its own side, names the exception's type. The refusals made
  before any record is read (the broadcast's checks, ``check_kept_state``) and the budget's refusal are not the local
  step and stay errors; so does a :class:`privfl.errors.UsageError` raised inside it, a refusal the program decides
  alone (a model opacus cannot clip per example, a record-level step that reads its records outside DP-SGD or trains
  twice, a loss without per-example values), the same on every neighbouring dataset. A non-private run keeps raising
  (a clear error is better there).
- **A client-level client without records.** At client level the neighbour of a client's data is its data removed,
  and the roster is public, so the removed client still takes part; its contribution is zero, which is what the
  charged sensitivity assumes. Such a client releases exact zeros for every channel
  (``ReleasePipeline.removed_values``) without running its local step (an algorithm's own "no data" answer need not
  be zero: a Bayesian net's initial probabilities, a posterior's norm-C change). At record level its local step
  runs as before (DP-SGD's noise-only steps are what its charge covers).
"""

from __future__ import annotations

from typing import Callable, Mapping

from privfl.algorithms.base import ClientOutput
from privfl.errors import UsageError


def releases_as_removed(privacy, dataset) -> bool:
    """Whether a client holding ``dataset`` releases as a removed client (zeros, no local step): a private
    client-level run and no records."""
    return bool(privacy.private) and privacy.unit == "client" and len(dataset) == 0


def removed_output(algorithm, pipeline, client: int, events: Mapping | None = None) -> ClientOutput:
    """The round of a client-level client without records: zeros for every channel of ``pipeline`` (``events``: the
    run plan's planned events of its DP-SGD-trained channels), at the algorithm's public weight."""
    return ClientOutput(pipeline.removed_values(events), weight=algorithm.private_release_weight(int(client)))


def fallback_on_failure(algorithm, privacy, pipeline, client: int, round: int,
                        events: Mapping | None = None) -> Callable[[Exception], ClientOutput] | None:
    """The ``on_failure`` of a private client's local step (``ClientHalf.client_update``): a function of the exception
    the step raised returning the fallback round to release in its place (see the module docstring); None in a
    non-private run (the exception propagates)."""
    if not privacy.private:
        return None

    def fallback(exc: Exception) -> ClientOutput:
        if isinstance(exc, UsageError):  # decided by the program, not the records: the same on every neighbour
            raise exc
        values = pipeline.failed_step_values(round, exc, events)
        if values is None:  # a channel that is not private: nothing to hide, a clear error
            raise exc
        return ClientOutput(values, weight=algorithm.private_release_weight(int(client)))

    return fallback


def run_local_step(step: Callable[[], ClientOutput], on_failure) -> ClientOutput:
    """``step()``, or ``on_failure(exc)`` for an exception it raised when ``on_failure`` is given."""
    try:
        return step()
    except Exception as exc:  # noqa: BLE001 - the local step's failure, decided by the records
        if on_failure is None:
            raise
        return on_failure(exc)


__all__ = ["fallback_on_failure", "releases_as_removed", "removed_output", "run_local_step"]
