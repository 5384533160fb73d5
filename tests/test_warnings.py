"""Warnings no user can act on are silenced by message, and only those."""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch.utilities._pytree import _tree_flatten

from lightning_fsdp_plus._warnings import silence_unactionable


def _lightning_and_torchdata() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    _tree_flatten(torch.ones(1))  # what Lightning's batch transfer calls on every batch
    StatefulDataLoader([1, 2])  # the app's resumable loader


def test_lightnings_and_torchdatas_deprecations_are_silenced_and_other_warnings_are_not():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _lightning_and_torchdata()
    messages = " ".join(str(w.message) for w in caught)
    assert "LeafSpec" in messages and "set_vital" in messages  # these versions warn
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_unactionable()
        _lightning_and_torchdata()
        warnings.warn("a warning of the user's own", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a warning of the user's own"]
