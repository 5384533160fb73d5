"""cpu_threads.py: CPU ranks share the host's cores (torchrun's default), and the process gets its count back."""

from __future__ import annotations

import torch

from lightning_fsdp_plus.cpu_threads import cores_per_rank, restore_threads, share_cores


def test_each_rank_gets_its_share_of_the_cores_at_least_one():
    assert cores_per_rank(local_ranks=2, cores=16) == 8
    assert cores_per_rank(local_ranks=3, cores=8) == 2
    assert cores_per_rank(local_ranks=4, cores=2) == 1


def test_share_cores_sets_torch_threads_unless_omp_num_threads_decides_and_restore_gives_them_back():
    before = torch.get_num_threads()
    try:
        assert share_cores(local_ranks=2, environ={"OMP_NUM_THREADS": "3"}, cores=8) is None
        assert torch.get_num_threads() == before
        wanted = 2 if before != 2 else 4
        assert share_cores(local_ranks=2, environ={}, cores=2 * wanted) == wanted
        assert torch.get_num_threads() == wanted
        restore_threads()
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
