"""Compute backends: the torch CPU reference (`cpu.py`) and the NVRTC/cuda-python backend (`cuda/`)."""
