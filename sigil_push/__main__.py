"""Allows `python -m sigil_push`, identical to the `sigil-push` command."""

import sys

from sigil_push.cli import main

sys.exit(main())
