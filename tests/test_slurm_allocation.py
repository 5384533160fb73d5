"""``slurm.py``: a Trainer that does not match its SLURM allocation is refused in ``Trainer(...)`` with both numbers
(measured without it: 2 tasks per node with ``devices=1`` failed on rank 1 with an IndexError while rank 0 waited)."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer

from lightning_fsdp_plus import FSDPPlusStrategy
from lightning_fsdp_plus.slurm import check_slurm_allocation, tasks_per_node

ALLOCATION = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_JOB_NAME": "job",
              "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_ID": "7",
              "SLURM_NODELIST": "localhost"}  # fmt: skip


@pytest.mark.parametrize(("environ", "expected"), [({"SLURM_NTASKS_PER_NODE": "4"}, 4),
                                                   ({"SLURM_TASKS_PER_NODE": "2(x3)"}, 2), ({}, None)])  # fmt: skip
def test_tasks_per_node_reads_either_variable(environ, expected):
    assert tasks_per_node(environ) == expected


def test_a_matching_allocation_passes_and_others_name_both_numbers():
    check_slurm_allocation(devices=2, num_nodes=1, environ=ALLOCATION)
    with pytest.raises(ValueError, match=r"SLURM runs 2 task\(s\) per node \(--ntasks-per-node=2\) but"
                                         r" Trainer\(devices=1\).*Set devices=2"):  # fmt: skip
        check_slurm_allocation(devices=1, num_nodes=1, environ=ALLOCATION)
    with pytest.raises(ValueError, match=r"SLURM allocated 1 node\(s\) \(--nodes=1\) but Trainer\(num_nodes=2\)"):
        check_slurm_allocation(devices=2, num_nodes=2, environ=ALLOCATION)


def test_the_trainer_refuses_a_mismatch_before_any_process_group(monkeypatch):
    for key, value in ALLOCATION.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"but Trainer\(devices=1\)"):
        Trainer(strategy=FSDPPlusStrategy(), accelerator="cpu", devices=1, logger=False)
