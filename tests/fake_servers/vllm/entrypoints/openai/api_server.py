"""Stands in for ``python -m vllm.entrypoints.openai.api_server`` in tests (see ``tests/fake_servers/stub.py``)."""
import sys

from stub import main

main("vllm", sys.argv[1:])
