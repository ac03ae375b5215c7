"""``TORCH_LOGS="npu_fuse_backend.graphs"``: every aten graph before and after npu_fuse's passes.

This module only gives the graphs' logger a name that ``TORCH_LOGS`` accepts when torch parses
it at ``import torch``, before any package of ours is loaded: torch accepts the name of an
importable module there (a name of ours registered later, such as the ``npu_fuse_graphs``
artifact, would make ``import torch`` fail). It is not under ``npu_fuse``, because naming a
package in ``TORCH_LOGS`` turns on all of its modules: ``TORCH_LOGS="npu_fuse"`` logs the
reports, not the graphs.
"""
