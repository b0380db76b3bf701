"""`make test` collects tests/: transformers' own test files under upstream/ run only through
tests/frameworks/run_transformers.py (which sets BCP_TRANSFORMERS_SUITE=1)."""
import os

collect_ignore_glob = [] if os.environ.get("BCP_TRANSFORMERS_SUITE") == "1" else ["upstream/*", "upstream"]
