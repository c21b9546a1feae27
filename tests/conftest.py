"""Shared pytest fixtures, and loud skips under CI."""
import pytest
import torch

from tests.helpers.megatron_vectors import in_ci

# Skips CI accepts: hardware or OS features the machine lacks, and the optional extras CI does not install
# (tensorboard, transformers; their reason says "optional dependency"). Any other skip (missing data, an import of
# pipecast's own code turned into a skip) fails the test under CI=true, so a green CI run never hides tests that
# checked nothing.
ALLOWED_CI_SKIPS = ("CUDA", "/proc", "optional dependency")


# Modules whose tests start processes (gloo ranks, the pipecast CLI, trainers on spawned ranks): marked
# ``multiprocess`` and ``slow``, so ``pytest -m "not slow"`` is the quick loop of pure, in-process tests.
MULTIPROCESS_MODULES = {
    "test_api_messages", "test_deallocation", "test_equivalence", "test_gloo_io", "test_graphs_pipeline",
    "test_graphs_trainer", "test_harness_controls", "test_launch", "test_launch_data_and_teardown",
    "test_odd_pipelines", "test_p2p_messages", "test_parallel_state", "test_profiling_pipeline", "test_public_bugs",
    "test_readme", "test_reliability_config", "test_reliability_faults", "test_reliability_p2p", "test_spawn",
    "test_trainer_reference", "test_training_cli", "test_training_grads", "test_training_outputs",
    "test_training_runs", "test_training_validation", "test_zero_bubble_pipeline", "test_dualpipev_pipeline",
    "test_model_split", "test_profiling", "test_reliability_checkpoint", "test_tune", "test_hf_models",
    "test_llama_reference", "test_hf_roundtrip", "test_sharding", "test_tensor_parallel", "test_sequence_parallel_api",
    "test_registered_family", "test_recompute_pipeline", "test_moe_parallel", "test_moe_recipe", "test_moe_tensor_parallel", "test_fit_recipe",
    "test_pipeline_schedule", "test_schedule_agreement", "test_grad_norm", "test_parallel_combinations", "test_host_syncs",
    "test_moe_sharding",
}


MIN_TIMEOUT_S = 240
"""Floor of every per-test timeout (seconds).  The timeouts are hang guards, not speed checks: on a shared CI
machine a 2-rank test that takes 15 s alone can take five times that, so a test's own smaller value is raised to
this (a hang still fails, later)."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rpartition(".")[2] in MULTIPROCESS_MODULES:
            item.add_marker(pytest.mark.multiprocess)
            item.add_marker(pytest.mark.slow)
        own = item.get_closest_marker("timeout")
        if own is not None and own.args and own.args[0] < MIN_TIMEOUT_S:
            item.add_marker(pytest.mark.timeout(MIN_TIMEOUT_S), append=False)


@pytest.fixture
def one_thread():
    """Run the test with one intra-op thread (tiny tensors on 2 shared cores), restoring the count afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def skip_reason(report) -> str:
    """The reason text of a skipped test's report."""
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under ``CI=true``, a skip whose reason names none of :data:`ALLOWED_CI_SKIPS` becomes a failure."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if not any(allowed in reason for allowed in ALLOWED_CI_SKIPS):
        report.outcome = "failed"
        report.longrepr = f"CI=true: this test skipped ({reason}); under CI only {ALLOWED_CI_SKIPS} skips are allowed"
