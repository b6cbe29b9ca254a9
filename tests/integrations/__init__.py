"""Tests against the released frameworks this package plugs into (docs/drop-in.md)."""

INSTALL = "pip install --no-deps -r tests/integrations/requirements.txt"  # what they need (CI installs it)
