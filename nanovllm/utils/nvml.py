"""This process's GPU memory as NVML (the driver's management library, libnvidia-ml) counts it, through ctypes: no
package to install. CUDA itself only reports the whole GPU's free memory, which other processes' memory takes too."""
import ctypes
import functools
import os

NVML_SUCCESS = 0
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1  # an unsigned -1: NVML cannot say (its usedGpuMemory under some drivers)
MAX_PROCESSES = 256  # processes a GPU may list: the call fails (and the count says unknown) beyond


class ProcessInfo(ctypes.Structure):
    """nvmlProcessInfo_t, the layout nvmlDeviceGetComputeRunningProcesses_v3 fills."""
    _fields_ = [("pid", ctypes.c_uint), ("used_gpu_memory", ctypes.c_ulonglong),
                ("gpu_instance_id", ctypes.c_uint), ("compute_instance_id", ctypes.c_uint)]


@functools.lru_cache(maxsize=1)
def library():
    """libnvidia-ml, initialized once; None where it is missing or does not start."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    return lib if lib.nvmlInit_v2() == NVML_SUCCESS else None


def process_gpu_bytes(device_uuid: str, lib=None) -> int | None:
    """The GPU memory NVML counts for this process on the GPU named by device_uuid ("GPU-..."): its CUDA context,
    kernels and every allocation. None where NVML is missing or fails, or does not list this process (a container
    whose PIDs the driver does not see lists other PIDs, or none)."""
    lib = lib or library()
    if lib is None:
        return None
    handle = ctypes.c_void_p()
    if lib.nvmlDeviceGetHandleByUUID(device_uuid.encode(), ctypes.byref(handle)) != NVML_SUCCESS:
        return None
    list_processes = getattr(lib, "nvmlDeviceGetComputeRunningProcesses_v3", None)  # drivers from 2022 on
    count, infos = ctypes.c_uint(MAX_PROCESSES), (ProcessInfo * MAX_PROCESSES)()
    if list_processes is None or list_processes(handle, ctypes.byref(count), infos) != NVML_SUCCESS:
        return None
    pid = os.getpid()
    used = [info.used_gpu_memory for info in infos[:count.value] if info.pid == pid]
    return used[0] if used and used[0] != NVML_VALUE_NOT_AVAILABLE else None
