"""The metadata modules import without torch (and without transformers)."""
import subprocess
import sys

CODE = """
import sys
sys.modules["torch"] = None
sys.modules["transformers"] = None
import nanovllm, nanovllm.config, nanovllm.sampling_params
import nanovllm.engine.sequence, nanovllm.engine.block_pool, nanovllm.engine.block_manager
import nanovllm.engine.scheduler, nanovllm.engine.step_plan
import nanovllm_offload.host_block_pool, nanovllm_offload.policy
from nanovllm import SamplingParams
import nanovllm.inputs
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
print("ok")
"""


def test_metadata_imports_without_torch():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
