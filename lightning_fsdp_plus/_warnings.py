"""Warnings a user of this package cannot act on, silenced by message where they arise (never by category alone).

* Lightning 2.6's batch-transfer helper builds ``torch.utils._pytree.LeafSpec()``, which torch 2.13 deprecates:
  "`isinstance(treespec, LeafSpec)` is deprecated" twice a run, from Lightning's code, about Lightning's code.
* torchdata's ``StatefulDataLoader`` (the app's resumable loader) calls torch's deprecated ``set_vital`` when it
  is built: "'set_vital' is deprecated, please do not call", four times a run, about torchdata's code.

PEFT's read of transformers' deprecated ``is_gradient_checkpointing`` is silenced only around our own call of
``get_peft_model`` (:func:`lightning_fsdp_plus.lora.apply_lora`): a user who calls PEFT still sees it.
"""

from __future__ import annotations

import warnings

UNACTIONABLE = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.pytorch\.utilities\._pytree"),
    (r"'set_vital' is deprecated", r"torchdata\.stateful_dataloader\.stateful_dataloader"),
)
"""(message pattern, module pattern) of each silenced warning."""


def silence_unactionable() -> None:
    """Ignore each of :data:`UNACTIONABLE` (idempotent: ``warnings`` keeps one filter per identical entry)."""
    for message, module in UNACTIONABLE:
        warnings.filterwarnings("ignore", message=message, module=module)
