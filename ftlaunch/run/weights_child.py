"""A cheap scan of model weights: safetensors headers and a sample of each folder's float tensors.

Run by ftlaunch.run.rollback.scan_weights as `TRAINER_PYTHON weights_child.py SPEC_JSON` in the
trainer's Python, by path: it imports nothing of ftlaunch (numpy when there, else only the standard
library), so it works where ftlaunch is not installed, and it never loads a model: the header says
where each tensor lies, and only the sampled bytes are read.

SPEC = {"folders": [{"label": "checkpoint-4", "path": "..."}, ...], "max_tensors": 16,
        "max_elements": 65536}. A label's path may be a hub model id: its cached snapshot is scanned.
Prints one JSON object: label -> {files, elements (sampled), nonfinite, max_abs, tensors: {name:
max |w| of its sample}} or {error}. The same tensor names are sampled in every folder (spread evenly
over the sorted union of names), so a checkpoint and the base model compare tensor by tensor.
"""

import json
import math
import os
import struct
import sys
import zlib

# Run by path, so Python put this file's folder first on sys.path, where ftlaunch/run/ray would be taken
# for the top-level `ray` (transformers' is_ray_tune_available found it) and any sibling module for a
# package of the same name. The trainer's Python may predate -P (3.11): take the folder off here,
# before anything past the standard library is imported.
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]

SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
CHUNKS = 4  # a large tensor is sampled as this many runs of elements, spread over it


def resolve(path):
    """A folder, or a hub id's cached snapshot (never downloaded: the trainer has it or it does not)."""
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, local_files_only=True, allow_patterns=["*.safetensors", "*.json"])
    except Exception:  # noqa: BLE001 - not cached, not a hub id, no huggingface_hub: nothing to scan
        return None


def headers(folder):
    """{tensor name: (file, absolute offset, dtype, elements)} of the folder's safetensors files."""
    out = {}
    names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    for name in names:
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            head = json.loads(f.read(n))
        for key, info in head.items():
            if key == "__metadata__" or info.get("dtype") not in SIZES:
                continue
            start, end = info["data_offsets"]
            out[key] = (path, 8 + n + start, info["dtype"], (end - start) // SIZES[info["dtype"]])
    return out, len(names)


def decode(raw, dtype):
    """Bytes -> floats, with numpy when it is there."""
    try:
        import numpy as np

        if dtype == "BF16":
            return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        return np.frombuffer(raw, dtype={"F64": "<f8", "F32": "<f4", "F16": "<f2"}[dtype])
    except ImportError:
        if dtype == "BF16":
            ints = struct.unpack(f"<{len(raw) // 2}H", raw)
            return [struct.unpack("<f", struct.pack("<I", i << 16))[0] for i in ints]
        code = {"F64": "d", "F32": "f", "F16": "e"}[dtype]
        return list(struct.unpack(f"<{len(raw) // SIZES[dtype]}{code}", raw))


def stats(values):
    """(non-finite count, max |finite value|)."""
    try:
        import numpy as np

        a = np.asarray(values, dtype=np.float64)
        ok = np.isfinite(a)
        bad = int(a.size - ok.sum())
        return bad, float(np.abs(a[ok]).max()) if ok.any() else 0.0
    except ImportError:
        finite = [abs(v) for v in values if math.isfinite(v)]
        return len(values) - len(finite), max(finite, default=0.0)


def sample(path, offset, dtype, elements, budget):
    """(non-finite count, max |finite value|) over the whole tensor, or CHUNKS runs spread over it."""
    size = SIZES[dtype]
    if elements <= budget:
        runs = [(0, elements)]
    else:
        per = budget // CHUNKS
        runs = [(i * (elements - per) // (CHUNKS - 1), per) for i in range(CHUNKS)]
    bad, top = 0, 0.0
    with open(path, "rb") as f:
        for start, count in runs:
            f.seek(offset + start * size)
            b, t = stats(decode(f.read(count * size), dtype))
            bad, top = bad + b, max(top, t)
    return bad, top


def pick(names, k):
    """k names spread evenly over the sorted list, and a few chosen by hash (the same in every run)."""
    names = sorted(names)
    if len(names) <= k:
        return names
    even = [names[i * (len(names) - 1) // max(1, k // 2 - 1)] for i in range(k // 2)]
    hashed = sorted(names, key=lambda n: zlib.crc32(n.encode()))[: k - len(set(even))]
    return sorted(set(even) | set(hashed))


def main():
    spec = json.load(open(sys.argv[1]))
    k, budget = int(spec.get("max_tensors", 16)), int(spec.get("max_elements", 65536))
    found = {}
    for item in spec["folders"]:
        folder = resolve(item["path"])
        if folder is None:
            found[item["label"]] = {"error": f"not found: {item['path']}"}
            continue
        try:
            found[item["label"]] = headers(folder)
        except (OSError, ValueError, KeyError, struct.error) as exc:
            found[item["label"]] = {"error": f"{type(exc).__name__}: {exc}"}
    union = {n for v in found.values() if isinstance(v, tuple) for n in v[0]}
    chosen = set(pick(union, k))
    out = {}
    for label, got in found.items():
        if isinstance(got, dict):
            out[label] = got
            continue
        tensors, files = got
        names = [n for n in sorted(tensors) if n in chosen] or pick(tensors, k)  # adapters: its own names
        res = {"files": files, "elements": 0, "nonfinite": 0, "max_abs": 0.0, "tensors": {}}
        try:
            for name in names:
                bad, top = sample(*tensors[name], budget)
                res["elements"] += min(tensors[name][3], budget)
                res["nonfinite"] += bad
                res["max_abs"] = max(res["max_abs"], top)
                res["tensors"][name] = top
        except (OSError, ValueError, struct.error) as exc:
            res = {"error": f"{type(exc).__name__}: {exc}"}
        out[label] = res
    print(json.dumps(out))


if __name__ == "__main__":
    main()
