"""What every route needs from the app: the engine, the config, id and clock sources."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quart import current_app

from voltserve.config import EngineConfig
from voltserve.errors import EngineDeadError, InvalidRequestError, ModelNotFoundError

EXTENSION_KEY = "voltserve"


def random_id(prefix: str) -> str:
    """`prefix` + 32 random hex digits, e.g. "chatcmpl-3f2a..."."""
    return prefix + uuid.uuid4().hex


def unix_time_s() -> int:
    """Seconds since the epoch, the OpenAI `created` field."""
    return int(time.time())


@dataclass
class ServerState:
    """Shared by all routes of one app (stored in `app.extensions["voltserve"]`).

    Attributes:
        engine: an `actors.engine.AsyncEngine` (or a test double with the same interface); None until started.
        config: the engine config the app was made with.
        new_id: prefix -> unique response id; injectable so tests can compare exact bytes.
        clock: -> unix seconds for `created`; injectable for the same reason.
        started_s: when the app was created (the model card's `created`).
    """

    engine: Any
    config: EngineConfig
    new_id: Callable[[str], str] = random_id
    clock: Callable[[], int] = unix_time_s
    started_s: int = field(default_factory=unix_time_s)

    def ready_engine(self) -> Any:
        """The engine, when it can take requests.

        Raises:
            EngineDeadError: not started yet, stopped, or an actor died.
        """
        if self.engine is None or not self.engine.is_healthy:
            raise EngineDeadError("the engine is not running")
        return self.engine

    def check_model(self, name: str) -> None:
        """Raises ModelNotFoundError (404) unless `name` is the served model name (empty -> 400)."""
        if not name:
            raise InvalidRequestError("'model' must name the served model", param="model")
        if name != self.config.served_model_name:
            raise ModelNotFoundError(f"The model `{name}` does not exist (this server serves "
                                     f"`{self.config.served_model_name}`).")


def get_state() -> ServerState:
    """The ServerState of the app handling the current request."""
    return current_app.extensions[EXTENSION_KEY]
