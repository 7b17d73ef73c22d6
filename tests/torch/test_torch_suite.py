"""torch's own backend-generic distributed suite on the "ferrodist" backend, at 2 and 4 ranks.

torch 2.13's ``DistributedTest._DistTestBase`` (torch/testing/_internal/distributed/
distributed_test.py) is the suite torch runs on Gloo, NCCL and MPI, with the harness of
torch's test/distributed/test_distributed_spawn.py; scripts/torch_suite.py runs it (its
docstring says how, and what differs; ``WORLD_SIZE`` sets the ranks). On this CPU build of
torch:

- **Gloo** passes the 90 tests of ``GLOO_PASSES`` at 2 and 3 ranks, and 3 more at 4 ranks
  (``AT_FOUR``: gathering objects, ``new_subgroups`` of a given group), recorded by running
  the same script with ``gloo``; the other tests of the class skip (CUDA, NCCL or MPI only, a
  ``file://`` init method, ...).
- **ferrodist** must pass every one of them, over ``shm`` and over ``tcp``, at both sizes
  (``make test`` runs shm at 4 ranks and tcp at 2, ``make torch-suite`` both at 2, 3 and 4
  ranks and Gloo's own runs: see ``RUNS``), except the three of ``NOT_FOR_FERRODIST``, which call torch's ``dist.monitored_barrier``:
  torch implements it for Gloo only and refuses every other backend by name
  (``ferrodist.collectives.monitored_barrier`` is ferrodist's).

So each run is 87 or 90 tests: every collective (blocking, async, coalesced, complex,
sparse, on the world and on a group of every rank), send/recv with tags and from any
source, batch_isend_irecv, barriers with a timeout, new_group and destroying groups, the
object collectives, ``get_future``, and torch's DDP on CPU (no_sync, comm hooks,
``gradient_as_bucket_view``, static graph, logging). Each test forks its ranks from the
script's process, which has loaded torch and ferrodist (``ferrodist.torch.preload``); a test
takes about 0.3-0.5 s on either backend here, and a run 30-50 s.

To run the whole class rather than what Gloo passes (what the decorators skip for Gloo
skips here too)::

    WORLD_SIZE=4 FERRODIST_TORCH_TRANSPORT=shm python tests/torch/scripts/torch_suite.py ferrodist out.json

and ``python tests/torch/scripts/torch_suite.py gloo out.json`` records what Gloo passes
(``FERRODIST_TORCH_SUITE_GLOO=1`` makes ``test_gloo_passes_what_was_recorded`` compare it with
the lists). ``bench/torch/suite.py`` times both backends over the same tests in one run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest", reason="torch's test utilities need expecttest (pip install packages/torch[test])")
pytest.importorskip("ferrodist.torch", reason="ferrodist-torch is not installed (pip install packages/torch)")

SCRIPT = Path(__file__).parent / "scripts" / "torch_suite.py"
#: The longest one run of the suite may take (under a minute here).
RUN_LIMIT = 900

#: The tests of torch 2.13's _DistTestBase that Gloo passes at 2 ranks (torch 2.13.0, CPU build).
GLOO_PASSES = (
    "test_Backend_enum_class",
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_all_gather",
    "test_all_gather_coalesced_complex",
    "test_all_gather_coalesced_full_group",
    "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_with_empty",
    "test_all_gather_complex",
    "test_all_gather_full_group",
    "test_all_gather_object_default_pg",
    "test_all_gather_object_subgroup",
    "test_all_reduce_coalesced_full_group_max",
    "test_all_reduce_coalesced_full_group_min",
    "test_all_reduce_coalesced_full_group_product",
    "test_all_reduce_coalesced_full_group_sum",
    "test_all_reduce_coalesced_max",
    "test_all_reduce_coalesced_max_complex_unsupported",
    "test_all_reduce_coalesced_min",
    "test_all_reduce_coalesced_product",
    "test_all_reduce_coalesced_sum",
    "test_all_reduce_complex_unsupported_ops",
    "test_all_reduce_full_group_max",
    "test_all_reduce_full_group_min",
    "test_all_reduce_full_group_product",
    "test_all_reduce_full_group_sum",
    "test_all_reduce_max",
    "test_all_reduce_min",
    "test_all_reduce_product",
    "test_all_reduce_sum",
    "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex",
    "test_barrier",
    "test_barrier_full_group",
    "test_barrier_timeout_full_group",
    "test_batch_isend_irecv_gloo",
    "test_batch_isend_irecv_gloo_tags",
    "test_broadcast",
    "test_broadcast_full_group",
    "test_ddp_create_graph",
    "test_ddp_logging_data_cpu",
    "test_destroy_full_group",
    "test_destroy_group",
    "test_dump_DDP_relevant_env_vars",
    "test_gather",
    "test_gather_checks",
    "test_gather_full_group",
    "test_get_backend",
    "test_get_future",
    "test_get_rank",
    "test_get_rank_size_full_group",
    "test_get_rank_size_group",
    "test_grads_same_across_ranks_with_no_sync",
    "test_irecv",
    "test_isend",
    "test_isend_autograd_profiler",
    "test_isend_torch_profiler",
    "test_monitored_barrier_gloo",
    "test_monitored_barrier_gloo_rank_0_timeout",
    "test_monitored_barrier_gloo_subgroup",
    "test_reduce_full_group_max",
    "test_reduce_full_group_min",
    "test_reduce_full_group_product",
    "test_reduce_full_group_sum",
    "test_reduce_max",
    "test_reduce_min",
    "test_reduce_product",
    "test_reduce_sum",
    "test_reduce_sum_twice",
    "test_scatter",
    "test_scatter_checks",
    "test_scatter_complex",
    "test_scatter_full_group",
    "test_scatter_object_list",
    "test_send_recv",
    "test_send_recv_any_source",
    "test_send_recv_any_source_autograd_profiler",
    "test_send_recv_any_source_torch_profiler",
    "test_send_recv_autograd_profiler",
    "test_send_recv_torch_profiler",
    "test_send_recv_with_tag",
    "test_send_recv_with_tag_autograd_profiler",
    "test_send_recv_with_tag_torch_profiler",
    "test_sparse_all_reduce_sum",
    "test_static_graph_api_cpu",
)
#: What Gloo passes at 4 ranks besides (these skip below 3 or 4 ranks).
AT_FOUR = ("test_gather_object", "test_gather_object_subgroup", "test_new_subgroups_with_group_param")


def gloo_passes(ranks: int) -> tuple[str, ...]:
    """What Gloo passes at ``ranks`` ranks (at 3, the same as at 2)."""
    return GLOO_PASSES + (AT_FOUR if ranks == 4 else ())


#: Tests Gloo passes that ferrodist is not held to, and why.
NOT_FOR_FERRODIST = {
    name: "calls dist.monitored_barrier, which torch implements for Gloo only and refuses for every other "
    "backend ('monitored_barrier is only implemented for GLOO backend', or no backend for cpu on a custom "
    "group); ferrodist.collectives.monitored_barrier is ferrodist's own"
    for name in (
        "test_monitored_barrier_gloo",
        "test_monitored_barrier_gloo_rank_0_timeout",
        "test_monitored_barrier_gloo_subgroup",
    )
}

#: Variables of an enclosing job that must not reach the suite's ranks.
_PLACE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FERRODIST_TOKEN")


def run_suite(tmp_path: Path, backend: str, names: list[str], **env: str) -> dict[str, list]:
    """Run the suite's ``names`` on ``backend`` (``WORLD_SIZE`` in ``env``: the ranks); each
    test's [outcome, seconds, detail]."""
    out = tmp_path / f"{backend}.json"
    clean = {k: v for k, v in os.environ.items() if k not in _PLACE and not k.startswith(("OMPI_", "PMI", "SLURM_"))}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), backend, str(out), *names],
        env={**clean, **env, "PYTORCH_PRINT_REPRO_ON_FAILURE": "0"},
        capture_output=True,
        text=True,
        timeout=RUN_LIMIT,
        cwd=tmp_path,
    )
    assert out.exists(), f"the suite did not finish (exit {done.returncode}):\n{done.stderr[-6000:]}"
    report = json.loads(out.read_text())
    print(f"torch's suite on {backend} {env}: {len(report['tests'])} tests in {report['seconds']} s")
    return report["tests"]


def failures(outcomes: dict[str, list]) -> str:
    """Each test that did not pass, with the last lines of what it raised."""
    lines = []
    for name, (outcome, _, detail) in sorted(outcomes.items()):
        if outcome != "pass":
            said = [line.strip() for line in detail.splitlines() if line.strip()][-3:]
            lines.append(f"{name}: {outcome}: {' | '.join(said)}")
    return "\n".join(lines)


def test_the_lists_are_consistent():
    assert len(GLOO_PASSES) == len(set(GLOO_PASSES)) == 90
    assert len(set(gloo_passes(4))) == 93
    assert set(NOT_FOR_FERRODIST) < set(GLOO_PASSES)


#: (transport, ranks) of the runs ``make test`` makes: each transport once and each size once,
#: shared memory at 4 ranks (its own protocol, with ranks that share the cores), tcp at 2.
#: ``FERRODIST_TORCH_SUITE=all`` (``make torch-suite``) runs both at 2, 3 and 4 ranks.
RUNS = [("shm", 4), ("tcp", 2)]
EVERY_RUN = [(transport, ranks) for transport in ("shm", "tcp") for ranks in (2, 3, 4)]


@pytest.mark.timeout(RUN_LIMIT + 60)
@pytest.mark.parametrize(
    ("transport", "ranks"), EVERY_RUN if os.environ.get("FERRODIST_TORCH_SUITE") == "all" else RUNS
)
def test_ferrodist_passes_what_gloo_passes(tmp_path, transport, ranks):
    names = [name for name in gloo_passes(ranks) if name not in NOT_FOR_FERRODIST]
    outcomes = run_suite(tmp_path, "ferrodist", names, FERRODIST_TORCH_TRANSPORT=transport, WORLD_SIZE=str(ranks))
    assert sorted(outcomes) == sorted(names)
    assert all(outcome == "pass" for outcome, _, _ in outcomes.values()), (
        f"torch's suite on ferrodist over {transport} at {ranks} ranks:\n{failures(outcomes)}"
    )


@pytest.mark.timeout(RUN_LIMIT + 60)
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_gloo_passes_what_was_recorded(tmp_path, ranks):
    """Gloo's own run of the whole class: what it passes is the list (opt-in: a minute or two more)."""
    if os.environ.get("FERRODIST_TORCH_SUITE_GLOO") != "1":
        pytest.skip("set FERRODIST_TORCH_SUITE_GLOO=1 to run torch's suite on Gloo and compare it with GLOO_PASSES")
    outcomes = run_suite(tmp_path, "gloo", [], WORLD_SIZE=str(ranks))
    passed = sorted(name for name, (outcome, _, _) in outcomes.items() if outcome == "pass")
    assert passed == sorted(gloo_passes(ranks)), failures(
        {k: v for k, v in outcomes.items() if v[0] not in ("pass", "skip")}
    )
