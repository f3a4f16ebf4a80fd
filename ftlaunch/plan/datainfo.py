"""LLaMA-Factory's dataset registry (0.9.5 ``data/parser.py``): the names that both the hub shell
(``ftlaunch.hub.datasets``, which reads it and downloads) and planning (``ftlaunch.plan.prepared``,
which writes a run's own copy) use. Data only: nothing here imports a plan type.
"""

from __future__ import annotations

INFO_FILE = "dataset_info.json"  # in dataset_dir: dataset name -> entry (hf_hub_url, file_name, ...)
ONLINE = "ONLINE"  # dataset_dir: ONLINE: every dataset name is itself a hub repo id
OTHER_HUBS = ("ms_hub_url", "om_hub_url")  # ModelScope's and Modelers' urls, which win over hf_hub_url when enabled
