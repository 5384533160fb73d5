"""The auto plan against measurements: every candidate trained, predictions compared, budgets checked.

    python -m benchmarks.autoplan [--devices 2] [--repeats 2] [--batch-size 2] [--families full,lora_int8]
                                  [--size full|135m|400m] [--out outputs/benchmarks/autoplan]

On ``--devices`` ranks (torchrun; gloo on CPU) and a Llama built from a config, no download (``--size``: the
benchmark's 12.8M ``full``, or issue 32's ``135m`` and ``400m``, ``benchmarks.cases.SIZES``), for each family of
candidates:

* ``full``: a full fine-tune (3 strategies x activation checkpointing);
* ``lora_int8``: LoRA r=16 on every projection with ``allow_quantize=["int8"]`` (strategies x ``lora_only`` x
  checkpointing x {no quantization, int8});
* ``lora_int8_nf4``: the same with ``allow_quantize=["int8", "nf4"]``.

the auto plan predicts every candidate (memory from the estimator, step time from the cost model with the
hardware probed on this very group), then every candidate trains for real through ``FSDPPlusStrategy`` with its
options; repetitions interleave the candidates and the report takes medians. The ranks run under tcmalloc when it
is installed (as ``scripts/run`` runs them), else under glibc with every allocation its own mapping. Three peaks
are measured per rank:

* the tensor-accounted peak of ``MemoryMonitor``'s step-boundary samples (after forward, before and after the
  optimizer step), which the estimator's ``peak_bytes_per_rank`` predicts;
* the live peak (:class:`TruePeak`, sampled every 0.2 ms through the warm-up steps: tcmalloc's allocated bytes, or
  the resident set when every allocation is its own mapping), transients included, which the estimator's
  ``live_peak_bytes_per_rank`` predicts;
* the process peak: the resident set's growth over the same steps (what the allocator keeps included), which the
  plan's real peak (``real_peak_bytes_per_rank``) predicts and budgets.

The report gives, per candidate, the three comparisons and predicted vs measured step time (error and Spearman
rank correlation), and budget checks: a budget's usable part (less ``memory_margin``, which the plan keeps free of
its prediction) is placed at the midpoint between two consecutive measured process peaks; the plan's choice passes
when its measured peaks are within the budget and its step time within 10% of the fastest candidate whose measured
peak leaves the margin free as well. Three budgets at the widest gaps are the acceptance set; every gap is listed
too. And for every candidate, a budget of 1.1x its measured process peak: the plan's choice there must stay inside.
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
from lightning_fsdp_plus.memory.allocator import (
    platform_for,
    release_free_memory,
    tcmalloc_allocated_bytes,
    tcmalloc_path,
)
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
BENCH_SIZES = ("full", "135m", "400m")
"""``--size`` choices: the benchmark's 12.8M Llama and issue 32's two larger ones."""
BUDGET_OVER_PEAK = 1.1
"""The per-candidate budget check: a budget this many times a candidate's measured process peak."""
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
    parser.add_argument("--size", default="full", choices=BENCH_SIZES, help="the Llama (benchmarks.cases.SIZES)")
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
                          quantize=family["quantize"], lora_run=family["lora_run"],
                          platform=platform_for(setting.device.type))  # fmt: skip
    hardware = probe_hardware(features=(config.hidden_size, config.intermediate_size),
                              tokens=setting.batch_size * setting.size["seq"], precision=PRECISION,
                              device=setting.device, quantize=[q for q in family["quantize"] if q])  # fmt: skip
    return plan.with_hardware(hardware)


class TruePeak(Callback):
    """The live and the process peak of the warm-up steps, transients included, sampled by a thread every 0.2 ms.

    Live: tcmalloc's allocated bytes when it is this process's allocator; else the resident set, which follows the
    tensors because every allocation above 64 KiB is its own mapping (``MALLOC_MMAP_THRESHOLD_`` pinned at launch).
    Process: the resident set. Each peak = its growth from just before the first step + the tensor bytes alive then
    (parameters and buffers, sharded and replicated). torch's ``FSDPMemTracker`` would give the live peak for float
    models, but it never sees bitsandbytes' int8 training path free its tensors and grows by ~11 MiB a step there."""

    def __init__(self, *, steps: int) -> None:
        self.steps, self.peak, self.process_peak = steps, 0, 0
        self._base = self._top = self._base_live = self._top_live = 0
        self._before = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _live(resident: int) -> int:
        allocated = tcmalloc_allocated_bytes()
        return resident if allocated is None else allocated

    def _sample(self) -> None:
        with open("/proc/self/statm") as statm:
            while not self._stop.is_set():
                statm.seek(0)
                resident = int(statm.read().split()[1]) * PAGE
                self._top = max(self._top, resident)
                self._top_live = max(self._top_live, self._live(resident))
                time.sleep(0.0002)

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            gc.collect()
            release_free_memory()  # what earlier candidates left in the allocator: as if a fresh process
            self._before = model_state_bytes(trainer.strategy.model).params + sum(
                local_bytes(b) for b in trainer.strategy.model.buffers())  # fmt: skip
            self._base = self._top = int(Path("/proc/self/statm").read_text().split()[1]) * PAGE
            self._base_live = self._top_live = self._live(self._base)
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.steps - 1 and self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.peak = self._top_live - self._base_live + self._before
            self.process_peak = self._top - self._base + self._before


def measure(setting: Setting, family: dict[str, Any], plan: AutoPlan, index: int) -> dict[str, Any]:
    """Train candidate ``index`` for real; this rank's step time, sampled peak and true peak."""
    options = plan.predictions[index].candidate.options(FSDPPlusOptions(**family["options"]))
    module = CausalLMModule(_model(setting), lr=LR)
    peak = TruePeak(steps=setting.warmup)
    figures = _fit(setting, FSDPPlusStrategy(options=options), module, precision=PRECISION, callbacks=(peak,))
    return {"step_time_s": figures["step_time_s"], "peak_bytes": figures["tensor_peak_bytes"],
            "true_peak_bytes": peak.peak, "process_peak_bytes": peak.process_peak}  # fmt: skip


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
    ``peak`` (``process_peak_bytes``: the process's real peak, what its allocator keeps included; ``peak_bytes``:
    MemoryMonitor's step-boundary samples) leaves ``memory_margin`` of the budget free, as the plan requires of its
    prediction.
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
    within = all(measured[chosen][key] <= budget for key in ("process_peak_bytes", "peak_bytes"))
    labels = [p.candidate.label for p in plan.predictions]
    return row | {"chosen": chosen, "chosen_label": labels[chosen], "fastest_label": labels[fastest],
                  "chosen_measured_peak": measured[chosen][peak], "fastest_fitting": fastest,
                  "step_ratio": ratio, "ok": within and ratio <= TOLERANCE}  # fmt: skip


def check_over_peak(plan: AutoPlan, measured: list[dict[str, Any]], index: int) -> dict[str, Any]:
    """A budget of ``BUDGET_OVER_PEAK`` x candidate ``index``'s measured process peak: the plan's choice there must
    take at most the budget (measured)."""
    budget = int(BUDGET_OVER_PEAK * measured[index]["process_peak_bytes"])
    try:
        chosen = dataclasses.replace(plan, budget=budget, chosen=None).with_hardware(plan.hardware).chosen
    except ValueError:  # NoFitError: the plan refuses; honoured, if cautious
        return {"budget_bytes": budget, "chosen": None, "ok": True}
    assert chosen is not None
    peak = measured[chosen]["process_peak_bytes"]
    return {"budget_bytes": budget, "chosen": chosen, "chosen_peak": peak, "ok": peak <= budget}


def report(name: str, plan: AutoPlan, measured: list[dict[str, Any]]) -> dict[str, Any]:
    """Predicted vs measured for every candidate, the rank correlation, and the budget checks."""
    rows = []
    for p, m in zip(plan.predictions, measured, strict=True):
        predicted_peak, live = p.memory.peak_bytes_per_rank, p.memory.live_peak_bytes_per_rank
        assert predicted_peak is not None and live is not None and p.step is not None
        rows.append({"label": p.candidate.label, "predicted_peak": predicted_peak, "measured_peak": m["peak_bytes"],
                     "peak_error": predicted_peak / m["peak_bytes"] - 1, "live_peak": live,
                     "true_peak": m["true_peak_bytes"], "true_peak_error": live / m["true_peak_bytes"] - 1,
                     "plan_peak": p.peak_bytes, "process_peak": m["process_peak_bytes"],
                     "process_peak_error": p.peak_bytes / m["process_peak_bytes"] - 1,
                     "predicted_step": p.step.total, "measured_step": m["step_time_s"],
                     "step_error": p.step.total / m["step_time_s"] - 1})  # fmt: skip
    rho = spearman([r["predicted_step"] for r in rows], [r["measured_step"] for r in rows])
    checks: dict[str, Any] = {"over_peak": [check_over_peak(plan, measured, i) for i in range(len(measured))]}
    for peak in ("process_peak_bytes", "peak_bytes"):
        peaks = [m[peak] for m in measured]
        widest, every = widest_gap_budgets(peaks, margin=plan.margin), gap_budgets(peaks, margin=plan.margin)
        checks[peak] = {
            "budgets": [check_budget(plan, measured, b, peak=peak) for b in widest],
            "every_gap": [check_budget(plan, measured, b, peak=peak) for _, b in every],
        }
    return {"family": name, "hardware": plan.hardware.to_dict() if plan.hardware else None, "candidates": rows,
            "spearman": rho, "max_peak_error": max(abs(r["peak_error"]) for r in rows),
            "max_true_peak_error": max(abs(r["true_peak_error"]) for r in rows),
            "max_process_peak_error": max(abs(r["process_peak_error"]) for r in rows),
            "max_step_error": max(abs(r["step_error"]) for r in rows), "checks": checks,
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
                  "| candidate | tensor peak: predicted | sampled | error | live peak: predicted | measured | error"
                  " | real peak: planned | process | error | step s: predicted | measured | error |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for c in r["candidates"]:
            cells = [format_bytes(c[k]) for k in ("predicted_peak", "measured_peak", "live_peak", "true_peak",
                                                  "plan_peak", "process_peak")]  # fmt: skip
            lines.append(
                f"| {c['label']} | {cells[0]} | {cells[1]} | {c['peak_error']:+.1%} | {cells[2]} | {cells[3]} |"
                f" {c['true_peak_error']:+.1%} | {cells[4]} | {cells[5]} | {c['process_peak_error']:+.1%} |"
                f" {c['predicted_step']:.3f} | {c['measured_step']:.3f} | {c['step_error']:+.1%} |"
            )
        over = r["checks"]["over_peak"]
        lines += ["", f"Platform {r['plan']['platform']}. Memory: tensor-accounted peak (MemoryMonitor's samples)"
                  f" within {r['max_peak_error']:.1%}; live peak (transients included) within"
                  f" {r['max_true_peak_error']:.1%}; the plan's real peak within {r['max_process_peak_error']:.1%} of"
                  f" the process peak. Step time: within {r['max_step_error']:.1%}, Spearman rank correlation"
                  f" {r['spearman']:.2f}. A budget of {BUDGET_OVER_PEAK:g}x a candidate's measured process peak:"
                  f" honoured by the plan's choice for {sum(b['ok'] for b in over)} of {len(over)} candidates.", "",
                  ]  # fmt: skip
        for peak, title in (("process_peak_bytes", "process peaks"),
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
        # tcmalloc as scripts/run preloads it; else every allocation above 64 KiB its own mapping, unmapped when
        # freed, so the resident set follows the live tensors
        found = tcmalloc_path()
        env = {"LD_PRELOAD": str(found)} if found else {"MALLOC_MMAP_THRESHOLD_": "65536"}
        sys.exit(launch(argv, args.devices, module="benchmarks.autoplan", env=env))
    dist.init_process_group("gloo")
    started = time.perf_counter()
    setting = Setting(size=SIZES[args.size], batch_size=args.batch_size, warmup=2, steps=args.steps,
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
                     "true_peak_bytes": max(r["true_peak_bytes"] for r in run),
                     "process_peak_bytes": max(r["process_peak_bytes"] for r in run)} for run in runs]  # fmt: skip
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
