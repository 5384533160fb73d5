"""Randomized preemption trials: SIGTERM to rank 0, rank 1 or both at a random moment of a 2-rank run.

    python scripts/preemption_trials.py [--program trainer|app] [--trials 24] [--seed 0] [--out outputs/preemption]

``--program trainer`` (default) runs ``tests/helpers/ckpt_cases.py``, a plain ``Trainer(strategy=FSDPPlusStrategy())``
script (3 x 4 SGD steps with 0.25 s of work after each, validation every 2 steps, a checkpoint every 4);
``--program app`` runs ``fsdp-plus-train`` (24 AdamW steps with 0.1 s of work after each, validation every 8).
Each trial waits until rank 0 has finished a random step, then after a random further delay (0-0.4 s) sends
SIGTERM from outside (as ``timeout``, SLURM or Kubernetes do) to the chosen ranks, so signals land in forward,
backward, the optimizer step, validation and checkpoint saves alike. It records every process's exit status
(rank 1's where the program writes it) and when each process was gone, then resumes (``fit(ckpt_path="last")`` /
``ckpt_path=last``) and compares the final parameters with an uninterrupted run, bit for bit. Writes
``trials.json`` and ``trials.md``; exits 1 if any trial failed (a process alive 60 s after the signal, a wrong
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

from lightning_fsdp_plus.export import read_checkpoint

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "helpers" / "ckpt_cases.py"
EXIT_WITHIN_S = 60.0
LAST_STEP = {"trainer": 12, "app": 24}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _command(program: str, out: Path, scenario: str, *, resume: bool) -> list[str]:
    if program == "trainer":
        command = [sys.executable, str(SCRIPT), "--out", str(out), "--scenario", scenario, "--stateful", "--validate",
                   "--step-sleep", "0.25"]  # fmt: skip
        return command + (["--resume", "last"] if resume else [])
    record = "tests.helpers.ckpt_cases.Record"  # pid and progress files; rank 0 saves the final parameters
    command = [sys.executable, "-m", "lightning_fsdp_plus.app.train", f"hydra.run.dir={out}", "trainer.max_steps=24",
               "trainer.enable_progress_bar=false", "validate_before=false", "trainer.val_check_interval=8",
               "data.val_size=32", "generate.num_prompts=0", f"+callbacks.record._target_={record}",
               f"+callbacks.record.out={out}", f"+callbacks.record.name={scenario}",
               "+callbacks.record.step_sleep=0.1"]  # fmt: skip
    return command + (["ckpt_path=last"] if resume else [])


def _start(program: str, out: Path, scenario: str, *, resume: bool = False) -> subprocess.Popen:
    log = (out / f"{scenario}.log").open("wb")
    command = _command(program, out, scenario, resume=resume)
    return subprocess.Popen(command, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)


def _wait_file(path: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while not path.is_file() and time.time() < deadline:
        time.sleep(0.02)
    if not path.is_file():
        raise TimeoutError(f"{path} did not appear")


def _gone(pid: int) -> bool:
    """The process has exited (it may linger as a zombie until its parent reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def _final(out: Path, scenario: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{scenario}.pt", weights_only=True)


def reference(program: str, out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The uninterrupted run: final parameters and rank 0's record."""
    proc = _start(program, out, "reference")
    if proc.wait(timeout=600) != 0:
        raise SystemExit(f"the reference run failed: see {out / 'reference.log'}")
    return _final(out, "reference"), json.loads((out / "reference.rank0.json").read_text())


def _wait_step(path: Path, step: int, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = path.read_text().strip() if path.is_file() else ""
        if text and int(text) >= step:
            return
        time.sleep(0.01)
    raise TimeoutError(f"{path} never reached step {step}")


def trial(program: str, out: Path, *, targets: tuple[int, ...], step: int, delay: float,
          ref: dict[str, torch.Tensor]) -> dict:  # fmt: skip
    """One preempted run and its resume."""
    out.mkdir(parents=True)
    proc = _start(program, out, "preempted")
    for rank in (0, 1):
        _wait_file(out / f"preempted.rank{rank}.pid", 300)
    pids = [int((out / f"preempted.rank{r}.pid").read_text()) for r in (0, 1)]
    _wait_step(out / "preempted.rank0.progress", step, 300)
    time.sleep(delay)
    sent = time.time()
    for rank in targets:
        with contextlib.suppress(ProcessLookupError):  # that rank already finished
            os.kill(pids[rank], signal.SIGTERM)
    gone_at: list[float | None] = [None, None]
    while None in gone_at and time.time() < sent + EXIT_WITHIN_S:
        for rank, pid in enumerate(pids):
            if gone_at[rank] is None and (_gone(pid) or (rank == 0 and proc.poll() is not None)):
                gone_at[rank] = time.time()
        time.sleep(0.02)
    for pid in pids:  # nothing may be left behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    rank1 = out / "preempted.exit.rank1.json"  # ckpt_cases.py writes its exit status; the app does not
    codes = [proc.wait(timeout=30), json.loads(rank1.read_text())["code"] if rank1.is_file() else None]
    exit_s = [round(t - sent, 2) if t is not None else None for t in gone_at]
    finished = codes[0] == 0  # the signal came after training ended
    row = {"targets": list(targets), "after_step": step, "delay_s": round(delay, 2), "codes": codes}
    row["exit_after_s"] = exit_s
    ckpt = out / ("ckpt" if program == "trainer" else "checkpoints") / "last.ckpt" / "meta.pt"
    row["saved_step"] = torch.load(ckpt, weights_only=True)["global_step"] if ckpt.is_file() else None
    if finished:
        final = _final(out, "preempted")
    else:
        resumed = _start(program, out, "resumed", resume=True)
        row["resume_code"] = resumed.wait(timeout=600)
        final = _final(out, "resumed") if row["resume_code"] == 0 and (out / "resumed.pt").is_file() else None
        if row["resume_code"] == 0 and row["saved_step"] == LAST_STEP[program]:  # stopped after the last step:
            final = {k: v.float() for k, v in read_checkpoint(ckpt.parent)["state_dict"].items()}  # nothing to resume
    row["identical"] = final is not None and all(torch.equal(final[k], ref[k]) for k in ref)
    in_time = all(s is not None and s < EXIT_WITHIN_S for s in exit_s)
    right_codes = finished or (codes[0] == 143 and codes[1] in (143, None))
    row["ok"] = bool(in_time and row["identical"] and right_codes)
    return row


def write_report(out: Path, rows: list[dict], *, program: str, record: dict) -> None:
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
        "program": program,
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
    parser.add_argument("--program", choices=["trainer", "app"], default="trainer")
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("outputs/preemption"))
    args = parser.parse_args()
    if args.trials < 1:
        parser.error(f"--trials={args.trials} must be a positive integer")
    out = args.out / args.program
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    ref, record = reference(args.program, out)
    rows = []
    choices = [(0,), (1,), (0, 1)]
    for i in range(args.trials):
        targets = choices[i % 3]
        step, delay = rng.randint(1, LAST_STEP[args.program] - 1), rng.uniform(0, 0.4)
        row = trial(args.program, out / f"trial{i:02d}", targets=targets, step=step, delay=delay, ref=ref)
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_report(out, rows, program=args.program, record=record)
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
