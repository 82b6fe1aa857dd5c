"""The version of lossguard: one number for the CLI and this package.

It must equal the CLI's, ``project(lossguard VERSION x.y.z ...)`` in the repository's CMakeLists.txt
(python/tests/test_capture_api.py compares them); pyproject.toml reads it from here.
"""

__version__ = "0.1.0"
