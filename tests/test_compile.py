"""``compile`` in one process: the option's validation, which units are compiled, what the plan says, and what
compiling a unit keeps (names, outputs) and does (one graph for every block, also for a decoder given a cache)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.utilities.compile import from_compiled

from lightning_fsdp_plus.compile import (
    CompileSpec,
    compile_counters,
    compile_spec_from,
    compile_units,
    compiled_paths,
    eager_for_generation,
    from_compiled_module,
    reset_compile_counters,
)
from lightning_fsdp_plus.options import FSDPPlusOptions
from lightning_fsdp_plus.plan import MeshLayout, ShardingStrategy, build_sharding_plan
from tests.helpers.models import VOCAB, TinyLM, make_model, tiny_llama


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    reset_compile_counters()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("value", "expected"),
    [(False, None), (None, None), (True, CompileSpec()),
     ({"backend": "eager", "fullgraph": True}, CompileSpec(kwargs={"backend": "eager", "fullgraph": True}))],
)  # fmt: skip
def test_the_option_is_off_on_or_torch_compile_arguments(value, expected):
    assert compile_spec_from(value) == expected
    assert FSDPPlusOptions(compile=value).compile == (expected or False)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"backend": "eager", "fulgraph": True}, r"compile has 'fulgraph'=True, which is not a torch.compile argument"
         r" it takes; valid keys: backend, mode, fullgraph, dynamic, options"),
        ({"fullgraph": "yes"}, r"compile.fullgraph='yes' must be true or false"),
        ({"dynamic": 1}, r"compile.dynamic=1 must be true, false or null"),
        ({"mode": "max-autotune", "options": {"max_autotune": True}}, r"torch.compile takes mode or options, not both"),
        ({"options": "fast"}, r"compile.options='fast' must be a dict of inductor settings"),
        ({"backend": 3}, r"compile.backend=3 must be a backend name"),
        ("inductor", r"compile='inductor' must be false, true, or a dict of torch.compile arguments"),
    ],
)  # fmt: skip
def test_bad_values_name_the_key_the_value_and_the_choices(value, message):
    with pytest.raises(ValueError, match=message):
        FSDPPlusOptions(compile=value)


def test_every_unit_but_the_root_is_compiled_or_the_root_when_alone():
    assert compiled_paths(["model.blocks.1", "model.blocks.0", ""]) == ("model.blocks.1", "model.blocks.0")
    assert compiled_paths([""]) == ("",)


def test_the_plan_records_and_prints_the_compiled_units():
    model = make_model()
    plan = build_sharding_plan(model, unit_paths=["blocks.0", "blocks.1", "blocks.2"],
                               sharding_strategy=ShardingStrategy.FULL_SHARD, mesh=MeshLayout(1, 2),
                               compile=CompileSpec(kwargs={"backend": "eager"}))  # fmt: skip
    assert plan.compiled == ("blocks.0", "blocks.1", "blocks.2")
    assert plan.to_dict()["compile"] == "torch.compile(backend='eager')"
    assert "compiled (torch.compile(backend='eager'), each unit's forward): blocks.0, blocks.1, blocks.2" in (
        plan.format_table()
    )
    eager = build_sharding_plan(model, unit_paths=["blocks.0"], sharding_strategy=ShardingStrategy.FULL_SHARD,
                                mesh=MeshLayout(1, 2))  # fmt: skip
    assert eager.compiled == () and "compiled" not in eager.format_table()


def test_a_compiled_unit_keeps_its_names_and_outputs_and_every_block_shares_one_graph():
    model, reference = make_model(), make_model()
    compile_units(model, ["blocks.0", "blocks.1", "blocks.2"], spec=CompileSpec(kwargs={"backend": "aot_eager"}))
    assert list(model.state_dict()) == list(reference.state_dict())
    assert type(model.blocks[0]) is type(reference.blocks[0])
    tokens = torch.randint(0, VOCAB, (2, 16))
    out, expected = model(tokens), reference(tokens)
    out.sum().backward()
    expected.sum().backward()
    assert torch.equal(out, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    assert compile_counters() == {"graphs": 1, "graph_breaks": 0, "frames": 1}
    compile_units(model, ["blocks.0"], spec=CompileSpec(kwargs={"backend": "aot_eager"}))  # a second setup
    model(tokens)
    assert compile_counters()["graphs"] == 1  # not compiled twice


def _llama_step_with_cache(model) -> None:
    from transformers import DynamicCache

    tokens = torch.randint(0, VOCAB, (2, 8))
    model(input_ids=tokens, labels=tokens, cache=DynamicCache(), use_cache=True).loss.backward()


def test_a_decoder_given_a_cache_is_compiled_once_not_once_per_layer():
    """A Llama layer given a key/value cache reads its ``layer_idx`` (dynamo guards on it): compiled by hand, each
    layer is another graph; compiled as units are, the layers run without the cache under grad and share one."""
    layers = ["model.layers.0", "model.layers.1", "model.layers.2"]
    by_hand = tiny_llama(layers=3)
    for path in layers:
        layer = by_hand.get_submodule(path)
        layer.forward = torch.compile(layer.forward, backend="eager")
    _llama_step_with_cache(by_hand)
    assert compile_counters()["graphs"] == 3
    torch._dynamo.reset()
    reset_compile_counters()
    model = tiny_llama(layers=3)
    compile_units(model, layers, spec=CompileSpec(kwargs={"backend": "eager"}))
    _llama_step_with_cache(model)
    assert compile_counters()["graphs"] == 1


def test_generation_runs_compiled_units_eagerly():
    model = make_model()
    compile_units(model, ["blocks.0", "blocks.1"], spec=CompileSpec(kwargs={"backend": "eager"}))
    with torch.no_grad(), eager_for_generation():
        for length in (3, 4, 5):
            model(torch.randint(0, VOCAB, (1, length)))
    assert compile_counters()["graphs"] == 0


def test_a_compiled_lightning_module_gives_its_compiler_and_is_uncompiled():
    module = TinyLM()
    training_step = module.training_step
    lightning_view = from_compiled(torch.compile(module, backend="eager"))  # what Trainer.fit does first
    assert lightning_view is module and module._compiler_ctx is not None
    spec = from_compiled_module(module)
    assert spec is not None and spec.context is not None
    assert spec.describe() == "torch.compile with the arguments of the module passed to trainer.fit"
    assert module._compiler_ctx is None and module.training_step == training_step  # the whole module: not compiled
    assert from_compiled_module(TinyLM()) is None


def test_the_option_and_a_compiled_module_together_are_refused():
    module = from_compiled(torch.compile(TinyLM(), backend="eager"))
    with pytest.raises(ValueError, match=r"compile=CompileSpec\(.*\) and a compiled module passed to trainer.fit"):
        from_compiled_module(module, option=CompileSpec())


def _saved_float_weights(model, tokens) -> tuple[int, int]:
    """``(bytes saved for backward, how many of them are float copies of an int8 base weight)`` in one step."""
    from lightning_fsdp_plus.quantization import Int8Linear

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, Int8Linear)}
    saved = {"bytes": 0, "weights": 0}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in params:
            saved["bytes"] += tensor.numel() * tensor.element_size()
            saved["weights"] += tuple(tensor.shape) in weight_shapes and tensor.is_floating_point()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=tokens, labels=tokens).loss.backward()
    return saved["bytes"], saved["weights"]


def test_compiled_int8_layers_recompute_their_float_weight_in_backward():
    """Traced, the int8 training matmul's dequantized weight would be kept for backward by inductor's partitioner
    (every int8 layer's weight in float until backward: the int8 saving gone). It is recomputed instead: a compiled
    step saves no float weight and no more than the eager step."""
    from lightning_fsdp_plus.pipeline import prepare_model, quantize_model
    from tests.helpers.models import LORA, LORA_LLAMA

    options = FSDPPlusOptions(lora=LORA, quantize_base="int8")
    models = []
    for _ in range(2):
        model = tiny_llama(0, **LORA_LLAMA)
        prepare_model(model, options)
        quantize_model(model, options)
        models.append(model.train())
    eager, compiled = models
    layers = [n for n, m in compiled.named_modules() if type(m).__name__ == "LlamaDecoderLayer"]
    compile_units(compiled, layers, spec=CompileSpec())  # inductor: its partitioner decides what is saved
    tokens = torch.randint(0, VOCAB, (2, 16))
    eager_bytes, eager_weights = _saved_float_weights(eager, tokens)
    compiled_bytes, compiled_weights = _saved_float_weights(compiled, tokens)
    assert eager_weights == 0 and compiled_weights == 0
    assert compiled_bytes <= eager_bytes
    assert compile_counters()["graph_breaks"] == 0


def test_a_compiled_model_generates_what_the_eager_model_generates():
    """Greedy decoding (a new length per token) with compiled units: eagerly under ``eager_for_generation`` (as the
    app generates), and compiled too (dynamo makes the length symbolic after specialising the first) — the same
    tokens."""
    from lightning_fsdp_plus.app.generate import greedy_generate

    class Tokenizer:
        eos_token_id = -1

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [int(t) for t in text.split()]}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    eager, compiled = tiny_llama(layers=2).eval(), tiny_llama(layers=2).eval()
    compile_units(compiled, ["model.layers.0", "model.layers.1"], spec=CompileSpec(kwargs={"backend": "aot_eager"}))
    prompts = ["1 2 3", "7 8"]
    generate = lambda model: greedy_generate(lambda ids: model(input_ids=ids).logits, Tokenizer(), prompts,  # noqa: E731
                                             max_new_tokens=6)  # fmt: skip
    expected = generate(eager)
    with eager_for_generation():
        assert generate(compiled) == expected
    assert compile_counters()["graphs"] == 0
    assert generate(compiled) == expected
    lengths = 7  # the prompts grow through lengths 2-8
    assert 1 <= compile_counters()["graphs"] < lengths  # static graphs first, then a symbolic length: not one each
