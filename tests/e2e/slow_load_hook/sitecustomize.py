"""A model load that takes VOLTSERVE_TEST_LOAD_DELAY_S seconds, in every process of a server under test.

A test puts this folder first on the PYTHONPATH of the server it starts: Python imports `sitecustomize` at the start
of every interpreter, so the API process, the engine process and the tensor-parallel rank processes all wrap
`loaders.load_model` with the delay (the ranks and the engine call it by that name at run time). Each call first
appends "load PID" to the file VOLTSERVE_TEST_LOAD_LOG names, so the test knows when every load is under way.
"""

import os

_DELAY_S = float(os.environ.get("VOLTSERVE_TEST_LOAD_DELAY_S") or 0)

if _DELAY_S:
    import time

    import loaders

    _load_model = loaders.load_model

    def _slow_load_model(*args, **kwargs):
        with open(os.environ["VOLTSERVE_TEST_LOAD_LOG"], "a") as log:
            log.write(f"load {os.getpid()}\n")
        time.sleep(_DELAY_S)
        return _load_model(*args, **kwargs)

    loaders.load_model = _slow_load_model
