"""The tensor-parallel benchmark's counting and report (issue 48): every collective's payload once (a functional
all-reduce and its wait are one transfer), an all-gather by its output; the table in rank order."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from benchmarks.tensor_parallel import _collective_bytes, report


def test_collectives_are_counted_once_each_by_their_payload():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mode = _collective_bytes()
        with mode:
            dist.all_reduce(torch.ones(100))  # 400 bytes
            out = torch.empty(50)
            dist.all_gather_into_tensor(out, torch.ones(50))  # 200 bytes: the output
            funcol.all_reduce(torch.ones(25), "sum", dist.group.WORLD).wait()  # 100 bytes, the wait moves nothing
            torch.ones(10) * 2  # not a collective
        assert mode.bytes == 400 + 200 + 100
    finally:
        dist.destroy_process_group()


def test_the_report_orders_by_ranks_then_tensor_size():
    rows = [{"layout": name, "ranks": ranks, "tensor_parallel_size": tp, "data_parallel": ranks // tp,
             "param_bytes_per_rank": 1000 * tp, "peak_rss_bytes": 2**30, "step_wall_s": 0.5, "step_cpu_s": 0.25,
             "collective_bytes_per_step": 3 * 2**20}
            for ranks, name, tp in ((4, "tp2", 2), (2, "fsdp", 1))]  # fmt: skip
    table = report(rows).splitlines()
    assert table[2] == "| 2 | fsdp | 1 x 2 | 1,000 | 1,024 MiB | 0.500 | 0.250 | 3.0 MiB |"
    assert table[3].startswith("| 4 | tp2 | 2 x 2 | 2,000 |")
