"""Short public name of the npu_fuse backend (``import npu_fuse``).

It also makes ``TORCH_LOGS="+npu_fuse"`` valid: torch checks log names against
importable modules when it starts, before any backend is loaded, and the backend
logs to the ``npu_fuse`` logger.
"""

from npu_fuse_backend import *  # noqa: F401,F403
from npu_fuse_backend import __all__  # noqa: F401
