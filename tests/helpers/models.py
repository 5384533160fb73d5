"""Small, deterministic models and LightningModules shared by the tests (and the single-process reference)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from lightning_fsdp_plus.loss import causal_lm_loss

VOCAB, DIM, HEADS, SEQ = 61, 32, 4, 12


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, dim: int = DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        # no bias on q, k, v: a key bias adds the same score to every key of a query, so softmax gives it a gradient
        # that is zero in exact arithmetic; what remained was rounding noise that differs with the CPU's kernels and
        # the reduction order, and AdamW turned it into lr-sized steps (parity failed on AVX-512/AMX CPUs only)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    """Token embedding, ``layers`` blocks, a final norm and an untied LM head."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in fp32."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


class TokenDataset(Dataset):
    """Fixed pseudo-random token sequences (same on every rank and in the reference)."""

    def __init__(self, n: int = 64, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def make_model(seed: int = 0, layers: int = 3) -> TinyTransformer:
    """The model with a fixed initialisation."""
    torch.manual_seed(seed)
    return TinyTransformer(layers=layers)


class TinyLM(LightningModule):
    """LightningModule around ``TinyTransformer``; the data order is fixed (no shuffling) for parity tests."""

    def __init__(self, *, optimizer: str = "sgd", lr: float = 0.1, batch_size: int = 4, seed: int = 0) -> None:
        super().__init__()
        self.model = make_model(seed)
        self.optimizer_name, self.lr, self.batch_size = optimizer, lr, batch_size
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.model(batch), batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.model(batch), batch)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.optimizer_name, self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        ds = TokenDataset()
        sampler = DistributedSampler(
            ds, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(ds, batch_size=self.batch_size, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        ds = TokenDataset(n=16, seed=99)
        sampler = DistributedSampler(
            ds, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(ds, batch_size=self.batch_size, sampler=sampler)


def make_optimizer(name: str, params, *, lr: float) -> torch.optim.Optimizer:
    """SGD with momentum or AdamW, the two optimizers the parity tests use."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    raise ValueError(name)


def global_batches(*, world_size: int, batch_size: int, steps: int) -> list[torch.Tensor]:
    """The global batch of every step: what all ranks' DistributedSamplers (shuffle=False) serve together."""
    data = TokenDataset().data
    per_rank = [data[r::world_size] for r in range(world_size)]
    return [torch.cat([chunk[s * batch_size : (s + 1) * batch_size] for chunk in per_rank]) for s in range(steps)]


def train_reference(
    *,
    steps: int,
    optimizer: str = "sgd",
    lr: float = 0.1,
    world_size: int = 2,
    batch_size: int = 4,
    clip_norm: float | None = None,
    clip_value: float | None = None,
    grad_norms: list[float] | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the same global batches: per-step losses and final parameters.

    ``grad_norms``, if given, receives the pre-clip global gradient norm of every step.
    """
    model = make_model(0)
    opt = make_optimizer(optimizer, model.parameters(), lr=lr)
    losses = []
    for batch in global_batches(world_size=world_size, batch_size=batch_size, steps=steps):
        # the mean of per-rank mean losses equals the global mean: every rank holds the same number of tokens
        loss = torch.stack([lm_loss(model(b), b) for b in batch.chunk(world_size)]).mean()
        opt.zero_grad()
        loss.backward()
        if grad_norms is not None:
            grad_norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        opt.step()
        losses.append(loss.item())
    return losses, {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}


def sgd_causal_lm(model: nn.Module, *, lr: float):
    """``CausalLMModule`` with SGD+momentum over trainable parameters, for tight comparisons with references."""
    from lightning_fsdp_plus.app.lm import CausalLMModule

    class SGDCausalLM(CausalLMModule):
        def configure_optimizers(self):
            return make_optimizer("sgd", [p for p in self.parameters() if p.requires_grad], lr=self.lr)

    return SGDCausalLM(model, lr=lr)


def tiny_llama(seed: int = 0, layers: int = 2, hidden: int = DIM, intermediate: int = 64, tied: bool = False):
    """A transformers Llama built from a tiny config (no download); ``tied``: the LM head is the embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def tiny_bert_mlm(seed: int = 0, layers: int = 2):
    """A transformers ``BertForMaskedLM`` from a tiny config: its decoder is tied to the word embeddings, which sit
    in ``BertEmbeddings`` (one of its ``_no_split_modules``). No dropout, so sharded and single runs compare."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=layers, num_attention_heads=HEADS,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)  # fmt: skip
    torch.manual_seed(seed)
    return BertForMaskedLM(config)


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": LORA_TARGETS}
LORA_LLAMA = {"hidden": 256, "intermediate": 512}  # linear layers dominate, as in real LLMs


def lora_llama(seed: int = 0, r: int = LORA["r"]):
    """The LoRA test model: a Llama whose linear layers dominate, with PEFT LoRA on all projections."""
    from peft import get_peft_model

    from lightning_fsdp_plus.lora import make_lora_config

    return get_peft_model(tiny_llama(seed, **LORA_LLAMA), make_lora_config({**LORA, "r": r, "alpha": 2 * r}))


class StridedSampler(Sampler):
    """Rank r takes items r, r+W, r+2W, ... (DistributedSampler without shuffling), resolved when iterated."""

    def __init__(self, n: int) -> None:
        self.n = n

    def _rank_world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def __iter__(self):
        rank, world = self._rank_world()
        return iter(range(rank, self.n, world))

    def __len__(self) -> int:
        rank, world = self._rank_world()
        return len(range(rank, self.n, world))


class FixedBatches(Dataset):
    """The same ``per_step`` sequences every step (for 'the loss falls on a fixed batch')."""

    def __init__(self, *, steps: int, per_step: int = 8) -> None:
        self.data = TokenDataset(n=per_step).data
        self.n = steps * per_step

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i % len(self.data)]


def tiny_falcon(seed: int = 0):
    """A transformers Falcon (``FalconLinear`` layers: an ``nn.Linear`` subclass with its own forward; head tied to
    the word embeddings) from a tiny config."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=2, num_attention_heads=HEADS,
                          new_decoder_architecture=False, multi_query=True, bias=True, hidden_dropout=0.0,
                          attention_dropout=0.0)  # fmt: skip
    torch.manual_seed(seed)
    return FalconForCausalLM(config)


ARCH_LORA_TARGETS = {
    "llama": LORA_TARGETS,
    "falcon": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "bert": ["query", "key", "value", "dense"],
}
"""LoRA targets per architecture of the LoRA + int8 cases."""


def lora_base(arch: str, seed: int = 0) -> nn.Module:
    """The base model of the LoRA + int8 cases: ``llama`` (linear layers dominate), ``falcon`` or ``bert``."""
    return {"llama": lambda: tiny_llama(seed, **LORA_LLAMA), "falcon": lambda: tiny_falcon(seed),
            "bert": lambda: tiny_bert_mlm(seed)}[arch]()  # fmt: skip


def arch_lora(arch: str) -> dict:
    """The LoRA settings of ``arch``'s cases (``LORA`` with its target modules)."""
    return {**LORA, "target_modules": ARCH_LORA_TARGETS[arch]}


def lora_model(arch: str, seed: int = 0) -> nn.Module:
    """``lora_base(arch)`` with PEFT LoRA applied as the strategy applies ``arch_lora(arch)``."""
    from peft import get_peft_model

    from lightning_fsdp_plus.lora import make_lora_config, with_task_type

    base = lora_base(arch, seed)
    return get_peft_model(base, with_task_type(make_lora_config(arch_lora(arch)), base))


def train_lora_int8_reference(*, steps: int, lr: float, arch: str = "llama", world_size: int = 2, batch_size: int = 4):
    """Single-process LoRA+int8 (SGD+momentum) on the global batch of ``FixedBatches``: losses, LoRA weights."""
    from lightning_fsdp_plus.quantization import convert_to_int8

    model = lora_model(arch)
    convert_to_int8(model)
    return _train_on_global_batch(model, steps=steps, lr=lr, world_size=world_size, batch_size=batch_size)


def _train_on_global_batch(model, *, steps: int, lr: float, world_size: int, batch_size: int):
    """SGD+momentum on the global batch of ``FixedBatches``, each rank's half forwarded separately: losses and the
    trainable weights afterwards."""
    opt = make_optimizer("sgd", [p for p in model.parameters() if p.requires_grad], lr=lr)
    data = FixedBatches(steps=steps).data
    # DistributedSampler(shuffle=False) gives rank r the items r, r+W, r+2W, ...
    batch = torch.cat([data[r::world_size][:batch_size] for r in range(world_size)])
    losses = []
    for _ in range(steps):
        # the loss as CausalLMModule computes it (chunked for causal LMs, the model's own otherwise)
        loss = torch.stack([causal_lm_loss(model, {"input_ids": b, "labels": b}) for b in batch.chunk(world_size)])
        loss = loss.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def tied_model(kind: str) -> nn.Module:
    """The models of the tied-weight cases: ``bert`` (masked LM) or ``llama`` (tied head)."""
    return tiny_bert_mlm(0) if kind == "bert" else tiny_llama(0, tied=True)


def train_tied_reference(kind: str, *, steps: int, lr: float, world_size: int = 2, batch_size: int = 4):
    """Single process, SGD+momentum on the global batch of ``FixedBatches``: losses and every parameter after."""
    return _train_on_global_batch(tied_model(kind), steps=steps, lr=lr, world_size=world_size, batch_size=batch_size)


def train_lora_4bit_reference(*, steps: int, lr: float, quant_type: str = "nf4", world_size: int = 2,
                              batch_size: int = 4):  # fmt: skip
    """Single process, bitsandbytes' own QLoRA layers: every frozen projection a ``bnb.nn.Linear4bit`` (quantized from
    the fp32 weights), then PEFT LoRA as ``lora_llama`` applies it (the same random draws: the conversion runs in a
    forked RNG). SGD+momentum on the global batch of ``FixedBatches``: losses and LoRA weights."""
    import bitsandbytes as bnb
    from peft import get_peft_model

    from lightning_fsdp_plus.lora import make_lora_config

    model = tiny_llama(0, **LORA_LLAMA)
    with torch.random.fork_rng():
        for path, module in list(model.named_modules()):
            if type(module) is nn.Linear and "lm_head" not in path:
                layer = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                                          quant_type=quant_type, compress_statistics=False)  # fmt: skip
                layer.load_state_dict(module.state_dict())
                model.set_submodule(path, layer.to("cpu"))  # bitsandbytes quantizes when the layer is placed
    model = get_peft_model(model, make_lora_config({**LORA, "r": LORA["r"], "alpha": 2 * LORA["r"]}))
    return _train_on_global_batch(model, steps=steps, lr=lr, world_size=world_size, batch_size=batch_size)
