"""torchneox: train GPT-NeoX-style language models from GPT-NeoX configs, on PyTorch alone."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("torchneox")
except PackageNotFoundError:  # a source tree that was not installed
    __version__ = "0+unknown"
