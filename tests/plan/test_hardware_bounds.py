"""Bounds on the GPU counts a user types (issue 31 item 3): `--gpu H100-80GBx99999999999999999999` grew
to 24 GB, `RTX4090x6000` took 1.9 GB and 13 s (one object per card, P2P pairs O(N^2)), `H100x1000`
planned 1000 GPUs without a word. Now: at most MAX_GPUS_PER_NODE cards a machine, MAX_NODES nodes a
Slurm job, refused with exit 4 naming the limit, before anything is sized by the count."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.errors import HardwareError
from ftlaunch.plan.hardware import (
    MAX_CATALOG_GPUS,
    MAX_GPUS_PER_NODE,
    MAX_NODES,
    catalog_hardware,
    check_typed_machine,
    hardware_from_json,
    parse_gpu_spec,
)

from ..helpers import flat, said

HUGE = ["H100-80GBx99999999999999999999", "H100x" + "9" * 5000, "RTX4090x6000", "H100x1000", "9999999999xT4"]


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    except HardwareError:
        pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


@pytest.mark.parametrize("spec", HUGE)
def test_a_typed_count_beyond_one_node_is_refused_naming_the_limit_and_sizes_nothing(spec):
    with pytest.raises(HardwareError) as e:
        check_typed_machine([spec])
    assert f"{MAX_GPUS_PER_NODE}" in e.value.message and e.value.exit_code == 4
    assert len(e.value.message) < 400  # a 5000-digit count is not echoed whole
    assert _peak_bytes(lambda: check_typed_machine([spec])) < 1 << 20
    assert _peak_bytes(lambda: catalog_hardware(spec)) < 1 << 20  # never a card object per typed card


def test_counts_up_to_a_node_plan_as_before():
    assert parse_gpu_spec("H100x16") == ("H100-80GB", 16)
    assert parse_gpu_spec("4xA100-80GB") == ("A100-80GB", 4)
    assert parse_gpu_spec("RTX4090") == ("RTX4090", 1) and parse_gpu_spec("none") == ("none", 0)
    check_typed_machine(["H100x16", "T4", "none"], nodes=MAX_NODES)
    with pytest.raises(HardwareError, match="must be 1 or more"):
        parse_gpu_spec("A100x0")


def test_a_slurm_cluster_is_one_catalog_machine_with_a_pair_table_of_one_node():
    # `--slurm --nodes 4 --gpu RTX4090x8` plans 32 cards: above a node, within the cluster bound
    hw = catalog_hardware("RTX4090x32")
    assert hw.gpu_count == 32 and len(hw.p2p_blocked) == MAX_GPUS_PER_NODE * (MAX_GPUS_PER_NODE - 1) // 2
    peak = _peak_bytes(lambda: catalog_hardware(f"RTX4090x{MAX_CATALOG_GPUS}"))
    assert peak < 32 << 20  # the largest cluster: cards, not a table of their 134 million pairs
    with pytest.raises(HardwareError, match=f"{MAX_NODES} nodes"):
        catalog_hardware(f"A100-80GBx{MAX_CATALOG_GPUS + 1}")


def test_too_many_nodes_are_refused_naming_the_limit():
    with pytest.raises(HardwareError) as e:
        check_typed_machine(["A100-80GBx8"], nodes=MAX_NODES + 1)
    assert f"at most {MAX_NODES}" in e.value.message and e.value.exit_code == 4


def test_a_hardware_file_of_more_cards_than_a_machine_has_is_refused():
    gpus = [{"index": i, "name": "NVIDIA H100 80GB HBM3", "total_mib": 81559} for i in range(MAX_GPUS_PER_NODE + 1)]
    with pytest.raises(HardwareError, match=f"at most {MAX_GPUS_PER_NODE}"):
        hardware_from_json(json.dumps({"gpus": gpus}), "hw.json")
    assert hardware_from_json(json.dumps({"gpus": gpus[:MAX_GPUS_PER_NODE]}), "hw.json").gpu_count == 16


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "{cfg}", "--gpu", "H100x1000"],
        ["plan", "{cfg}", "--gpu", "H100-80GBx99999999999999999999"],
        ["estimate", "{cfg}", "--gpu", "T4", "--gpu", "RTX4090x6000"],
        ["train", "{cfg}", "--gpu", "H100x17"],
        ["train", "{cfg}", "--slurm", "--nodes", str(MAX_NODES + 1), "--gpu", "A100-80GBx8"],
        ["schedule", "add", "n", "{cfg}", "--cron", "@daily", "--gpu", "A100-80GBx64"],
    ],
)
def test_every_command_that_takes_a_machine_exits_4_naming_the_limit(args, tmp_path, isolated_home):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_name_or_path: m\nstage: sft\n")
    r = CliRunner().invoke(main, [a.format(cfg=cfg) for a in args])
    assert r.exit_code == 4, r.output
    assert "Traceback" not in r.output and r.exception is None or isinstance(r.exception, SystemExit)
    limit = str(MAX_NODES) if "--nodes" in args else str(MAX_GPUS_PER_NODE)
    assert said(f"at most {limit}", r.output) or said(f"have {limit}", r.output), flat(r.output)
    assert not (isolated_home / "runs").exists()  # nothing was started
