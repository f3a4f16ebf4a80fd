"""ftlaunch.hub: get a model onto local disk before training: pick an endpoint (mirror), download with retries, verify.

What this adds on top of ``huggingface_hub.snapshot_download`` (read against huggingface_hub 1.x):

* Endpoint choice (``choose_endpoint``): explicit mirror > ``HF_ENDPOINT`` > probe huggingface.co then
  hf-mirror.com with a short timeout. ``HF_ENDPOINT`` is frozen when huggingface_hub is imported, so the chosen
  URL is always passed explicitly as ``endpoint=``.
* One commit for the whole download: the repo info (with file sizes and LFS sha256) is fetched once, with a
  timeout, and ``snapshot_download`` is called with that commit id. Retries then never mix two commits, the
  listing doubles as the verification manifest, and ``refs/<revision>`` is written so offline loading by repo id
  still works.
* Retries (tenacity) with exponential backoff and jitter on timeouts, dropped/refused connections, 5xx and 429
  (``Retry-After`` honoured). 401/403/404 and the hub's not-found/gated errors are never retried: they become a
  ``HubError`` that says how to log in. Files completed by an attempt stay in the cache and are not fetched again.
* Resume inside a transfer. huggingface_hub 1.x writes each file to a process-unique ``*.incomplete`` temp file
  and deletes it when the download fails, so nothing survives from one ``snapshot_download`` call to the next;
  its own in-call resume only covers a clean early close, and only at 10 MiB chunk boundaries (httpx keeps the
  partial chunk in memory and loses it with the exception). So, while ``download`` runs, huggingface_hub's
  shared httpx client is replaced by one that (1) caps every timeout (some of its calls have none) and (2) when a
  response body breaks off, re-requests the remainder with ``Range``/``If-Range`` and splices it into the same
  stream: huggingface_hub never sees the break and no byte already received is fetched again. (Files stored on
  Xet are fetched by ``hf_xet``, which has its own retries and chunk cache; this applies to plain HTTP.)
* Cache hygiene: lock files left by dead processes are removed; a lock held by a live process is waited for,
  then ``BusyError``. Orphaned temp files are removed (they can never be resumed, see above).
* Verification: every listed file present with the listed size, LFS files with the listed sha256, every shard of
  a ``*.safetensors.index.json`` present, and no ``*.incomplete`` left.

Modules: repo (what names a hub repo; cache folder and token from the environment), endpoints (choice
of hub or mirror), download (the use case), client (resumable HTTP), errors (classification,
messages), cache (locks, partial files), verify, results, modelscope, model (pre-download a config's
model), datasets (pre-download a config's hub datasets). Both return plain values (what was fetched,
from where, the local paths); planning turns them into the plan's Changes (ftlaunch.plan.prepared).
The package (floor 2) imports nothing of ftlaunch but the ground and, of ftlaunch.plan, only
plan.datainfo (dataset_info.json's names): never the Plan or Change types (tests/test_layers.py
checks). Importing it is cheap: huggingface_hub, httpx and tenacity are imported inside the
functions.
Tokens are passed through to huggingface_hub and never appear in results, messages or logs.
"""

from __future__ import annotations

from .cache import clear_stale_locks, lock_is_held
from .download import download, offline_env
from .endpoints import DEFAULT_CANDIDATES, KNOWN_ENDPOINTS, MODELSCOPE, EndpointChoice, choose_endpoint
from .results import DownloadResult, ExpectedFile
from .verify import verify_snapshot

__all__ = [
    "DEFAULT_CANDIDATES",
    "KNOWN_ENDPOINTS",
    "MODELSCOPE",
    "DownloadResult",
    "EndpointChoice",
    "ExpectedFile",
    "choose_endpoint",
    "clear_stale_locks",
    "download",
    "lock_is_held",
    "offline_env",
    "verify_snapshot",
]
