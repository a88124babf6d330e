"""The installed package's version (pyproject.toml's), for `nanovllm --version` and the server's /version."""
from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "nano-vllm-offload"


def package_version() -> str:
    """The version pip installed; "unknown" when the package runs from a checkout that was never installed."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"
