"""Check the memory model (ftlaunch.plan.memory) against real training on a GPU: predicted vs measured peak memory.

Runs a few short ``llamafactory-cli train`` jobs (3 optimizer steps, 2 micro-batches each) with
``RECORD_VRAM=1``, reads ``vram_allocated`` / ``vram_reserved`` (torch.cuda.max_memory_allocated /
max_memory_reserved, GiB) from ``output_dir/trainer_log.jsonl``, and compares them with
``ftlaunch.plan.memory.peak.estimate`` for the same config. Writes docs/gpu-check.md (and, when $OUT is set,
gpu-check.md + gpu-check.json + failing logs under $OUT).

Models, all local (nothing is downloaded):
  tiny   scripts/make_tiny.py (LLaMA, hidden 64, 2 layers, vocab ~1k)
  small  $SMALL_MODEL, else a Qwen2.5-0.5B in the HF cache, else a randomly initialised model with
         Qwen2.5-0.5B's shapes (memory does not depend on the weights' values)
Data: a synthetic text corpus, stage ``pt`` with packing, so every sequence is exactly cutoff_len.

Usage (from the repository root, through scripts/gpu_check.sh):
  python scripts/gpu_check.py [--quick] [--jobs 3] [--budget-s 420] [--work DIR]
  python scripts/gpu_check.py --cpu-smoke     # no GPU: one tiny fp32 run, checks the plumbing only
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ftlaunch.plan.memory.peak import CUDA_CONTEXT_GIB, FRAGMENTATION, estimate  # noqa: E402
from ftlaunch.plan.memory.setup import setup_from_config  # noqa: E402
from ftlaunch.plan.modelspec import load_model_spec  # noqa: E402

QWEN05_SHAPES = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)


@dataclass(frozen=True)
class Run:
    model: str  # "tiny" | "small"
    finetuning_type: str
    micro_batch: int
    seq_len: int
    attn: str = "sdpa"  # llamafactory flash_attn value
    gc: bool = True
    quant: int | None = None
    needs: str = ""  # "bnb" | "fa2" | ""
    optim: str = "adamw_torch"  # the memory model's default (foreach AdamW)

    @property
    def name(self) -> str:
        q = f"-q{self.quant}" if self.quant else ""
        o = "-fused" if "fused" in self.optim else ""
        return (
            f"{self.model}-{self.finetuning_type}{q}-b{self.micro_batch}-s{self.seq_len}-{self.attn}"
            + ("" if self.gc else "-nogc")
            + o
        )


RUNS: tuple[Run, ...] = (
    Run("tiny", "lora", 1, 512),
    Run("tiny", "full", 4, 1024),
    Run("small", "lora", 1, 1024),
    Run("small", "lora", 4, 1024),
    Run("small", "lora", 2, 2048),
    Run("small", "lora", 1, 2048, gc=False),
    Run("small", "lora", 1, 2048, attn="disabled", gc=False),  # eager: the s^2 score tensors show
    Run("small", "full", 1, 1024),
    Run("small", "full", 1, 1024, optim="adamw_torch_fused"),  # no foreach step temporaries
    Run("small", "full", 2, 2048),
    Run("small", "lora", 2, 2048, quant=4, needs="bnb"),
    Run("small", "lora", 2, 4096, attn="fa2", needs="fa2"),
)
QUICK = (RUNS[0], RUNS[3], RUNS[9])


@dataclass
class Result:
    run: Run
    config: dict
    predicted: dict = field(default_factory=dict)
    allocated: float | None = None
    reserved: float | None = None
    seconds: float = 0.0
    error: str = ""
    log_tail: str = ""


# ---------------------------------------------------------------------------------------- setup


def have(module: str) -> bool:
    try:
        __import__(module)
        return True
    except Exception:
        return False


def make_text_data(data_dir: Path, words: int = 120_000, seed: int = 0) -> None:
    """Random text for stage pt: with packing every block is exactly cutoff_len tokens."""
    vocab = (
        "the model learns to answer short questions about numbers colours animals and places red "
        "green blue cat dog bird river mountain city one two three four five six seven eight nine "
        "ten add subtract what is name a list give an example of please explain why how"
    ).split()
    rng = random.Random(seed)
    rows = [{"text": " ".join(rng.choice(vocab) for _ in range(200))} for _ in range(words // 200)]
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "gpu_check_text.json").write_text(json.dumps(rows))
    info = {"gpu_check_text": {"file_name": "gpu_check_text.json", "columns": {"prompt": "text"}}}
    (data_dir / "dataset_info.json").write_text(json.dumps(info, indent=2))


def find_small_model() -> Path | None:
    env = os.environ.get("SMALL_MODEL")
    if env and (Path(env) / "config.json").is_file():
        return Path(env)
    hub = Path(
        os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache/huggingface")) / "hub"
    )
    for pattern in ("models--Qwen--Qwen2.5-0.5B*/snapshots/*", "models--Qwen--Qwen3-0.6B*/snapshots/*"):
        for snap in sorted(hub.glob(pattern)):
            if (snap / "config.json").is_file() and list(snap.glob("*.safetensors")):
                return snap
    return None


def make_synthetic_small(out: Path, tokenizer_dir: Path) -> Path:
    """A random-weight model with Qwen2.5-0.5B's shapes, saved in bf16, with the tiny tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = Qwen2Config(**QWEN05_SHAPES, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    del model
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(f, out / f.name)
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def train_config(run: Run, model_dir: Path, data_dir: Path, out_dir: Path, bf16: bool) -> dict:
    cfg: dict = {
        "model_name_or_path": str(model_dir),
        "stage": "pt",
        "do_train": True,
        "finetuning_type": run.finetuning_type,
        "dataset": "gpu_check_text",
        "dataset_dir": str(data_dir),
        "template": "empty",
        "cutoff_len": run.seq_len,
        "packing": True,
        "preprocessing_num_workers": 4,
        "dataloader_num_workers": 0,
        "output_dir": str(out_dir),
        "overwrite_output_dir": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "per_device_train_batch_size": run.micro_batch,
        "gradient_accumulation_steps": 2,  # gradients stay allocated across micro-batches
        "max_steps": 3,
        "learning_rate": 1.0e-5,
        "optim": run.optim,
        "flash_attn": run.attn,
        "disable_gradient_checkpointing": not run.gc,
        "bf16": bf16,
        "seed": 0,
    }
    if run.finetuning_type == "lora":
        cfg.update({"lora_rank": 8, "lora_target": "all"})
    if run.quant:
        cfg["quantization_bit"] = run.quant
    return cfg


# ---------------------------------------------------------------------------------------- runs


def parse_vram(log: Path) -> tuple[float | None, float | None]:
    """Max vram_allocated / vram_reserved over trainer_log.jsonl lines (GiB)."""
    alloc: list[float] = []
    resv: list[float] = []
    if not log.is_file():
        return None, None
    for line in log.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row.get("vram_allocated"), (int, float)):
            alloc.append(float(row["vram_allocated"]))
        if isinstance(row.get("vram_reserved"), (int, float)) and row["vram_reserved"] >= 0:
            resv.append(float(row["vram_reserved"]))
    return (max(alloc) if alloc else None), (max(resv) if resv else None)


def run_one(res: Result, cli: list[str], work: Path, timeout_s: int) -> Result:
    import yaml

    rdir = work / res.run.name
    rdir.mkdir(parents=True, exist_ok=True)
    cfg_path = rdir / "train.yaml"
    cfg_path.write_text(yaml.safe_dump(res.config, sort_keys=False))
    env = dict(os.environ)
    env.update(
        {
            "RECORD_VRAM": "1",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "DISABLE_VERSION_CHECK": "1",
            "HF_HOME": str(rdir / "hf"),
            "HF_DATASETS_CACHE": str(rdir / "hf" / "datasets"),
            "MPLCONFIGDIR": str(rdir / "mpl"),
            "WANDB_DISABLED": "true",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    env.pop("FORCE_TORCHRUN", None)
    if env.get("CUDA_VISIBLE_DEVICES", "") != "":
        env["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"].split(",")[0]
    elif shutil.which("nvidia-smi"):
        env["CUDA_VISIBLE_DEVICES"] = "0"  # one device: llamafactory trains in-process, no torchrun
    t0 = time.time()
    log_file = rdir / "train.log"
    try:
        with log_file.open("w") as fh:
            proc = subprocess.run(
                [*cli, "train", str(cfg_path)],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=timeout_s,
                cwd=rdir,
            )
        if proc.returncode != 0:
            res.error = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        res.error = f"timeout after {timeout_s}s"
    except OSError as exc:
        res.error = f"could not start {cli[0]}: {exc}"
    res.seconds = time.time() - t0
    res.allocated, res.reserved = parse_vram(Path(res.config["output_dir"]) / "trainer_log.jsonl")
    if res.error or res.allocated is None:
        res.log_tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-40:])
        res.error = res.error or "no vram_allocated in trainer_log.jsonl"
    return res


def waves(results: list[Result], jobs: int, capacity_gib: float) -> list[list[Result]]:
    """Group runs to share the one GPU: at most ``jobs`` per wave, predicted peaks summing below
    ``capacity_gib`` (each process has its own allocator statistics, so sharing does not mix them)."""
    out: list[list[Result]] = []
    for res in sorted(results, key=lambda r: -r.predicted.get("peak_gib", 0.0)):
        need = res.predicted.get("peak_gib", 0.0)
        for wave in out:
            used = sum(r.predicted.get("peak_gib", 0.0) for r in wave)
            if len(wave) < max(1, jobs) and used + need <= capacity_gib:
                wave.append(res)
                break
        else:
            out.append([res])
    return out


def predict(model_dir: Path, cfg: dict) -> dict:
    spec = load_model_spec(model_dir)
    if spec is None:
        raise SystemExit(f"no config.json in {model_dir}")
    est = estimate(spec, setup_from_config(cfg, world_size=1))
    d = est.to_dict()
    d["reserved_gib"] = est.tensors_gib * (1 + FRAGMENTATION)
    d["params"] = spec.params
    return d


# ---------------------------------------------------------------------------------------- report


def render(results: list[Result], meta: dict) -> str:
    lines = [
        "# GPU check: ftlaunch.plan.memory predicted vs measured",
        "",
        f"Generated by `scripts/gpu_check.sh` on {meta['date']}: {meta['gpu']} ({meta['capacity_gib']:.1f} GiB), "
        f"torch {meta['torch']}, transformers {meta['transformers']}, llamafactory {meta['llamafactory']}.",
        f"Small model: {meta['small']}.",
        "",
        "Each run: `llamafactory-cli train`, stage pt with packing (every sequence = cutoff_len tokens), "
        "3 optimizer steps x 2 micro-batches, `optim: adamw_torch`, bf16, `RECORD_VRAM=1`. "
        "*Measured* = max over steps of torch.cuda.max_memory_allocated / max_memory_reserved. "
        "*Predicted alloc* = `MemoryEstimate.tensors_gib` (peak without overhead); *predicted reserved* = "
        f"that x (1 + {FRAGMENTATION}); *peak* = `peak_gib`, which adds the {CUDA_CONTEXT_GIB} GiB CUDA context "
        "torch does not count. Ratio = predicted / measured allocated (> 1: the model over-estimates).",
        "",
        "| run | params | ft | micro | seq | attn | ckpt | pred alloc | meas alloc | ratio | pred reserved "
        "| meas reserved | pred peak | time s | note |",
        "|---|---:|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        p = r.predicted
        ratio = (p["tensors_gib"] / r.allocated) if (r.allocated and p) else None
        ft = r.run.finetuning_type + (f" q{r.run.quant}" if r.run.quant else "")

        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}"

        lines.append(
            f"| {r.run.name} | {p.get('params', 0) / 1e6:.1f}M | {ft} | {r.run.micro_batch} | {r.run.seq_len} "
            f"| {r.run.attn} | {'on' if r.run.gc else 'off'} | {f(p.get('tensors_gib'))} | {f(r.allocated)} "
            f"| {f(ratio)} | {f(p.get('reserved_gib'))} | {f(r.reserved)} | {f(p.get('peak_gib'))} "
            f"| {r.seconds:.0f} | {r.error} |"
        )
    ok = [r for r in results if r.allocated and r.predicted]
    if ok:
        ratios = [r.predicted["tensors_gib"] / r.allocated for r in ok]
        lines += ["", f"Ratio over {len(ok)} runs: min {min(ratios):.2f}, max {max(ratios):.2f}."]
    skipped = meta.get("skipped") or []
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="three runs only")
    ap.add_argument("--jobs", type=int, default=3, help="runs in parallel on the one GPU (default 3)")
    ap.add_argument("--budget-s", type=int, default=420, help="stop starting runs after this many seconds")
    ap.add_argument("--timeout-s", type=int, default=240, help="per-run timeout")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--report", type=Path, default=ROOT / "docs" / "gpu-check.md")
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: one tiny fp32 run, plumbing only")
    args = ap.parse_args()
    t_start = time.time()

    import torch

    gpu = torch.cuda.is_available()
    if not gpu and not args.cpu_smoke:
        print("gpu_check: no CUDA device visible (use --cpu-smoke to check the plumbing)", file=sys.stderr)
        return 2
    cli_path = shutil.which("llamafactory-cli") or str(Path(sys.executable).parent / "llamafactory-cli")
    if not Path(cli_path).exists():
        print("gpu_check: llamafactory-cli not found next to this python or on PATH", file=sys.stderr)
        return 2
    cli = [str(Path(cli_path).resolve())]

    work = args.work or Path(tempfile.mkdtemp(prefix="ftlaunch-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    data_dir = work / "data"
    make_text_data(data_dir)
    tiny_dir = work / "tiny"
    if not (tiny_dir / "model" / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny.py"), str(tiny_dir)], check=True)
    models = {"tiny": tiny_dir / "model"}

    skipped: list[str] = []
    runs = list(QUICK if args.quick else RUNS)
    if args.cpu_smoke:
        runs = [Run("tiny", "lora", 1, 256)]
    else:
        small = find_small_model()
        small_label = str(small) if small else "random-weight model with Qwen2.5-0.5B shapes (local, no download)"
        if small is None:
            small = make_synthetic_small(work / "small", models["tiny"])
        models["small"] = small
        bnb, fa2 = have("bitsandbytes"), have("flash_attn")
        for r in list(runs):
            if (r.needs == "bnb" and not bnb) or (r.needs == "fa2" and not fa2):
                runs.remove(r)
                skipped.append(f"{r.name} ({r.needs} not installed)")
    capacity = torch.cuda.get_device_properties(0).total_memory / 2**30 if gpu else 0.0

    results: list[Result] = []
    for r in runs:
        cfg = train_config(r, models[r.model], data_dir, work / r.name / "out", bf16=gpu)
        res = Result(r, cfg)
        try:
            res.predicted = predict(models[r.model], cfg)
        except Exception as exc:  # keep going: report it
            res.error = f"predict failed: {exc}"
        if gpu and res.predicted and res.predicted["peak_gib"] > capacity * 0.95:
            skipped.append(f"{r.name} (predicted {res.predicted['peak_gib']:.1f} GiB > capacity)")
            continue
        results.append(res)

    done: list[Result] = []
    for wave in waves(results, args.jobs, capacity * 0.9 if gpu else float("inf")):
        if time.time() - t_start > args.budget_s:
            skipped.extend(f"{res.run.name} (time budget)" for res in wave)
            continue
        with cf.ThreadPoolExecutor(max_workers=len(wave)) as pool:
            for r in pool.map(lambda res: run_one(res, cli, work, args.timeout_s), wave):
                done.append(r)
                pa = r.predicted.get("tensors_gib")
                print(
                    f"{r.run.name:40s} predicted {pa if pa is None else round(pa, 2)} GiB, "
                    f"measured {r.allocated} GiB alloc / {r.reserved} GiB reserved  {r.error}",
                    flush=True,
                )
    done.sort(key=lambda r: runs.index(r.run))

    import transformers

    try:
        import llamafactory

        lf_version = getattr(llamafactory, "__version__", "?")
    except Exception:
        lf_version = "?"
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "gpu": torch.cuda.get_device_name(0) if gpu else "CPU (smoke run, no VRAM figures)",
        "capacity_gib": capacity,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llamafactory": lf_version,
        "small": small_label if not args.cpu_smoke else "-",
        "skipped": skipped,
    }
    report = render(done, meta)
    print(report)
    if not args.cpu_smoke:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(report)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu-check.md").write_text(report)
        rows = [
            {
                "run": r.run.name,
                "config": r.config,
                "predicted": r.predicted,
                "allocated": r.allocated,
                "reserved": r.reserved,
                "seconds": r.seconds,
                "error": r.error,
            }
            for r in done
        ]
        (Path(out) / "gpu-check.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1, default=str))
        for r in done:
            if r.log_tail:
                (Path(out) / f"{r.run.name}.log.txt").write_text(r.log_tail)
    failed = [r for r in done if r.error]
    return 1 if failed or not done else 0


if __name__ == "__main__":
    sys.exit(main())
