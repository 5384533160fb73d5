"""The auto plan against measurements: every candidate trained, predictions compared, budgets checked.

    python -m benchmarks.autoplan [--devices 2] [--repeats 2] [--batch-size 2] [--families full,lora_int8]
                                  [--out outputs/benchmarks/autoplan]

On ``--devices`` ranks (torchrun; gloo on CPU) and the benchmark Llama (``benchmarks.cases.SIZES["full"]``, built
from a config, no download), for each family of candidates:

* ``full``: a full fine-tune (3 strategies x activation checkpointing);
* ``lora_int8``: LoRA r=16 on every projection with ``allow_quantize=["int8"]`` (strategies x ``lora_only`` x
  checkpointing x {no quantization, int8});
* ``lora_int8_nf4``: the same with ``allow_quantize=["int8", "nf4"]``.

the auto plan predicts every candidate (memory from the estimator, step time from the cost model with the
hardware probed on this very group), then every candidate trains for real through ``FSDPPlusStrategy`` with its
options; repetitions interleave the candidates and the report takes medians. Two peaks are measured per rank:

* the tensor-accounted peak of ``MemoryMonitor``'s step-boundary samples (after forward, before and after the
  optimizer step), which the estimator's ``peak_bytes_per_rank`` predicts;
* the real peak (:class:`TruePeak`: the process's resident set sampled every 0.2 ms through the warm-up steps,
  every allocation its own mapping), transients included — what a device must hold, and what the plan budgets
  (``peak_with_transient_bytes_per_rank``).

The report gives, per candidate, both comparisons and predicted vs measured step time (the Spearman rank
correlation), and budget checks: a budget's usable part (less ``memory_margin``, which the plan keeps free of its
prediction) is placed at the midpoint between two consecutive measured peaks; the plan's choice passes when its
measured peaks are within the budget and its step time within 10% of the fastest candidate whose measured peak
leaves the margin free as well. Three budgets at the widest gaps are the acceptance set; every gap is listed too.
Writes ``raw.pkl`` (plans and measurements; ``--render`` writes the reports again from it), ``results.json`` and
``results.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os
import pickle
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback

from benchmarks.cases import LORA, LR, SIZES, Setting, _fit, _model
from benchmarks.run import launch
from lightning_fsdp_plus import FSDPPlusStrategy
from lightning_fsdp_plus._dist import all_gather_object, shutdown
from lightning_fsdp_plus.app.lm import CausalLMModule
from lightning_fsdp_plus.autoplan import AutoPlan, predict_memory
from lightning_fsdp_plus.autoplan.budget import format_bytes
from lightning_fsdp_plus.autoplan.probe import probe_hardware
from lightning_fsdp_plus.memory.accounting import local_bytes, model_state_bytes
from lightning_fsdp_plus.memory.fake import ForwardBatch
from lightning_fsdp_plus.options import FSDPPlusOptions

FAMILIES: dict[str, dict[str, Any]] = {
    "full": {"options": {}, "quantize": (None,), "lora_run": False},
    "lora_int8": {"options": {"lora": LORA}, "quantize": (None, "int8"), "lora_run": True},
    "lora_int8_nf4": {"options": {"lora": LORA}, "quantize": (None, "int8", "nf4"), "lora_run": True},
}
"""Families of candidates: the base options and what the plan may vary."""
PRECISION = "32-true"
PAGE = os.sysconf("SC_PAGE_SIZE")
RAW = "raw.pkl"
"""The plans and measurements of a run, for ``--render``."""
TOLERANCE = 1.10
"""The chosen candidate's measured step time may be at most this times the fastest measurably fitting one's."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per run (after 2 warm-up steps)")
    parser.add_argument("--families", default="full,lora_int8", help=f"comma-separated: {', '.join(FAMILIES)}")
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks/autoplan"))
    parser.add_argument("--render", action="store_true", help="only write the reports again from --out's raw.pkl")
    args = parser.parse_args(argv)
    unknown = [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:
        parser.error(f"--families: unknown {unknown}; valid choices: {', '.join(FAMILIES)}")
    return args


def predict(setting: Setting, family: dict[str, Any]) -> AutoPlan:
    """The auto plan for this family (no budget yet: everything fits), hardware probed on this group."""
    base = FSDPPlusOptions(**family["options"])
    config = setting.config()
    plan = predict_memory(config, options=base, world_size=setting.world_size, precision=PRECISION,
                          batch=ForwardBatch(setting.batch_size, setting.size["seq"]), budget=2**50, margin=0.1,
                          quantize=family["quantize"], lora_run=family["lora_run"])  # fmt: skip
    hardware = probe_hardware(features=(config.hidden_size, config.intermediate_size),
                              tokens=setting.batch_size * setting.size["seq"], precision=PRECISION,
                              device=setting.device, quantize=[q for q in family["quantize"] if q])  # fmt: skip
    return plan.with_hardware(hardware)


class TruePeak(Callback):
    """The real peak of the warm-up steps, transients included, from the process's memory: a thread samples the
    resident set every 0.2 ms while they run. Every allocation above 64 KiB is its own mapping, returned to the
    system when freed (``MALLOC_MMAP_THRESHOLD_`` is pinned at launch), so the resident set follows the tensors.
    Peak = (largest resident set - resident set before the first step) + the tensor bytes alive then (parameters
    and buffers, sharded and replicated). torch's ``FSDPMemTracker`` would say the same for float models, but it
    never sees bitsandbytes' int8 training path free its tensors and grows by ~11 MiB a step there; the resident
    set does not."""

    def __init__(self, *, steps: int) -> None:
        self.steps, self.peak = steps, 0
        self._base = self._top = 0
        self._before = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        with open("/proc/self/statm") as statm:
            while not self._stop.is_set():
                statm.seek(0)
                self._top = max(self._top, int(statm.read().split()[1]) * PAGE)
                time.sleep(0.0002)

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            gc.collect()
            self._before = model_state_bytes(trainer.strategy.model).params + sum(
                local_bytes(b) for b in trainer.strategy.model.buffers())  # fmt: skip
            self._base = self._top = int(Path("/proc/self/statm").read_text().split()[1]) * PAGE
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.steps - 1 and self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.peak = self._top - self._base + self._before


def measure(setting: Setting, family: dict[str, Any], plan: AutoPlan, index: int) -> dict[str, Any]:
    """Train candidate ``index`` for real; this rank's step time, sampled peak and true peak."""
    options = plan.predictions[index].candidate.options(FSDPPlusOptions(**family["options"]))
    module = CausalLMModule(_model(setting), lr=LR)
    peak = TruePeak(steps=setting.warmup)
    figures = _fit(setting, FSDPPlusStrategy(options=options), module, precision=PRECISION, callbacks=(peak,))
    return {"step_time_s": figures["step_time_s"], "peak_bytes": figures["tensor_peak_bytes"],
            "true_peak_bytes": peak.peak}  # fmt: skip


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def gap_budgets(peaks: list[int], *, margin: float) -> list[tuple[float, int]]:
    """``(relative width, budget)`` for every gap between consecutive distinct measured peaks: the budget whose usable
    part (less ``margin``, which the plan keeps free) is the gap's midpoint."""
    distinct = sorted(set(peaks))
    return [(high / low, int((low + high) / 2 / (1 - margin))) for low, high in itertools.pairwise(distinct)]


def widest_gap_budgets(peaks: list[int], *, margin: float, count: int = 3) -> list[int]:
    """The acceptance budgets: those of the ``count`` widest gaps between consecutive measured peaks (a budget in a
    narrow gap sits at one candidate's edge, where the last per cent of prediction error alone decides)."""
    return sorted(budget for _, budget in sorted(gap_budgets(peaks, margin=margin), reverse=True)[:count])


def check_budget(plan: AutoPlan, measured: list[dict[str, Any]], budget: int, *, peak: str) -> dict[str, Any]:
    """The plan's choice at ``budget`` against the fastest candidate that fits by measurement: whose measured
    ``peak`` (``true_peak_bytes``: the process's real peak, transients included; ``peak_bytes``: MemoryMonitor's
    step-boundary samples) leaves ``memory_margin`` of the budget free, as the plan requires of its prediction.
    Passes when the chosen candidate's measured peaks are within the budget and its step time within 10% of that
    fastest one's."""
    usable = int(budget * (1 - plan.margin))
    fitting = [i for i, m in enumerate(measured) if m[peak] <= usable]
    row: dict[str, Any] = {"budget_bytes": budget, "measured_fitting": len(fitting)}
    try:
        chosen = dataclasses.replace(plan, budget=budget, chosen=None).with_hardware(plan.hardware).chosen
    except ValueError as err:  # NoFitError
        return row | {"chosen": None, "error": str(err).split(". Raise")[0], "ok": not fitting}
    assert chosen is not None
    fastest = min(fitting, key=lambda i: measured[i]["step_time_s"]) if fitting else chosen
    ratio = measured[chosen]["step_time_s"] / measured[fastest]["step_time_s"]
    within = all(measured[chosen][key] <= budget for key in ("true_peak_bytes", "peak_bytes"))
    labels = [p.candidate.label for p in plan.predictions]
    return row | {"chosen": chosen, "chosen_label": labels[chosen], "fastest_label": labels[fastest],
                  "chosen_measured_peak": measured[chosen][peak], "fastest_fitting": fastest,
                  "step_ratio": ratio, "ok": within and ratio <= TOLERANCE}  # fmt: skip


def report(name: str, plan: AutoPlan, measured: list[dict[str, Any]]) -> dict[str, Any]:
    """Predicted vs measured for every candidate, the rank correlation, and the three budget checks."""
    rows = []
    for p, m in zip(plan.predictions, measured, strict=True):
        predicted_peak = p.memory.peak_bytes_per_rank
        assert predicted_peak is not None and p.step is not None
        rows.append({"label": p.candidate.label, "predicted_peak": predicted_peak, "measured_peak": m["peak_bytes"],
                     "peak_error": predicted_peak / m["peak_bytes"] - 1, "plan_peak": p.peak_bytes,
                     "true_peak": m["true_peak_bytes"], "true_peak_error": p.peak_bytes / m["true_peak_bytes"] - 1,
                     "predicted_step": p.step.total, "measured_step": m["step_time_s"]})  # fmt: skip
    rho = spearman([r["predicted_step"] for r in rows], [r["measured_step"] for r in rows])
    checks = {}
    for peak in ("true_peak_bytes", "peak_bytes"):
        peaks = [m[peak] for m in measured]
        widest, every = widest_gap_budgets(peaks, margin=plan.margin), gap_budgets(peaks, margin=plan.margin)
        checks[peak] = {
            "budgets": [check_budget(plan, measured, b, peak=peak) for b in widest],
            "every_gap": [check_budget(plan, measured, b, peak=peak) for _, b in every],
        }
    return {"family": name, "hardware": plan.hardware.to_dict() if plan.hardware else None, "candidates": rows,
            "spearman": rho, "max_peak_error": max(abs(r["peak_error"]) for r in rows),
            "max_true_peak_error": max(abs(r["true_peak_error"]) for r in rows), "checks": checks,
            "plan": plan.to_dict(), "measured": measured}  # fmt: skip


HEADER = "| budget | fit (measured) | chosen | its measured peak | fastest that fits (measured) | chosen/fastest | ok |"


def _budget_row(b: dict[str, Any]) -> str:
    if b["chosen"] is None:
        return (f"| {format_bytes(b['budget_bytes'])} | {b['measured_fitting']} | none fits: {b['error']} | | | |"
                f" {'yes' if b['ok'] else 'no'} |")  # fmt: skip
    return (f"| {format_bytes(b['budget_bytes'])} | {b['measured_fitting']} | {b['chosen_label']} |"
            f" {format_bytes(b['chosen_measured_peak'])} | {b['fastest_label']} | {b['step_ratio']:.3f}"
            f" | {'yes' if b['ok'] else 'no'} |")  # fmt: skip


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The report as Markdown."""
    lines = [f"# Auto plan: predicted vs measured ({meta['date']})", "",
             f"{meta['machine']}; {meta['world_size']} ranks; Llama {meta['model']}; batch {meta['batch_size']} x "
             f"{meta['seq']} tokens per rank; {PRECISION}; {meta['repeats']} repetitions of {meta['steps']} measured"
             f" steps; `{meta['command']}` ({meta['wall_s'] / 60:.1f} min)", ""]  # fmt: skip
    for r in results:
        hw = r["hardware"]
        lines += [f"## {r['family']}", "",
                  f"Probed: matmul {hw['matmul_flops'] / 1e9:.1f} GFLOP/s, "
                  + ", ".join(f"{k} {bw / 1e9:.2f} GB/s + {lat * 1e6:.0f} us" for k, (bw, lat) in
                              hw["collectives"].items())
                  + f", AdamW {hw['optimizer_rate'] / 1e6:.0f} M elements/s"
                  + "".join(f", {k} {v / 1e9:.1f} GFLOP/s" for k, v in hw["quantized_flops"].items()), "",
                  "| candidate | predicted peak | sampled peak | error | predicted with transient | true peak | error"
                  " | predicted step s | measured step s |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for c in r["candidates"]:
            predicted, sampled, planned, real = (format_bytes(c[k]) for k in ("predicted_peak", "measured_peak",
                                                                             "plan_peak", "true_peak"))  # fmt: skip
            lines.append(
                f"| {c['label']} | {predicted} | {sampled} | {c['peak_error']:+.1%} | {planned} | {real} |"
                f" {c['true_peak_error']:+.1%} | {c['predicted_step']:.3f} | {c['measured_step']:.3f} |"
            )
        lines += ["", f"Memory: tensor-accounted peak (MemoryMonitor's samples) within {r['max_peak_error']:.1%};"
                  f" real peak (resident set, transients included) within {r['max_true_peak_error']:.1%} of the"
                  f" planned peak. Step time: Spearman rank correlation {r['spearman']:.2f}.", "",
                  ]  # fmt: skip
        for peak, title in (("true_peak_bytes", "real peaks (resident set)"),
                            ("peak_bytes", "tensor-accounted peaks (MemoryMonitor)")):  # fmt: skip
            check = r["checks"][peak]
            lines += [f"Budgets whose usable part (less memory_margin) is the midpoint of one of the three widest gaps"
                      f" between measured {title}:", "", HEADER,
                      "|---|---|---|---|---|---|---|", *(_budget_row(b) for b in check["budgets"])]  # fmt: skip
            missed = [b for b in check["every_gap"] if not b["ok"]]
            lines += ["", f"Every gap between consecutive measured {title} ({len(check['every_gap'])} budgets):"
                      f" {len(check['every_gap']) - len(missed)} ok.", ""]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Entry point: launch the ranks, predict, measure every candidate, report on rank 0."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.render:
        write_reports(args.out)
        return
    if "LOCAL_RANK" not in os.environ:
        # every allocation above 64 KiB its own mapping, unmapped when freed: the resident set follows the tensors
        sys.exit(launch(argv, args.devices, module="benchmarks.autoplan", env={"MALLOC_MMAP_THRESHOLD_": "65536"}))
    dist.init_process_group("gloo")
    started = time.perf_counter()
    setting = Setting(size=SIZES["full"], batch_size=args.batch_size, warmup=2, steps=args.steps,
                      world_size=dist.get_world_size())  # fmt: skip
    raw = []
    for name in args.families.split(","):
        family = FAMILIES[name]
        plan = predict(setting, family)
        runs: list[list[dict[str, Any]]] = [[] for _ in plan.predictions]
        for rep in range(args.repeats):
            for i in range(len(plan.predictions)):
                ranks = all_gather_object(measure(setting, family, plan, i))
                runs[i].append({key: max(r[key] for r in ranks) for key in ranks[0]})
                if dist.get_rank() == 0:
                    print(f"[autoplan] {name} repetition {rep + 1}/{args.repeats} candidate {i + 1}:"
                          f" {plan.predictions[i].candidate.label} done", flush=True)  # fmt: skip
        measured = [{"step_time_s": statistics.median(r["step_time_s"] for r in run),
                     "peak_bytes": max(r["peak_bytes"] for r in run),
                     "true_peak_bytes": max(r["true_peak_bytes"] for r in run)} for run in runs]  # fmt: skip
        raw.append((name, plan, measured))
    if dist.get_rank() == 0:
        meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores, {torch.get_num_threads()}"
                f" thread(s)/rank", "world_size": setting.world_size, "model": {k: v for k, v in setting.size.items()},
                "batch_size": setting.batch_size, "seq": setting.size["seq"], "repeats": args.repeats,
                "steps": args.steps, "command": " ".join(["python -m benchmarks.autoplan", *argv]),
                "wall_s": time.perf_counter() - started}  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / RAW).open("wb") as file:  # the measurements first: a report can be rendered again
            pickle.dump({"meta": meta, "raw": raw}, file)
        write_reports(args.out)
    dist.barrier()


def write_reports(out: Path) -> None:
    """``results.json`` and ``results.md`` from the plans and measurements in ``out/raw.pkl``."""
    with (out / RAW).open("rb") as file:
        saved = pickle.load(file)  # written by this module, from this very run
    results = [report(name, plan, measured) for name, plan, measured in saved["raw"]]
    (out / "results.json").write_text(json.dumps({"meta": saved["meta"], "families": results}, indent=1))
    text = markdown(results, saved["meta"])
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown()
