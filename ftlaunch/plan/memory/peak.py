"""The peak GPU memory of one training step: ``estimate`` and the figures it returns.

No I/O, no torch. Every number is in GiB (2**30 bytes). The model, its sources and where it
deviates from them are written up in ``docs/memory-model.md``; each function names the formula it
implements.

Peak per GPU = overhead + max(forward/backward phase, optimizer-step phase), where
  forward/backward = weights + gradients + optimizer states + activations + logits
  optimizer step   = resident weights + gradients + optimizer states + step temporaries
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from ftlaunch.plan.memory.activations import logits_bytes, stored_and_working
from ftlaunch.plan.memory.setup import TrainSetup
from ftlaunch.plan.memory.states import ModelStates, model_states, trainable_params
from ftlaunch.plan.modelspec import ModelSpec

GIB = float(2**30)

# Overhead outside the tensors PyTorch allocates (see docs/memory-model.md, "Overhead"), from the
# one real ledger this project has (a V100 OOM: 27.81 GiB allocated, 1.02 GiB reserved but
# unallocated, 30.30 GiB used by the process):
CUDA_CONTEXT_GIB = 1.5  # outside PyTorch's allocator: context, cuBLAS/cuDNN workspaces, kernels
NCCL_GIB = 0.4  # NCCL communicator buffers when world_size > 1
FRAGMENTATION = 0.04  # caching-allocator reserved/allocated slack, as a fraction of the tensor peak

_ATTN = ("eager", "sdpa", "fa2")


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU memory of one training step, GiB.

    ``activations_gib`` = stored activations + one layer's backward working set; ``logits_gib`` =
    the loss peak. The two working sets do not coexist, so ``peak_gib`` = ``overhead_gib`` +
    max(weights + gradients + optimizer + stored + max(working set, logits),
        resident weights + gradients + optimizer + ``transient_gib``), not the sum of the fields.
    """

    weights_gib: float
    gradients_gib: float
    optimizer_gib: float
    activations_gib: float
    logits_gib: float
    overhead_gib: float
    peak_gib: float
    host_gib: float  # host RAM needed for offloaded states (0 without offload)
    trainable_params: int
    transient_gib: float = 0.0  # optimizer-step temporaries (foreach AdamW); only in the step phase
    tensors_gib: float = 0.0  # predicted torch.cuda.max_memory_allocated() (peak without overhead)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _phases(spec: ModelSpec, setup: TrainSetup, st: ModelStates, stored: float, working: float) -> tuple[float, ...]:
    """Tensor bytes at the three peaks of forward/backward without DeepSpeed (see the simulator).

    Gradients are alive in the forward pass only with accumulation > 1 (``zero_grad(set_to_none)``
    frees them after each optimizer step). The autocast weight cache (16-bit copies of fp32
    trainable weights) lives until the forward's autocast region ends; afterwards only the copies
    autograd saved remain: all of them without checkpointing, the lm_head's with it (the
    checkpointed layers re-cast during recomputation).
      loss     = resident + copies + optimizer + [gradients] + stored + forward logits (10 B/token/V)
      backward = resident + saved copies + optimizer + [gradients] + stored + max(working, logits)
      end      = resident + optimizer + gradients + max(working set, embedding-gradient temporaries)
    """
    resident, copies = st.weights_resident, st.weights - st.weights_resident
    grads_fwd = st.grads if setup.accumulation > 1 else 0.0
    saved_copies = st.head_copy if setup.gradient_checkpointing else copies
    tokens_v = setup.micro_batch * setup.seq_len * spec.vocab_size
    loss = resident + copies + st.optimizer + grads_fwd + stored + 10.0 * tokens_v
    backward = resident + saved_copies + st.optimizer + grads_fwd + stored + max(working, 12.0 * tokens_v)
    end = resident + st.optimizer + st.grads + max(working, st.embedding_grad_extra)
    return loss, backward, end


def peak_from_tensors(tensors_gib: float, world_size: int = 1) -> float:
    """Process memory (GiB) for a tensor peak: + the CUDA context and workspaces outside PyTorch,
    + NCCL buffers on several GPUs, + the caching allocator's slack. Also turns a simulated tensor
    peak into a figure comparable with the card."""
    return tensors_gib * (1 + FRAGMENTATION) + CUDA_CONTEXT_GIB + (NCCL_GIB if world_size > 1 else 0.0)


def estimate(spec: ModelSpec, setup: TrainSetup) -> MemoryEstimate:
    """Peak GPU memory per device (GiB) for one training step of ``setup`` on ``spec``."""
    if setup.attn_impl not in _ATTN:
        raise ValueError(f"unknown attn_impl {setup.attn_impl!r} (expected eager, sdpa or fa2)")
    if setup.micro_batch < 1 or setup.seq_len < 1:
        raise ValueError("micro_batch and seq_len must be >= 1")
    if setup.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0..3, got {setup.zero_stage}")
    T = trainable_params(spec, setup)
    st = model_states(spec, setup, T)
    stored, working = stored_and_working(spec, setup)
    logits = logits_bytes(spec, setup)

    step = st.weights_resident + st.grads + st.optimizer + st.transient
    if setup.zero_stage == 0:
        tensors = max(step, *_phases(spec, setup, st, stored, working))
    else:
        # DeepSpeed cannot be simulated here: the older, conservative sum (gradients and the autocast
        # copies alive throughout; the loss peak and a layer's working set do not coexist).
        fwd_bwd = st.weights + st.grads + st.optimizer + stored + max(working, logits)
        tensors = max(fwd_bwd, step)
    peak = peak_from_tensors(tensors / GIB, setup.world_size) * GIB
    overhead = peak - tensors
    return MemoryEstimate(
        weights_gib=st.weights / GIB,
        gradients_gib=st.grads / GIB,
        optimizer_gib=st.optimizer / GIB,
        activations_gib=(stored + working) / GIB,
        logits_gib=logits / GIB,
        overhead_gib=overhead / GIB,
        peak_gib=peak / GIB,
        host_gib=st.host / GIB,
        trainable_params=T,
        transient_gib=st.transient / GIB,
        tensors_gib=tensors / GIB,
    )


Estimator = Callable[[TrainSetup], MemoryEstimate]


def corrected(spec: ModelSpec, correction: float = 1.0) -> Estimator:
    """``estimate`` on ``spec`` with every peak scaled by ``correction`` (observed / predicted peak
    of an earlier run of the same config on the same card; 1.0 = the formulas as they are)."""
    if correction == 1.0:
        return lambda setup: estimate(spec, setup)

    def scaled(setup: TrainSetup) -> MemoryEstimate:
        est = estimate(spec, setup)
        return replace(
            est, peak_gib=est.peak_gib * correction, overhead_gib=est.peak_gib * correction - est.tensors_gib
        )

    return scaled
