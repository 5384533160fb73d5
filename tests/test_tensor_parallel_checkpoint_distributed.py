"""A checkpoint of a tensor-parallel run, sharded or full, moves between layouts exactly (issue 48): saved on
(dp 2, tp 2), it loads on (dp 4, tp 1) and on one process with the saved parameters bit for bit, and both continue
as the uninterrupted run did (AdamW's moments loaded too), within 1e-5 at fp32. ``tests/helpers/tp_ckpt_cases.py``:
one 4-rank ``torchrun`` launch, then one process."""

from __future__ import annotations

import json

from tests.helpers.launch import REPO, run_script
from tests.helpers.tp_ckpt_cases import KINDS, STEPS


def test_a_tp2_checkpoint_loads_on_dp4_and_on_one_process_and_continues_exactly(tmp_path):
    script = REPO / "tests" / "helpers" / "tp_ckpt_cases.py"
    run_script(script, "--out", str(tmp_path), "--phase", "save", torchrun=4)
    run_script(script, "--out", str(tmp_path), "--phase", "one")
    saved = json.loads((tmp_path / "save.json").read_text())
    one = json.loads((tmp_path / "one.json").read_text())
    assert sorted(saved) == sorted(one) == sorted(KINDS)
    assert (tmp_path / "tp2-sharded.ckpt").is_dir() and (tmp_path / "tp2-full.ckpt").is_file()
    for kind in KINDS:
        assert saved[kind]["dp4_start"] == 0.0 and one[kind]["one_start"] == 0.0, kind  # the saved parameters
        after = saved[kind]["uninterrupted"][STEPS:]
        for resumed in (saved[kind]["dp4"], one[kind]["one"]):
            assert max(abs(a - b) for a, b in zip(resumed, after, strict=True)) <= 1e-5, (kind, resumed, after)
