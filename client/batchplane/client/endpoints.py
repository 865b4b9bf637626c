"""Where a rank's constructor listens: an explicit address, the environment variable
BATCHPLANE_CONSTRUCTOR, or the rank's entry in the endpoints file that `batchplane up` writes
(named by BATCHPLANE_ENDPOINTS).

The endpoints file is read again whenever the address is asked for, so a client started before
the data plane waits for the file to appear, and a client whose data plane was restarted on new
addresses finds them.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time
from collections.abc import Mapping

from batchplane.client.errors import DataPlaneUnavailable, InvalidRequestError

log = logging.getLogger(__name__)

ENV_ADDRESS = "BATCHPLANE_CONSTRUCTOR"
ENV_ENDPOINTS = "BATCHPLANE_ENDPOINTS"
#: How often a client waiting for the endpoints file looks again.
POLL_S = 0.2


class AddressBook:
    """The address of one rank's constructor.

    Args:
        address: An explicit address ("host:port" or "unix:///path"); it never changes.
        rank: The global rank whose constructor is wanted.
        environ: The environment to read (default: os.environ).
    Raises:
        InvalidRequestError: no address is given and neither environment variable is set.
    """

    def __init__(self, address: str | None, *, rank: int, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.rank = rank
        self._fixed = address or env.get(ENV_ADDRESS) or None
        endpoints = env.get(ENV_ENDPOINTS)
        self.endpoints = pathlib.Path(endpoints) if endpoints and not self._fixed else None
        if self._fixed is None and self.endpoints is None:
            raise InvalidRequestError(f"no constructor address: pass address=, or set {ENV_ADDRESS} or {ENV_ENDPOINTS}")

    def lookup(self) -> tuple[str | None, str]:
        """(the address now, or None with what is missing). Reads the endpoints file again.

        Raises:
            InvalidRequestError: the endpoints file is not JSON, or names constructors but none
                for this rank.
        """
        if self._fixed is not None or self.endpoints is None:  # __init__ makes sure one is set
            return self._fixed, ""
        try:
            text = self.endpoints.read_text()
        except FileNotFoundError:
            return None, f"the endpoints file {str(self.endpoints)!r} ({ENV_ENDPOINTS}) does not exist yet: is `batchplane up` running?"
        except OSError as exc:
            return None, f"the endpoints file {str(self.endpoints)!r} cannot be read: {exc}"
        try:
            table = json.loads(text)
        except ValueError as exc:
            raise InvalidRequestError(f"{ENV_ENDPOINTS}={str(self.endpoints)!r} is not an endpoints file (not JSON): {exc}") from exc
        constructors = table.get("constructors", {}) if isinstance(table, dict) else {}
        found = constructors.get(str(self.rank))
        if not found:
            raise InvalidRequestError(
                f"the endpoints file {str(self.endpoints)!r} has no constructor for rank {self.rank} (it has ranks {sorted(constructors, key=int)})"
            )
        return found, ""

    def wait(self, *, timeout_s: float) -> str:
        """The address, waiting up to `timeout_s` for the endpoints file to appear.

        Raises:
            DataPlaneUnavailable: it did not appear in time (the message says what is missing).
            InvalidRequestError: as `lookup`.
        """
        give_up = time.monotonic() + timeout_s
        said = ""
        while True:
            address, missing = self.lookup()
            if address is not None:
                if said:
                    log.info("rank %d: found the data plane's constructor at %s", self.rank, address)
                return address
            if time.monotonic() >= give_up:
                raise DataPlaneUnavailable(f"rank {self.rank} waited {timeout_s:.0f} s for the data plane: {missing}")
            if missing != said:
                log.info("rank %d is waiting for the data plane: %s", self.rank, missing)
                said = missing
            time.sleep(min(POLL_S, max(give_up - time.monotonic(), 0.0)))
