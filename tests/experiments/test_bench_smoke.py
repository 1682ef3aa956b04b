"""Every benchmark in experiments/ runs its smallest configuration to completion and prints the keys of its default
run (issue 30: so that none rots again after a move; ``make bench`` runs them at full size).

Each benchmark is run as ``make bench`` runs it, a subprocess from the repository root, with the flags of its
smallest configuration (documented in its docstring). The key sets below were taken from each benchmark's default
run; they are contracts read by automated tools, so a benchmark that renames, drops or adds a key fails here.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
HAS_FLWR = importlib.util.find_spec("flwr") is not None
MACHINE = {"machine", "cpus", "python"}

# keys whose benchmark falls back to "unavailable" without flwr; the other Flower keys are then not printed
SECAGG_FLOWER = {"flower_version", "flower_num_shares", "flower_threshold", "flower_mean_max_abs_error"}
SECAGG_KEYS = {
    "python", "cpus", "n", "d", "bits", "mask_word_bits", "dropout",
    "mask_peers", "mask_repeats", "client_mask_ms", "keystream_bound_ms", "mask_over_bound", "client_mask_median_ms",
    "keystream_bound_median_ms", "degree", "threshold", "input_signature_ms", "signature_verify_us",
    "pairwise_key_us", "tag_verify_us", "round_first_s", "round_first_sum_exact", "malicious_first_over_semi_honest",
    "round_repeats", "round_s", "round_included", "round_sum_exact", "round_mean_max_abs_error",
    "round_semi_honest_s", "round_semi_honest_sum_exact", "malicious_over_semi_honest", "round_median_s",
    "round_semi_honest_median_s", "round_spread_s", "round_spread_sum_exact",
    "flower_round_s", "flower_over_privfl",
}
FLOWER_INPROCESS = {"parameters", "inprocess_seconds", "inprocess_per_client_seconds"}
FLOWER_UNAVAILABLE = {"flower_seconds", "flower_over_inprocess", "engine_seconds",
                      "privfl_over_plain_flower", "sim_1000_clients_round_seconds"}
# privfl's FedAvg and DP-FedAvg against a plain Flower app doing the same job, alternated on one stock deployment
FLOWER_VS_PLAIN = {"compare_isolation", "compare_repeats", "compare_rounds", "dp_noise_multiplier", "dp_clip",
                   "privfl_over_plain_flower_fedavg", "privfl_over_plain_flower_dp", "privfl_over_plain_flower",
                   "privfl_round_seconds", "plain_flower_round_seconds"} | {
    f"{variant}_{key}" for variant in ("privfl_fedavg", "plain_flower_fedavg", "privfl_dp", "plain_flower_dp")
    for key in ("seconds", "runs_seconds", "round_seconds")}
FLOWER_KEYS = FLOWER_INPROCESS | {
    "supernode_poll", "object_backoff", "worker_poll", "reply_poll", "superexec_poll", "superlink_database",
    "flower_seconds", "flower_round_seconds", "flower_after_result_seconds", "flower_equals_inprocess_per_client",
    "flower_over_inprocess_per_client", "flower_rounds_over_inprocess", "worker_task_seconds_max",
    "worker_clientapp_seconds_mean", "worker_tasks", "flower_over_inprocess",
    "engine_clients", "engine_seconds", "engine_round_seconds", "sim_1000_clients_round_seconds",
} | FLOWER_VS_PLAIN
ACCOUNTING_KEYS = MACHINE | {"commit_ms", "audit_ms_1000x200", "audit_reopen_ms_1000x200"} | {
    key
    for workload in ("tiny_", "")
    for r in (5, 50, 200)
    for key in (f"{workload}dpsgd_fedavg_wall_s_R{r}", f"{workload}dpsgd_fedavg_accounting_s_R{r}",
                f"{workload}fola_wall_s_R{r}", f"{workload}fola_accounting_s_R{r}",
                f"accounting_share_{workload}R{r}", f"charge_ms_{workload}R{r}")
}

# benchmark file -> (flags of its smallest configuration, the keys its default run prints)
BENCHMARKS = {
    "bench_accountant.py": (["--smoke"], MACHINE | {
        "exact_calibrated_over_minimum_max", "exact_calibrated_over_minimum_min", "exact_calibration_ms",
        "pld_over_dp_accounting_max", "pld_over_dp_accounting_min", "pld_calibration_ms"}),
    "bench_accounting.py": (["--smoke"], ACCOUNTING_KEYS),
    "bench_fisher.py": (["--smoke"], {
        "model", "parameters", "examples_per_epoch", "batch_size", "threads", "repeats",
        "plain_epoch_s", "dp_fisher_epoch_s", "fisher_pass_epoch_s", "opacus_dpsgd_epoch_s",
        "opacus_dpsgd_fisher_epoch_s", "dp_fisher_over_plain", "fisher_pass_over_plain", "opacus_dpsgd_over_plain",
        "opacus_dpsgd_fisher_over_opacus_dpsgd"}),
    "bench_flower.py": (["--smoke"], FLOWER_KEYS if HAS_FLWR else FLOWER_INPROCESS | FLOWER_UNAVAILABLE),
    "bench_noise_once.py": (["--smoke"], MACHINE | {"rounds", "sampling_rate", "plan_seconds"} | {
        f"{kind}_eps{e}" for e in (1, 3, 8) for kind in ("central_z", "distributed_z", "distributed_over_central_z",
                                                        "zcdp_bound_z", "zcdp_bound_over_central_z")}),
    "bench_overhead.py": (["--smoke"], MACHINE | {
        "params", "round_without_privacy_ms", "round_with_privacy_ms", "privacy_layer_ms", "privacy_overhead"}),
    # one DP-FedAvg round at 10, 100 and 1000 clients (the sizes are its keys): its default run takes seconds
    "bench_scale.py": ([], MACHINE | {
        "round_s_10", "round_s_100", "round_s_1000", "growth_exponent_10_to_100", "growth_exponent_100_to_1000"}),
    "bench_secagg.py": (["--smoke"], SECAGG_KEYS | (SECAGG_FLOWER if HAS_FLWR else set())),
    "bench_simulation.py": (["--smoke"], MACHINE | {
        "cpu_model", "torch", "torch_threads",
        "fedavg_over_hand_100", "fedavg_over_hand_100_cpu", "fedavg_over_hand_1000", "fedavg_over_hand_1000_cpu",
        "dpsgd_over_hand_100", "dpsgd_over_hand_100_cpu", "clients_per_s_tiny"}),
}

# runs the benchmark as __main__ with flwr unimportable (as without the optional extra)
WITHOUT_FLWR = ("import runpy, sys; sys.modules['flwr'] = None; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
WITHOUT_FLWR_KEYS = {
    "bench_secagg.py": SECAGG_KEYS,
    "bench_flower.py": FLOWER_INPROCESS | FLOWER_UNAVAILABLE,
}

KEY = re.compile(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=")


def printed_keys(stdout: str) -> set[str]:
    """The key of every ``key=value`` pair printed (a line may hold several, separated by spaces)."""
    return {key for line in stdout.splitlines() for key in KEY.findall(line)}


def run_benchmark(command: list[str]) -> str:
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"{' '.join(command[1:])} exited with {proc.returncode}\n"
                                  f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc.stdout


# bench_flower.py's smallest configuration starts five loopback deployments and Ray (three to four minutes on 2 cores):
# make test-all (CI time); test_benchmark_completes_without_flwr runs its in-process part in make test
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "bench_flower.py" else n
                                  for n in sorted(BENCHMARKS)])
def test_benchmark_smallest_configuration(name):
    flags, keys = BENCHMARKS[name]
    stdout = run_benchmark([sys.executable, f"experiments/{name}", *flags])
    assert printed_keys(stdout) == keys, stdout


@pytest.mark.parametrize("name", sorted(WITHOUT_FLWR_KEYS))
def test_benchmark_completes_without_flwr(name):
    flags, _ = BENCHMARKS[name]
    stdout = run_benchmark([sys.executable, "-c", WITHOUT_FLWR, f"experiments/{name}", *flags])
    assert printed_keys(stdout) == WITHOUT_FLWR_KEYS[name], stdout


def test_every_benchmark_has_a_smoke_test():
    assert {p.name for p in EXPERIMENTS.glob("bench_*.py")} == set(BENCHMARKS)
