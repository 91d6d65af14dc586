"""CUDA backend: NVRTC-compiled kernels from `ptx/`, launched through cuda-python on torch's stream.

Nothing here imports cuda-python at module import time: `import voltserve.backends.cuda` works on a machine
without it; the bindings load on first use (`driver.bindings()`).
"""
