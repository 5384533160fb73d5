"""Several nodes without a cluster (issue 34): two ``torchrun --nnodes 2 --nproc-per-node 1`` agents on loopback, a
c10d rendezvous, ``HYBRID_SHARD`` with its default shard group (one node's ranks: 1) and the replicate dimension
across the two "nodes" — trained as one process trains."""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.conftest import DIST_CASES, load_case
from tests.helpers.launch import REPO, failure_excerpt, subprocess_env
from tests.test_strategy_distributed import max_loss_diff, max_param_diff


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_nodes_hybrid_shard_replicates_across_nodes_and_matches_one_process(tmp_path, reference):
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}",
             "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-nodes", str(DIST_CASES),
             "--out", str(tmp_path), "--cases", "hybrid_shard_per_node_sgd"],
            cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]  # fmt: skip
    outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), failure_excerpt("\n".join(outputs))
    result = load_case(tmp_path, "hybrid_shard_per_node_sgd")
    plan = result.rank0["plan"]
    assert plan["mesh"] == {"replicate": 2, "shard": 1, "tensor": 1}  # shard groups in a node, replicas across nodes
    assert result.rank0["world_size"] == 2
    losses, state = reference()
    assert max_loss_diff(result.rank0["losses"], losses) < 1e-5
    assert max_param_diff(result.state, state) < 1e-5
    assert "mesh replicate=2 x shard=1" in outputs[0] and "2 node(s) x 1 rank(s)" in outputs[0]
