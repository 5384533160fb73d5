"""memory/allocator.py and scripts/malloc.sh: which malloc serves a process, and tcmalloc preloaded when installed."""

from __future__ import annotations

import os
import subprocess
import sys

from lightning_fsdp_plus.memory.allocator import (
    PLATFORMS,
    allocator_advice,
    allocator_in_use,
    platform_for,
    tcmalloc_allocated_bytes,
    tcmalloc_path,
)
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
    # and tcmalloc's live bytes follow a tensor (this process, under glibc, has none to read)
    probe = ("import torch; from lightning_fsdp_plus.memory.allocator import tcmalloc_allocated_bytes as b;"
             " before = b(); x = torch.ones(2**26, dtype=torch.uint8); during = b(); del x;"
             " print(during - before, b() - before)")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", probe], env={**subprocess_env(), "LD_PRELOAD": str(found)},
                         capture_output=True, text=True, check=True)  # fmt: skip
    grown, after = map(int, run.stdout.split())
    assert 2**26 <= grown < 2**26 + 2**20 and after < 2**20
    # tcmalloc keeps a freed 256 MiB resident until asked to give it back
    probe = (
        "import torch; from lightning_fsdp_plus.memory.allocator import release_free_memory;"
        " rss = lambda: int(open('/proc/self/statm').read().split()[1]);"
        " x = torch.ones(2**28, dtype=torch.uint8); del x; kept = rss(); release_free_memory(); print(kept - rss())"
    )
    run = subprocess.run([sys.executable, "-c", probe], env={**subprocess_env(), "LD_PRELOAD": str(found)},
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert int(run.stdout) * os.sysconf("SC_PAGE_SIZE") >= 2**27
    assert tcmalloc_allocated_bytes() is None
    assert allocator_in_use() == "glibc" and f"LD_PRELOAD={found}" in allocator_advice()  # this process: glibc


def test_the_platform_follows_the_device_the_allocator_and_glibcs_mmap_threshold():
    assert platform_for("cuda", allocator="glibc") is PLATFORMS["cuda"]
    assert platform_for("cpu", allocator="tcmalloc", environ={}) is PLATFORMS["cpu-tcmalloc"]
    assert platform_for("cpu", allocator="glibc", environ={}) is PLATFORMS["cpu-glibc"]
    # every allocation above 64 KiB its own mapping, returned when freed: the resident set is the live bytes
    assert platform_for("cpu", allocator="glibc", environ={"MALLOC_MMAP_THRESHOLD_": "65536"}) is PLATFORMS["cpu-mmap"]
    assert platform_for("cpu", allocator="glibc", environ={"MALLOC_MMAP_THRESHOLD_": "8388608"}) is PLATFORMS[
        "cpu-glibc"]  # a high threshold keeps glibc's heap (measured: 1,601 vs 1,874 MiB)  # fmt: skip
    assert platform_for("cpu", allocator="jemalloc", environ={}) is PLATFORMS["cpu-glibc"]  # unmeasured: glibc's
    assert platform_for("cpu", environ={}) is PLATFORMS["cpu-glibc"]  # this process (pytest) runs on glibc
    assert PLATFORMS["cuda"].gather_copies == 0 and PLATFORMS["cuda"].allocator_factor == 1.0


def test_the_cuda_runtime_counts_the_context_once_and_one_communicator_per_process_group():
    from lightning_fsdp_plus.memory.allocator import CUDA_CONTEXT_BYTES, NCCL_COMMUNICATOR_BYTES, PLATFORMS

    cuda = PLATFORMS["cuda"]
    pairs, more = NCCL_COMMUNICATOR_BYTES
    assert cuda.runtime_bytes(group_sizes=(1, 1, 1)) == CUDA_CONTEXT_BYTES  # one GPU: no communicator
    assert cuda.runtime_bytes(group_sizes=(8, 8, 1)) == CUDA_CONTEXT_BYTES + more  # FULL_SHARD: the world's group
    assert cuda.runtime_bytes(group_sizes=(8, 4, 2)) == CUDA_CONTEXT_BYTES + 2 * more + pairs  # HSDP: three groups
    assert PLATFORMS["cpu-tcmalloc"].runtime_bytes(group_sizes=(8, 4, 2)) == 0  # gloo: inside the process's heap
