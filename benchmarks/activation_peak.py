"""The activation peak of the memory-profiling step (nanovllm/engine/memory_profile.py), counted without a GPU.

`LiveBytes` is a dispatch mode that counts the bytes of every tensor storage an op creates while it is active, until
the storage is freed, and keeps the largest sum: the live bytes at op boundaries. It misses what an op allocates
and frees inside itself (a sort's scratch), so it is a floor of what CUDA's allocator reports, and it is exact for
what the Python code keeps alive, which is what the engine's code decides. On the meta device it runs the real
shapes of an 8B model in seconds: one decoder layer stands for all (the layers run one after another and each
leaves only the residual stream behind).

    python benchmarks/activation_peak.py qwen3-8b qwen3-4b
prints, per preset, the peak of the profiling step (8,192 tokens, 256 sampled rows with top-k/top-p and logprobs)
and the phase that holds it.
"""
import contextlib
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MiB = 1 << 20


class LiveBytes(TorchDispatchMode):
    """live_bytes: bytes of the storages created under the mode and still alive; peak_bytes: their largest sum;
    peak_phase: `phase` (set by the caller) when the peak was reached."""

    def __init__(self):
        super().__init__()
        self.live_bytes = self.peak_bytes = 0
        self.phase = self.peak_phase = ""
        self.phase_peak_bytes = {}  # phase -> the most bytes alive while it ran
        self._seen = set()  # ids of the storages counted and not yet freed
        self._is_paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._is_paused:
            self._count_outputs(out, (args, kwargs))
        return out

    def fused(self, fn):
        """fn counted as one fused kernel: its outputs only, not the intermediates its eager ops free inside it.
        On a GPU the `compilable` ops run compiled (and SiLU-and-mul as a Triton kernel), which is what this
        models."""
        def call(*args, **kwargs):
            self._is_paused = True
            try:
                out = fn(*args, **kwargs)
            finally:
                self._is_paused = False
            self._count_outputs(out, (args, kwargs))
            return out
        return call

    def _count_outputs(self, out, inputs):
        """Counts the storages of `out` that no input holds: a view or an in-place op's result allocates nothing
        (and a view of a weight, made outside the mode, must not count as a new tensor that never dies)."""
        input_ids = {id(t.untyped_storage()) for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in input_ids:
                self._count(t.untyped_storage())

    def _count(self, storage):
        key = id(storage)  # a storage's Python object lives as long as the storage (PyObject preservation)
        if key in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(key)
        self.live_bytes += storage.nbytes()
        weakref.finalize(storage, self._free, key, storage.nbytes())
        self.phase_peak_bytes[self.phase] = max(self.phase_peak_bytes.get(self.phase, 0), self.live_bytes)
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_phase = self.live_bytes, self.phase

    def _free(self, key: int, nbytes: int):
        self._seen.discard(key)
        self.live_bytes -= nbytes


def one_layer_model(preset: str, device: str = "meta"):
    """The preset's model with one decoder layer, bf16 weights on `device` (quantized linears need a GPU), its MLP
    sliced as on a card under 70 GiB (the 8 GiB card whose KV this peak is taken from)."""
    from nanovllm.config import SMALL_CARD_BATCH_LIMITS
    from nanovllm.models.decoder import DecoderForCausalLM
    from nanovllm.utils.presets import PRESETS, QWEN3_COMMON
    from transformers import Qwen3Config
    shape = {k: v for k, v in PRESETS[preset].items() if k != "quantization_config"}
    hf = Qwen3Config(**dict(QWEN3_COMMON, **dict(shape, num_hidden_layers=1)))
    with torch.device(device):
        return DecoderForCausalLM(hf, "qwen3", mlp_chunk_tokens=SMALL_CARD_BATCH_LIMITS["mlp_chunk_tokens"]).to(
            torch.bfloat16)


def name_phases(model, sampler, counter: LiveBytes):
    """Forward pre-hooks that set counter.phase to the part of the step that runs: the decoder layer's attention
    and MLP, the LM head, the sampler, then the logprobs after it."""
    def phase(name):
        def hook(*_):
            counter.phase = name
        return hook
    layer = model.model.layers[0]
    layer.self_attn.qkv_proj.register_forward_pre_hook(phase("attention"))
    layer.post_attention_layernorm.register_forward_pre_hook(phase("mlp"))
    model.model.norm.register_forward_pre_hook(phase("final norm"))
    model.lm_head.register_forward_pre_hook(phase("logits"))
    sampler.register_forward_pre_hook(phase("sampler"))
    sampler.register_forward_hook(phase("logprobs"))


@contextlib.contextmanager
def fused_compilable_ops(counter: LiveBytes):
    """Every `compilable` op counted as the one kernel it is on a GPU (LiveBytes.fused), until the block ends."""
    from nanovllm.utils import compile as compile_switches
    switches = compile_switches._switches
    saved = [switch.active for switch in switches]
    for switch in switches:
        switch.active = counter.fused(switch.fn)
    try:
        yield
    finally:
        for switch, active in zip(switches, saved):
            switch.active = active


def count_profile_step(model, device: torch.device, num_tokens: int, seq_len: int, num_rows: int,
                       sample: bool = True, max_logprobs: int = 20) -> LiveBytes:
    """memory_profile.profile_step counted by a LiveBytes, with its phases named."""
    from nanovllm.engine.memory_profile import profile_step
    from nanovllm.layers.sampler import Sampler
    sampler, counter = Sampler(), LiveBytes()
    name_phases(model, sampler, counter)
    with torch.inference_mode(), fused_compilable_ops(counter), counter:
        profile_step(model, sampler, device, num_tokens, seq_len, num_rows, sample, max_logprobs)
    return counter


def main(presets: list[str]):
    for preset in presets:
        counter = count_profile_step(one_layer_model(preset), torch.device("meta"), 8192, 8192, 256)
        phases = ", ".join(f"{name or 'embedding'} {n / MiB:.0f}" for name, n in counter.phase_peak_bytes.items())
        print(f"{preset}: activation peak {counter.peak_bytes / MiB:.0f} MiB, at {counter.peak_phase} "
              f"(MiB by phase: {phases})")


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen3-8b", "qwen3-4b"])
