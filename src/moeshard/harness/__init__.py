"""The verification harness behind ``moeshard check``: case generation (``cases``), per-case
inputs (``inputs``), running one case on one rank (``execute``), one spawn per world size with
per-case watchdogs (``runner``) and the report (``report``)."""
