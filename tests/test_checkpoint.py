"""Checkpoint files on one process: plain Lightning checkpoints load, the optimizer layout is torch's standard one,
and saving over an existing path never deletes what is not a checkpoint (Lightning's ModelParallelStrategy rules)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from lightning_fsdp_plus.checkpoint import (
    CheckpointError,
    load_full,
    load_param_groups_only,
    load_sharded,
    optimizer_state_by_ids,
    optimizer_state_by_names,
    save_full,
    save_sharded,
    verify,
)


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model with a frozen first layer (as under LoRA) and an AdamW that took two steps with two groups."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5), nn.Linear(5, 3))
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([{"params": [model[3].weight, model[2].bias]},
                                   {"params": [model[2].weight, model[3].bias], "lr": 0.01}])  # fmt: skip
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    return model, optimizer


def test_full_optimizer_state_is_torchs_standard_layout_and_converts_back():
    model, optimizer = _trained()
    named = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    assert named["param_groups"][0]["params"] == ["3.weight", "2.bias"]  # torch's own layout: names
    standard = optimizer.state_dict()  # what DDP and a single device save and load

    by_ids = optimizer_state_by_ids(named)
    assert [g["params"] for g in by_ids["param_groups"]] == [g["params"] for g in standard["param_groups"]]
    assert by_ids["state"].keys() == standard["state"].keys()
    torch.testing.assert_close(by_ids["state"], standard["state"], rtol=0, atol=0)
    fresh = torch.optim.AdamW([{"params": [model[3].weight, model[2].bias]},
                               {"params": [model[2].weight, model[3].bias], "lr": 0.01}])  # fmt: skip
    fresh.load_state_dict(by_ids)  # what Lightning's DDP restore does

    back = optimizer_state_by_names(standard, names=["3.weight", "2.bias", "2.weight", "3.bias"])
    assert back["param_groups"][1]["params"] == ["2.weight", "3.bias"]
    torch.testing.assert_close(back["state"], named["state"], rtol=0, atol=0)
    assert optimizer_state_by_names(named, names=[]) is named  # already by name: unchanged
    assert optimizer_state_by_ids({}) == {}  # ranks > 0 hold nothing in a full state
    with pytest.raises(CheckpointError, match="the checkpoint's optimizer has 4 parameters, this one 3"):
        optimizer_state_by_names(standard, names=["a", "b", "c"])


def test_an_optimizer_state_without_per_parameter_state_restores_the_hyperparameters():
    """Plain SGD (or any optimizer before its first step) saves only its param groups: those are restored; a state
    with per-parameter entries is left to torch; a different group layout is refused with both numbers."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    saved = torch.optim.SGD(model.parameters(), lr=0.05, weight_decay=0.1)
    fresh = torch.optim.SGD(model.parameters(), lr=0.1)
    assert load_param_groups_only(fresh, saved.state_dict())
    assert fresh.param_groups[0]["lr"] == 0.05 and fresh.param_groups[0]["weight_decay"] == 0.1
    assert fresh.param_groups[0]["params"] == list(model.parameters()) and not fresh.state
    stateful = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    stateful.step()
    assert not load_param_groups_only(fresh, stateful.state_dict()) and fresh.param_groups[0]["lr"] == 0.05
    two_groups = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1)
    with pytest.raises(CheckpointError, match=r"has 1 parameter group\(s\), this one 2"):
        load_param_groups_only(two_groups, saved.state_dict())
    fewer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="group has 4 parameters, this one 2"):
        load_param_groups_only(fewer, saved.state_dict())


def test_a_plain_lightning_file_without_sidecar_loads_and_a_corrupted_one_with_sidecar_does_not(tmp_path):
    plain = tmp_path / "ddp.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 3}, plain)  # what Lightning's DDP writes
    assert load_full(plain)["epoch"] == 3

    ours = save_full(tmp_path / "ours.ckpt", checkpoint={"state_dict": {"w": torch.ones(2)}})
    data = bytearray(ours.read_bytes())
    data[-20] ^= 0xFF
    ours.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"ours\.ckpt is truncated or corrupted"):
        load_full(ours)


def test_loading_a_path_that_is_no_checkpoint_names_it(tmp_path):
    (tmp_path / "empty").mkdir()
    for path, what in ((tmp_path / "empty", "an empty or other directory"), (tmp_path / "nowhere", "nothing is")):
        with pytest.raises(CheckpointError, match=re.escape(f"{path} does not point to a valid checkpoint") + ".*"
                           + what):  # fmt: skip
            verify(path)


def _sharded(path, value: float = 1.0):
    model = nn.Linear(2, 2)
    nn.init.constant_(model.weight, value)
    return save_sharded(path, model_state=model.state_dict(), optimizer_states=[], metadata={"epoch": 1}), model


def test_sharded_save_into_a_folder_keeps_its_other_files_and_replaces_a_file(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "logs").mkdir()
    _sharded(folder, 1.0)
    _sharded(folder, 2.0)  # again over the checkpoint it now is
    assert (folder / "notes.txt").read_text() == "mine" and (folder / "logs").is_dir()
    loaded = nn.Linear(2, 2)
    load_sharded(folder, model=loaded, optimizers=[])
    assert torch.equal(loaded.weight, torch.full((2, 2), 2.0))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fsdp_plus_")]  # nothing left behind

    file = tmp_path / "file.ckpt"
    save_full(file, checkpoint={"state_dict": {}})
    _sharded(file)
    assert file.is_dir() and not (tmp_path / "file.ckpt.sha256").exists()  # the old file's sidecar went with it


def test_full_save_refuses_a_folder_and_replaces_a_sharded_checkpoint_only_when_nothing_else_is_in_it(tmp_path):
    folder = tmp_path / "not-empty"
    folder.mkdir()
    (folder / "file").touch()
    with pytest.raises(IsADirectoryError, match=r"The checkpoint path exists and is a directory: .*not-empty; a full"):
        save_full(folder, checkpoint={"state_dict": {}})
    assert (folder / "file").exists()

    sharded, _ = _sharded(tmp_path / "sharded")
    save_full(sharded, checkpoint={"state_dict": {}, "epoch": 2})
    assert sharded.is_file() and load_full(sharded)["epoch"] == 2

    mixed, _ = _sharded(tmp_path / "mixed")
    (mixed / "README").touch()
    with pytest.raises(IsADirectoryError, match=r"also holds other files \(README\); a full checkpoint replacing"):
        save_full(mixed, checkpoint={"state_dict": {}})
    assert (mixed / "README").exists()


def test_lightnings_sharded_layout_needs_no_manifest_but_ours_does(tmp_path):
    ours, _ = _sharded(tmp_path / "ours")
    (ours / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing"):
        verify(ours)
    for extra in ours.glob("rng_rank*.pt"):  # what ModelParallelStrategy writes: DCP files and meta.pt
        extra.unlink()
    verify(ours)
    loaded = nn.Linear(2, 2)
    assert load_sharded(ours, model=loaded, optimizers=[])["epoch"] == 1
    assert torch.equal(loaded.weight, torch.ones(2, 2))


def test_sharded_loading_honours_strict_loading(tmp_path):
    """``LightningModule.strict_loading = False``: a model with keys the checkpoint lacks loads what is there."""
    path, _ = _sharded(tmp_path / "ckpt", 3.0)
    grown = nn.Linear(2, 2)
    grown.register_parameter("extra", nn.Parameter(torch.full((2,), 7.0)))
    with pytest.raises(CheckpointError, match=r"into this model: RuntimeError: Missing key in checkpoint state_dict: "
                       r"state_dict\.extra\. \(LightningModule\.strict_loading = False keeps"):  # fmt: skip
        load_sharded(path, model=grown, optimizers=[])
    load_sharded(path, model=grown, optimizers=[], strict=False)
    assert torch.equal(grown.weight, torch.full((2, 2), 3.0)) and torch.equal(grown.extra, torch.full((2,), 7.0))
