"""The one error the launch decisions raise (its own module so every decision module can import it)."""

from __future__ import annotations

from ..errors import UsageError


class PlanError(UsageError):
    """The hardware cannot honour what was asked: the message names the GPU and the alternative."""
