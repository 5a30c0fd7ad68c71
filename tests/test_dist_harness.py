"""The rank harness of the multi-rank tests: a rank that dies fails the test in words instead of
leaving the others waiting in a collective, and the test run waiting with them."""

import os

import pytest
import torch

from tests.dist_harness import run_ranks


def _rank_1_dies_before_a_collective() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that is gone
    return 1


def test_a_rank_that_dies_before_reporting_fails_the_run_naming_it_and_its_exit_code():
    with pytest.raises(AssertionError, match=r"rank\(s\) \[1\] died before reporting \(exit codes \[3\]\)"):
        run_ranks(2, _rank_1_dies_before_a_collective, timeout=120)
