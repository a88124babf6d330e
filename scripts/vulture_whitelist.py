"""Names vulture (dead-code finder, run by .ci/run) reports as unused that are used where it cannot see: by name
through a string, by a framework, or as part of an interface. Each entry says who uses it. A real dead name is
deleted, never listed here. This file is read by vulture, never imported."""
# ruff: noqa
_ = object()

# Executor.call runs these runner methods on every rank by name (executor.call("allocate_kv_cache", ...))
_.num_kv_blocks_for_budget
_.allocate_kv_cache
_.allocate_host_cache
_.capture_cuda_graphs
# scheduler stats counters, read through dataclasses.asdict into stats() and the server's metrics
_.blocks_onloaded
blocks_onloaded
_.swap_fallback_recomputes
swap_fallback_recomputes
# the module's __getattr__: Python calls it for a missing attribute (lazy imports)
__getattr__
# reprlib.Repr's settings, read by reprlib
_.maxstring
_.maxother
# tuning switches read by name from the NANOVLLM_* environment variables (nanovllm/utils/switches.py)
prefill_tile
decode_tile
# FastAPI calls the route handlers and exception handlers its decorators register
health
tokenize_route
detokenize_route
chat_completions
on_api_error
on_validation_error
on_http_error
on_engine_error
count_tokens
# tokenizers.Tokenizer's setting, read by the tokenizer (benchmarks/agent_session.py)
_.pre_tokenizer
# request fields pydantic reads from a body and this server accepts without using (Anthropic's and OpenAI's)
_.signature
_.budget_tokens
_.strict
# a pydantic validator, called by pydantic
_._utf8_only
_._content_unless_assistant
# signal.signal's handler signature
signum
# verify_swap.py runs each check by name: globals()[f"check_{name}"]
check_fp8_kv_roundtrip
check_fp8_resume_mid_decode
check_counters
check_bandwidth
check_tp2
# a Triton kernel's signature shared with its variants (bench_gemm.py's split-K kernel ignores K)
K
# pytest calls its hooks by name (tests/conftest.py)
pytest_collection_modifyitems
pytest_configure
pytest_addoption
pytest_runtest_makereport
pytest_runtest_protocol
pytest_runtest_logreport
pytest_terminal_summary
pytest_collection_finish
pytest_sessionfinish
exitstatus
# pytest reads module-level pytestmark; fixtures used for their setup and teardown only
pytestmark
serves_good
serves_the_same
_.serves_good
# uvicorn reads Server.should_exit
_.should_exit
# tests/flash_attn_standin.py stands in for flash_attn: its signatures are flash_attn's, parameters it ignores included
_.__spec__
deterministic
return_attn_probs
return_softmax_lse
rotary_interleaved
rotary_sin
# functools.lru_cache keys: a GGUF file's reader is parsed again when the file's mtime or size changes
mtime_ns
# pytest fixtures that act by being requested (a test names them as parameters and never reads the value)
torch_threads
no_model_load
# torch reads its backend settings
_.allow_tf32
# tests/triton_standin.py: Triton's runtime calls the stand-in driver's methods by name, and the compile tests'
# subprocess scripts (strings, which vulture does not read) call compile_instead_of_launching
_.get_current_device
_.get_current_stream
_.get_current_target
_.get_active_torch_device
compile_instead_of_launching
