"""Randomized preemption trials: SIGTERM to rank 0, rank 1 or both at a random moment of a 2-rank run.

    python scripts/preemption_trials.py [--trials 24] [--seed 0] [--out outputs/preemption]

Each trial starts ``tests/helpers/ckpt_cases.py`` (a plain ``Trainer(strategy=FSDPPlusStrategy())`` script: 3 x 4
SGD steps with 0.25 s of work after each, validation every 2 steps, a checkpoint every 4), waits until rank 0 has
finished a random step (1-11), then after a random further delay (0-0.4 s) sends SIGTERM from outside (as
``timeout``, SLURM or Kubernetes do) to the chosen ranks, so signals land in forward, backward, the optimizer step,
validation and checkpoint saves alike. It records every process's exit status and how long after the signal it
exited, then resumes with ``fit(ckpt_path="last")`` and compares the final parameters with an uninterrupted run
(bit for bit).
Writes ``trials.json`` and ``trials.md``; exits 1 if any trial failed (a process alive after 60 s, a wrong
status, or different parameters).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "helpers" / "ckpt_cases.py"
RUN = ("--stateful", "--validate", "--step-sleep", "0.25")
EXIT_WITHIN_S = 60.0


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _start(out: Path, scenario: str, *args: str) -> subprocess.Popen:
    log = (out / f"{scenario}.log").open("wb")
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--scenario", scenario, *RUN, *args]
    return subprocess.Popen(command, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)


def _wait_file(path: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while not path.is_file() and time.time() < deadline:
        time.sleep(0.02)
    if not path.is_file():
        raise TimeoutError(f"{path} did not appear")


def _final(out: Path, scenario: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{scenario}.pt", weights_only=True)


def reference(out: Path) -> tuple[dict[str, torch.Tensor], float, dict]:
    """The uninterrupted run: final parameters, training seconds, rank 0's record."""
    proc = _start(out, "reference")
    _wait_file(out / "reference.rank1.pid", 300)
    started = time.time()
    if proc.wait(timeout=600) != 0:
        raise SystemExit(f"the reference run failed: see {out / 'reference.log'}")
    record = json.loads((out / "reference.rank0.json").read_text())
    return _final(out, "reference"), time.time() - started, record


def _wait_step(path: Path, step: int, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = path.read_text().strip() if path.is_file() else ""
        if text and int(text) >= step:
            return
        time.sleep(0.01)
    raise TimeoutError(f"{path} never reached step {step}")


def trial(out: Path, *, targets: tuple[int, ...], step: int, delay: float, ref: dict[str, torch.Tensor]) -> dict:
    """One preempted run and its resume."""
    out.mkdir(parents=True)
    proc = _start(out, "preempted")
    for rank in (0, 1):
        _wait_file(out / f"preempted.rank{rank}.pid", 300)
    pids = [int((out / f"preempted.rank{r}.pid").read_text()) for r in (0, 1)]
    _wait_step(out / "preempted.rank0.progress", step, 300)
    time.sleep(delay)
    sent = time.time()
    for rank in targets:
        with contextlib.suppress(ProcessLookupError):  # that rank already finished
            os.kill(pids[rank], signal.SIGTERM)
    try:
        proc.wait(timeout=EXIT_WITHIN_S + 5)
    except subprocess.TimeoutExpired:
        proc.kill()
    exits = []
    for rank in (0, 1):
        path = out / f"preempted.exit.rank{rank}.json"
        deadline = sent + EXIT_WITHIN_S
        while not path.is_file() and time.time() < deadline:
            time.sleep(0.05)
        exits.append(json.loads(path.read_text()) if path.is_file() else {"code": None, "time": None})
    for pid in pids:  # nothing may be left behind
        try:
            os.kill(pid, signal.SIGKILL)
            alive_after = True
        except ProcessLookupError:
            alive_after = False
        exits[pids.index(pid)]["alive_after"] = alive_after
    codes = [e["code"] for e in exits]
    exit_s = [round(e["time"] - sent, 2) if e["time"] else None for e in exits]
    finished = codes == [0, 0]  # the signal came after training ended
    row = {"targets": list(targets), "after_step": step, "delay_s": round(delay, 2), "codes": codes}
    row["exit_after_s"] = exit_s
    ckpt = out / "ckpt" / "last.ckpt" / "meta.pt"
    row["saved_step"] = torch.load(ckpt, weights_only=True)["global_step"] if ckpt.is_file() else None
    if finished:
        final = _final(out, "preempted")
    else:
        resumed = _start(out, "resumed", "--resume", "last")
        row["resume_code"] = resumed.wait(timeout=600)
        final = _final(out, "resumed") if row["resume_code"] == 0 else None
    row["identical"] = final is not None and all(torch.equal(final[k], ref[k]) for k in ref)
    in_time = all(s is not None and s < EXIT_WITHIN_S for s in exit_s)
    row["ok"] = bool(in_time and row["identical"] and (finished or codes == [143, 143]))
    return row


def write_report(out: Path, rows: list[dict], *, train_s: float, record: dict) -> None:
    """trials.json and trials.md."""
    exit_times = [s for r in rows for s in r["exit_after_s"] if s is not None]
    agree_ms = 1000 * record["agree_seconds"] / max(record["agree_calls"], 1)
    summary = {
        "trials": len(rows),
        "ok": sum(r["ok"] for r in rows),
        "exit_after_s_median": statistics.median(exit_times) if exit_times else None,
        "exit_after_s_max": max(exit_times) if exit_times else None,
        "agreement_ms_per_call": round(agree_ms, 3),
        "agreement_calls_per_run": record["agree_calls"],
        "training_s": round(train_s, 1),
    }
    (out / "trials.json").write_text(json.dumps({"summary": summary, "trials": rows}, indent=1))
    lines = ["| # | signalled ranks | after step + s | exit status (rank 0, 1) | exit after s | saved step"
             " | identical | ok |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, r in enumerate(rows):
        lines.append(f"| {i} | {','.join(map(str, r['targets']))} | {r['after_step']} + {r['delay_s']} | {r['codes']}"
                     f" | {r['exit_after_s']} | {r['saved_step']} | {r['identical']} | {r['ok']} |")  # fmt: skip
    lines.append("")
    lines.append(json.dumps(summary))
    (out / "trials.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    """Run the trials."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("outputs/preemption"))
    args = parser.parse_args()
    if args.trials < 1:
        parser.error(f"--trials={args.trials} must be a positive integer")
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    ref, train_s, record = reference(args.out)
    print(f"uninterrupted run: {train_s:.1f} s of training", flush=True)
    rows = []
    choices = [(0,), (1,), (0, 1)]
    for i in range(args.trials):
        targets = choices[i % 3]
        step, delay = rng.randint(1, 11), rng.uniform(0, 0.4)
        row = trial(args.out / f"trial{i:02d}", targets=targets, step=step, delay=delay, ref=ref)
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_report(args.out, rows, train_s=train_s, record=record)
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
