"""``python -m dllm_engine.cli``: the ``dllm`` command."""
import sys

from . import main

sys.exit(main())
