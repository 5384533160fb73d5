"""What a SLURM allocation must agree with before any rank starts: one task per device, on the nodes it has.

Under ``srun`` Lightning's ``SLURMEnvironment`` takes each rank from SLURM, and ``Trainer(devices=, num_nodes=)`` from
the user; when the two disagree nothing stops it: with 2 tasks per node and ``devices=1`` (measured) rank 1 fails
with ``IndexError: list index out of range`` (its local rank has no device) while rank 0 waits for it in the
rendezvous until the timeout. Checked in ``FSDPPlusStrategy._configure_launcher`` (``Trainer.__init__``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def tasks_per_node(environ: Mapping[str, str]) -> int | None:
    """SLURM's tasks on this node (``SLURM_NTASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE``'s first count, e.g.
    ``2(x3)``), or None when SLURM does not say."""
    value = environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "")
    head = value.split(",")[0].split("(")[0]
    return int(head) if head.isdigit() else None


def check_slurm_allocation(*, devices: int, num_nodes: int, environ: Mapping[str, str] = os.environ) -> None:
    """Raise ``ValueError`` naming both numbers when ``Trainer(devices=, num_nodes=)`` does not match the SLURM
    allocation (tasks per node, nodes)."""
    tasks = tasks_per_node(environ)
    if tasks is not None and tasks != devices:
        raise ValueError(
            f"SLURM runs {tasks} task(s) per node (--ntasks-per-node={tasks}) but Trainer(devices={devices}): there"
            f" must be one task per device. Set devices={tasks} (the app:"
            f" trainer.devices=${{SLURM_NTASKS_PER_NODE}}) or --ntasks-per-node={devices}"
        )
    nodes = environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES")
    if nodes and nodes.isdigit() and int(nodes) != num_nodes:
        raise ValueError(
            f"SLURM allocated {nodes} node(s) (--nodes={nodes}) but Trainer(num_nodes={num_nodes}). Set"
            f" num_nodes={nodes} (the app: trainer.num_nodes=${{SLURM_NNODES}}) or --nodes={num_nodes}"
        )
