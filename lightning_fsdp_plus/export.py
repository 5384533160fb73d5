"""``fsdp-plus-export CKPT OUT``: turn any fsdp_plus checkpoint into a consolidated state dict or a PEFT adapter.

    fsdp-plus-export outputs/.../checkpoints/last.ckpt exported/          # auto: adapter for LoRA runs
    fsdp-plus-export CKPT OUT --format state_dict [--strip-prefix model.]
    fsdp-plus-export outputs/.../checkpoints/last.ckpt merged/ --merge [--base PATH]   # a full model

Runs in one process without GPUs: sharded checkpoints are consolidated with torch's own
``dcp_to_torch_save``. ``state_dict`` writes ``OUT/model.safetensors`` (keys without the LightningModule's
attribute prefix, so a transformers model loads them); ``adapter`` writes ``OUT/adapter_config.json`` and
``OUT/adapter_model.safetensors`` for ``peft.PeftModel.from_pretrained``. ``--merge`` writes a whole model for
``AutoModelForCausalLM.from_pretrained`` (safetensors, config, the base's tokenizer): the LoRA update merged into
the base's original float weights (never into int8 or 4-bit ones the run trained on), or a full fine-tune's
weights; ``--base`` defaults to the run's ``model.name_or_path`` (read from the Hydra run directory the checkpoint is
in).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from lightning_fsdp_plus.checkpoint import CheckpointError, is_sharded_checkpoint, load_full, verify


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The whole checkpoint (model ``state_dict``, optimizer states, metadata) as plain CPU tensors."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_sharded_checkpoint(path):
        return load_full(path)
    verify(path)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        consolidated = Path(tmp) / "consolidated.pt"
        dcp_to_torch_save(str(path), str(consolidated))
        state = torch.load(consolidated, weights_only=True)
    return {**torch.load(path / "meta.pt", weights_only=True), **state}


def strip_common_prefix(state: dict[str, torch.Tensor], prefix: str | None) -> dict[str, torch.Tensor]:
    """Drop ``prefix`` from every key; ``"auto"`` drops the first component when all keys share it."""
    if prefix == "auto":
        heads = {k.split(".", 1)[0] for k in state}
        prefix = f"{heads.pop()}." if len(heads) == 1 and all("." in k for k in state) else ""
    prefix = prefix or ""
    return {k.removeprefix(prefix): v for k, v in state.items()}


def _save_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    seen: dict[int, str] = {}
    unique = {}
    for key, tensor in state.items():  # tied weights are stored once (safetensors refuses shared storage)
        if tensor.data_ptr() in seen:
            continue
        seen[tensor.data_ptr()] = key
        unique[key] = tensor.detach().contiguous().cpu()
    save_file(unique, str(path), metadata={"format": "pt"})


def export_state_dict(checkpoint: dict[str, Any], out: Path, *, strip_prefix: str | None = "auto") -> Path:
    """Write the model weights as ``out/model.safetensors``."""
    out.mkdir(parents=True, exist_ok=True)
    state = strip_common_prefix(checkpoint["state_dict"], strip_prefix)
    _save_safetensors(state, out / "model.safetensors")
    return out / "model.safetensors"


def export_adapter(checkpoint: dict[str, Any], out: Path) -> Path:
    """Write a PEFT adapter directory from a LoRA run's checkpoint."""
    from peft import LoraConfig

    lora = checkpoint.get("fsdp_plus", {}).get("peft")
    if lora is None:
        raise CheckpointError("this checkpoint has no LoRA adapter; use --format state_dict")
    prefix, adapter, config = lora["path"], lora["adapter_name"], lora["config"]
    state = {}
    for key, tensor in checkpoint["state_dict"].items():
        if "lora_" in key and key.startswith(f"{prefix}."):
            state[key.removeprefix(f"{prefix}.").replace(f".{adapter}.", ".")] = tensor
    out.mkdir(parents=True, exist_ok=True)
    _save_safetensors(state, out / "adapter_model.safetensors")
    fields = LoraConfig.__dataclass_fields__
    LoraConfig(**{k: v for k, v in config.items() if k in fields and fields[k].init}).save_pretrained(str(out))
    return out


def run_base(checkpoint_path: Path) -> Path:
    """The base model of the app run that wrote ``checkpoint_path`` (its ``.hydra/config.yaml``)."""
    for parent in checkpoint_path.resolve().parents:
        config = parent / ".hydra" / "config.yaml"
        if config.is_file():
            from omegaconf import OmegaConf

            from lightning_fsdp_plus.app.config.shipped import register_shipped_resolver

            register_shipped_resolver()  # the shipped experiments name their model ${shipped:examples/...}
            name = OmegaConf.load(config).model.get("name_or_path")
            if not name:
                break
            run_cwd = OmegaConf.load(parent / ".hydra" / "hydra.yaml").hydra.runtime.cwd  # where it was relative to
            path = Path(name).expanduser()
            return path if path.is_absolute() or not (Path(run_cwd) / path).exists() else Path(run_cwd) / path
    raise CheckpointError(
        f"no base model known for {checkpoint_path} (not inside an fsdp-plus-train run directory whose model has a"
        " name_or_path): give --base PATH, the float model the adapter was trained on"
    )


def _fine_tuned_whole(checkpoint: dict[str, Any], *, base: Path | str) -> Any:
    """A full fine-tune's weights in the base's architecture (only the config is read from ``base``: its weights
    would all be replaced)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(config, "dtype", None))
    state = strip_common_prefix(checkpoint["state_dict"], "auto")  # the LightningModule's attribute prefix
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    if unexpected or set(missing) - tied:
        raise CheckpointError(
            f"the checkpoint's weights do not fit {base}: missing {sorted(set(missing) - tied)[:5]},"
            f" unexpected {sorted(unexpected)[:5]}; give --base PATH, the model it was trained from"
        )
    return model


def export_merged(checkpoint: dict[str, Any], out: Path, *, base: Path | str) -> Path:
    """Write a whole transformers model directory: the base with the run's LoRA merged in, or a full fine-tune's
    weights in the base's architecture; the base's tokenizer beside them."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        if checkpoint.get("fsdp_plus", {}).get("peft") is None:  # a full fine-tune: nothing to merge
            merged = _fine_tuned_whole(checkpoint, base=base)
        else:
            adapter = export_adapter(checkpoint, Path(tmp) / "adapter")
            model = AutoModelForCausalLM.from_pretrained(base)  # the original float weights, in their dtype
            merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out, safe_serialization=True)
    with contextlib.suppress(OSError, ValueError):  # a base without a tokenizer: the weights are still complete
        AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``fsdp-plus-export`` (its ``--help`` is in the docs' reference)."""
    parser = argparse.ArgumentParser(
        prog="fsdp-plus-export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--format", choices=("auto", "state_dict", "adapter"), default="auto")
    parser.add_argument("--strip-prefix", default="auto", help='prefix removed from weight names ("" keeps them)')
    parser.add_argument("--merge", action="store_true",
                        help="a whole model: a LoRA run's base with the adapter merged in, or a full fine-tune's"
                             " weights with the base's config and tokenizer")  # fmt: skip
    parser.add_argument("--base", help="--merge: the float base model (default: the run's model.name_or_path)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    args = build_parser().parse_args(argv)
    try:
        checkpoint = read_checkpoint(args.checkpoint)
        if args.merge:
            written = export_merged(checkpoint, args.out, base=args.base or run_base(args.checkpoint))
            print(f"wrote {written}")
            return 0
        kind = args.format
        if kind == "auto":
            kind = "adapter" if checkpoint.get("fsdp_plus", {}).get("peft") else "state_dict"
        if kind == "adapter":
            written = export_adapter(checkpoint, args.out)
        else:
            written = export_state_dict(checkpoint, args.out, strip_prefix=args.strip_prefix)
    except CheckpointError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
