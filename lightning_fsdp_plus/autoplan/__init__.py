"""The auto plan: given a memory budget per device, the fastest configuration that fits.

``FSDPPlusStrategy(sharding_strategy="auto", memory_budget="40GiB", plan_batch_size=..., plan_seq_len=...)``
enumerates the allowed candidates (:mod:`.candidates`), predicts each one's per-rank peak with the estimator and
its step time with a cost model (:mod:`.cost`, figures from a short probe of the real devices, :mod:`.probe`),
and shards with the fastest that fits (:mod:`.choose`). ``fsdp-plus-estimate --budget`` prints the same table.
"""

from lightning_fsdp_plus.autoplan.budget import parse_budget
from lightning_fsdp_plus.autoplan.candidates import Candidate, enumerate_candidates
from lightning_fsdp_plus.autoplan.choose import AutoPlan, NoFitError, Prediction, predict_memory
from lightning_fsdp_plus.autoplan.cost import PRESETS, Hardware, StepTime, predict_step_time

__all__ = [
    "PRESETS",
    "AutoPlan",
    "Candidate",
    "Hardware",
    "NoFitError",
    "Prediction",
    "StepTime",
    "enumerate_candidates",
    "parse_budget",
    "predict_memory",
    "predict_step_time",
]
