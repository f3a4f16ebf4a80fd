"""The planner plans nodes x processes per node itself (a Slurm job's nodes): the plan is final, so
what its table shows is what runs. Pure: catalog machines, `on_nodes`, `plan`."""

from __future__ import annotations

from ftlaunch.plan import v1
from ftlaunch.plan.hardware import Hardware, catalog_hardware, on_nodes
from ftlaunch.plan.planner import PlanOptions, plan
from ftlaunch.present.render import plan_text

LORA = {"stage": "sft", "do_train": True, "finetuning_type": "lora", "output_dir": "/o", "bf16": True,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 4}  # fmt: skip


def rows(p) -> dict[str, tuple]:
    return {c.key: (c.old, c.new) for c in p.changes}


def test_two_nodes_of_four_gpus_keep_the_global_batch():
    hw = on_nodes(catalog_hardware("A100-80GBx4"), 2)
    assert (hw.nodes, hw.gpu_count, hw.gpus_per_node, hw.world_size) == (2, 8, 4, 8)
    p = plan({**LORA, "gradient_accumulation_steps": 8}, hw)  # global batch 32 on 1 GPU
    assert (p.nodes, p.processes_per_node, p.world_size) == (2, 4, 8)
    assert p.global_batch_source == p.global_batch_target == 32 == p.micro_batch * p.accumulation * 8
    assert p.env == {"FORCE_TORCHRUN": "1", "NNODES": "2", "NPROC_PER_NODE": "4"}
    layout = rows(p)
    assert layout["NNODES"] == (None, "2") and layout["NPROC_PER_NODE"] == (None, "4")
    assert "2 nodes x 4 trainer process(es) (one per GPU)" in next(c.reason for c in p.changes if c.key == "NNODES")
    assert p.to_dict()["nodes"] == 2 and p.to_dict()["processes_per_node"] == 4
    assert p.to_dict()["hardware"]["nodes"] == 2
    text = plan_text(p)
    assert "2 nodes of 4x NVIDIA A100-SXM4-80GB" in text and "x 8 device(s) (2 nodes x 4)" in text


def test_a_batch_that_does_not_divide_runs_fewer_processes_on_every_node():
    hw = on_nodes(catalog_hardware("A100-80GBx8"), 2)
    p = plan({**LORA, "gradient_accumulation_steps": 6}, hw)  # 24 does not divide over 16
    assert (p.nodes, p.processes_per_node, p.global_batch_target) == (2, 6, 24)
    assert p.env == {"FORCE_TORCHRUN": "1", "NNODES": "2", "NPROC_PER_NODE": "6"}  # no pin: Slurm names the GPUs
    assert rows(p)["NPROC_PER_NODE"] == ("8", "6") and "NNODES" not in rows(p)  # only what changed
    assert any("2 x 6 keep it exactly" in w for w in p.warnings)
    every = plan({**LORA, "gradient_accumulation_steps": 6}, hw, PlanOptions(keep_devices=True))
    assert (every.nodes, every.processes_per_node, every.global_batch_target) == (2, 8, 32)


def test_cpu_nodes_one_process_each_keep_the_global_batch_over_them():
    p = plan(LORA, on_nodes(catalog_hardware("none"), 4))
    c = p.config
    assert (p.nodes, p.processes_per_node, p.world_size, p.global_batch_target) == (4, 1, 4, 16)
    assert not c.get("bf16") and c["ddp_backend"] == "gloo" and p.precision == "fp32"
    assert c["per_device_train_batch_size"] * c["gradient_accumulation_steps"] * 4 == 16
    assert p.env == {"FORCE_TORCHRUN": "1", "NNODES": "4", "NPROC_PER_NODE": "1"}
    assert {"ddp_backend", "gradient_accumulation_steps", "NNODES"} <= set(rows(p))
    odd = plan({**LORA, "gradient_accumulation_steps": 1}, on_nodes(catalog_hardware("none"), 3))  # 4 over 3 nodes
    assert (odd.nodes, odd.global_batch_target) == (3, 3) and any("nearest" in w for w in odd.warnings)


def test_a_one_process_config_runs_on_one_node():
    p = plan({**LORA, "use_kt": True}, on_nodes(catalog_hardware("A100-80GBx8"), 2))
    assert (p.nodes, p.processes_per_node, p.world_size) == (1, 1, 1)
    assert "NNODES" not in p.env and any("KTransformers" in w for w in p.warnings)


def test_one_node_is_the_plan_it_always_was():
    hw = catalog_hardware("A100-80GBx4")
    assert on_nodes(hw, 1) is hw and hw.nodes == 1 and "nodes" not in hw.to_dict()
    p = plan(LORA, hw)
    assert p.nodes == 1 and "nodes" not in p.to_dict() and "NNODES" not in p.env


def test_the_nodes_read_back_and_describe_themselves():
    hw = on_nodes(catalog_hardware("RTX4090x4"), 2)
    assert Hardware.from_dict(hw.to_dict()) == hw
    assert hw.describe() == "2 nodes of 4x NVIDIA GeForce RTX 4090 (24 GiB, cc 8.9)"
    assert [g.index for g in hw.gpus] == list(range(8)) and all(g.uuid is None for g in hw.gpus)
    assert hw.p2p_blocked == tuple((i, j) for i in range(4) for j in range(i + 1, 4))  # one node's pairs
    assert plan(LORA, hw).env["NCCL_P2P_DISABLE"] == "1"
    assert on_nodes(catalog_hardware("nonex2"), 3).describe() == "3 CPU nodes (2 process(es) each)"
    assert on_nodes(catalog_hardware("nonex2"), 3).world_size == 6


def test_a_v1_config_over_nodes():
    p = v1.plan_v1({"model": "m", "micro_batch_size": 1}, on_nodes(catalog_hardware("A100-80GBx4"), 2))
    assert (p.nodes, p.processes_per_node) == (2, 4)
    assert p.env == {"USE_V1": "1", "FORCE_TORCHRUN": "1", "NNODES": "2", "NPROC_PER_NODE": "4"}
