"""Exact parameter counts from config.json, checked against the corpus oracle and transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ftlaunch.plan.modelspec import (
    ModelSpec,
    layer_params,
    linear_shapes,
    load_config_json,
    load_model_spec,
    parse_param_count,
    spec_from_config,
    spec_from_param_count,
)

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "data" / "corpus" / "model-configs"
COUNTS_FILE = CORPUS / "parameter-counts.json"


def _counts() -> dict[str, int]:
    return json.loads(COUNTS_FILE.read_text())


# ---------------------------------------------------------------- corpus oracle (exact equality)


@pytest.mark.parametrize("name", sorted(_counts()))
def test_corpus_configs_count_exactly(name: str) -> None:
    spec = load_model_spec(CORPUS / name)
    assert spec is not None
    assert spec.params == _counts()[name]
    assert spec.count_method == "exact"


def test_corpus_shapes_are_read() -> None:
    llama = load_model_spec(CORPUS / "llama3-8b")
    assert llama is not None
    assert (llama.hidden_size, llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (
        4096,
        32,
        32,
        8,
        128,
    )
    assert not llama.tie_word_embeddings
    qwen3 = load_model_spec(CORPUS / "qwen3-4b")
    assert qwen3 is not None
    assert qwen3.head_dim == 128 and qwen3.qk_norm and qwen3.tie_word_embeddings
    # a config dict (not only a directory) works the same way
    cfg = load_config_json(CORPUS / "qwen2.5-1.5b")
    assert cfg is not None
    assert spec_from_config(cfg).params == _counts()["qwen2.5-1.5b"]


def test_lora_r8_all_on_llama3_8b_matches_peft_count() -> None:
    # peft print_trainable_parameters for Llama-3-8B, r=8 on all linear layers: 20,971,520
    spec = load_model_spec(CORPUS / "llama3-8b")
    assert spec is not None
    total = sum(8 * (i + o) * c for entries in linear_shapes(spec).values() for i, o, c in entries)
    assert total == 20_971_520


# ---------------------------------------------------------------- hand-built configs


def _cfg(**kw: object) -> dict:
    base = dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return base


def test_llama_count_by_hand() -> None:
    h, inter, layers, vocab, kv_dim = 64, 96, 3, 300, 2 * 16
    per_layer = h * h + 2 * h * kv_dim + h * h + 3 * h * inter + 2 * h
    expected = 2 * vocab * h + layers * per_layer + h
    assert spec_from_config(_cfg()).params == expected
    tied = spec_from_config(_cfg(tie_word_embeddings=True))
    assert tied.params == expected - vocab * h  # lm_head counted once when tied


def test_biases_and_qk_norm_are_counted() -> None:
    plain = spec_from_config(_cfg()).params
    q_dim, kv_dim, h, layers = 64, 32, 64, 3
    assert spec_from_config(_cfg(attention_bias=True)).params == plain + layers * (q_dim + 2 * kv_dim + h)
    assert spec_from_config(_cfg(model_type="qwen2")).params == plain + layers * (q_dim + 2 * kv_dim)
    assert spec_from_config(_cfg(model_type="qwen3", head_dim=16)).params == plain + layers * 2 * 16


def test_moe_counts_experts_router_and_shared_expert() -> None:
    h, layers, experts, moe_i, shared_i = 64, 3, 4, 40, 56
    dense = spec_from_config(_cfg(model_type="qwen2")).params
    mlp_dense = 3 * h * 96
    moe = spec_from_config(
        _cfg(
            model_type="qwen2_moe",
            num_experts=experts,
            num_experts_per_tok=2,
            moe_intermediate_size=moe_i,
            shared_expert_intermediate_size=shared_i,
        )
    )
    sparse = experts * 3 * h * moe_i + experts * h + 3 * h * shared_i + h
    assert moe.params == dense + layers * (sparse - mlp_dense)
    assert moe.num_moe_layers == layers and moe.experts_per_token == 2
    # mlp_only_layers / decoder_sparse_step keep some layers dense
    mixed = spec_from_config(
        _cfg(
            model_type="qwen2_moe",
            num_experts=experts,
            num_experts_per_tok=2,
            moe_intermediate_size=moe_i,
            shared_expert_intermediate_size=shared_i,
            mlp_only_layers=[1],
        )
    )
    assert mixed.num_moe_layers == 2
    assert mixed.params == dense + 2 * (sparse - mlp_dense)


def test_missing_key_is_named() -> None:
    cfg = _cfg()
    del cfg["num_hidden_layers"]
    with pytest.raises(ValueError, match="num_hidden_layers"):
        spec_from_config(cfg)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        spec_from_config(_cfg(model_type="qwen3_moe", num_experts=4))


def test_unknown_family_is_llama_like_and_flagged() -> None:
    spec = spec_from_config(_cfg(model_type="somethingnew"))
    assert spec.count_method == "llama-like"
    assert spec.params == spec_from_config(_cfg()).params


def test_text_config_of_composite_model() -> None:
    spec = spec_from_config({"model_type": "llava", "text_config": _cfg(), "vision_config": {}})
    assert spec.params == spec_from_config(_cfg()).params
    assert spec.count_method == "text-only"


def test_load_model_spec_without_config(tmp_path: Path) -> None:
    assert load_model_spec(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps(_cfg()))
    spec = load_model_spec(tmp_path)
    assert isinstance(spec, ModelSpec)
    assert ModelSpec(**spec.to_dict()) == spec


def test_layer_params_is_the_per_layer_share() -> None:
    spec = spec_from_config(_cfg())
    assert layer_params(spec) * spec.num_layers + 2 * 300 * 64 + 64 == spec.params


# ---------------------------------------------------------------- --params fallback


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("7B", 7_000_000_000),
        ("1.5b", 1_500_000_000),
        ("500M", 500_000_000),
        ("7e9", 7_000_000_000),
        ("8,030,261,248", 8_030_261_248),
        ("70 B", 70_000_000_000),
        ("120k", 120_000),
        ("0.5B", 500_000_000),
    ],
)
def test_parse_param_count(text: str, value: int) -> None:
    assert parse_param_count(text) == value


@pytest.mark.parametrize("bad", ["", "seven", "7X", "-1B", "0", "B7"])
def test_parse_param_count_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_param_count(bad)


@pytest.mark.parametrize("text", ["500M", "1.5B", "3B", "7B", "8B", "13B", "32B", "70B"])
def test_spec_from_param_count_is_plausible(text: str) -> None:
    spec = spec_from_param_count(text)
    target = parse_param_count(text)
    assert spec.params == target
    assert spec.count_method == "synthetic"
    shapes_total = spec_from_config(
        dict(
            model_type="llama",
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads,
            vocab_size=spec.vocab_size,
            tie_word_embeddings=spec.tie_word_embeddings,
        )
    ).params
    assert abs(math.log(shapes_total / target)) < math.log(1.15)  # shapes add up to within 15%
    assert spec.hidden_size % spec.num_heads == 0


# ---------------------------------------------------------------- against transformers itself

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
)
FAMILIES = {
    "llama": {},
    "llama-bias": dict(model_type="llama", attention_bias=True, mlp_bias=True, head_dim=32),
    "mistral": dict(head_dim=24),
    "qwen2": {},
    "qwen3": dict(head_dim=32),
    "qwen3-default-head-dim": dict(model_type="qwen3", attention_bias=True),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=40,
        shared_expert_intermediate_size=56,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, head_dim=16, decoder_sparse_step=2
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "gemma2": dict(head_dim=16),
    "gemma3_text": dict(head_dim=16),
    "phi3": dict(vocab_size=32064),
}


@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return torch, transformers


def _hf_count(hf, cfg: dict) -> int:
    torch, transformers = hf
    kwargs = dict(cfg)
    config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with torch.device("meta"):  # shapes only, no memory
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # tied weights are yielded once


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_matches_transformers(hf, family: str) -> None:
    extra = dict(FAMILIES[family])
    base = dict(TINY, model_type=extra.pop("model_type", family), **extra)
    for tie in (None, True, False):  # None: the config class default (gemma ties, the others do not)
        cfg = dict(base) if tie is None else dict(base, tie_word_embeddings=tie)
        assert spec_from_config(cfg).params == _hf_count(hf, cfg), tie


@pytest.mark.parametrize("name", sorted(_counts()))
def test_corpus_oracle_agrees_with_transformers(hf, name: str) -> None:
    cfg = load_config_json(CORPUS / name)
    assert cfg is not None
    keep = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}
    assert _hf_count(hf, keep) == _counts()[name] == spec_from_config(cfg).params
