"""Optimizer states, counted on the real optimizers, against plan/memory/optimizers.py.

Usage: PYTHONPATH=DIR .venv/bin/python scripts/check_optimizer_states.py
(DIR holding galore-torch, adam-mini and badam, e.g. `pip install --target DIR --no-deps galore-torch
adam-mini badam`: they are not llamafactory's dependencies; a package that is missing is skipped.)

Builds a small LlamaForCausalLM on the CPU (real fp32 tensors), builds each optimizer the way
LLaMA-Factory 0.9.5 does (its own train/trainer_utils.py functions where they take only the model
and arguments), runs one step, sums the bytes of every tensor in the optimizer's state (BAdam: plus
its fp32 copy of the active block) and prints them beside the formula's figure.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ftlaunch.plan.memory.optimizers import CustomOptimizer, badam_block, optimizer_bytes
from ftlaunch.plan.modelspec import spec_from_config

CFG = dict(
    model_type="llama",
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)


def state_bytes(opt) -> int:
    seen, total = set(), 0

    def add(x) -> None:
        nonlocal total
        if torch.is_tensor(x) and id(x) not in seen:
            seen.add(id(x))
            total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                add(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                add(v)
        elif hasattr(x, "ortho_matrix"):  # a GaLore projector
            add(x.ortho_matrix)

    for st in opt.state.values():
        add(st)
    return total


def step(model, opt) -> None:
    ids = torch.randint(0, CFG["vocab_size"], (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def args(**kw):
    base = dict(
        optim="adamw_torch",
        learning_rate=1e-4,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        gradient_accumulation_steps=1,
    )
    return SimpleNamespace(**{**base, **kw})


def _stub_bitsandbytes() -> None:
    """galore_torch imports bitsandbytes for its 8-bit variant (CUDA only), unused here: a stand-in."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        import types

        for name in ("bitsandbytes", "bitsandbytes.optim", "bitsandbytes.optim.optimizer", "bitsandbytes.functional"):
            sys.modules[name] = types.ModuleType(name)
        sys.modules["bitsandbytes.optim.optimizer"].Optimizer2State = object  # type: ignore[attr-defined]


def main() -> None:
    _stub_bitsandbytes()
    from llamafactory.train import trainer_utils as tu

    torch.manual_seed(0)
    spec = spec_from_config(CFG)
    rows = []

    def fresh():
        m = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in CFG.items() if k != "model_type"}))
        return m, sum(p.numel() for p in m.parameters())

    # GaLore (LLaMA-Factory's _create_galore_optimizer with its defaults: rank 16, std, all linear)
    try:
        import galore_torch  # noqa: F401

        model, n = fresh()
        fa = SimpleNamespace(
            galore_target=["all"],
            galore_rank=16,
            galore_update_interval=200,
            galore_scale=2.0,
            galore_proj_type="std",
            galore_layerwise=False,
            freeze_vision_tower=True,
        )
        tu.Trainer.get_optimizer_cls_and_kwargs = staticmethod(lambda a: (None, {"lr": 1e-4}))
        opt = tu._create_galore_optimizer(model, args(), fa)
        step(model, opt)
        want = optimizer_bytes(spec, "adamw_torch", CustomOptimizer("galore", 16), "full", n, 4).states
        rows.append(("galore r16", state_bytes(opt), want))
    except ImportError as exc:
        print(f"galore skipped: {exc}", file=sys.stderr)

    # Adam-mini (LLaMA-Factory's _create_adam_mini_optimizer)
    try:
        import adam_mini  # noqa: F401

        model, n = fresh()
        opt = tu._create_adam_mini_optimizer(model, args())
        step(model, opt)
        want = optimizer_bytes(spec, "adamw_torch", CustomOptimizer("adam_mini"), "full", n, 4).states
        rows.append(("adam-mini", state_bytes(opt), want))
    except ImportError as exc:
        print(f"adam-mini skipped: {exc}", file=sys.stderr)

    # Muon (LLaMA-Factory's third_party/muon)
    model, n = fresh()
    opt = tu._create_muon_optimizer(model, args())
    step(model, opt)
    want = optimizer_bytes(spec, "adamw_torch", CustomOptimizer("muon"), "full", n, 4).states
    rows.append(("muon", state_bytes(opt), want))

    # BAdam, layer mode: its fp32 copy of the active block + AdamW's moments of it
    try:
        from badam import BlockOptimizer

        model, n = fresh()
        model.to(torch.bfloat16)  # LLaMA-Factory keeps the model in half precision under BAdam
        base = torch.optim.AdamW(model.parameters(), lr=1e-4)
        opt = BlockOptimizer(base, list(model.named_parameters()), switch_block_every=50, verbose=0)
        step(model, opt)
        hp = sum(p.numel() * p.element_size() for p in opt.param_idx2hp.values())
        block = badam_block(spec, CustomOptimizer("badam"))
        rows.append(("badam fp32 block copy", hp, 4 * block))
        rows.append(("badam AdamW moments", state_bytes(base), 8 * block))
    except ImportError as exc:
        print(f"badam skipped: {exc}", file=sys.stderr)

    # plain AdamW, for reference
    model, n = fresh()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, opt)
    rows.append(("adamw_torch", state_bytes(opt), optimizer_bytes(spec, "adamw_torch", None, "full", n, 4).states))

    print(f"{'optimizer':24} {'counted':>12} {'formula':>12} {'error':>8}")
    for name, got, want in rows:
        print(f"{name:24} {got:>12,} {int(want):>12,} {(want - got) / got:>+8.2%}")


if __name__ == "__main__":
    main()
