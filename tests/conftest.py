"""Test-session settings shared by every test file."""

import os

from hypothesis import settings

# CI gates a merge, so its property tests draw the same examples every run (a failure there is then
# reproducible); local runs keep hypothesis' random exploration and its example database.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
