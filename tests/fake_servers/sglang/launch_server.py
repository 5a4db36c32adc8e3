"""Stands in for ``python -m sglang.launch_server`` in tests (see ``tests/fake_servers/stub.py``)."""
import sys

from stub import main

main("sglang", sys.argv[1:])
