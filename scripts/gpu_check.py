"""GPU check: run only where CUDA GPUs exist (CI has none). Exits 0 when every check passes.

    python scripts/gpu_check.py [--steps 30]

Covers what CPU tests cannot: bitsandbytes' CUDA int8 and 4-bit kernels behind ``Int8Linear`` and
``FourBitLinear`` (bit-identical to ``Linear8bitLt`` / ``Linear4bit``), autocast on the CUDA device, streaming
loading into CUDA shards (equal to ``from_pretrained`` + the old pipeline, nccl), and a real
``fsdp-plus-train experiment=medical_lora`` run on ``min(2, GPUs)`` GPUs with nccl, bf16-mixed, LoRA on an int8
base — the "real-model path" with only ``trainer.accelerator`` and ``trainer.devices`` changed (add
``model.name_or_path=...`` for a real model) — preemption on GPUs (SIGTERM to one rank, exit 143, resume), and
the auto plan (the CUDA probe's figures next to the assumed GPU presets; ``strategy=auto_lora`` trained), and
``compile=True`` (the benchmark's compiled cases at fp32 and bf16-mixed; the app's LoRA + int8 run compiled).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def assert_same_forward_and_input_grad(reference: torch.nn.Module, ours: torch.nn.Module, *, dtype: torch.dtype,
                                       what: str) -> None:  # fmt: skip
    """Outputs and input gradients of ``ours`` equal ``reference``'s bit for bit on a CUDA batch."""
    x = (torch.randn(4, 16, 256, device="cuda", dtype=dtype) * 3).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y, y2 = reference(x), ours(x2)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad), f"{what} differs on CUDA"


def check_int8_kernels() -> None:
    import bitsandbytes as bnb

    from lightning_fsdp_plus.quantization import Int8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 128).half()
    reference = bnb.nn.Linear8bitLt(256, 128, has_fp16_weights=False, threshold=6.0)
    reference.load_state_dict(linear.state_dict())
    reference = reference.cuda()
    ours = Int8Linear.from_linear(linear.cuda(), threshold=6.0)
    for training in (True, False):
        reference.train(training)
        ours.train(training)
        assert_same_forward_and_input_grad(reference, ours, dtype=torch.float16, what=f"Int8Linear ({training=})")
    print("ok: Int8Linear == Linear8bitLt on CUDA (forward and input grad, train and eval)")


def check_four_bit_kernels() -> None:
    import bitsandbytes as bnb

    from lightning_fsdp_plus.quantization import FourBitLinear

    for quant_type in ("nf4", "fp4"):
        torch.manual_seed(0)
        linear = torch.nn.Linear(256, 128).to(torch.bfloat16)
        reference = bnb.nn.Linear4bit(256, 128, quant_type=quant_type, compress_statistics=True)
        reference.load_state_dict(linear.state_dict())
        reference = reference.cuda()
        ours = FourBitLinear.from_linear(linear.cuda(), quant_type=quant_type, double_quant=True)
        assert_same_forward_and_input_grad(reference, ours, dtype=torch.bfloat16, what=f"FourBitLinear ({quant_type})")
    print("ok: FourBitLinear == Linear4bit on CUDA (NF4 and FP4, double quantization, forward and input grad)")


def check_autocast() -> None:
    from lightning_fsdp_plus.precision import FSDPPlusPrecision

    plugin = FSDPPlusPrecision("bf16-mixed", device="cuda")
    a = torch.randn(8, 8, device="cuda")
    with plugin.forward_context():
        assert (a @ a).dtype == torch.bfloat16
    print("ok: bf16 autocast on the CUDA device")


def check_streaming_load() -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_fsdp_plus import FSDPPlusPrecision
    from lightning_fsdp_plus.app.lm import CausalLMModule, build_causal_lm
    from lightning_fsdp_plus.options import FSDPPlusOptions
    from lightning_fsdp_plus.pipeline import build_sharded_model
    from lightning_fsdp_plus.sharding import build_mesh

    sys.path.insert(0, str(REPO))
    from tests.helpers.checkpoints import save_checkpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531", RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    device = torch.device("cuda", 0)
    options = FSDPPlusOptions(lora={"r": 4}, quantize_base="int8")
    layout = options.mesh_layout(world_size=1)
    mesh = build_mesh(layout=layout, device_type="cuda")
    for arch in ("llama", "qwen2", "gpt2"):
        path = save_checkpoint(Path(tempfile.mkdtemp(prefix=f"gpu_check_{arch}_")), arch)
        states = []
        for streamed in (False, True):
            torch.manual_seed(0)
            module = CausalLMModule.from_pretrained(str(path)) if streamed else CausalLMModule(
                build_causal_lm(name_or_path=str(path)))  # fmt: skip
            model, _ = build_sharded_model(module, options, mesh=mesh, layout=layout,
                                           precision=FSDPPlusPrecision("bf16-true"), device=device)  # fmt: skip
            assert all(p.device.type == "cuda" for p in model.parameters()), "a parameter is not on the GPU"
            states.append(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
        different = [k for k in states[0] if not torch.equal(states[0][k], states[1][k])]
        assert not different, f"{arch}: streamed weights differ from from_pretrained + pipeline: {different[:3]}"
    dist.destroy_process_group()
    print("ok: streaming loading into CUDA shards (nccl, LoRA + int8) == from_pretrained + pipeline (3 architectures)")


def check_training_run(steps: int) -> None:
    devices = min(2, torch.cuda.device_count())
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    command = [
        *(sys.executable, "-m", "lightning_fsdp_plus.app.train", "experiment=medical_lora", "precision=bf16_mixed"),
        *("trainer.accelerator=gpu", f"trainer.devices={devices}", f"trainer.max_steps={steps}"),
        *("trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"),
    ]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "distributed_backend=nccl" in proc.stdout + proc.stderr, "expected the nccl backend"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["val_perplexity"] < 0.8 * metrics["base_val_perplexity"], metrics
    before, after = metrics["base_val_perplexity"], metrics["val_perplexity"]
    step_ms, peak_mib = metrics["step_time_s_median"] * 1000, metrics["peak_bytes_per_rank"] / 2**20
    print(
        f"ok: fsdp-plus-train on {devices} GPU(s), nccl, bf16-mixed, LoRA+int8: perplexity {before:.2f} -> "
        f"{after:.2f}, step {step_ms:.1f} ms, peak {peak_mib:.0f} MiB/rank"
    )


def check_preemption() -> None:
    """SIGTERM to the last rank of a GPU app run: all exit 143 within 60 s, saved; ``ckpt_path=last`` resumes."""
    import os
    import signal
    import time

    devices = min(2, torch.cuda.device_count())
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_check_preempt_"))
    command = [
        *(sys.executable, "-m", "lightning_fsdp_plus.app.train", "precision=bf16_mixed", "trainer.accelerator=gpu"),
        *(f"trainer.devices={devices}", "trainer.max_steps=400", "trainer.enable_progress_bar=false"),
        *(f"hydra.run.dir={run_dir}", "validate_before=false", "generate.num_prompts=0"),
        *("+callbacks.record._target_=tests.helpers.ckpt_cases.Record", f"+callbacks.record.out={run_dir}"),
        "+callbacks.record.name=preempted",
    ]
    log = (run_dir / "preempted.log").open("wb")
    proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    last = run_dir / f"preempted.rank{devices - 1}.progress"
    deadline = time.time() + 600
    while not (last.is_file() and last.read_text().strip() and int(last.read_text()) >= 20):
        assert time.time() < deadline and proc.poll() is None, (run_dir / "preempted.log").read_text()[-5000:]
        time.sleep(0.05)
    os.kill(int((run_dir / f"preempted.rank{devices - 1}.pid").read_text()), signal.SIGTERM)
    sent = time.time()
    status = proc.wait(timeout=60)
    output = (run_dir / "preempted.log").read_text()
    assert status == 143 and "saved step" in output, output[-5000:]
    took = time.time() - sent
    resumed = subprocess.run([*command[:-1], "+callbacks.record.name=resumed", "ckpt_path=last"], cwd=REPO,
                             capture_output=True, text=True)  # fmt: skip
    assert resumed.returncode == 0 and "Restored all states" in resumed.stdout + resumed.stderr, resumed.stderr[-5000:]
    record = json.loads((run_dir / "resumed.rank0.json").read_text())
    per_call = 1000 * record["agree_seconds"] / max(record["agree_calls"], 1)
    print(f"ok: SIGTERM to rank {devices - 1} of {devices} GPU rank(s): exit 143 after {took:.1f} s, resumed from"
          f" last.ckpt; the preemption check {per_call:.3f} ms per call")  # fmt: skip


def check_autoplan() -> None:
    """``strategy=auto_lora`` on the GPUs: the probe's CUDA figures next to the assumed presets, the choice trained."""
    from lightning_fsdp_plus.autoplan.cost import PRESETS
    from lightning_fsdp_plus.autoplan.probe import measure

    timings = measure(features=(4096, 14336), tokens=2048, precision="bf16-true", device=torch.device("cuda"),
                      quantize=["int8", "nf4"])  # fmt: skip
    flops = {k[:-2]: timings[f"{k[:-2]}_flops"] / timings[k] / 1e12 for k in ("matmul_s", "int8_s", "nf4_s")}
    preset = PRESETS["h100"]
    print(f"probe (1 GPU, 8B MLP shape, bf16): matmul {flops['matmul']:.0f}, int8 {flops['int8']:.0f}, nf4"
          f" {flops['nf4']:.0f} TFLOP/s; h100 preset assumes {preset.matmul_flops / 1e12:.0f},"
          f" {preset.quantized_flops['int8'] / 1e12:.0f}, {preset.quantized_flops['nf4'] / 1e12:.0f}")  # fmt: skip
    devices = min(2, torch.cuda.device_count())
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_check_auto_"))
    command = [
        *(sys.executable, "-m", "lightning_fsdp_plus.app.train", "experiment=medical_lora", "strategy=auto_lora"),
        *("strategy.memory_budget=0.9", "strategy.allow_quantize=[int8,nf4]", "precision=bf16_mixed"),
        *("trainer.accelerator=gpu", f"trainer.devices={devices}", "trainer.max_steps=20"),
        *("trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"),
    ]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "chosen: #" in output, output[-5000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    chosen = next(line for line in output.splitlines() if line.startswith("chosen: #"))
    print(f"ok: auto plan on {devices} GPU(s): {chosen}; trained, peak {metrics['peak_bytes_per_rank'] / 2**20:.0f}"
          f" MiB/rank, step {metrics['step_time_s_median'] * 1000:.1f} ms")  # fmt: skip


def check_sync_batchnorm() -> None:
    """``Trainer(sync_batchnorm=True)`` on one GPU: BatchNorm becomes SyncBatchNorm before sharding and trains (on CPU
    fsdp_plus refuses it: torch's SyncBatchNorm runs on accelerators only)."""
    from lightning.pytorch import LightningModule, Trainer
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_fsdp_plus import FSDPPlusStrategy

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    net = Net()
    data = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=4)
    trainer = Trainer(accelerator="gpu", devices=1, strategy=FSDPPlusStrategy(), sync_batchnorm=True, max_steps=3,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    trainer.fit(net, data)
    assert isinstance(net.net[1], nn.SyncBatchNorm), type(net.net[1])
    assert int(net.net[1].num_batches_tracked) == 3
    print("ok: sync_batchnorm on GPU: BatchNorm1d became SyncBatchNorm before sharding, 3 steps trained")


def check_compile() -> None:
    """``compile=True`` on GPUs (issue 33): the benchmark's Llama at fp32 and bf16-mixed, compiled fsdp_plus against
    the eager references and the hand-compiled loop (ratios printed; <= 1.05x the hand-compiled loop asserted), and
    the app's LoRA + int8 run compiled (it trains; graphs and graph breaks printed)."""
    devices = min(2, torch.cuda.device_count())
    out = Path(tempfile.mkdtemp(prefix="gpu_check_compile_"))
    cases = ("fsdp2_loop_full_shard,lightning_model_parallel_full_shard,fsdp_plus_full_shard,"
             "compiled_fsdp_plus_full_shard,compiled_fsdp2_loop_full_shard,bf16_fsdp2_loop_full_shard,"
             "compiled_bf16_fsdp_plus_full_shard,compiled_bf16_fsdp2_loop_full_shard")  # fmt: skip
    command = [sys.executable, "-m", "benchmarks.run", "--accelerator", "gpu", "--devices", str(devices),
               "--repeats", "2", "--cases", cases, "--out", str(out)]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-5000:]
    compiled = json.loads((out / "results.json").read_text())["compile"]
    for label, entry in compiled.items():
        eager, hand = entry["vs_eager"]["median"], entry["vs_hand_compiled"]["median"]
        print(
            f"ok: compile=True on {devices} GPU(s), {label}: {eager:.3f}x the faster eager reference"
            f" ({entry['eager_reference']}), {hand:.3f}x the hand-compiled loop; first steps {entry['first_step_s']}"
        )
        assert hand <= 1.05, f"{label}: compiled fsdp_plus {hand:.3f}x the hand-compiled loop"
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_check_compile_app_"))
    command = [
        *(sys.executable, "-m", "lightning_fsdp_plus.app.train", "experiment=medical_lora", "precision=bf16_mixed"),
        *("strategy.compile=true", "trainer.accelerator=gpu", f"trainer.devices={devices}", "trainer.max_steps=20"),
        *("trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"),
    ]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-5000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["val_perplexity"] < metrics["base_val_perplexity"], metrics
    print(
        f"ok: fsdp-plus-train compiled on {devices} GPU(s): perplexity {metrics['base_val_perplexity']:.2f} ->"
        f" {metrics['val_perplexity']:.2f}, first step {metrics['first_step_s']:.1f} s, step"
        f" {metrics['step_time_s_median'] * 1000:.1f} ms, {metrics['compile']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to check")
        sys.exit(0)
    print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    check_int8_kernels()
    check_four_bit_kernels()
    check_autocast()
    check_streaming_load()
    check_training_run(args.steps)
    check_preemption()
    check_autoplan()
    check_sync_batchnorm()
    check_compile()


if __name__ == "__main__":
    main()
