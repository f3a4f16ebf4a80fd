"""Make a tiny LLaMA model, tokenizer and alpaca dataset locally, with no network.

Usage: python scripts/make_tiny.py OUT_DIR [--rows 64]
Writes OUT_DIR/model (LlamaForCausalLM, hidden 64, 2 layers, ~200k params) and OUT_DIR/data
(alpaca_tiny.json + dataset_info.json). Needs the `train` extra (torch, transformers, tokenizers).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "the model learns to answer short questions about numbers colours animals and places "
    "red green blue cat dog bird river mountain city one two three four five six seven eight "
    "nine ten add subtract what is name a list give an example of please explain why how"
).split()

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 20)))
        a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
        out.append({"instruction": f"{q} ({i})", "input": "", "output": a})
    return out


def make_tokenizer(texts: list[str], out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|pad|>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # transformers 5 writes a class name 4.x cannot load; this one loads in both.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))


def make_model(vocab: int, out: Path, pad_id: int, bos_id: int, eos_id: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()
    model_dir, data_dir = args.out / "model", args.out / "data"
    model_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    data = rows(args.rows)
    (data_dir / "alpaca_tiny.json").write_text(json.dumps(data, indent=1))
    (data_dir / "dataset_info.json").write_text(
        json.dumps({"alpaca_tiny": {"file_name": "alpaca_tiny.json"}}, indent=2)
    )
    texts = [f"{r['instruction']} {r['output']}" for r in data] * 4
    make_tokenizer(texts, model_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    n = make_model(len(tok), model_dir, tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    print(f"tiny model: {n} parameters, vocab {len(tok)} -> {model_dir}; {len(data)} rows -> {data_dir}")


if __name__ == "__main__":
    main()
