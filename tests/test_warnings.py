"""Warnings no user can act on are silenced by message, and only those."""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch.utilities._pytree import _tree_flatten

from lightning_fsdp_plus._warnings import silence_unactionable


def test_lightnings_leafspec_deprecation_is_silenced_and_other_warnings_are_not():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _tree_flatten(torch.ones(1))  # what Lightning's batch transfer calls on every batch
    assert any("LeafSpec" in str(w.message) for w in caught)  # this Lightning on this torch warns
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_unactionable()
        _tree_flatten(torch.ones(1))
        warnings.warn("a warning of the user's own", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a warning of the user's own"]
