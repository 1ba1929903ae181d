"""The error verify raises for bad input."""
from __future__ import annotations

from ..errors import UserError


class VerifyError(UserError):
    """Bad input to verify (bundle, prompts, target source): exit 2, no traceback."""
