"""memory/allocator.py and scripts/malloc.sh: which malloc serves a process, and tcmalloc preloaded when installed."""

from __future__ import annotations

import subprocess
import sys

from lightning_fsdp_plus.memory.allocator import allocator_advice, allocator_in_use, tcmalloc_path
from tests.helpers.launch import REPO, subprocess_env

LIBC = "7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"


def test_the_allocator_is_read_from_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(LIBC)
    assert allocator_in_use(maps) == "glibc"
    maps.write_text(LIBC + "7f20-7f30 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4\n")
    assert allocator_in_use(maps) == "tcmalloc"
    assert allocator_in_use(tmp_path / "absent") == "unknown"


def test_tcmalloc_is_found_where_debian_installs_it(tmp_path):
    assert tcmalloc_path((str(tmp_path),)) is None
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert tcmalloc_path((str(tmp_path),)) == tmp_path / "libtcmalloc_minimal.so.4"


def test_scripts_preload_tcmalloc_when_installed_and_the_process_then_runs_on_it():
    def preload(**env: str) -> str:
        command = ["bash", "-c", 'source scripts/malloc.sh; echo "${LD_PRELOAD:-}"']
        return subprocess.run(command, cwd=REPO, env={**subprocess_env(), **env}, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    assert preload(FSDP_PLUS_MALLOC="glibc") == ""  # the opt-out
    found = tcmalloc_path()
    if found is None:  # not installed: the advice says how to get it
        assert preload() == "" and "apt-get install libtcmalloc-minimal4" in allocator_advice()
        return
    assert preload() == str(found)
    probe = "from lightning_fsdp_plus.memory.allocator import allocator_in_use as a; print(a())"
    run = subprocess.run([sys.executable, "-c", probe], env={**subprocess_env(), "LD_PRELOAD": str(found)},
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert run.stdout.strip() == "tcmalloc"
    assert allocator_in_use() == "glibc" and f"LD_PRELOAD={found}" in allocator_advice()  # this process: glibc
