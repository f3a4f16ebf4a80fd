"""ftlaunch's token counter: llamafactory's own preprocessing, lengths written as JSON.

Run by ftlaunch.estimate.probe.count_tokens as `TRAINER_PYTHON count_child.py SPEC_JSON OUT_JSON` in the
trainer's Python, by path: it imports llamafactory and nothing of ftlaunch, so it works where ftlaunch is
not installed. ftlaunch never runs it in its own process: main() imports llamafactory, hence torch.

argv: SPEC_JSON OUT_JSON. SPEC = {"config": {...}}. Runs the calls run_sft/run_pt/... make
(get_train_args, load_tokenizer, get_template_and_fix_tokenizer, get_dataset), up to three times:
  train    the config as given: what the dataloader iterates (rows, label tokens)
  samples  packing only: the same with packing off at llamafactory's packing cutoff (cutoff - 1)
  raw      sft only, when some sample reaches the cutoff: no cutoff, to count truncation
"""

import json
import os
import sys

# Run by path, so Python put this file's folder first on sys.path, where ftlaunch/run/ray would be taken
# for the top-level `ray` (transformers' is_ray_tune_available found it) and any sibling module for a
# package of the same name. The trainer's Python may predate -P (3.11): take the folder off here,
# before anything past the standard library is imported.
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]

# Printed before exiting 3 when the tokenizer cannot encode: probe.py turns it into a config error.
EMPTY_TOKENIZER = "FTLAUNCH_EMPTY_TOKENIZER:"
PROBE_TEXT = "The quick brown fox jumps over the lazy dog 0123456789."


def check_tokenizer(tokenizer, model):
    """Stop when the tokenizer encodes a plain sentence to nothing (or only to its unknown token):
    transformers 5 builds such an empty tokenizer from a folder without tokenizer files, and every
    count made with it would be a few special tokens per sample, reported as exact."""
    ids = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    unk = getattr(tokenizer, "unk_token_id", None)
    if not ids or all(i == unk for i in ids):
        vocab = len(tokenizer)
        print(
            f"{EMPTY_TOKENIZER} the tokenizer of {model} encodes {PROBE_TEXT!r} to {ids} (vocabulary of {vocab}): "
            "it has no usable vocabulary",
            flush=True,
        )
        sys.exit(3)


def main():
    spec = json.load(open(sys.argv[1]))
    cfg = spec["config"]
    raw_cutoff, ignore_index = spec["raw_cutoff"], spec["ignore_index"]
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    def load(overrides):
        merged = dict(cfg)
        merged.update(overrides)
        if overrides:
            merged.pop("tokenized_path", None)
        model_args, data_args, training_args, finetuning_args, _ = get_train_args(merged)
        if data_args.streaming:
            raise ValueError("streaming datasets have no length to count; estimate with streaming: false")
        tm = load_tokenizer(model_args)
        check_tokenizer(tm["tokenizer"], model_args.model_name_or_path)
        template = get_template_and_fix_tokenizer(tm["tokenizer"], data_args)
        stage = finetuning_args.stage
        ds_stage = {"dpo": "rm"}.get(stage, stage)
        dm = get_dataset(template, model_args, data_args, training_args, stage=ds_stage, **tm)
        return data_args, stage, dm

    def measure(ds):
        import pyarrow.compute as pc

        cols = ds.column_names
        if "chosen_input_ids" in cols:
            pairs = [("chosen_input_ids", "chosen_labels"), ("rejected_input_ids", "rejected_labels")]
        else:
            pairs = [("input_ids", "labels" if "labels" in cols else None)]
        lengths = [[] for _ in pairs]
        labels = 0
        for batch in ds.with_format("arrow").iter(batch_size=10000):
            for k, (ic, lc) in enumerate(pairs):
                lens = pc.list_value_length(batch.column(ic)).to_pylist()
                lengths[k].extend(lens)
                if lc is None:
                    labels += sum(lens)
                else:
                    flat = pc.list_flatten(batch.column(lc))
                    labels += int(pc.sum(pc.not_equal(flat, ignore_index)).as_py() or 0)
        joined = [x for part in lengths for x in part]
        return {"rows": len(lengths[0]), "lengths": joined, "label_tokens": labels, "sequences_per_row": len(pairs)}

    def eval_part(dm):
        ev = dm.get("eval_dataset")
        if ev is None:
            return None
        parts = list(ev.values()) if isinstance(ev, dict) else [ev]
        rows = tokens = 0
        for d in parts:
            m = measure(d)
            rows += m["rows"]
            tokens += sum(m["lengths"])
        return {"rows": rows, "tokens": tokens}

    data_args, stage, dm = load({})
    out = {
        "stage": stage,
        "packing": bool(data_args.packing),
        "neat_packing": bool(data_args.neat_packing),
        "truncation_at": data_args.cutoff_len,
        "preprocessing_batch_size": data_args.preprocessing_batch_size,
        "preprocessing_num_workers": data_args.preprocessing_num_workers or 1,
        "train": measure(dm["train_dataset"]),
        "eval": eval_part(dm),
        "samples": None,
        "raw": None,
        "notes": [],
    }
    used_saved = bool(cfg.get("tokenized_path"))
    if used_saved:
        out["notes"].append("read the saved tokenized_path; the cutoff's effect on it is unknown")
        out["truncation_at"] = None
    per_sample = out["train"]
    if stage == "sft" and data_args.packing and not used_saved:
        _, _, dm2 = load({"packing": False, "neat_packing": False, "cutoff_len": data_args.cutoff_len})
        out["samples"] = per_sample = measure(dm2["train_dataset"])
    if stage == "sft" and not used_saved and per_sample["lengths"]:
        if max(per_sample["lengths"]) >= data_args.cutoff_len - 2:
            _, _, dm3 = load({"packing": False, "neat_packing": False, "cutoff_len": raw_cutoff})
            out["raw"] = {"lengths": measure(dm3["train_dataset"])["lengths"]}
    elif stage != "sft":
        out["truncation_at"] = None
        out["notes"].append(f"stage {stage}: truncation is not counted")
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
