"""End-to-end benchmarks (`jaxinfer bench`). Kept import-free: the HF baseline runs `hf_baseline.py`
from this folder in a torch-only process."""
