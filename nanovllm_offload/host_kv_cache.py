"""The host tensors of the swap tier: one pinned block pool that mirrors the GPU cache block for block."""
import logging
import weakref

import torch

from nanovllm_offload.host_memory import GiB

logger = logging.getLogger(__name__)
CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process, not only the current device's


class HostKVCache:
    """kv[num_cpu_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], the GPU layout with cpu_block_ids.

    Block-major like the GPU cache, so one block (all layers, K and V) is one contiguous chunk: one DMA per block,
    one per run of consecutive ids. Pinned on CUDA machines so copies are asynchronous and run at link speed: the
    pages of a plain allocation are registered with cudaHostRegister (as SGLang's host pool does), so the pool
    locks exactly its size; torch.empty(pin_memory=True) would lock the next power of two (40 GiB -> 64 GiB).
    NOTE: the pages stay registered until close(), or until the tensor is freed if close() is never called.
    """

    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool):
        self.kv = torch.empty((num_blocks, *block_shape), dtype=dtype, device="cpu")
        self._unregister = None
        num_bytes = self.kv.numel() * self.kv.element_size()
        if pin_memory and num_bytes:
            ptr = self.kv.data_ptr()
            cudart = _cudart()
            _check(cudart.cudaHostRegister(ptr, num_bytes, CUDA_HOST_REGISTER_PORTABLE), "cudaHostRegister", num_bytes)
            # tied to the tensor, not to self: the copy engine holds the tensor, and its pages must stay
            # registered while it can still copy from them
            self._unregister = weakref.finalize(self.kv, _unregister_pages, cudart, ptr)
            logger.info("host KV pool: %d blocks, %.2f GiB pinned", num_blocks, num_bytes / GiB)

    @property
    def num_blocks(self) -> int:
        return self.kv.size(0)

    def close(self):
        """Unregister the pages (safe to call twice); call it once no copy from or to the pool is in flight."""
        if self._unregister is not None:
            self._unregister()


def _cudart():
    return torch.cuda.cudart()


def _unregister_pages(cudart, ptr: int):
    result = int(cudart.cudaHostUnregister(ptr))
    if result != 0:  # the pages are freed next either way; a failure here must not mask the caller's error
        logger.warning("cudaHostUnregister of the host KV pool failed with cudaError %d", result)


def _check(result, call: str, num_bytes: int):
    if int(result) != 0:
        raise RuntimeError(f"{call} of {num_bytes / GiB:.2f} GiB failed with cudaError {int(result)} "
                           f"(a lower swap_space may fit the host's limit on locked memory, see `ulimit -l`)")
