"""The private Lightning names multiloss relies on are all in this Lightning (an upgrade that moves one fails here)."""

from __future__ import annotations

import lightning

from multiloss.lightning_internals import check_internals


def test_every_private_lightning_name_multiloss_uses_is_there():
    missing = check_internals()
    assert not missing, f"Lightning {lightning.__version__} no longer has: {', '.join(missing)}"
