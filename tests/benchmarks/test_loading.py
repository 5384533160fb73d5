"""benchmarks/loading.py: its report's arithmetic (the measurement itself runs in tests/loading at a small size)."""

from __future__ import annotations

from benchmarks.loading import BOUNDS, CASES, MODES, checkpoint_sizes, report
from tests.helpers.checkpoints import save_checkpoint


def _rank(added_anon: int, seconds: float) -> dict:
    return {"rank": 0, "seconds": seconds, "added_anon": added_anon, "added_file": 0, "resident_anon": added_anon,
            "resident_file": 0}  # fmt: skip


def test_the_report_checks_each_case_against_its_bound_and_compares_times():
    b, t, n = 800_000_000, 130_000_000, 2
    results = {
        "old_int8_sharded": [[_rank(650_000_000, 2.0)], [_rank(640_000_000, 2.2)], [_rank(600_000_000, 1.8)]],
        "new_int8_sharded": [[_rank(300_000_000, 1.2)], [_rank(296_000_000, 1.4)], [_rank(290_000_000, 1.3)]],
    }
    table = report(results, b=b, t=t, n=n)
    limit = 1.1 * (b / (2 * n) + t)  # 363 MB
    assert f"B/(2N) + T +10% = {limit / 1e6:,.0f}" in table
    assert "| old_int8_sharded | 650 |" in table and "| no |" in table  # the largest round, over its bound
    assert "| new_int8_sharded | 300 |" in table and "| yes |" in table
    assert "int8_sharded: load time new / old = 0.65" in table  # medians 1.3 / 2.0


def test_every_mode_has_a_bound_and_both_paths():
    assert set(BOUNDS) == set(MODES)
    expected = [f"{p}_{m}" for m in MODES for p in ("old", "new")]
    assert expected == CASES


def test_checkpoint_sizes_are_bf16_bytes_and_the_largest_tensor_in_fp32(tmp_path):
    save_checkpoint(tmp_path, "llama")  # bf16; the largest tensors are the 256 x 64 embedding and head
    b, t = checkpoint_sizes(tmp_path)
    from lightning_fsdp_plus.loading import read_checkpoint

    assert b == sum(i.nbytes for i in read_checkpoint(tmp_path).tensors.values())
    assert t == 256 * 64 * 4
