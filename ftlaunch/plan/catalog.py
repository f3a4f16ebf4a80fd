"""The GPU catalog: one row per card that `--gpu` names, every fact a plan or an estimate needs of it.

Read by planning (``ftlaunch.plan.hardware``: a what-if machine of catalog cards, its memory, compute
capability and peer-to-peer access) and by the estimate (``ftlaunch.estimate.throughput``: the
card's dense peak FLOP/s). A new card is one row here; tests/plan/test_catalog.py checks that every
row has every field. Pure data.
"""

from __future__ import annotations

from typing import NamedTuple


class Card(NamedTuple):
    """One catalog card (a NamedTuple, not a frozen dataclass: it is made on every plan's import path,
    and a dataclass costs ~1 ms there; immutable all the same).

    ``nvml_names``: the name NVML and nvidia-smi give it, the first being the one a what-if machine's
    GPUs carry. ``memory_mib``: the total memory as NVML reports it. ``p2p``: peer-to-peer access
    between two of them over PCIe without a bridge (False for the GeForce cards whose driver gives
    none: the RTX 4090 has none at all; the 3090 and 2080 Ti only over an NVLink bridge a what-if
    cannot know of; a what-if for several plans NCCL_P2P_DISABLE=1. Data-centre and workstation
    cards are assumed to have it; a probed machine is measured with nvmlDeviceGetP2PStatus instead).
    ``tflops_16bit`` / ``tflops_fp32``: dense peak TFLOP/s from the vendor's data sheet, no sparsity
    (16-bit tensor cores with fp32 accumulate; fp32)."""

    key: str
    nvml_names: tuple[str, ...]
    memory_mib: int
    compute_capability: tuple[int, int]
    p2p: bool
    tflops_16bit: float
    tflops_fp32: float
    note: str = ""  # where a figure is not the vendor's

    @property
    def nvml_name(self) -> str:
        return self.nvml_names[0]

    def peak_tflops(self, precision: str) -> float:
        """Dense peak TFLOP/s for a plan's precision: fp32, else the 16-bit figure (bf16, fp16, pure_bf16)."""
        return self.tflops_fp32 if precision == "fp32" else self.tflops_16bit


def _card(
    key: str, nvml: str, mib: int, cc: tuple[int, int], t16: float, t32: float, *, p2p: bool = True, note: str = ""
) -> Card:
    return Card(key, (nvml,), mib, cc, p2p, t16, t32, note)


# In the order `--gpu` lists them. Columns: key, NVML name, memory MiB, compute capability, peak dense
# TFLOP/s 16-bit and fp32, then p2p=False where the card has no peer-to-peer access.
CARDS: dict[str, Card] = {
    c.key: c
    for c in (
        _card("P100-16GB", "Tesla P100-PCIE-16GB", 16280, (6, 0), 18.7, 9.3),
        _card("V100-16GB", "Tesla V100-SXM2-16GB", 16160, (7, 0), 125.0, 15.7),
        _card("V100-32GB", "Tesla V100-SXM2-32GB", 32510, (7, 0), 125.0, 15.7),
        _card("T4", "Tesla T4", 15360, (7, 5), 65.0, 8.1),
        _card("RTX2080TI", "NVIDIA GeForce RTX 2080 Ti", 11264, (7, 5), 53.8, 13.4, p2p=False),
        _card("A10", "NVIDIA A10", 23028, (8, 6), 125.0, 31.2),
        _card("A10G", "NVIDIA A10G", 23028, (8, 6), 70.0, 31.2, note="16-bit: not published, the measured figure"),
        _card("L4", "NVIDIA L4", 23034, (8, 9), 121.0, 30.3),
        _card("L40S", "NVIDIA L40S", 46068, (8, 9), 362.0, 91.6),
        _card("RTX3090", "NVIDIA GeForce RTX 3090", 24576, (8, 6), 71.0, 35.6, p2p=False),
        _card("RTX4090", "NVIDIA GeForce RTX 4090", 24564, (8, 9), 165.2, 82.6, p2p=False),
        _card("A6000", "NVIDIA RTX A6000", 49140, (8, 6), 154.8, 38.7),
        _card("A100-40GB", "NVIDIA A100-SXM4-40GB", 40960, (8, 0), 312.0, 19.5),
        _card("A100-80GB", "NVIDIA A100-SXM4-80GB", 81920, (8, 0), 312.0, 19.5),
        _card("H100-80GB", "NVIDIA H100 80GB HBM3", 81559, (9, 0), 989.0, 67.0),
        _card("H200", "NVIDIA H200", 143771, (9, 0), 989.0, 67.0),
    )
}
