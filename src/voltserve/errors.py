"""One exception hierarchy for the engine core.

Core errors know nothing about HTTP: `api/errors.py` maps each class to a status code and an
OpenAI / Anthropic error body.
"""

from __future__ import annotations


class VoltError(Exception):
    """Base class of every error voltserve raises on purpose."""


class InvalidRequestError(VoltError):
    """A request that can never succeed as sent (bad value, bad type, unknown field value).

    Args:
        message: human-readable explanation, shown to the client.
        param: the offending request field (dotted path), or None.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self):  # keep `param` across a process boundary
        return type(self), (self.message, self.param)


class ContextLengthError(InvalidRequestError):
    """The prompt (plus requested output) does not fit the model's context window."""


class ModelNotFoundError(VoltError):
    """The request names a model this server does not serve."""

    def __init__(self, message: str, param: str | None = "model"):
        super().__init__(message)
        self.message = message
        self.param = param


class AuthenticationError(VoltError):
    """Missing or wrong API key."""


class QueueFullError(VoltError):
    """The engine cannot take more requests right now; retry later."""


class RequestAbortedError(VoltError):
    """The request was aborted before it finished (client gone, server stopping)."""


class ServerShuttingDownError(VoltError):
    """The server is shutting down: it takes no new requests and ended this one after its grace period."""


class StepFailedError(VoltError):
    """The engine step running this request raised; the request is failed, the engine keeps serving."""


class EngineDeadError(VoltError):
    """The engine has stopped (an actor crashed or it was shut down); no request can be served."""


class ConfigError(VoltError):
    """An engine or model setting is invalid."""


class LoaderError(VoltError):
    """A model file could not be found, fetched, verified or read."""


class UnsupportedModelError(LoaderError):
    """The model's architecture, tensor type or format is not supported."""


# a bad setting or model file: the operator's to fix, reported in one line without a traceback (`voltserve serve`
# exits 2 on them, before the model loads where it can check them, else when the engine's start fails)
INPUT_ERRORS = (ConfigError, LoaderError)


class KernelCompileError(VoltError):
    """NVRTC failed to compile a kernel. Carries the kernel name, options and the full log."""

    def __init__(self, kernel: str, options: list[str], log: str):
        super().__init__(f"NVRTC failed to compile {kernel} with {' '.join(options)}:\n{log}")
        self.kernel = kernel
        self.options = options
        self.log = log

    def __reduce__(self):  # picklable (the engine process sends startup errors to the API process)
        return type(self), (self.kernel, self.options, self.log)


class CudaError(VoltError):
    """A CUDA driver or NVRTC call returned an error code."""

    def __init__(self, call: str, code: int, name: str):
        super().__init__(f"{call} failed: {name} ({code})")
        self.call = call
        self.code = code
        self.name = name

    def __reduce__(self):
        return type(self), (self.call, self.code, self.name)
