"""The README's two Python quick-start blocks run as written: each saved as a script and run on 2 CPU processes, as
the README says to (Lightning starts the second process by running the script again), from the repository root."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers.docs import doc_block
from tests.helpers.launch import REPO, failure_excerpt, subprocess_env


def test_the_trainer_and_lora_blocks_train_on_two_cpu_processes_and_print_what_they_say(tmp_path):
    procs = {}
    for name, text in (("trainer", doc_block("trainer")), ("lora", doc_block("lora"))):  # both at once: imports
        script = tmp_path / f"{name}.py"
        script.write_text(text)
        procs[name] = subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=subprocess_env(),
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    out = {name: proc.communicate(timeout=600)[0] for name, proc in procs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, failure_excerpt(out[name])
    loss = re.search(r"train loss after 16 steps: ([0-9.]+)", out["trainer"])
    assert loss and float(loss.group(1)) < 4.5, failure_excerpt(out["trainer"])  # from ~5.9 (3.35 measured): learning
    assert "\nmodel.model.layers.0\n" in out["trainer"]  # the first FSDP unit, from the sharding plan
    held_out = re.search(r"held-out perplexity: ([0-9.]+) -> ([0-9.]+)", out["lora"])
    assert held_out and float(held_out.group(2)) < 0.5 * float(held_out.group(1)), failure_excerpt(out["lora"])
